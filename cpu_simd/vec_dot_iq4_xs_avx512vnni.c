/* vec_dot_iq4_xs_avx512vnni.c — IQ4_XS weights . Q8_K activations (W4A8), AVX-512 VNNI on
 * 256-bit registers (AVX512VL).
 *
 * The AVX2 kernel (vec_dot_iq4_xs_avx2.c: vpshufb onto the IQ4_NL grid, the sign trick
 * |w| * (a * sign(w)) into vpmaddubsw, pairs <= 2*127*127) with vpdpwssd fusing the
 * group-scale vpmaddwd (ls - 32) and the int32 accumulation, two accumulators. ymm rather
 * than zmm: the zmm variant (vshufi64x2 to order the codes, vpabsb + masked vpsubb for the
 * missing vpsignb, vpermw for the scales) measured slower in cache on Emerald Rapids
 * (9.8 vs 11.0 GB/s at 8 MiB). One FMA per super-block; no tail.
 * Oracle: vec_dot_iq4_xs_q8_K_ref (native/vec_dot_ref.c).
 * Build: part of the cffi extension (`pip install -e .`); the pragma below compiles this
 * file for AVX-512 VNNI whatever the baseline is; it runs only where the CPU has it.
 * Test: python -m pytest tests/test_vec_dot.py -k iq4_xs-avx512vnni (on a host with AVX-512 VNNI)
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

#include "simd_x86.h"

static inline __m256i scale_of(__m256i scales, int g) {
    return _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(0x0100 + 0x0202 * g)));
}

void vec_dot_iq4_xs_q8_K_avx512vnni(int64_t n, float *s, const void *vx, const void *vy) {
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
            s0 = _mm256_dpwssd_epi32(s0, p0, scale_of(scales, g));
            s1 = _mm256_dpwssd_epi32(s1, p1, scale_of(scales, g + 1));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(x[i].d) * y[i].d), _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), acc);
    }
    *s = le_hsum_ps_256(acc);
}
