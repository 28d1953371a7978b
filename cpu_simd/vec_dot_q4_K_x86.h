/* vec_dot_q4_K_x86.h — Q4_K weights . Q8_K activations (W4A8): the one body of the AVX2 and
 * AVX-512 VNNI kernels (vec_dot_q4_K_avx2.c, vec_dot_q4_K_avx512vnni.c include it after
 * their pragma).
 *
 * A 256-element super-block: 8 groups of 32 with a 6-bit scale sc_g and a 6-bit min m_g,
 * w = d * sc_g * q - dmin * m_g, q 0..15. So
 *   dot = d * da * sum_g sc_g * sum_{i in g} q_i a_i  -  dmin * da * sum_g m_g * sum_{i in g} a_i
 * and sum_{i in g} a_i is two of Q8_K's bsums (16 each): the min term costs one vpmaddwd of the 16 bsums by the
 * 8 mins each twice (int32 lane g: m_g * (bsum 2g + bsum 2g+1)), then a fused multiply-add into the same 8 float
 * lanes as the scale term (no horizontal add a block).
 * Each 32 bytes of qs hold groups 2c (low nibbles) and 2c+1 (high nibbles): one
 * vpmaddubsw per group (q unsigned x a signed, pairs <= 2*15*127), then the group's scale
 * (as int16) multiplied and accumulated in int32 by le_madd_acc_256 (simd_x86.h: vpmaddwd +
 * vpaddd on AVX2, one vpdpwssd on VNNI); two accumulators (low and high nibble groups) keep
 * the chains short. Two FMAs per block: by d * da, then by -dmin * da.
 * No tail: the kernel's step is one super-block, the type's block.
 * Oracle: vec_dot_q4_K_q8_K_ref (native/vec_dot_ref.c).
 */
#ifndef LE_VEC_DOT_Q4_K_X86_H
#define LE_VEC_DOT_Q4_K_X86_H

#include "simd_x86.h"

#if !defined(__AVX2__)
#error "include vec_dot_q4_K_x86.h after a #pragma GCC target that enables AVX2"
#endif

static inline void vec_dot_q4_K_q8_K_x86(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q4_K *x = vx;
    const block_q8_K *y = vy;
    const int64_t nb = n / QK_K;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        le_prefetch_ahead(x + i, sizeof *x);   /* DRAM (simd_x86.h) */
        const __m256 d = _mm256_set1_ps(y[i].d * _cvtsh_ss(x[i].d));
        const __m256 dmin = _mm256_set1_ps(y[i].d * _cvtsh_ss(x[i].dmin));
        const __m128i packed = le_q4_K_scales_mins(x[i].scales);
        /* int16: lanes 0..7 the group scales, 8..15 the group mins */
        const __m256i sm = _mm256_cvtepu8_epi16(packed);
        const __m256i scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm));
        const uint8_t *q4 = x[i].qs;
        const int8_t *q8 = y[i].qs;
        __m256i s_lo = _mm256_setzero_si256(), s_hi = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int c = 0; c < QK_K / 64; c++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(q4 + 32 * c));
            const __m256i lo = _mm256_and_si256(bits, m4);                       /* group 2c */
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4); /* group 2c+1 */
            const __m256i p_lo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(q8 + 64 * c)));
            const __m256i p_hi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(q8 + 64 * c + 32)));
            s_lo = le_madd_acc_256(s_lo, p_lo, le_k4_scale_of(scales, 2 * c));
            s_hi = le_madd_acc_256(s_hi, p_hi, le_k4_scale_of(scales, 2 * c + 1));
        }
        acc = le_k4_block_step(acc, d, dmin, _mm256_add_epi32(s_lo, s_hi), le_k4_mins_twice(packed), y[i].bsums);
    }
    *s = le_hsum_ps_256(acc);
}

/* Several activation rows (le_vec_dot_n_fn): NT rows a pass (8 where AVX-512VL gives 32 vector registers, else 4),
 * each block's nibbles and scales unpacked once for all of them; row t's arithmetic is vec_dot_q4_K_q8_K_x86's step
 * for step (its int32 sum of the block, le_k4_block_step, the same final sum), so every s[t]
 * is that kernel's bits: one int32 accumulator holds what its s_lo + s_hi hold (int32 sums are exact, any order). */
#if defined(__AVX512VL__)
#define Q4_K_NT 8
#else
#define Q4_K_NT 4
#endif
static inline __attribute__((always_inline)) void q4_K_rows(int64_t n, float *s, int64_t ls, const block_q4_K *x,
                                                            const uint8_t *yb, int64_t ly, const int NT) {
    const int64_t nb = n / QK_K;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 acc[Q4_K_NT];
    #pragma GCC unroll 8
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        le_prefetch_ahead(x + i, sizeof *x);
        const __m256 xd = _mm256_set1_ps(_cvtsh_ss(x[i].d)), xdmin = _mm256_set1_ps(_cvtsh_ss(x[i].dmin));
        const __m128i packed = le_q4_K_scales_mins(x[i].scales);
        const __m256i sm = _mm256_cvtepu8_epi16(packed), mins2 = le_k4_mins_twice(packed);
        const __m256i scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm));
        const uint8_t *q4 = x[i].qs;
        __m256i si[Q4_K_NT];
        #pragma GCC unroll 8
        for (int t = 0; t < NT; t++) si[t] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int c = 0; c < QK_K / 64; c++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(q4 + 32 * c));
            const __m256i lo = _mm256_and_si256(bits, m4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
            const __m256i sc_lo = le_k4_scale_of(scales, 2 * c), sc_hi = le_k4_scale_of(scales, 2 * c + 1);
            #pragma GCC unroll 8
            for (int t = 0; t < NT; t++) {
                const int8_t *q8 = ((const block_q8_K *)(yb + t * ly))[i].qs + 64 * c;
                const __m256i a_lo = _mm256_loadu_si256((const __m256i *)q8);
                const __m256i a_hi = _mm256_loadu_si256((const __m256i *)(q8 + 32));
                si[t] = le_madd_acc_256(si[t], _mm256_maddubs_epi16(lo, a_lo), sc_lo);
                si[t] = le_madd_acc_256(si[t], _mm256_maddubs_epi16(hi, a_hi), sc_hi);
            }
        }
        #pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            const block_q8_K *y = (const block_q8_K *)(yb + t * ly) + i;
            const __m256 yd = _mm256_broadcast_ss(&y->d); /* a load: no shuffle-port broadcast a row and block */
            acc[t] = le_k4_block_step(acc[t], _mm256_mul_ps(yd, xd), _mm256_mul_ps(yd, xdmin), si[t], mins2, y->bsums);
        }
    }
    #pragma GCC unroll 8
    for (int t = 0; t < NT; t++) s[t * ls] = le_hsum_ps_256(acc[t]);
}

static inline void vec_dot_n_q4_K_q8_K_x86(int64_t n, float *s, int64_t ls, const void *vx, const void *vy,
                                           int64_t ly, int nt) {
#if Q4_K_NT == 8
    LE_ROWS_BY_8(q4_K_rows, n, s, ls, vx, vy, ly, nt);
#else
    LE_ROWS_BY_4(q4_K_rows, n, s, ls, vx, vy, ly, nt);
#endif
}

#endif
