/* vec_dot_q2_K_x86.h — Q2_K weights . Q8_K activations (W2A8): the one body of the AVX2 and
 * AVX-512 VNNI kernels (vec_dot_q2_K_avx2.c, vec_dot_q2_K_avx512vnni.c include it after
 * their pragma).
 *
 * A 256-element super-block: 16 groups of 16, a scale byte per group (low nibble: scale,
 * high nibble: min), w = d * (sc & 15) * q - dmin * (sc >> 4), q 0..3. The min term is
 * dmin * da * sum_g (sc_g >> 4) * bsum_g (Q8_K's bsums, one vpmaddwd). Per 128 elements
 * (qs + 32h) the shifts 0,2,4,6 of the 32 qs bytes give 32 codes (groups 8h+2k, 8h+2k+1):
 * one vpmaddubsw (pairs <= 2*3*127), then the group scales [sc_a x8 | sc_b x8] multiplied
 * and accumulated in int32 by le_madd_acc_256 (simd_x86.h: vpmaddwd + vpaddd on AVX2, one
 * vpdpwssd on VNNI), into two accumulators (k even / odd) to keep the chains short.
 * One FMA per super-block; no tail. Oracle: vec_dot_q2_K_q8_K_ref (native/vec_dot_ref.c).
 */
#ifndef LE_VEC_DOT_Q2_K_X86_H
#define LE_VEC_DOT_Q2_K_X86_H

#include "simd_x86.h"

#if !defined(__AVX2__)
#error "include vec_dot_q2_K_x86.h after a #pragma GCC target that enables AVX2"
#endif

/* int16 [sc_g x8 | sc_g+1 x8] from the 16 scale bytes held in both 128-bit lanes (g even):
 * byte g (low lane) / g+1 (high lane), zero-extended by the 0x80 (zero) control bytes. */
static inline __m256i scale_pair(__m256i sc8x2, int g) {
    const __m256i ctrl = _mm256_set_m128i(_mm_set1_epi16((short)(0x8000 | (g + 1))), _mm_set1_epi16((short)(0x8000 | g)));
    return _mm256_shuffle_epi8(sc8x2, ctrl);
}

static inline void vec_dot_q2_K_q8_K_x86(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q2_K *x = vx;
    const block_q8_K *y = vy;
    const int64_t nb = n / QK_K;
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m128i m4 = _mm_set1_epi8(0x0f);
    __m256 acc = _mm256_setzero_ps();
    __m256 acc_m = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        le_prefetch_ahead(x + i, sizeof *x);   /* DRAM (simd_x86.h) */
        const float dall = y[i].d * _cvtsh_ss(x[i].d);
        const float dmin = y[i].d * _cvtsh_ss(x[i].dmin);
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)x[i].scales);
        /* min term: 16 mins . 16 bsums */
        const __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc8, 4), m4));
        const __m256i bsums = _mm256_loadu_si256((const __m256i *)y[i].bsums);
        acc_m = _mm256_fmadd_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(_mm256_madd_epi16(mins, bsums)), acc_m);

        const __m256i scales = _mm256_broadcastsi128_si256(_mm_and_si128(sc8, m4));
        const uint8_t *q2 = x[i].qs;
        const int8_t *q8 = y[i].qs;
        __m256i sumi[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 2
        for (int h = 0; h < QK_K / 128; h++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(q2 + 32 * h));
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const __m256i q = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * k), m3);
                const __m256i p = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)(q8 + 128 * h + 32 * k)));
                sumi[k & 1] = le_madd_acc_256(sumi[k & 1], p, scale_pair(scales, 8 * h + 2 * k));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dall), _mm256_cvtepi32_ps(_mm256_add_epi32(sumi[0], sumi[1])), acc);
    }
    *s = le_hsum_ps_256(acc) - le_hsum_ps_256(acc_m);
}

#endif
