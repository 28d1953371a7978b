/* vec_dot_iq4_nl_ssse3.c — 32-element blocks on a 16-value grid (IQ4_NL, MXFP4) against
 * Q8_0 activations (W4A8), SSSE3 (no AVX, F16C or FMA).
 *
 * As vec_dot_iq4_nl_avx2.c on 128-bit halves: pshufb maps the 16 low nibbles (elements
 * 0..15) and the 16 high nibbles (16..31) to signed grid values, the sign trick feeds
 * pmaddubsw, pmaddwd sums to int32. Four blocks per loop step: phaddd gives one int32 per
 * block and one mulps applies the 4 scales (IQ4_NL: fp16 d, converted 4 at a time by
 * le_h2f_x4; MXFP4: 2^(e-128)). The last 0..3 blocks go to the scalar reference (the tail).
 * Oracle: vec_dot_{iq4_nl,mxfp4}_q8_0_ref (native/vec_dot_ref.c).
 * Build: part of the cffi extension (`pip install -e .`); the pragma below compiles this
 * file for SSSE3 whatever the baseline is.
 * Test: python -m pytest tests/test_vec_dot.py -k "iq4_nl-ssse3 or mxfp4-ssse3"
 */
#pragma GCC target("ssse3")

#include "simd_x86.h"

/* 4 int32 partial sums of grid[q] * a over one block of 16 code bytes. */
static inline __m128i grid_dot(__m128i grid, const uint8_t *qs, const int8_t *a) {
    __m128i lo, hi;
    le_nibbles_128(_mm_loadu_si128((const __m128i *)qs), &lo, &hi);
    const __m128i w0 = _mm_shuffle_epi8(grid, lo), w1 = _mm_shuffle_epi8(grid, hi);
    return _mm_add_epi32(le_dot_i8_128(w0, _mm_loadu_si128((const __m128i *)a)),
                         le_dot_i8_128(w1, _mm_loadu_si128((const __m128i *)(a + 16))));
}

void vec_dot_iq4_nl_q8_0_ssse3(int64_t n, float *s, const void *vx, const void *vy) {
    const block_iq4_nl *x = vx;
    const block_q8_0 *y = vy;
    const int64_t nb = n / QK4_NL;
    const __m128i grid = _mm_loadu_si128((const __m128i *)le_kvalues_iq4nl);
    __m128 acc = _mm_setzero_ps();
    int64_t ib = 0;
    for (; ib + 4 <= nb; ib += 4) {
        le_prefetch_ahead(x + ib, 4 * sizeof *x);   /* DRAM (simd_x86.h) */
        const __m128i sums = le_hsum4_epi32(grid_dot(grid, x[ib].qs, y[ib].qs), grid_dot(grid, x[ib + 1].qs, y[ib + 1].qs),
                                            grid_dot(grid, x[ib + 2].qs, y[ib + 2].qs),
                                            grid_dot(grid, x[ib + 3].qs, y[ib + 3].qs));
        const __m128 d = _mm_mul_ps(le_h2f_x4(le_halves_x4(&y[ib], sizeof *y, 0)), le_h2f_x4(le_halves_x4(&x[ib], sizeof *x, 0)));
        acc = _mm_add_ps(acc, _mm_mul_ps(d, _mm_cvtepi32_ps(sums)));
    }
    float sumf = le_hsum_ps_128(acc);
    if (ib < nb) {                                            /* scalar tail: 1..3 blocks */
        float t;
        vec_dot_iq4_nl_q8_0_ref((nb - ib) * QK4_NL, &t, x + ib, y + ib);
        sumf += t;
    }
    *s = sumf;
}

void vec_dot_mxfp4_q8_0_ssse3(int64_t n, float *s, const void *vx, const void *vy) {
    const block_mxfp4 *x = vx;
    const block_q8_0 *y = vy;
    const int64_t nb = n / QK_MXFP4;
    const __m128i grid = _mm_loadu_si128((const __m128i *)le_kvalues_mxfp4);
    __m128 acc = _mm_setzero_ps();
    int64_t ib = 0;
    for (; ib + 4 <= nb; ib += 4) {
        le_prefetch_ahead(x + ib, 4 * sizeof *x);   /* DRAM (simd_x86.h) */
        const __m128i sums = le_hsum4_epi32(grid_dot(grid, x[ib].qs, y[ib].qs), grid_dot(grid, x[ib + 1].qs, y[ib + 1].qs),
                                            grid_dot(grid, x[ib + 2].qs, y[ib + 2].qs),
                                            grid_dot(grid, x[ib + 3].qs, y[ib + 3].qs));
        const __m128 d = _mm_mul_ps(le_h2f_x4(le_halves_x4(&y[ib], sizeof *y, 0)), _mm_setr_ps(le_e8m0_half(x[ib].e), le_e8m0_half(x[ib + 1].e),
                                               le_e8m0_half(x[ib + 2].e), le_e8m0_half(x[ib + 3].e)));
        acc = _mm_add_ps(acc, _mm_mul_ps(d, _mm_cvtepi32_ps(sums)));
    }
    float sumf = le_hsum_ps_128(acc);
    if (ib < nb) {                                            /* scalar tail: 1..3 blocks */
        float t;
        vec_dot_mxfp4_q8_0_ref((nb - ib) * QK_MXFP4, &t, x + ib, y + ib);
        sumf += t;
    }
    *s = sumf;
}
