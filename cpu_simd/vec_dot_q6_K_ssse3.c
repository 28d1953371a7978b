/* vec_dot_q6_K_ssse3.c — Q6_K weights . Q8_K activations (W6A8), SSSE3 (no AVX, F16C or FMA).
 *
 * As vec_dot_q6_K_avx2.c on 128-bit vectors, each exactly one group of 16: q 0..63 from a
 * ql nibble and a qh bit pair, pmaddubsw (q unsigned x a signed, pairs <= 2*63*127) and
 * pmaddwd by the group's int8 scale; the offset 32 is taken out once per super-block as
 * 32 * sum_g sc_g * bsum_g (Q8_K's bsums, two pmaddwd). fp16 by le_h2f; no tail.
 * Oracle: vec_dot_q6_K_q8_K_ref (native/vec_dot_ref.c).
 * Build: part of the cffi extension (`pip install -e .`); the pragma below compiles this
 * file for SSSE3 whatever the baseline is. Test: python -m pytest tests/test_vec_dot.py -k q6_K-ssse3
 */
#pragma GCC target("ssse3")

#include "simd_x86.h"

/* int32 sums of q . a for one group of 16 scaled by sc. */
static inline __m128i group(__m128i q, const int8_t *a, int sc) {
    return _mm_madd_epi16(_mm_maddubs_epi16(q, _mm_loadu_si128((const __m128i *)a)), _mm_set1_epi16((short)sc));
}

void vec_dot_q6_K_q8_K_ssse3(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q6_K *x = vx;
    const block_q8_K *y = vy;
    const int64_t nb = n / QK_K;
    const __m128i m4 = _mm_set1_epi8(0x0f), m2 = _mm_set1_epi8(0x03);
    __m128 acc = _mm_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        le_prefetch_ahead(x + i, sizeof *x);   /* DRAM (simd_x86.h) */
        const int8_t *sc = x[i].scales;
        /* offset term: 32 * sum_g sc_g * bsum_g, scales widened to int16 */
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)sc);
        const __m128i sc_lo = le_cvtepi8_epi16_lo(sc8), sc_hi = le_cvtepi8_epi16_lo(_mm_srli_si128(sc8, 8));
        const __m128i off = _mm_add_epi32(_mm_madd_epi16(sc_lo, _mm_loadu_si128((const __m128i *)y[i].bsums)),
                                          _mm_madd_epi16(sc_hi, _mm_loadu_si128((const __m128i *)(y[i].bsums + 8))));
        __m128i sumi = _mm_sub_epi32(_mm_setzero_si128(), _mm_slli_epi32(off, 5));

        const uint8_t *ql = x[i].ql, *qh = x[i].qh;
        const int8_t *q8 = y[i].qs;
        for (int h = 0; h < QK_K / 128; h++, ql += 64, qh += 32, q8 += 128, sc += 8) {
            for (int j = 0; j < 2; j++) {          /* elements l = 16j .. 16j+15 of each 32-row */
                const __m128i l0 = _mm_loadu_si128((const __m128i *)(ql + 16 * j));
                const __m128i l1 = _mm_loadu_si128((const __m128i *)(ql + 32 + 16 * j));
                const __m128i hb = _mm_loadu_si128((const __m128i *)(qh + 16 * j));
                const __m128i q0 = _mm_or_si128(_mm_and_si128(l0, m4), _mm_slli_epi16(_mm_and_si128(hb, m2), 4));
                const __m128i q1 = _mm_or_si128(_mm_and_si128(l1, m4),
                                                _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hb, 2), m2), 4));
                const __m128i q2 = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(l0, 4), m4),
                                                _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hb, 4), m2), 4));
                const __m128i q3 = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(l1, 4), m4),
                                                _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hb, 6), m2), 4));
                /* element l of rows 0..3 of this half: l, l+32, l+64, l+96; group = row*2 + j */
                sumi = _mm_add_epi32(sumi, group(q0, q8 + 16 * j, sc[0 + j]));
                sumi = _mm_add_epi32(sumi, group(q1, q8 + 32 + 16 * j, sc[2 + j]));
                sumi = _mm_add_epi32(sumi, group(q2, q8 + 64 + 16 * j, sc[4 + j]));
                sumi = _mm_add_epi32(sumi, group(q3, q8 + 96 + 16 * j, sc[6 + j]));
            }
        }
        acc = _mm_add_ps(acc, _mm_mul_ps(_mm_set1_ps(le_h2f(x[i].d) * y[i].d), _mm_cvtepi32_ps(sumi)));
    }
    *s = le_hsum_ps_128(acc);
}
