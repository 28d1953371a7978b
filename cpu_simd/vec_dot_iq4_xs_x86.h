/* vec_dot_iq4_xs_x86.h — IQ4_XS weights . Q8_K activations (W4A8): the one body of the AVX2
 * and AVX-512 VNNI kernels (vec_dot_iq4_xs_avx2.c, vec_dot_iq4_xs_avx512vnni.c include it
 * after their pragma).
 *
 * A 256-element super-block: 8 groups of 32 on the IQ4_NL grid (-127..113) with a 6-bit
 * scale ls_g (biased by 32), w = d * (ls_g - 32) * grid[q]. 32 bytes of qs are two groups:
 * bytes 0..15 hold group g (low nibbles = elements 0..15, high = 16..31), bytes 16..31
 * group g+1; two 128-bit lane permutes put each group's 32 codes in one vector, one
 * vpshufb maps them to signed weights, the sign trick |w| * (a * sign(w)) feeds
 * vpmaddubsw (pairs <= 2*127*127), and the group scale (ls_g - 32) is multiplied and
 * accumulated in int32 by le_madd_acc_256 (simd_x86.h: vpmaddwd + vpaddd on AVX2, one
 * vpdpwssd on VNNI), two accumulators (groups g, g+1).
 * One FMA per super-block by d * da; no tail (the step is one super-block).
 * Oracle: vec_dot_iq4_xs_q8_K_ref (native/vec_dot_ref.c).
 */
#ifndef LE_VEC_DOT_IQ4_XS_X86_H
#define LE_VEC_DOT_IQ4_XS_X86_H

#include "simd_x86.h"

#if !defined(__AVX2__)
#error "include vec_dot_iq4_xs_x86.h after a #pragma GCC target that enables AVX2"
#endif

/* int16 lanes all equal to scale g of `scales` (8 int16 scales in both 128-bit lanes). */
static inline __m256i scale_of(__m256i scales, int g) {
    return _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(0x0100 + 0x0202 * g)));
}

static inline void vec_dot_iq4_xs_q8_K_x86(int64_t n, float *s, const void *vx, const void *vy) {
    const block_iq4_xs *x = vx;
    const block_q8_K *y = vy;
    const int64_t nb = n / QK_K;
    const __m256i grid = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)le_kvalues_iq4nl));
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        le_prefetch_ahead(x + i, sizeof *x);   /* DRAM (simd_x86.h) */
        const __m256i scales = _mm256_broadcastsi128_si256(le_iq4_xs_scales(&x[i]));
        const uint8_t *qs = x[i].qs;
        const int8_t *q8 = y[i].qs;
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int g = 0; g < 8; g += 2) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(qs + 16 * g));
            const __m256i lo = _mm256_and_si256(bits, m4);                       /* [g lo | g+1 lo] */
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4); /* [g hi | g+1 hi] */
            const __m256i w0 = _mm256_shuffle_epi8(grid, _mm256_permute2x128_si256(lo, hi, 0x20));
            const __m256i w1 = _mm256_shuffle_epi8(grid, _mm256_permute2x128_si256(lo, hi, 0x31));
            const __m256i a0 = _mm256_loadu_si256((const __m256i *)(q8 + 32 * g));
            const __m256i a1 = _mm256_loadu_si256((const __m256i *)(q8 + 32 * g + 32));
            const __m256i p0 = _mm256_maddubs_epi16(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(a0, w0));
            const __m256i p1 = _mm256_maddubs_epi16(_mm256_sign_epi8(w1, w1), _mm256_sign_epi8(a1, w1));
            s0 = le_madd_acc_256(s0, p0, scale_of(scales, g));
            s1 = le_madd_acc_256(s1, p1, scale_of(scales, g + 1));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(x[i].d) * y[i].d), _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), acc);
    }
    *s = le_hsum_ps_256(acc);
}

#endif
