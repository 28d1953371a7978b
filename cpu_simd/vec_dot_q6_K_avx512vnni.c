/* vec_dot_q6_K_avx512vnni.c — Q6_K weights . Q8_K activations (W6A8), AVX-512 VNNI.
 *
 * As vec_dot_q6_K_avx2.c, 64 elements per step in a zmm. Per 128 elements (ql + 64h, qh + 32h):
 * the 64 ql bytes as one zmm give, in their low nibbles, elements 0..63 of the half
 * (ql[l] & 15 -> l, ql[32+l] & 15 -> 32+l) and in their high nibbles elements 64..127;
 * the qh bytes laid out as [qh | qh >> 2] supply the matching bit pairs (& 0x03, moved to
 * bits 4-5, for the low codes; & 0x30 in place for the high ones). Codes q are 0..63; the
 * offset 32 is taken out once per block as 32 * sum_g sc_g * bsum_g (Q8_K's bsums).
 * vpmaddubsw makes 32 int16 pair sums per 64 elements (pairs <= 2*63*127; 8 lanes per group
 * of 16) and vpdpwssd multiplies them by the group scales (int8 widened once per block,
 * spread by vpermw) and accumulates in int32 (VNNI fuses vpmaddwd + vpaddd). One FMA per
 * block. zmm here, unlike the Q4_K/Q5_K kernels: it measured faster than a ymm variant on
 * Emerald Rapids (1 MiB of weights in cache: 19.8 vs 17.1 GB/s; AVX2 14.9).
 * No tail (the step is one super-block). Oracle: vec_dot_q6_K_q8_K_ref.
 * Build: part of the cffi extension (`pip install -e .`); the pragma below compiles this
 * file for AVX-512 VNNI whatever the baseline is; it runs only where the CPU has it.
 * Test: python -m pytest tests/test_vec_dot.py -k q6_K-avx512vnni (on a host with AVX-512 VNNI)
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

#include "simd_x86.h"

void vec_dot_q6_K_q8_K_avx512vnni(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q6_K *x = vx;
    const block_q8_K *y = vy;
    const int64_t nb = n / QK_K;
    const __m512i m4 = _mm512_set1_epi8(0x0f), m2 = _mm512_set1_epi8(0x03), m30 = _mm512_set1_epi8(0x30);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        le_prefetch_ahead(x + i, sizeof *x);   /* DRAM (simd_x86.h) */
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)x[i].scales);
        const __m512i sc16 = _mm512_zextsi256_si512(_mm256_cvtepi8_epi16(sc8));  /* group g in lane g */
        /* the offset term, -32 * sum_g sc_g * bsum_g, in the low 8 lanes */
        const __m256i off = _mm256_madd_epi16(_mm512_castsi512_si256(sc16), _mm256_loadu_si256((const __m256i *)y[i].bsums));
        __m512i sumi = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_zextsi256_si512(_mm256_slli_epi32(off, 5)));

        const uint8_t *ql = x[i].ql, *qh = x[i].qh;
        const int8_t *q8 = y[i].qs;
#pragma GCC unroll 2
        for (int h = 0; h < QK_K / 128; h++, ql += 64, qh += 32, q8 += 128) {
            const __m512i lz = _mm512_loadu_si512(ql);
            const __m256i hb = _mm256_loadu_si256((const __m256i *)qh);
            const __m512i hz = _mm512_inserti64x4(_mm512_castsi256_si512(hb), _mm256_srli_epi16(hb, 2), 1);
            const __m512i qa = _mm512_or_si512(_mm512_and_si512(lz, m4), _mm512_slli_epi16(_mm512_and_si512(hz, m2), 4));
            const __m512i qb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lz, 4), m4), _mm512_and_si512(hz, m30));
            const __m512i pa = _mm512_maddubs_epi16(qa, _mm512_loadu_si512(q8));
            const __m512i pb = _mm512_maddubs_epi16(qb, _mm512_loadu_si512(q8 + 64));
            sumi = _mm512_dpwssd_epi32(sumi, pa, le_group_scales_epi16(sc16, 8 * h, 8));
            sumi = _mm512_dpwssd_epi32(sumi, pb, le_group_scales_epi16(sc16, 8 * h + 4, 8));
        }
        acc = _mm512_fmadd_ps(_mm512_set1_ps(y[i].d * _cvtsh_ss(x[i].d)), _mm512_cvtepi32_ps(sumi), acc);
    }
    *s = _mm512_reduce_add_ps(acc);
}

/* Several activation rows (le_vec_dot_n_fn): NT rows a pass (8, then 4: their accumulators fit the 32 zmm registers),
 * each block's codes and scales unpacked once; row t's int32 sums and its one FMA per block are the kernel above's, so
 * s[t] has its bits. */
static inline __attribute__((always_inline)) void q6_K_rows(int64_t n, float *s, int64_t ls, const block_q6_K *x,
                                                            const uint8_t *yb, int64_t ly, const int NT) {
    const int64_t nb = n / QK_K;
    const __m512i m4 = _mm512_set1_epi8(0x0f), m2 = _mm512_set1_epi8(0x03), m30 = _mm512_set1_epi8(0x30);
    __m512 acc[8];
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        le_prefetch_ahead(x + i, sizeof *x);
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)x[i].scales);
        const __m512i sc16 = _mm512_zextsi256_si512(_mm256_cvtepi8_epi16(sc8));
        __m512i sumi[8];
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            const block_q8_K *y = (const block_q8_K *)(yb + t * ly) + i;
            const __m256i off = _mm256_madd_epi16(_mm512_castsi512_si256(sc16), _mm256_loadu_si256((const __m256i *)y->bsums));
            sumi[t] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_zextsi256_si512(_mm256_slli_epi32(off, 5)));
        }
        const uint8_t *ql = x[i].ql, *qh = x[i].qh;
#pragma GCC unroll 2
        for (int h = 0; h < QK_K / 128; h++, ql += 64, qh += 32) {
            const __m512i lz = _mm512_loadu_si512(ql);
            const __m256i hb = _mm256_loadu_si256((const __m256i *)qh);
            const __m512i hz = _mm512_inserti64x4(_mm512_castsi256_si512(hb), _mm256_srli_epi16(hb, 2), 1);
            const __m512i qa = _mm512_or_si512(_mm512_and_si512(lz, m4), _mm512_slli_epi16(_mm512_and_si512(hz, m2), 4));
            const __m512i qb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lz, 4), m4), _mm512_and_si512(hz, m30));
            const __m512i sca = le_group_scales_epi16(sc16, 8 * h, 8), scb = le_group_scales_epi16(sc16, 8 * h + 4, 8);
#pragma GCC unroll 8
            for (int t = 0; t < NT; t++) {
                const int8_t *q8 = ((const block_q8_K *)(yb + t * ly))[i].qs + 128 * h;
                sumi[t] = _mm512_dpwssd_epi32(sumi[t], _mm512_maddubs_epi16(qa, _mm512_loadu_si512(q8)), sca);
                sumi[t] = _mm512_dpwssd_epi32(sumi[t], _mm512_maddubs_epi16(qb, _mm512_loadu_si512(q8 + 64)), scb);
            }
        }
        const float xd = _cvtsh_ss(x[i].d);
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            const block_q8_K *y = (const block_q8_K *)(yb + t * ly) + i;
            acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(y->d * xd), _mm512_cvtepi32_ps(sumi[t]), acc[t]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) s[t * ls] = _mm512_reduce_add_ps(acc[t]);
}

void vec_dot_n_q6_K_q8_K_avx512vnni(int64_t n, float *s, int64_t ls, const void *vx, const void *vy, int64_t ly,
                                    int nt) {
    LE_ROWS_BY_8(q6_K_rows, n, s, ls, vx, vy, ly, nt);
}
