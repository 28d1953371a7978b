/* vec_dot_q2_K_ssse3.c — Q2_K weights . Q8_K activations (W2A8), SSSE3 (no AVX, F16C or FMA).
 *
 * As vec_dot_q2_K_avx2.c on 128-bit vectors, each one group of 16: pmaddubsw (q 0..3 x a)
 * and pmaddwd by the group's 4-bit scale; the min term dmin * da * sum_g (sc_g >> 4) *
 * bsum_g takes two pmaddwd on Q8_K's bsums. fp16 by le_h2f; no tail.
 * Oracle: vec_dot_q2_K_q8_K_ref (native/vec_dot_ref.c).
 * Build: part of the cffi extension (`pip install -e .`); the pragma below compiles this
 * file for SSSE3 whatever the baseline is. Test: python -m pytest tests/test_vec_dot.py -k q2_K-ssse3
 */
#pragma GCC target("ssse3")

#include "simd_x86.h"

void vec_dot_q2_K_q8_K_ssse3(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q2_K *x = vx;
    const block_q8_K *y = vy;
    const int64_t nb = n / QK_K;
    const __m128i m3 = _mm_set1_epi8(3), m4 = _mm_set1_epi8(0x0f), zero = _mm_setzero_si128();
    __m128 acc = _mm_setzero_ps(), acc_m = _mm_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        le_prefetch_ahead(x + i, sizeof *x);   /* DRAM (simd_x86.h) */
        const float dall = y[i].d * le_h2f(x[i].d);
        const float dmin = y[i].d * le_h2f(x[i].dmin);
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)x[i].scales);
        const __m128i mins = _mm_and_si128(_mm_srli_epi16(sc8, 4), m4);
        const __m128i msum = _mm_add_epi32(
            _mm_madd_epi16(_mm_unpacklo_epi8(mins, zero), _mm_loadu_si128((const __m128i *)y[i].bsums)),
            _mm_madd_epi16(_mm_unpackhi_epi8(mins, zero), _mm_loadu_si128((const __m128i *)(y[i].bsums + 8))));
        acc_m = _mm_add_ps(acc_m, _mm_mul_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(msum)));

        int16_t sc[16];                                   /* the 4-bit scales as int16 */
        const __m128i scl = _mm_and_si128(sc8, m4);
        _mm_storeu_si128((__m128i *)sc, _mm_unpacklo_epi8(scl, zero));
        _mm_storeu_si128((__m128i *)(sc + 8), _mm_unpackhi_epi8(scl, zero));
        const uint8_t *q2 = x[i].qs;
        const int8_t *q8 = y[i].qs;
        __m128i sumi = _mm_setzero_si128();
#pragma GCC unroll 2
        for (int h = 0; h < QK_K / 128; h++) {
            const __m128i bits[2] = {_mm_loadu_si128((const __m128i *)(q2 + 32 * h)),
                                     _mm_loadu_si128((const __m128i *)(q2 + 32 * h + 16))};
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                for (int j = 0; j < 2; j++) {             /* group 8h + 2k + j */
                    const __m128i q = _mm_and_si128(_mm_srli_epi16(bits[j], 2 * k), m3);
                    const __m128i a = _mm_loadu_si128((const __m128i *)(q8 + 128 * h + 32 * k + 16 * j));
                    const __m128i p = _mm_maddubs_epi16(q, a);
                    sumi = _mm_add_epi32(sumi, _mm_madd_epi16(p, _mm_set1_epi16(sc[8 * h + 2 * k + j])));
                }
            }
        }
        acc = _mm_add_ps(acc, _mm_mul_ps(_mm_set1_ps(dall), _mm_cvtepi32_ps(sumi)));
    }
    *s = le_hsum_ps_128(acc) - le_hsum_ps_128(acc_m);
}
