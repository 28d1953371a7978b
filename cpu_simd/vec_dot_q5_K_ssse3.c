/* vec_dot_q5_K_ssse3.c — Q5_K weights . Q8_K activations (W5A8), SSSE3 (no AVX, F16C or FMA).
 *
 * vec_dot_q4_K_ssse3.c plus the 5th bit: qh[l] bit 2c adds 16 to element l of group 2c,
 * bit 2c+1 to element l of group 2c+1 (qh's two halves are shifted right by 2 per chunk,
 * the bit moved to bit 4 of its byte). q 0..31: two pmaddubsw summed in int16 stay
 * <= 4*31*127. fp16 by le_h2f, mulps + addps per super-block; no tail.
 * Oracle: vec_dot_q5_K_q8_K_ref (native/vec_dot_ref.c).
 * Build: part of the cffi extension (`pip install -e .`); the pragma below compiles this
 * file for SSSE3 whatever the baseline is. Test: python -m pytest tests/test_vec_dot.py -k q5_K-ssse3
 */
#pragma GCC target("ssse3")

#include "simd_x86.h"

void vec_dot_q5_K_q8_K_ssse3(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q5_K *x = vx;
    const block_q8_K *y = vy;
    const int64_t nb = n / QK_K;
    const __m128i one = _mm_set1_epi8(1);
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

        const uint8_t *q5 = x[i].qs;
        const int8_t *q8 = y[i].qs;
        __m128i h0 = _mm_loadu_si128((const __m128i *)x[i].qh);           /* elements l = 0..15 */
        __m128i h1 = _mm_loadu_si128((const __m128i *)(x[i].qh + 16));    /* l = 16..31 */
        __m128i sumi = _mm_setzero_si128();
#pragma GCC unroll 4
        for (int c = 0; c < QK_K / 64; c++, q5 += 32, q8 += 64) {
            __m128i lo0, hi0, lo1, hi1;
            le_nibbles_128(_mm_loadu_si128((const __m128i *)q5), &lo0, &hi0);
            le_nibbles_128(_mm_loadu_si128((const __m128i *)(q5 + 16)), &lo1, &hi1);
            lo0 = _mm_or_si128(lo0, _mm_slli_epi16(_mm_and_si128(h0, one), 4));
            lo1 = _mm_or_si128(lo1, _mm_slli_epi16(_mm_and_si128(h1, one), 4));
            hi0 = _mm_or_si128(hi0, _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(h0, 1), one), 4));
            hi1 = _mm_or_si128(hi1, _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(h1, 1), one), 4));
            h0 = _mm_srli_epi16(h0, 2);
            h1 = _mm_srli_epi16(h1, 2);
            const __m128i p_lo = _mm_add_epi16(_mm_maddubs_epi16(lo0, _mm_loadu_si128((const __m128i *)q8)),
                                               _mm_maddubs_epi16(lo1, _mm_loadu_si128((const __m128i *)(q8 + 16))));
            const __m128i p_hi = _mm_add_epi16(_mm_maddubs_epi16(hi0, _mm_loadu_si128((const __m128i *)(q8 + 32))),
                                               _mm_maddubs_epi16(hi1, _mm_loadu_si128((const __m128i *)(q8 + 48))));
            sumi = _mm_add_epi32(sumi, _mm_madd_epi16(p_lo, _mm_set1_epi16(sc[2 * c])));
            sumi = _mm_add_epi32(sumi, _mm_madd_epi16(p_hi, _mm_set1_epi16(sc[2 * c + 1])));
        }
        acc = _mm_add_ps(acc, _mm_mul_ps(_mm_set1_ps(d), _mm_cvtepi32_ps(sumi)));
    }
    *s = le_hsum_ps_128(acc) - le_hsum_ps_128(acc_m);
}
