/* vec_dot_q4_0_avx2.c — the legacy 32-element 4/5-bit weights (Q4_0, Q4_1, Q5_0, Q5_1)
 * against Q8_0 / Q8_1 activations (W4A8, W5A8), AVX2 + FMA + F16C.
 *
 * One block is one 256-bit vector of unsigned weight codes q (0..15, or 0..31 with the
 * 5th bit from qh): low nibbles of the 16 bytes are elements 0..15, high nibbles 16..31.
 * vpmaddubsw multiplies unsigned q by signed activations a. The offset types subtract
 * their offset o (8 or 16) as o * sum(a), itself one vpmaddubsw of the constant o:
 *   sum (q - o) a = sum q a - sum o a.
 * Q4_1/Q5_1 add the min term m * s per block, s = d_a * sum(a) from Q8_1's s field.
 * The block scale dw*da (f32) is applied with one FMA per block; two blocks per loop
 * step, two accumulators; an odd last block goes to the scalar reference (the tail).
 * Oracle: vec_dot_q{4,5}_{0,1}_q8_{0,1}_ref (native/vec_dot_ref.c).
 * Build: part of the cffi extension (`pip install -e .`); the pragma below compiles this
 * file for AVX2 whatever the baseline is.
 * Test: python -m pytest tests/test_vec_dot.py -k "q4_0-avx2 or q4_1-avx2 or q5_0-avx2 or q5_1-avx2"
 */
#pragma GCC target("avx2,fma,f16c")

#include "simd_x86.h"

/* 8 int32 partial sums of sum (q - off) * a over one block; q: 32 unsigned codes. */
static inline __m256i dot_offset(__m256i q, __m256i a, int off) {
    const __m256i p = _mm256_maddubs_epi16(q, a);                      /* |pairs| <= 2*31*127 */
    const __m256i o = _mm256_maddubs_epi16(_mm256_set1_epi8((char)off), a);
    return _mm256_madd_epi16(_mm256_sub_epi16(p, o), _mm256_set1_epi16(1));
}

/* The 5-bit codes of a Q5 block: nibble | (bit j of qh) << 4. */
static inline __m256i q5_codes(const uint8_t *qs, const uint8_t qh[4]) {
    const __m256i hi = _mm256_and_si256(le_bits_to_bytes_32(qh), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(le_nibbles_32(qs), hi);
}

void vec_dot_q4_0_q8_0_avx2(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q4_0 *x = vx;
    const block_q8_0 *y = vy;
    const int64_t nb = n / QK8_0;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t ib = 0;
    for (; ib + 2 <= nb; ib += 2) {
        le_prefetch_ahead(x + ib, 2 * sizeof *x);   /* DRAM (simd_x86.h) */
        const __m256i p0 = dot_offset(le_nibbles_32(x[ib].qs),
                                      _mm256_loadu_si256((const __m256i *)y[ib].qs), 8);
        const __m256i p1 = dot_offset(le_nibbles_32(x[ib + 1].qs),
                                      _mm256_loadu_si256((const __m256i *)y[ib + 1].qs), 8);
        const __m256 d0 = _mm256_set1_ps(_cvtsh_ss(x[ib].d) * _cvtsh_ss(y[ib].d));
        const __m256 d1 = _mm256_set1_ps(_cvtsh_ss(x[ib + 1].d) * _cvtsh_ss(y[ib + 1].d));
        acc0 = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(p0), acc0);
        acc1 = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(p1), acc1);
    }
    float sumf = le_hsum_ps_256(_mm256_add_ps(acc0, acc1));
    if (ib < nb) {                                            /* scalar tail */
        float t;
        vec_dot_q4_0_q8_0_ref((nb - ib) * QK8_0, &t, x + ib, y + ib);
        sumf += t;
    }
    *s = sumf;
}

void vec_dot_q4_1_q8_1_avx2(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q4_1 *x = vx;
    const block_q8_1 *y = vy;
    const int64_t nb = n / QK8_1;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float summs0 = 0, summs1 = 0;                             /* sums of m * s */
    int64_t ib = 0;
    for (; ib + 2 <= nb; ib += 2) {
        le_prefetch_ahead(x + ib, 2 * sizeof *x);   /* DRAM (simd_x86.h) */
        const __m256i p0 = le_dot_u8_256(le_nibbles_32(x[ib].qs),
                                         _mm256_loadu_si256((const __m256i *)y[ib].qs));
        const __m256i p1 = le_dot_u8_256(le_nibbles_32(x[ib + 1].qs),
                                         _mm256_loadu_si256((const __m256i *)y[ib + 1].qs));
        const __m256 d0 = _mm256_set1_ps(_cvtsh_ss(x[ib].d) * _cvtsh_ss(y[ib].d));
        const __m256 d1 = _mm256_set1_ps(_cvtsh_ss(x[ib + 1].d) * _cvtsh_ss(y[ib + 1].d));
        acc0 = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(p0), acc0);
        acc1 = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(p1), acc1);
        summs0 += _cvtsh_ss(x[ib].m) * _cvtsh_ss(y[ib].s);        /* two chains: the adds' latency */
        summs1 += _cvtsh_ss(x[ib + 1].m) * _cvtsh_ss(y[ib + 1].s);
    }
    float sumf = le_hsum_ps_256(_mm256_add_ps(acc0, acc1)) + (summs0 + summs1);
    if (ib < nb) {                                            /* scalar tail */
        float t;
        vec_dot_q4_1_q8_1_ref((nb - ib) * QK8_1, &t, x + ib, y + ib);
        sumf += t;
    }
    *s = sumf;
}

void vec_dot_q5_0_q8_0_avx2(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q5_0 *x = vx;
    const block_q8_0 *y = vy;
    const int64_t nb = n / QK8_0;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t ib = 0;
    for (; ib + 2 <= nb; ib += 2) {
        le_prefetch_ahead(x + ib, 2 * sizeof *x);   /* DRAM (simd_x86.h) */
        const __m256i p0 = dot_offset(q5_codes(x[ib].qs, x[ib].qh),
                                      _mm256_loadu_si256((const __m256i *)y[ib].qs), 16);
        const __m256i p1 = dot_offset(q5_codes(x[ib + 1].qs, x[ib + 1].qh),
                                      _mm256_loadu_si256((const __m256i *)y[ib + 1].qs), 16);
        const __m256 d0 = _mm256_set1_ps(_cvtsh_ss(x[ib].d) * _cvtsh_ss(y[ib].d));
        const __m256 d1 = _mm256_set1_ps(_cvtsh_ss(x[ib + 1].d) * _cvtsh_ss(y[ib + 1].d));
        acc0 = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(p0), acc0);
        acc1 = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(p1), acc1);
    }
    float sumf = le_hsum_ps_256(_mm256_add_ps(acc0, acc1));
    if (ib < nb) {                                            /* scalar tail */
        float t;
        vec_dot_q5_0_q8_0_ref((nb - ib) * QK8_0, &t, x + ib, y + ib);
        sumf += t;
    }
    *s = sumf;
}

void vec_dot_q5_1_q8_1_avx2(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q5_1 *x = vx;
    const block_q8_1 *y = vy;
    const int64_t nb = n / QK8_1;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float summs0 = 0, summs1 = 0;
    int64_t ib = 0;
    for (; ib + 2 <= nb; ib += 2) {
        le_prefetch_ahead(x + ib, 2 * sizeof *x);   /* DRAM (simd_x86.h) */
        const __m256i p0 = le_dot_u8_256(q5_codes(x[ib].qs, x[ib].qh),
                                         _mm256_loadu_si256((const __m256i *)y[ib].qs));
        const __m256i p1 = le_dot_u8_256(q5_codes(x[ib + 1].qs, x[ib + 1].qh),
                                         _mm256_loadu_si256((const __m256i *)y[ib + 1].qs));
        const __m256 d0 = _mm256_set1_ps(_cvtsh_ss(x[ib].d) * _cvtsh_ss(y[ib].d));
        const __m256 d1 = _mm256_set1_ps(_cvtsh_ss(x[ib + 1].d) * _cvtsh_ss(y[ib + 1].d));
        acc0 = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(p0), acc0);
        acc1 = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(p1), acc1);
        summs0 += _cvtsh_ss(x[ib].m) * _cvtsh_ss(y[ib].s);        /* two chains: the adds' latency */
        summs1 += _cvtsh_ss(x[ib + 1].m) * _cvtsh_ss(y[ib + 1].s);
    }
    float sumf = le_hsum_ps_256(_mm256_add_ps(acc0, acc1)) + (summs0 + summs1);
    if (ib < nb) {                                            /* scalar tail */
        float t;
        vec_dot_q5_1_q8_1_ref((nb - ib) * QK8_1, &t, x + ib, y + ib);
        sumf += t;
    }
    *s = sumf;
}
