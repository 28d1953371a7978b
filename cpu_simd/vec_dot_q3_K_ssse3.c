/* vec_dot_q3_K_ssse3.c — Q3_K weights . Q8_K activations (W3A8), SSSE3 (no AVX, F16C or FMA).
 *
 * As vec_dot_q3_K_avx2.c on 128-bit vectors, each one group of 16: the unsigned code
 * c = low2 | (hmask bit) << 2 (0..7) goes through pmaddubsw and pmaddwd by the group's
 * scale (s - 32); the constant -4 of q = c - 4 is paid once per block as
 * -4 * sum_g (s_g - 32) * bsum_g (Q8_K's bsums). The high bit of element l of row (h, k)
 * is hmask[l] bit 4h+k. fp16 by le_h2f; no tail (the step is one super-block).
 * Oracle: vec_dot_q3_K_q8_K_ref (native/vec_dot_ref.c).
 * Build: part of the cffi extension (`pip install -e .`); the pragma below compiles this
 * file for SSSE3 whatever the baseline is. Test: python -m pytest tests/test_vec_dot.py -k q3_K-ssse3
 */
#pragma GCC target("ssse3")

#include "simd_x86.h"

void vec_dot_q3_K_q8_K_ssse3(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q3_K *x = vx;
    const block_q8_K *y = vy;
    const int64_t nb = n / QK_K;
    const __m128i m3 = _mm_set1_epi8(3), one = _mm_set1_epi8(1);
    __m128 acc = _mm_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        le_prefetch_ahead(x + i, sizeof *x);   /* DRAM (simd_x86.h) */
        const __m128i s8 = _mm_sub_epi8(le_q3_K_scales(x[i].scales), _mm_set1_epi8(32));   /* -32..31 */
        int16_t sc[16];
        const __m128i s_lo = le_cvtepi8_epi16_lo(s8), s_hi = le_cvtepi8_epi16_lo(_mm_srli_si128(s8, 8));
        _mm_storeu_si128((__m128i *)sc, s_lo);
        _mm_storeu_si128((__m128i *)(sc + 8), s_hi);
        const __m128i off = _mm_add_epi32(_mm_madd_epi16(s_lo, _mm_loadu_si128((const __m128i *)y[i].bsums)),
                                          _mm_madd_epi16(s_hi, _mm_loadu_si128((const __m128i *)(y[i].bsums + 8))));
        __m128i sumi = _mm_sub_epi32(_mm_setzero_si128(), _mm_slli_epi32(off, 2));
        const __m128i hm[2] = {_mm_loadu_si128((const __m128i *)x[i].hmask),
                               _mm_loadu_si128((const __m128i *)(x[i].hmask + 16))};
        const uint8_t *q3 = x[i].qs;
        const int8_t *q8 = y[i].qs;
#pragma GCC unroll 2
        for (int h = 0; h < QK_K / 128; h++) {
            const __m128i bits[2] = {_mm_loadu_si128((const __m128i *)(q3 + 32 * h)),
                                     _mm_loadu_si128((const __m128i *)(q3 + 32 * h + 16))};
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                for (int j = 0; j < 2; j++) {             /* group 8h + 2k + j: elements 16j..16j+15 */
                    const __m128i lo2 = _mm_and_si128(_mm_srli_epi16(bits[j], 2 * k), m3);
                    const __m128i hb = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hm[j], 4 * h + k), one), 2);
                    const __m128i a = _mm_loadu_si128((const __m128i *)(q8 + 128 * h + 32 * k + 16 * j));
                    const __m128i p = _mm_maddubs_epi16(_mm_or_si128(lo2, hb), a);
                    sumi = _mm_add_epi32(sumi, _mm_madd_epi16(p, _mm_set1_epi16(sc[8 * h + 2 * k + j])));
                }
            }
        }
        acc = _mm_add_ps(acc, _mm_mul_ps(_mm_set1_ps(le_h2f(x[i].d) * y[i].d), _mm_cvtepi32_ps(sumi)));
    }
    *s = le_hsum_ps_128(acc);
}
