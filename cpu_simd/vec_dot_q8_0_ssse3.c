/* vec_dot_q8_0_ssse3.c — Q8_0 weights . Q8_0 activations (W8A8), SSSE3 (the legacy-host tier:
 * no AVX, F16C or FMA).
 *
 * A 32-element block is two 128-bit halves; signed x signed byte products go through
 * pmaddubsw (unsigned x signed) with the sign trick |w| * (a * sign(w)) (psignb), pmaddwd
 * against ones gives 4 int32 per block. Four blocks per loop step: phaddd reduces their
 * partial sums to one int32 per block, so the scales dw*da of the 4 blocks are applied
 * with one mulps (fp16 converted 4 at a time in software: le_h2f_x4). The last 0..3
 * blocks go to the scalar reference (the tail).
 * Oracle: vec_dot_q8_0_q8_0_ref (native/vec_dot_ref.c).
 * Build: part of the cffi extension (`pip install -e .`); the pragma below compiles this
 * file for SSSE3 whatever the baseline is. Test: python -m pytest tests/test_vec_dot.py -k q8_0-ssse3
 */
#pragma GCC target("ssse3")

#include "simd_x86.h"

/* 4 int32 partial sums of one block's w . a */
static inline __m128i block_dot(const block_q8_0 *x, const block_q8_0 *y) {
    const __m128i x0 = _mm_loadu_si128((const __m128i *)x->qs);
    const __m128i x1 = _mm_loadu_si128((const __m128i *)(x->qs + 16));
    const __m128i y0 = _mm_loadu_si128((const __m128i *)y->qs);
    const __m128i y1 = _mm_loadu_si128((const __m128i *)(y->qs + 16));
    return _mm_add_epi32(le_dot_i8_128(x0, y0), le_dot_i8_128(x1, y1));
}

void vec_dot_q8_0_q8_0_ssse3(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q8_0 *x = vx;
    const block_q8_0 *y = vy;
    const int64_t nb = n / QK8_0;
    __m128 acc = _mm_setzero_ps();
    int64_t ib = 0;
    for (; ib + 4 <= nb; ib += 4) {
        le_prefetch_ahead(x + ib, 4 * sizeof *x);   /* DRAM (simd_x86.h) */
        const __m128i sums = le_hsum4_epi32(block_dot(&x[ib], &y[ib]), block_dot(&x[ib + 1], &y[ib + 1]),
                                            block_dot(&x[ib + 2], &y[ib + 2]), block_dot(&x[ib + 3], &y[ib + 3]));
        const __m128 d = _mm_mul_ps(le_h2f_x4(le_halves_x4(&x[ib], sizeof *x, 0)),
                                    le_h2f_x4(le_halves_x4(&y[ib], sizeof *y, 0)));
        acc = _mm_add_ps(acc, _mm_mul_ps(d, _mm_cvtepi32_ps(sums)));
    }
    float sumf = le_hsum_ps_128(acc);
    if (ib < nb) {                                            /* scalar tail: 1..3 blocks */
        float t;
        vec_dot_q8_0_q8_0_ref((nb - ib) * QK8_0, &t, x + ib, y + ib);
        sumf += t;
    }
    *s = sumf;
}
