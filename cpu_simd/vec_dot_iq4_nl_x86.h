/* vec_dot_iq4_nl_x86.h — 32-element blocks on a 16-value grid (IQ4_NL, MXFP4) against Q8_0
 * activations (W4A8): the one body of the AVX2 and AVX-512 VNNI kernels (vec_dot_iq4_nl_avx2.c,
 * vec_dot_iq4_nl_avx512vnni.c include it after their pragma).
 *
 * The 4-bit codes index a signed grid (IQ4_NL: -127..113, MXFP4: doubled E2M1 -12..12):
 * one vpshufb turns 32 codes into 32 signed weights. Signed x signed products take the sign
 * trick |w| * (a * sign(w)) into vpmaddubsw + vpmaddwd (AVX2) or one vpdpbusd (VNNI):
 * le_mul_sum_i8_256 (simd_x86.h). The two types differ only in the grid and the block
 * scale (IQ4_NL: fp16 d; MXFP4: E8M0 exponent 2^(e-128)).
 * Two blocks per loop step, two accumulators; an odd last block goes to the scalar
 * reference (the tail). Oracle: vec_dot_{iq4_nl,mxfp4}_q8_0_ref (native/vec_dot_ref.c).
 */
#ifndef LE_VEC_DOT_IQ4_NL_X86_H
#define LE_VEC_DOT_IQ4_NL_X86_H

#include "simd_x86.h"

#if !defined(__AVX2__)
#error "include vec_dot_iq4_nl_x86.h after a #pragma GCC target that enables AVX2"
#endif

/* 8 int32 partial sums of grid[q] * a over one block of 16 code bytes. */
static inline __m256i grid_dot(__m256i grid, const uint8_t *qs, const int8_t *a) {
    const __m256i w = _mm256_shuffle_epi8(grid, le_nibbles_32(qs));
    return le_mul_sum_i8_256(w, _mm256_loadu_si256((const __m256i *)a));
}

static inline void vec_dot_iq4_nl_q8_0_x86(int64_t n, float *s, const void *vx, const void *vy) {
    const block_iq4_nl *x = vx;
    const block_q8_0 *y = vy;
    const int64_t nb = n / QK4_NL;
    const __m256i grid = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)le_kvalues_iq4nl));
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t ib = 0;
    for (; ib + 2 <= nb; ib += 2) {
        le_prefetch_ahead(x + ib, 2 * sizeof *x);   /* DRAM (simd_x86.h) */
        const __m256i p0 = grid_dot(grid, x[ib].qs, y[ib].qs);
        const __m256i p1 = grid_dot(grid, x[ib + 1].qs, y[ib + 1].qs);
        const __m256 d0 = _mm256_set1_ps(_cvtsh_ss(y[ib].d) * _cvtsh_ss(x[ib].d));
        const __m256 d1 = _mm256_set1_ps(_cvtsh_ss(y[ib + 1].d) * _cvtsh_ss(x[ib + 1].d));
        acc0 = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(p0), acc0);
        acc1 = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(p1), acc1);
    }
    float sumf = le_hsum_ps_256(_mm256_add_ps(acc0, acc1));
    if (ib < nb) {                                            /* scalar tail */
        float t;
        vec_dot_iq4_nl_q8_0_ref((nb - ib) * QK4_NL, &t, x + ib, y + ib);
        sumf += t;
    }
    *s = sumf;
}

static inline void vec_dot_mxfp4_q8_0_x86(int64_t n, float *s, const void *vx, const void *vy) {
    const block_mxfp4 *x = vx;
    const block_q8_0 *y = vy;
    const int64_t nb = n / QK_MXFP4;
    const __m256i grid = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)le_kvalues_mxfp4));
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t ib = 0;
    for (; ib + 2 <= nb; ib += 2) {
        le_prefetch_ahead(x + ib, 2 * sizeof *x);   /* DRAM (simd_x86.h) */
        const __m256i p0 = grid_dot(grid, x[ib].qs, y[ib].qs);
        const __m256i p1 = grid_dot(grid, x[ib + 1].qs, y[ib + 1].qs);
        const __m256 d0 = _mm256_set1_ps(_cvtsh_ss(y[ib].d) * le_e8m0_half(x[ib].e));
        const __m256 d1 = _mm256_set1_ps(_cvtsh_ss(y[ib + 1].d) * le_e8m0_half(x[ib + 1].e));
        acc0 = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(p0), acc0);
        acc1 = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(p1), acc1);
    }
    float sumf = le_hsum_ps_256(_mm256_add_ps(acc0, acc1));
    if (ib < nb) {                                            /* scalar tail */
        float t;
        vec_dot_mxfp4_q8_0_ref((nb - ib) * QK_MXFP4, &t, x + ib, y + ib);
        sumf += t;
    }
    *s = sumf;
}

#endif
