/* vec_dot_q4_K_ssse3.c — Q4_K weights . Q8_K activations (W4A8), SSSE3 (no AVX, F16C or FMA).
 *
 * As vec_dot_q4_K_avx2.c on 128-bit halves: 8 groups of 32 with 6-bit scale sc_g and min
 * m_g; chunk c's 32 qs bytes (two halves) hold group 2c in the low nibbles and 2c+1 in the
 * high nibbles. pmaddubsw (q 0..15 unsigned x a signed) + pmaddwd by the group scale give
 * int32 sums; the min term dmin * da * sum_g m_g * (bsum_2g + bsum_2g+1) is one phaddw +
 * one pmaddwd on Q8_K's bsums. fp16 by le_h2f, mulps + addps per super-block; no tail.
 * Oracle: vec_dot_q4_K_q8_K_ref (native/vec_dot_ref.c).
 * Build: part of the cffi extension (`pip install -e .`); the pragma below compiles this
 * file for SSSE3 whatever the baseline is. Test: python -m pytest tests/test_vec_dot.py -k q4_K-ssse3
 */
#pragma GCC target("ssse3")

#include "simd_x86.h"

void vec_dot_q4_K_q8_K_ssse3(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q4_K *x = vx;
    const block_q8_K *y = vy;
    const int64_t nb = n / QK_K;
    __m128 acc = _mm_setzero_ps(), acc_m = _mm_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        le_prefetch_ahead(x + i, sizeof *x);   /* DRAM (simd_x86.h) */
        const __m128i sm = le_q4_K_scales_mins(x[i].scales);   /* bytes: 8 scales | 8 mins */
        uint8_t sc[16];
        _mm_storeu_si128((__m128i *)sc, sm);
        const float d = y[i].d * le_h2f(x[i].d);
        const float dmin = y[i].d * le_h2f(x[i].dmin);

        const __m128i gsums = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)y[i].bsums),
                                             _mm_loadu_si128((const __m128i *)(y[i].bsums + 8)));
        const __m128i mins = _mm_unpackhi_epi8(sm, _mm_setzero_si128());
        acc_m = _mm_add_ps(acc_m, _mm_mul_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(_mm_madd_epi16(mins, gsums))));

        const uint8_t *q4 = x[i].qs;
        const int8_t *q8 = y[i].qs;
        __m128i sumi = _mm_setzero_si128();
#pragma GCC unroll 4
        for (int c = 0; c < QK_K / 64; c++, q4 += 32, q8 += 64) {
            __m128i lo0, hi0, lo1, hi1;
            le_nibbles_128(_mm_loadu_si128((const __m128i *)q4), &lo0, &hi0);
            le_nibbles_128(_mm_loadu_si128((const __m128i *)(q4 + 16)), &lo1, &hi1);
            /* group 2c: lo0 . a[0..15] + lo1 . a[16..31]; group 2c+1: hi0, hi1 . a[32..63] */
            const __m128i p_lo = _mm_add_epi16(_mm_maddubs_epi16(lo0, _mm_loadu_si128((const __m128i *)q8)),
                                               _mm_maddubs_epi16(lo1, _mm_loadu_si128((const __m128i *)(q8 + 16))));
            const __m128i p_hi = _mm_add_epi16(_mm_maddubs_epi16(hi0, _mm_loadu_si128((const __m128i *)(q8 + 32))),
                                               _mm_maddubs_epi16(hi1, _mm_loadu_si128((const __m128i *)(q8 + 48))));
            /* int16 sums of two pmaddubsw stay <= 4*15*127 */
            sumi = _mm_add_epi32(sumi, _mm_madd_epi16(p_lo, _mm_set1_epi16(sc[2 * c])));
            sumi = _mm_add_epi32(sumi, _mm_madd_epi16(p_hi, _mm_set1_epi16(sc[2 * c + 1])));
        }
        acc = _mm_add_ps(acc, _mm_mul_ps(_mm_set1_ps(d), _mm_cvtepi32_ps(sumi)));
    }
    *s = le_hsum_ps_128(acc) - le_hsum_ps_128(acc_m);
}

/* Several activation rows (le_vec_dot_n_fn): NT rows a pass, each block's nibbles and scales unpacked once; row t's
 * int32 sums and float steps are the kernel above's in its order, so s[t] has its bits. */
static inline __attribute__((always_inline)) void q4_K_rows(int64_t n, float *s, int64_t ls, const block_q4_K *x,
                                                            const uint8_t *yb, int64_t ly, const int NT) {
    const int64_t nb = n / QK_K;
    __m128 acc[4], acc_m[4];
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) acc[t] = acc_m[t] = _mm_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        le_prefetch_ahead(x + i, sizeof *x);
        const __m128i sm = le_q4_K_scales_mins(x[i].scales);
        uint8_t sc[16];
        _mm_storeu_si128((__m128i *)sc, sm);
        const float xd = le_h2f(x[i].d), xdmin = le_h2f(x[i].dmin);
        const __m128i mins = _mm_unpackhi_epi8(sm, _mm_setzero_si128());
        __m128i sumi[4];
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) sumi[t] = _mm_setzero_si128();
        const uint8_t *q4 = x[i].qs;
#pragma GCC unroll 4
        for (int c = 0; c < QK_K / 64; c++, q4 += 32) {
            __m128i lo0, hi0, lo1, hi1;
            le_nibbles_128(_mm_loadu_si128((const __m128i *)q4), &lo0, &hi0);
            le_nibbles_128(_mm_loadu_si128((const __m128i *)(q4 + 16)), &lo1, &hi1);
            const __m128i s_lo = _mm_set1_epi16(sc[2 * c]), s_hi = _mm_set1_epi16(sc[2 * c + 1]);
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) {
                const int8_t *q8 = ((const block_q8_K *)(yb + t * ly))[i].qs + 64 * c;
                const __m128i p_lo = _mm_add_epi16(_mm_maddubs_epi16(lo0, _mm_loadu_si128((const __m128i *)q8)),
                                                   _mm_maddubs_epi16(lo1, _mm_loadu_si128((const __m128i *)(q8 + 16))));
                const __m128i p_hi = _mm_add_epi16(_mm_maddubs_epi16(hi0, _mm_loadu_si128((const __m128i *)(q8 + 32))),
                                                   _mm_maddubs_epi16(hi1, _mm_loadu_si128((const __m128i *)(q8 + 48))));
                sumi[t] = _mm_add_epi32(sumi[t], _mm_madd_epi16(p_lo, s_lo));
                sumi[t] = _mm_add_epi32(sumi[t], _mm_madd_epi16(p_hi, s_hi));
            }
        }
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            const block_q8_K *y = (const block_q8_K *)(yb + t * ly) + i;
            const float d = y->d * xd, dmin = y->d * xdmin;
            const __m128i gsums = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)y->bsums),
                                                 _mm_loadu_si128((const __m128i *)(y->bsums + 8)));
            acc_m[t] = _mm_add_ps(acc_m[t], _mm_mul_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(_mm_madd_epi16(mins, gsums))));
            acc[t] = _mm_add_ps(acc[t], _mm_mul_ps(_mm_set1_ps(d), _mm_cvtepi32_ps(sumi[t])));
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) s[t * ls] = le_hsum_ps_128(acc[t]) - le_hsum_ps_128(acc_m[t]);
}

void vec_dot_n_q4_K_q8_K_ssse3(int64_t n, float *s, int64_t ls, const void *vx, const void *vy, int64_t ly, int nt) {
    LE_ROWS_BY_4(q4_K_rows, n, s, ls, vx, vy, ly, nt);
}
