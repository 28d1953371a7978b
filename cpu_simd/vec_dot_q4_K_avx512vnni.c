/* vec_dot_q4_K_avx512vnni.c — Q4_K weights . Q8_K activations (W4A8), AVX-512 VNNI on
 * 256-bit registers (AVX512VL).
 *
 * The AVX2 kernel (vec_dot_q4_K_avx2.c) with VNNI's vpdpwssd fusing the group-scale
 * vpmaddwd and the int32 accumulation: per group of 32, vpmaddubsw (q 0..15 unsigned x a
 * signed, pairs <= 2*15*127) then one vpdpwssd by the group scale; two accumulators (low
 * and high nibble groups) keep the vpdpwssd chains short. Why ymm and not zmm: on the
 * Emerald Rapids host the zmm variant (64 elements per vpmaddubsw, scales by vpermw) ran
 * 15-20% slower in cache than this one (1 MiB of weights: 16.9 vs 20.5 GB/s), and GEMV
 * from DRAM is bound by memory either way.
 * The min term is Q8_K's bsums . mins as in the AVX2 kernel. One FMA per super-block.
 * No tail (the step is one super-block). Oracle: vec_dot_q4_K_q8_K_ref.
 * Build: part of the cffi extension (`pip install -e .`); the pragma below compiles this
 * file for AVX-512 VNNI whatever the baseline is; it runs only where the CPU has it.
 * Test: python -m pytest tests/test_vec_dot.py -k q4_K-avx512vnni (on a host with AVX-512 VNNI)
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

#include "simd_x86.h"

/* int16 lanes all equal to scale g of `scales` (the 8 scales as int16, in both 128-bit lanes). */
static inline __m256i scale_of(__m256i scales, int g) {
    return _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(0x0100 + 0x0202 * g)));
}

void vec_dot_q4_K_q8_K_avx512vnni(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q4_K *x = vx;
    const block_q8_K *y = vy;
    const int64_t nb = n / QK_K;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 acc = _mm256_setzero_ps();
    __m128 acc_m = _mm_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        le_prefetch_ahead(x + i, sizeof *x);   /* DRAM (simd_x86.h) */
        const float d = y[i].d * _cvtsh_ss(x[i].d);
        const float dmin = y[i].d * _cvtsh_ss(x[i].dmin);
        const __m256i sm = _mm256_cvtepu8_epi16(le_q4_K_scales_mins(x[i].scales));  /* scales | mins */

        const __m256i bsums = _mm256_loadu_si256((const __m256i *)y[i].bsums);
        const __m128i gsums = _mm_hadd_epi16(_mm256_castsi256_si128(bsums), _mm256_extracti128_si256(bsums, 1));
        const __m128i prod = _mm_madd_epi16(_mm256_extracti128_si256(sm, 1), gsums);
        acc_m = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m);

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
            s_lo = _mm256_dpwssd_epi32(s_lo, p_lo, scale_of(scales, 2 * c));
            s_hi = _mm256_dpwssd_epi32(s_hi, p_hi, scale_of(scales, 2 * c + 1));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_add_epi32(s_lo, s_hi)), acc);
    }
    acc_m = _mm_add_ps(acc_m, _mm_movehl_ps(acc_m, acc_m));
    acc_m = _mm_add_ss(acc_m, _mm_movehdup_ps(acc_m));
    *s = le_hsum_ps_256(acc) - _mm_cvtss_f32(acc_m);
}
