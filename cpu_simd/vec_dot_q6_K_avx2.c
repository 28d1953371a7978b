/* vec_dot_q6_K_avx2.c — Q6_K weights . Q8_K activations (W6A8), AVX2 + FMA + F16C.
 *
 * A 256-element super-block: 16 groups of 16 with an int8 scale sc_g, w = d * sc_g * (q - 32),
 * q 0..63 (4 low bits in ql, 2 high bits in qh). The offset 32 is taken out once per block:
 *   sum_g sc_g * sum_{i in g} (q_i - 32) a_i = sum_g sc_g * sum q_i a_i  -  32 * sum_g sc_g * bsum_g
 * with Q8_K's bsums (one vpmaddwd). Per 128 elements (ql + 64h, qh + 32h) four 32-byte
 * vectors of q: elements l, l+32, l+64, l+96 (l = 0..31) from the nibbles of ql[l], ql[l+32]
 * and the bit pairs 0-1, 2-3, 4-5, 6-7 of qh[l]; each vector is two groups, so one
 * vpmaddubsw (pairs <= 2*63*127) and one vpmaddwd by [sc_a x8 | sc_b x8].
 * No tail: the kernel's step is one super-block. Oracle: vec_dot_q6_K_q8_K_ref.
 * Build: part of the cffi extension (`pip install -e .`); the pragma below compiles this
 * file for AVX2 whatever the baseline is. Test: python -m pytest tests/test_vec_dot.py -k q6_K-avx2
 */
#pragma GCC target("avx2,fma,f16c")

#include "simd_x86.h"

/* int16 [sc_g x8 | sc_g+1 x8] (g even) from 8 int16 scales (groups g & ~7 ..) in both lanes. */
static inline __m256i scale_pair(__m256i sc16x2, int g) {
    const int b = 2 * (g & 7);
    const __m256i ctrl = _mm256_set_m128i(_mm_set1_epi16((short)(((b + 3) << 8) | (b + 2))),
                                          _mm_set1_epi16((short)(((b + 1) << 8) | b)));
    return _mm256_shuffle_epi8(sc16x2, ctrl);
}

/* The codes q (0..63) of elements l, l+32, l+64, l+96 (l = 0..31) of a 128-element half: ql 64 bytes, qh 32. */
static inline __attribute__((always_inline)) void q6_K_codes(const uint8_t *ql, const uint8_t *qh, __m256i *q0,
                                                             __m256i *q1, __m256i *q2, __m256i *q3) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(0x03);
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
    const __m256i hb = _mm256_loadu_si256((const __m256i *)qh);
    *q0 = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m2), 4));
    *q1 = _mm256_or_si256(_mm256_and_si256(l1, m4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m2), 4));
    *q2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m2), 4));
    *q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m2), 4));
}

void vec_dot_q6_K_q8_K_avx2(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q6_K *x = vx;
    const block_q8_K *y = vy;
    const int64_t nb = n / QK_K;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        le_prefetch_ahead(x + i, sizeof *x);   /* DRAM (simd_x86.h) */
        const float d = y[i].d * _cvtsh_ss(x[i].d);
        /* the int8 scales as int16: lanes 0..7 groups 0..7, 8..15 groups 8..15 */
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x[i].scales));
        /* the offset term: -32 * sum_g sc_g * bsum_g */
        const __m256i bsums = _mm256_loadu_si256((const __m256i *)y[i].bsums);
        __m256i sumi = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, bsums), 5));
        const __m256i sc_half[2] = {_mm256_permute2x128_si256(sc16, sc16, 0x00),   /* groups 0..7 */
                                    _mm256_permute2x128_si256(sc16, sc16, 0x11)};  /* groups 8..15 */

        const uint8_t *ql = x[i].ql, *qh = x[i].qh;
        const int8_t *q8 = y[i].qs;
#pragma GCC unroll 2
        for (int h = 0; h < QK_K / 128; h++) {
            const int8_t *a = q8 + 128 * h;
            __m256i q0, q1, q2, q3;
            q6_K_codes(ql + 64 * h, qh + 32 * h, &q0, &q1, &q2, &q3);
            __m256i p0 = _mm256_maddubs_epi16(q0, _mm256_loadu_si256((const __m256i *)a));
            __m256i p1 = _mm256_maddubs_epi16(q1, _mm256_loadu_si256((const __m256i *)(a + 32)));
            __m256i p2 = _mm256_maddubs_epi16(q2, _mm256_loadu_si256((const __m256i *)(a + 64)));
            __m256i p3 = _mm256_maddubs_epi16(q3, _mm256_loadu_si256((const __m256i *)(a + 96)));
            p0 = _mm256_madd_epi16(p0, scale_pair(sc_half[h], 8 * h + 0));
            p1 = _mm256_madd_epi16(p1, scale_pair(sc_half[h], 8 * h + 2));
            p2 = _mm256_madd_epi16(p2, scale_pair(sc_half[h], 8 * h + 4));
            p3 = _mm256_madd_epi16(p3, scale_pair(sc_half[h], 8 * h + 6));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(_mm256_add_epi32(p0, p1), _mm256_add_epi32(p2, p3)));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    *s = le_hsum_ps_256(acc);
}

/* Several activation rows (le_vec_dot_n_fn): NT rows a pass, each block's codes and scales unpacked once; row t's
 * int32 sums and its one FMA per block are the kernel above's, so s[t] has its bits. */
static inline __attribute__((always_inline)) void q6_K_rows(int64_t n, float *s, int64_t ls, const block_q6_K *x,
                                                            const uint8_t *yb, int64_t ly, const int NT) {
    const int64_t nb = n / QK_K;
    __m256 acc[4];
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        le_prefetch_ahead(x + i, sizeof *x);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x[i].scales));
        __m256i sumi[4];
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            const block_q8_K *y = (const block_q8_K *)(yb + t * ly) + i;
            const __m256i bsums = _mm256_loadu_si256((const __m256i *)y->bsums);
            sumi[t] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, bsums), 5));
        }
        const __m256i sc_half[2] = {_mm256_permute2x128_si256(sc16, sc16, 0x00),
                                    _mm256_permute2x128_si256(sc16, sc16, 0x11)};
        const uint8_t *ql = x[i].ql, *qh = x[i].qh;
#pragma GCC unroll 2
        for (int h = 0; h < QK_K / 128; h++) {
            __m256i q0, q1, q2, q3;
            q6_K_codes(ql + 64 * h, qh + 32 * h, &q0, &q1, &q2, &q3);
            const __m256i s0 = scale_pair(sc_half[h], 8 * h + 0), s1 = scale_pair(sc_half[h], 8 * h + 2);
            const __m256i s2 = scale_pair(sc_half[h], 8 * h + 4), s3 = scale_pair(sc_half[h], 8 * h + 6);
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) {
                const int8_t *a = ((const block_q8_K *)(yb + t * ly))[i].qs + 128 * h;
                const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(q0, _mm256_loadu_si256((const __m256i *)a)), s0);
                const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(q1, _mm256_loadu_si256((const __m256i *)(a + 32))), s1);
                const __m256i p2 = _mm256_madd_epi16(_mm256_maddubs_epi16(q2, _mm256_loadu_si256((const __m256i *)(a + 64))), s2);
                const __m256i p3 = _mm256_madd_epi16(_mm256_maddubs_epi16(q3, _mm256_loadu_si256((const __m256i *)(a + 96))), s3);
                sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(_mm256_add_epi32(p0, p1), _mm256_add_epi32(p2, p3)));
            }
        }
        const float xd = _cvtsh_ss(x[i].d);
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            const block_q8_K *y = (const block_q8_K *)(yb + t * ly) + i;
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(y->d * xd), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) s[t * ls] = le_hsum_ps_256(acc[t]);
}

void vec_dot_n_q6_K_q8_K_avx2(int64_t n, float *s, int64_t ls, const void *vx, const void *vy, int64_t ly, int nt) {
    LE_ROWS_BY_4(q6_K_rows, n, s, ls, vx, vy, ly, nt);
}
