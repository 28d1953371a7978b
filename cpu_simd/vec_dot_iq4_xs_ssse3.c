/* vec_dot_iq4_xs_ssse3.c — IQ4_XS weights . Q8_K activations (W4A8), SSSE3 (no AVX, F16C, FMA).
 *
 * As vec_dot_iq4_xs_avx2.c on 128-bit halves: per group of 32 (16 qs bytes), pshufb maps
 * the low nibbles (elements 0..15) and high nibbles (16..31) to signed IQ4_NL grid values,
 * the sign trick feeds pmaddubsw, and pmaddwd by the group scale (ls - 32) gives int32.
 * One mulps + addps per super-block by d * da; no tail (the step is one super-block).
 * Oracle: vec_dot_iq4_xs_q8_K_ref (native/vec_dot_ref.c).
 * Build: part of the cffi extension (`pip install -e .`); the pragma below compiles this
 * file for SSSE3 whatever the baseline is. Test: python -m pytest tests/test_vec_dot.py -k iq4_xs-ssse3
 */
#pragma GCC target("ssse3")

#include "simd_x86.h"

void vec_dot_iq4_xs_q8_K_ssse3(int64_t n, float *s, const void *vx, const void *vy) {
    const block_iq4_xs *x = vx;
    const block_q8_K *y = vy;
    const int64_t nb = n / QK_K;
    const __m128i grid = _mm_loadu_si128((const __m128i *)le_kvalues_iq4nl);
    __m128 acc = _mm_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        le_prefetch_ahead(x + i, sizeof *x);   /* DRAM (simd_x86.h) */
        const uint8_t *qs = x[i].qs;
        const int8_t *q8 = y[i].qs;
        __m128i sumi = _mm_setzero_si128();
        for (int g = 0; g < 8; g++, qs += 16, q8 += 32) {
            const int ls = (((x[i].scales_l[g / 2] >> 4 * (g % 2)) & 0x0f) | (((x[i].scales_h >> 2 * g) & 3) << 4)) - 32;
            __m128i lo, hi;
            le_nibbles_128(_mm_loadu_si128((const __m128i *)qs), &lo, &hi);
            const __m128i w0 = _mm_shuffle_epi8(grid, lo), w1 = _mm_shuffle_epi8(grid, hi);
            const __m128i a0 = _mm_loadu_si128((const __m128i *)q8);
            const __m128i a1 = _mm_loadu_si128((const __m128i *)(q8 + 16));
            /* pairs of |w| <= 127 times |a| <= 127 reach 32258: each pmaddubsw result is widened
             * by its own pmaddwd (adding two in int16 could overflow) */
            const __m128i p0 = _mm_maddubs_epi16(_mm_sign_epi8(w0, w0), _mm_sign_epi8(a0, w0));
            const __m128i p1 = _mm_maddubs_epi16(_mm_sign_epi8(w1, w1), _mm_sign_epi8(a1, w1));
            const __m128i sc = _mm_set1_epi16((short)ls);
            sumi = _mm_add_epi32(sumi, _mm_add_epi32(_mm_madd_epi16(p0, sc), _mm_madd_epi16(p1, sc)));
        }
        acc = _mm_add_ps(acc, _mm_mul_ps(_mm_set1_ps(le_h2f(x[i].d) * y[i].d), _mm_cvtepi32_ps(sumi)));
    }
    *s = le_hsum_ps_128(acc);
}
