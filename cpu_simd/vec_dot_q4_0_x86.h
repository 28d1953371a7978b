/* vec_dot_q4_0_x86.h — the legacy 32-element 4/5-bit weights (Q4_0, Q4_1, Q5_0, Q5_1)
 * against Q8_0 / Q8_1 activations (W4A8, W5A8): the one body of the AVX2 and AVX-512 VNNI
 * kernels (vec_dot_q4_0_avx2.c, vec_dot_q4_0_avx512vnni.c include it after their pragma).
 *
 * One block is one 256-bit vector of unsigned weight codes q (0..15, or 0..31 with the
 * 5th bit from qh): low nibbles of the 16 bytes are elements 0..15, high nibbles 16..31.
 * The unsigned q times the signed activations a: vpmaddubsw + vpmaddwd (AVX2) or one
 * vpdpbusd (VNNI, 4 products per int32 lane). The offset types subtract their offset o
 * (8 or 16) as o * sum(a), the same product of the constant o:
 *   sum (q - o) a = sum q a - sum o a.
 * Q4_1/Q5_1 add the min term m * s per block, s = d_a * sum(a) from Q8_1's s field.
 * The block scale dw*da (f32) is applied with one FMA per block; two blocks per loop
 * step, two accumulators; an odd last block goes to the scalar reference (the tail).
 * Oracle: vec_dot_q{4,5}_{0,1}_q8_{0,1}_ref (native/vec_dot_ref.c).
 */
#ifndef LE_VEC_DOT_Q4_0_X86_H
#define LE_VEC_DOT_Q4_0_X86_H

#include "simd_x86.h"

#if !defined(__AVX2__)
#error "include vec_dot_q4_0_x86.h after a #pragma GCC target that enables AVX2"
#endif

/* 8 int32 partial sums of sum (q - off) * a over one block; q: 32 unsigned codes, a: 32
 * activations, off a constant (0: no offset). */
static inline __m256i dot_offset(__m256i q, const int8_t *a, int off) {
    const __m256i av = _mm256_loadu_si256((const __m256i *)a);
#if LE_X86_VNNI
    const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, av);
    if (!off) return p;
    return _mm256_sub_epi32(p, _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8((char)off), av));
#else
    if (!off) return le_dot_u8_256(q, av);
    const __m256i p = _mm256_maddubs_epi16(q, av);                     /* |pairs| <= 2*31*127 */
    const __m256i o = _mm256_maddubs_epi16(_mm256_set1_epi8((char)off), av);
    return _mm256_madd_epi16(_mm256_sub_epi16(p, o), _mm256_set1_epi16(1));
#endif
}

/* The 5-bit codes of a Q5 block: nibble | (bit j of qh) << 4. VNNI: qh as a mask register,
 * vmovdqu8 with zero masking writes 0x10 where bit j is set. */
static inline __m256i q5_codes(const uint8_t *qs, const uint8_t qh[4]) {
#if LE_X86_VNNI
    uint32_t h;
    memcpy(&h, qh, 4);
    return _mm256_or_si256(le_nibbles_32(qs), _mm256_maskz_mov_epi8((__mmask32)h, _mm256_set1_epi8(0x10)));
#else
    const __m256i hi = _mm256_and_si256(le_bits_to_bytes_32(qh), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(le_nibbles_32(qs), hi);
#endif
}

static inline void vec_dot_q4_0_q8_0_x86(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q4_0 *x = vx;
    const block_q8_0 *y = vy;
    const int64_t nb = n / QK8_0;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t ib = 0;
    for (; ib + 2 <= nb; ib += 2) {
        le_prefetch_ahead(x + ib, 2 * sizeof *x);   /* DRAM (simd_x86.h) */
        const __m256i p0 = dot_offset(le_nibbles_32(x[ib].qs), y[ib].qs, 8);
        const __m256i p1 = dot_offset(le_nibbles_32(x[ib + 1].qs), y[ib + 1].qs, 8);
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

static inline void vec_dot_q4_1_q8_1_x86(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q4_1 *x = vx;
    const block_q8_1 *y = vy;
    const int64_t nb = n / QK8_1;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float summs0 = 0, summs1 = 0;                             /* sums of m * s */
    int64_t ib = 0;
    for (; ib + 2 <= nb; ib += 2) {
        le_prefetch_ahead(x + ib, 2 * sizeof *x);   /* DRAM (simd_x86.h) */
        const __m256i p0 = dot_offset(le_nibbles_32(x[ib].qs), y[ib].qs, 0);
        const __m256i p1 = dot_offset(le_nibbles_32(x[ib + 1].qs), y[ib + 1].qs, 0);
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

static inline void vec_dot_q5_0_q8_0_x86(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q5_0 *x = vx;
    const block_q8_0 *y = vy;
    const int64_t nb = n / QK8_0;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t ib = 0;
    for (; ib + 2 <= nb; ib += 2) {
        le_prefetch_ahead(x + ib, 2 * sizeof *x);   /* DRAM (simd_x86.h) */
        const __m256i p0 = dot_offset(q5_codes(x[ib].qs, x[ib].qh), y[ib].qs, 16);
        const __m256i p1 = dot_offset(q5_codes(x[ib + 1].qs, x[ib + 1].qh), y[ib + 1].qs, 16);
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

static inline void vec_dot_q5_1_q8_1_x86(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q5_1 *x = vx;
    const block_q8_1 *y = vy;
    const int64_t nb = n / QK8_1;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float summs0 = 0, summs1 = 0;                             /* sums of m * s */
    int64_t ib = 0;
    for (; ib + 2 <= nb; ib += 2) {
        le_prefetch_ahead(x + ib, 2 * sizeof *x);   /* DRAM (simd_x86.h) */
        const __m256i p0 = dot_offset(q5_codes(x[ib].qs, x[ib].qh), y[ib].qs, 0);
        const __m256i p1 = dot_offset(q5_codes(x[ib + 1].qs, x[ib + 1].qh), y[ib + 1].qs, 0);
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

#endif
