/* vec_dot_q5_K_x86.h — Q5_K weights . Q8_K activations (W5A8): the one body of the AVX2 and
 * AVX-512 VNNI kernels (vec_dot_q5_K_avx2.c, vec_dot_q5_K_avx512vnni.c include it after
 * their pragma).
 *
 * Q4_K (vec_dot_q4_K_x86.h) plus a 5th bit: qh[l] bit 2c adds 16 to element l of
 * group 2c (low nibbles of chunk c), bit 2c+1 to element l of group 2c+1. The 32 qh bytes
 * are loaded once per super-block and shifted right by 2 per chunk; the bit lands in bit
 * 4 of each byte (vpsrlw/vpsllw keep it inside its byte after the mask).
 * Scales and mins are unpacked in vector form (le_q4_K_scales_mins).
 * q is 0..31: vpmaddubsw pairs <= 2*31*127, no saturation. The group scales: le_madd_acc_256
 * (simd_x86.h: vpmaddwd + vpaddd on AVX2, one vpdpwssd on VNNI), two accumulators; the min term and a block's
 * float step as Q4_K's (le_k4_block_step).
 * No tail (the step is one super-block). Oracle: vec_dot_q5_K_q8_K_ref (native/vec_dot_ref.c).
 */
#ifndef LE_VEC_DOT_Q5_K_X86_H
#define LE_VEC_DOT_Q5_K_X86_H

#include "simd_x86.h"

#if !defined(__AVX2__)
#error "include vec_dot_q5_K_x86.h after a #pragma GCC target that enables AVX2"
#endif

static inline void vec_dot_q5_K_q8_K_x86(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q5_K *x = vx;
    const block_q8_K *y = vy;
    const int64_t nb = n / QK_K;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i one = _mm256_set1_epi8(1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        le_prefetch_ahead(x + i, sizeof *x);   /* DRAM (simd_x86.h) */
        const __m256 d = _mm256_set1_ps(y[i].d * _cvtsh_ss(x[i].d));
        const __m256 dmin = _mm256_set1_ps(y[i].d * _cvtsh_ss(x[i].dmin));
        const __m128i packed = le_q4_K_scales_mins(x[i].scales);
        const __m256i sm = _mm256_cvtepu8_epi16(packed); /* scales | mins */
        const __m256i scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm));
        const uint8_t *q5 = x[i].qs;
        const int8_t *q8 = y[i].qs;
        const __m256i hbits = _mm256_loadu_si256((const __m256i *)x[i].qh);
        __m256i s_lo = _mm256_setzero_si256(), s_hi = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int c = 0; c < QK_K / 64; c++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(q5 + 32 * c));
            /* qh bit 2c -> bit 4 of the low codes, bit 2c+1 -> bit 4 of the high codes */
            const __m256i h_lo = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * c), one), 4);
            const __m256i h_hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * c + 1), one), 4);
            const __m256i lo = _mm256_or_si256(_mm256_and_si256(bits, m4), h_lo);
            const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4), h_hi);
            const __m256i p_lo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(q8 + 64 * c)));
            const __m256i p_hi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(q8 + 64 * c + 32)));
            s_lo = le_madd_acc_256(s_lo, p_lo, le_k4_scale_of(scales, 2 * c));
            s_hi = le_madd_acc_256(s_hi, p_hi, le_k4_scale_of(scales, 2 * c + 1));
        }
        acc = le_k4_block_step(acc, d, dmin, _mm256_add_epi32(s_lo, s_hi), le_k4_mins_twice(packed), y[i].bsums);
    }
    *s = le_hsum_ps_256(acc);
}

#endif
