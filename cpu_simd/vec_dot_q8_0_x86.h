/* vec_dot_q8_0_x86.h — Q8_0 weights . Q8_0 activations (W8A8): the one body of the AVX2 and
 * AVX-512 VNNI kernels (vec_dot_q8_0_avx2.c, vec_dot_q8_0_avx512vnni.c include it after
 * their pragma).
 *
 * One 32-element block is one 256-bit vector: the signed x signed byte products take the
 * sign trick |w| * (a * sign(w)) into vpmaddubsw + vpmaddwd (AVX2) or one vpdpbusd (VNNI),
 * 8 int32 partial sums either way (le_mul_sum_i8_256, simd_x86.h); the block scale dw*da
 * (f32) is applied with one FMA per block into 8 f32 lanes. Two blocks per iteration, two
 * accumulators (hides the FMA latency); an odd last block goes to the scalar reference.
 * Oracle: vec_dot_q8_0_q8_0_ref (native/vec_dot_ref.c).
 */
#ifndef LE_VEC_DOT_Q8_0_X86_H
#define LE_VEC_DOT_Q8_0_X86_H

#include "simd_x86.h"

#if !defined(__AVX2__)
#error "include vec_dot_q8_0_x86.h after a #pragma GCC target that enables AVX2"
#endif

/* x: nb blocks of Q8_0 weights, y: nb blocks of Q8_0 activations (-127..127). */
static inline void vec_dot_q8_0_q8_0_x86(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q8_0 *x = vx;
    const block_q8_0 *y = vy;
    const int64_t nb = n / QK8_0;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t ib = 0;
    for (; ib + 2 <= nb; ib += 2) {
        le_prefetch_ahead(x + ib, 2 * sizeof *x);   /* DRAM (simd_x86.h) */
        const __m256i p0 = le_mul_sum_i8_256(_mm256_loadu_si256((const __m256i *)x[ib].qs),
                                             _mm256_loadu_si256((const __m256i *)y[ib].qs));
        const __m256i p1 = le_mul_sum_i8_256(_mm256_loadu_si256((const __m256i *)x[ib + 1].qs),
                                             _mm256_loadu_si256((const __m256i *)y[ib + 1].qs));
        const __m256 d0 = _mm256_set1_ps(_cvtsh_ss(x[ib].d) * _cvtsh_ss(y[ib].d));
        const __m256 d1 = _mm256_set1_ps(_cvtsh_ss(x[ib + 1].d) * _cvtsh_ss(y[ib + 1].d));
        acc0 = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(p0), acc0);
        acc1 = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(p1), acc1);
    }
    float sumf = le_hsum_ps_256(_mm256_add_ps(acc0, acc1));
    if (ib < nb) {                                            /* scalar tail: the last block */
        float t;
        vec_dot_q8_0_q8_0_ref((nb - ib) * QK8_0, &t, x + ib, y + ib);
        sumf += t;
    }
    *s = sumf;
}

#endif
