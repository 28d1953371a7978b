/* vec_dot_q3_K_avx2.c — Q3_K weights . Q8_K activations (W3A8), AVX2 + FMA + F16C.
 *
 * A 256-element super-block: 16 groups of 16 with a 6-bit scale s_g (biased by 32),
 * w = d * (s_g - 32) * q, q = low2 - (hmask bit ? 0 : 4) in -4..3. Written as an unsigned
 * code c = low2 | bit << 2 (0..7) minus 4, the constant part leaves the loop:
 *   sum_g s_g * sum (c - 4) a = sum_g s_g * sum c a  -  4 * sum_g s_g * bsum_g
 * (Q8_K's bsums, one vpmaddwd). Per 128 elements (qs + 32h) the shifts 0,2,4,6 of the 32
 * qs bytes give 32 low-2-bit codes each (groups 8h+2k and 8h+2k+1); the high bit of
 * element l of that row is hmask[l] bit 4h+k. One vpmaddubsw (pairs <= 2*7*127) and one
 * vpmaddwd by the pair of group scales [s_a - 32 x8 | s_b - 32 x8] (vpshufb of the scales
 * widened to int16) per 32 elements. One FMA per super-block; no tail.
 * Oracle: vec_dot_q3_K_q8_K_ref (native/vec_dot_ref.c).
 * Build: part of the cffi extension (`pip install -e .`); the pragma below compiles this
 * file for AVX2 whatever the baseline is. Test: python -m pytest tests/test_vec_dot.py -k q3_K-avx2
 */
#pragma GCC target("avx2,fma,f16c")

#include "simd_x86.h"

/* int16 [s_g x8 | s_g+1 x8] (g even) from 8 int16 scales (groups g & ~7 ..) in both lanes. */
static inline __m256i scale_pair(__m256i sc16x2, int g) {
    const int b = 2 * (g & 7);
    const __m256i ctrl = _mm256_set_m128i(_mm_set1_epi16((short)(((b + 3) << 8) | (b + 2))),
                                          _mm_set1_epi16((short)(((b + 1) << 8) | b)));
    return _mm256_shuffle_epi8(sc16x2, ctrl);
}

void vec_dot_q3_K_q8_K_avx2(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q3_K *x = vx;
    const block_q8_K *y = vy;
    const int64_t nb = n / QK_K;
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m256i one = _mm256_set1_epi8(1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        le_prefetch_ahead(x + i, sizeof *x);   /* DRAM (simd_x86.h) */
        /* s_g - 32 as int16: lanes 0..7 groups 0..7, 8..15 groups 8..15 */
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_sub_epi8(le_q3_K_scales(x[i].scales), _mm_set1_epi8(32)));
        const __m256i off = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)y[i].bsums));
        __m256i sumi = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(off, 2));
        const __m256i sc_half[2] = {_mm256_permute2x128_si256(sc16, sc16, 0x00),   /* groups 0..7 */
                                    _mm256_permute2x128_si256(sc16, sc16, 0x11)};  /* groups 8..15 */
        const __m256i hm = _mm256_loadu_si256((const __m256i *)x[i].hmask);
        const uint8_t *q3 = x[i].qs;
        const int8_t *q8 = y[i].qs;
#pragma GCC unroll 2
        for (int h = 0; h < QK_K / 128; h++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(q3 + 32 * h));
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const __m256i lo2 = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * k), m3);
                const __m256i hb = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + k), one), 2);
                const __m256i c = _mm256_or_si256(lo2, hb);
                const __m256i p = _mm256_maddubs_epi16(c, _mm256_loadu_si256((const __m256i *)(q8 + 128 * h + 32 * k)));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, scale_pair(sc_half[h], 8 * h + 2 * k)));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(x[i].d) * y[i].d), _mm256_cvtepi32_ps(sumi), acc);
    }
    *s = le_hsum_ps_256(acc);
}
