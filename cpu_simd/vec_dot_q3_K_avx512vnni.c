/* vec_dot_q3_K_avx512vnni.c — Q3_K weights . Q8_K activations (W3A8), AVX-512 VNNI.
 *
 * q = low2 - 4 * (hmask bit clear) is written as an unsigned code c = low2 | bit << 2
 * (0..7) minus 4: sum_g s_g * sum (c - 4) a = sum_g s_g * sum c a - 4 * sum_g s_g * bsum_g,
 * so one vpmaddubsw (pairs <= 2*7*127) + one vpdpwssd (the group scales, accumulating
 * in int32) per 64 elements and the constant part once per block from Q8_K's bsums
 * (s_g = scale - 32). Per 128 elements (qs + 32h): the 32 qs bytes laid out as
 * [qs | qs >> 2] give rows 0,1 (& 3) and rows 2,3 (>> 4, & 3) of the half in the order
 * of the 64 activations each; hmask laid out as [hmask | hmask >> 1] gives the matching
 * high bits (bit 4h+k of hmask[l] for row k). 8 int16 lanes per group of 16, the scales
 * spread by vpermw. zmm here: it measured at least as fast as a ymm variant on Emerald
 * Rapids (8 MiB in cache: 7.3 vs 6.6 GB/s; AVX2 6.3). No tail (the step is one
 * super-block). Oracle: vec_dot_q3_K_q8_K_ref.
 * Build: part of the cffi extension (`pip install -e .`); the pragma below compiles this
 * file for AVX-512 VNNI whatever the baseline is; it runs only where the CPU has it.
 * Test: python -m pytest tests/test_vec_dot.py -k q3_K-avx512vnni (on a host with AVX-512 VNNI)
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

#include "simd_x86.h"

void vec_dot_q3_K_q8_K_avx512vnni(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q3_K *x = vx;
    const block_q8_K *y = vy;
    const int64_t nb = n / QK_K;
    const __m512i m3 = _mm512_set1_epi8(3), one = _mm512_set1_epi8(1);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        le_prefetch_ahead(x + i, sizeof *x);   /* DRAM (simd_x86.h) */
        const __m128i s8 = _mm_sub_epi8(le_q3_K_scales(x[i].scales), _mm_set1_epi8(32));   /* -32..31 */
        const __m512i sc16 = _mm512_zextsi256_si512(_mm256_cvtepi8_epi16(s8));
        /* the constant part, -4 * sum_g s_g * bsum_g, in the low 8 lanes */
        const __m256i off = _mm256_madd_epi16(_mm512_castsi512_si256(sc16), _mm256_loadu_si256((const __m256i *)y[i].bsums));
        __m512i sumi = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_zextsi256_si512(_mm256_slli_epi32(off, 2)));

        const __m256i hm = _mm256_loadu_si256((const __m256i *)x[i].hmask);
        const __m512i hz = _mm512_inserti64x4(_mm512_castsi256_si512(hm), _mm256_srli_epi16(hm, 1), 1);
        const uint8_t *q3 = x[i].qs;
        const int8_t *q8 = y[i].qs;
#pragma GCC unroll 2
        for (int h = 0; h < QK_K / 128; h++, q3 += 32, q8 += 128) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)q3);
            const __m512i bz = _mm512_inserti64x4(_mm512_castsi256_si512(bits), _mm256_srli_epi16(bits, 2), 1);
            const __m512i h01 = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hz, 4 * h), one), 2);
            const __m512i h23 = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hz, 4 * h + 2), one), 2);
            const __m512i c01 = _mm512_or_si512(_mm512_and_si512(bz, m3), h01);                       /* rows 0, 1 */
            const __m512i c23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(bz, 4), m3), h23); /* rows 2, 3 */
            const __m512i p01 = _mm512_maddubs_epi16(c01, _mm512_loadu_si512(q8));
            const __m512i p23 = _mm512_maddubs_epi16(c23, _mm512_loadu_si512(q8 + 64));
            sumi = _mm512_dpwssd_epi32(sumi, p01, le_group_scales_epi16(sc16, 8 * h, 8));
            sumi = _mm512_dpwssd_epi32(sumi, p23, le_group_scales_epi16(sc16, 8 * h + 4, 8));
        }
        acc = _mm512_fmadd_ps(_mm512_set1_ps(_cvtsh_ss(x[i].d) * y[i].d), _mm512_cvtepi32_ps(sumi), acc);
    }
    *s = _mm512_reduce_add_ps(acc);
}
