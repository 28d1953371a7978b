/* vec_dot_q8_0_avx512vnni.c — Q8_0 weights . Q8_0 activations (W8A8), AVX-512 VNNI
 * (vpdpbusd on 256-bit registers: AVX512VL).
 *
 * One 32-element block is one ymm: vpdpbusd sums 4 unsigned x signed byte products per
 * int32 lane without the int16 saturation of pmaddubsw; signed weights take the sign
 * trick |w| * (a * sign(w)). The block scale dw*da (f32) is one FMA per block; two blocks
 * per loop step, two accumulators; an odd last block goes to the scalar reference.
 * Oracle: vec_dot_q8_0_q8_0_ref (native/vec_dot_ref.c).
 * Build: part of the cffi extension (`pip install -e .`); the pragma below compiles this
 * file for AVX-512 VNNI whatever the baseline is (it compiles on any x86-64 gcc >= 8; it
 * runs only where le_isa_supported(LE_ISA_AVX512VNNI)).
 * Test: python -m pytest tests/test_vec_dot.py -k q8_0-avx512vnni (on a host with AVX-512 VNNI)
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

#include "simd_x86.h"

void vec_dot_q8_0_q8_0_avx512vnni(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q8_0 *x = vx;
    const block_q8_0 *y = vy;
    const int64_t nb = n / QK8_0;
    const __m256i zero = _mm256_setzero_si256();
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t ib = 0;
    for (; ib + 2 <= nb; ib += 2) {
        le_prefetch_ahead(x + ib, 2 * sizeof *x);   /* DRAM (simd_x86.h) */
        const __m256i p0 = le_dpbssd_256(zero, _mm256_loadu_si256((const __m256i *)x[ib].qs),
                                         _mm256_loadu_si256((const __m256i *)y[ib].qs));
        const __m256i p1 = le_dpbssd_256(zero, _mm256_loadu_si256((const __m256i *)x[ib + 1].qs),
                                         _mm256_loadu_si256((const __m256i *)y[ib + 1].qs));
        const __m256 d0 = _mm256_set1_ps(_cvtsh_ss(x[ib].d) * _cvtsh_ss(y[ib].d));
        const __m256 d1 = _mm256_set1_ps(_cvtsh_ss(x[ib + 1].d) * _cvtsh_ss(y[ib + 1].d));
        acc0 = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(p0), acc0);
        acc1 = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(p1), acc1);
    }
    float sumf = le_hsum_ps_256(_mm256_add_ps(acc0, acc1));
    if (ib < nb) {                                            /* scalar tail */
        float t;
        vec_dot_q8_0_q8_0_ref((nb - ib) * QK8_0, &t, x + ib, y + ib);
        sumf += t;
    }
    *s = sumf;
}
