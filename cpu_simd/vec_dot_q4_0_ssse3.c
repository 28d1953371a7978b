/* vec_dot_q4_0_ssse3.c — the legacy 32-element 4/5-bit weights (Q4_0, Q4_1, Q5_0, Q5_1)
 * against Q8_0 / Q8_1 activations (W4A8, W5A8), SSSE3 (no AVX, F16C or FMA).
 *
 * As vec_dot_q4_0_avx2.c on 128-bit halves: the low nibbles of the 16 qs bytes are
 * elements 0..15, the high nibbles 16..31; pmaddubsw multiplies the unsigned codes q by
 * the signed activations a, and the offset types (Q4_0: 8, Q5_0: 16) subtract
 * o * sum(a) (one more pmaddubsw of the constant o). Q5's 5th bits: qh bit j -> 0x10 in
 * byte j (pshufb + por + pcmpeqb). Q4_1/Q5_1 add m * s per block (s: Q8_1's d * sum(a)).
 * Four blocks per loop step: phaddd reduces each block's partial sums to one int32, and
 * the 4 block scales (fp16 converted 4 at a time in software, le_h2f_x4) are applied with
 * one mulps. The last 0..3 blocks go to the scalar reference (the tail).
 * Oracle: vec_dot_q{4,5}_{0,1}_q8_{0,1}_ref (native/vec_dot_ref.c).
 * Build: part of the cffi extension (`pip install -e .`); the pragma below compiles this
 * file for SSSE3 whatever the baseline is.
 * Test: python -m pytest tests/test_vec_dot.py -k "q4_0-ssse3 or q4_1-ssse3 or q5_0-ssse3 or q5_1-ssse3"
 */
#pragma GCC target("ssse3")

#include "simd_x86.h"

/* 16 bits of qh (from bit `first`) -> 16 bytes: 0x10 where the bit is set. */
static inline __m128i bits_to_0x10(uint32_t qh, int first) {
    const __m128i shuf = _mm_set_epi64x(0x0101010101010101LL, 0);
    __m128i v = _mm_shuffle_epi8(_mm_set1_epi32((int)(qh >> first)), shuf); /* byte j <- byte j/8 */
    v = _mm_or_si128(v, _mm_set1_epi64x(0x7fbfdfeff7fbfdfeLL));             /* all but bit j%8 */
    return _mm_and_si128(_mm_cmpeq_epi8(v, _mm_set1_epi8(-1)), _mm_set1_epi8(0x10));
}

/* 4 int32 partial sums of sum (q - off) * a over one block; q: unsigned codes of elements
 * 0..15 (c0) and 16..31 (c1). */
static inline __m128i dot_codes(__m128i c0, __m128i c1, const int8_t *a, int off) {
    const __m128i a0 = _mm_loadu_si128((const __m128i *)a);
    const __m128i a1 = _mm_loadu_si128((const __m128i *)(a + 16));
    __m128i p = _mm_add_epi16(_mm_maddubs_epi16(c0, a0), _mm_maddubs_epi16(c1, a1)); /* |.| <= 4*31*127 */
    if (off) {
        const __m128i o = _mm_set1_epi8((char)off);
        p = _mm_sub_epi16(p, _mm_add_epi16(_mm_maddubs_epi16(o, a0), _mm_maddubs_epi16(o, a1)));
    }
    return _mm_madd_epi16(p, _mm_set1_epi16(1));
}

static inline __m128i q4_dot(const uint8_t *qs, const int8_t *a, int off) {
    __m128i lo, hi;
    le_nibbles_128(_mm_loadu_si128((const __m128i *)qs), &lo, &hi);
    return dot_codes(lo, hi, a, off);
}

static inline __m128i q5_dot(const uint8_t *qs, const uint8_t qh[4], const int8_t *a, int off) {
    uint32_t h;
    memcpy(&h, qh, 4);
    __m128i lo, hi;
    le_nibbles_128(_mm_loadu_si128((const __m128i *)qs), &lo, &hi);
    return dot_codes(_mm_or_si128(lo, bits_to_0x10(h, 0)), _mm_or_si128(hi, bits_to_0x10(h, 16)), a, off);
}

/* why int16 sums stay exact: two pmaddubsw of 0..31 x (-127..127) pairs add to at most
 * 4*31*127 = 15748, and the offset term to 4*16*127 = 8128: their difference fits. */

void vec_dot_q4_0_q8_0_ssse3(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q4_0 *x = vx;
    const block_q8_0 *y = vy;
    const int64_t nb = n / QK8_0;
    __m128 acc = _mm_setzero_ps();
    int64_t ib = 0;
    for (; ib + 4 <= nb; ib += 4) {
        le_prefetch_ahead(x + ib, 4 * sizeof *x);   /* DRAM (simd_x86.h) */
        const __m128i sums = le_hsum4_epi32(q4_dot(x[ib].qs, y[ib].qs, 8), q4_dot(x[ib + 1].qs, y[ib + 1].qs, 8),
                                            q4_dot(x[ib + 2].qs, y[ib + 2].qs, 8), q4_dot(x[ib + 3].qs, y[ib + 3].qs, 8));
        const __m128 d = _mm_mul_ps(le_h2f_x4(le_halves_x4(&x[ib], sizeof *x, 0)),
                                    le_h2f_x4(le_halves_x4(&y[ib], sizeof *y, 0)));
        acc = _mm_add_ps(acc, _mm_mul_ps(d, _mm_cvtepi32_ps(sums)));
    }
    float sumf = le_hsum_ps_128(acc);
    if (ib < nb) {                                            /* scalar tail: 1..3 blocks */
        float t;
        vec_dot_q4_0_q8_0_ref((nb - ib) * QK8_0, &t, x + ib, y + ib);
        sumf += t;
    }
    *s = sumf;
}

void vec_dot_q4_1_q8_1_ssse3(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q4_1 *x = vx;
    const block_q8_1 *y = vy;
    const int64_t nb = n / QK8_1;
    __m128 acc = _mm_setzero_ps();
    __m128 acc_m = _mm_setzero_ps();
    int64_t ib = 0;
    for (; ib + 4 <= nb; ib += 4) {
        le_prefetch_ahead(x + ib, 4 * sizeof *x);   /* DRAM (simd_x86.h) */
        const __m128i sums = le_hsum4_epi32(q4_dot(x[ib].qs, y[ib].qs, 0), q4_dot(x[ib + 1].qs, y[ib + 1].qs, 0),
                                            q4_dot(x[ib + 2].qs, y[ib + 2].qs, 0), q4_dot(x[ib + 3].qs, y[ib + 3].qs, 0));
        const __m128 d = _mm_mul_ps(le_h2f_x4(le_halves_x4(&x[ib], sizeof *x, 0)),
                                    le_h2f_x4(le_halves_x4(&y[ib], sizeof *y, 0)));
        acc = _mm_add_ps(acc, _mm_mul_ps(d, _mm_cvtepi32_ps(sums)));
        const __m128 m = _mm_mul_ps(le_h2f_x4(le_halves_x4(&x[ib], sizeof *x, 2)),
                                    le_h2f_x4(le_halves_x4(&y[ib], sizeof *y, 2)));
        acc_m = _mm_add_ps(acc_m, m);                         /* m * s (Q8_1's s = da * sum a) */
    }
    float sumf = le_hsum_ps_128(_mm_add_ps(acc, acc_m));
    if (ib < nb) {                                            /* scalar tail: 1..3 blocks */
        float t;
        vec_dot_q4_1_q8_1_ref((nb - ib) * QK8_1, &t, x + ib, y + ib);
        sumf += t;
    }
    *s = sumf;
}

void vec_dot_q5_0_q8_0_ssse3(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q5_0 *x = vx;
    const block_q8_0 *y = vy;
    const int64_t nb = n / QK8_0;
    __m128 acc = _mm_setzero_ps();
    int64_t ib = 0;
    for (; ib + 4 <= nb; ib += 4) {
        le_prefetch_ahead(x + ib, 4 * sizeof *x);   /* DRAM (simd_x86.h) */
        const __m128i sums = le_hsum4_epi32(q5_dot(x[ib].qs, x[ib].qh, y[ib].qs, 16), q5_dot(x[ib + 1].qs, x[ib + 1].qh, y[ib + 1].qs, 16),
                                            q5_dot(x[ib + 2].qs, x[ib + 2].qh, y[ib + 2].qs, 16), q5_dot(x[ib + 3].qs, x[ib + 3].qh, y[ib + 3].qs, 16));
        const __m128 d = _mm_mul_ps(le_h2f_x4(le_halves_x4(&x[ib], sizeof *x, 0)),
                                    le_h2f_x4(le_halves_x4(&y[ib], sizeof *y, 0)));
        acc = _mm_add_ps(acc, _mm_mul_ps(d, _mm_cvtepi32_ps(sums)));
    }
    float sumf = le_hsum_ps_128(acc);
    if (ib < nb) {                                            /* scalar tail: 1..3 blocks */
        float t;
        vec_dot_q5_0_q8_0_ref((nb - ib) * QK8_0, &t, x + ib, y + ib);
        sumf += t;
    }
    *s = sumf;
}

void vec_dot_q5_1_q8_1_ssse3(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q5_1 *x = vx;
    const block_q8_1 *y = vy;
    const int64_t nb = n / QK8_1;
    __m128 acc = _mm_setzero_ps();
    __m128 acc_m = _mm_setzero_ps();
    int64_t ib = 0;
    for (; ib + 4 <= nb; ib += 4) {
        le_prefetch_ahead(x + ib, 4 * sizeof *x);   /* DRAM (simd_x86.h) */
        const __m128i sums = le_hsum4_epi32(q5_dot(x[ib].qs, x[ib].qh, y[ib].qs, 0), q5_dot(x[ib + 1].qs, x[ib + 1].qh, y[ib + 1].qs, 0),
                                            q5_dot(x[ib + 2].qs, x[ib + 2].qh, y[ib + 2].qs, 0), q5_dot(x[ib + 3].qs, x[ib + 3].qh, y[ib + 3].qs, 0));
        const __m128 d = _mm_mul_ps(le_h2f_x4(le_halves_x4(&x[ib], sizeof *x, 0)),
                                    le_h2f_x4(le_halves_x4(&y[ib], sizeof *y, 0)));
        acc = _mm_add_ps(acc, _mm_mul_ps(d, _mm_cvtepi32_ps(sums)));
        const __m128 m = _mm_mul_ps(le_h2f_x4(le_halves_x4(&x[ib], sizeof *x, 2)),
                                    le_h2f_x4(le_halves_x4(&y[ib], sizeof *y, 2)));
        acc_m = _mm_add_ps(acc_m, m);                         /* m * s (Q8_1's s = da * sum a) */
    }
    float sumf = le_hsum_ps_128(_mm_add_ps(acc, acc_m));
    if (ib < nb) {                                            /* scalar tail: 1..3 blocks */
        float t;
        vec_dot_q5_1_q8_1_ref((nb - ib) * QK8_1, &t, x + ib, y + ib);
        sumf += t;
    }
    *s = sumf;
}
