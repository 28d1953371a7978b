/* vec_dot_q4_K_avx512vnni.c — Q4_K weights . Q8_K activations (W4A8), AVX-512 VNNI on
 * 256-bit registers (AVX512VL).
 *
 * The body is vec_dot_q4_K_x86.h, shared with the AVX2 kernel; compiled here for VNNI one
 * vpdpwssd fuses the group-scale vpmaddwd and the int32 accumulation (le_madd_acc_256,
 * simd_x86.h). Why ymm and not zmm: on the Emerald Rapids host the zmm variant (64
 * elements per vpmaddubsw, scales by vpermw) ran 15-20% slower in cache than this one
 * (1 MiB of weights: 16.9 vs 20.5 GB/s), and GEMV from DRAM is bound by memory either way.
 * Oracle: vec_dot_q4_K_q8_K_ref (native/vec_dot_ref.c).
 * Build: part of the cffi extension (`pip install -e .`); the pragma below compiles this
 * file for AVX-512 VNNI whatever the baseline is; it runs only where the CPU has it.
 * Test: python -m pytest tests/test_vec_dot.py -k q4_K-avx512vnni (on a host with AVX-512 VNNI)
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

#include "vec_dot_q4_K_x86.h"

void vec_dot_q4_K_q8_K_avx512vnni(int64_t n, float *s, const void *x, const void *y) { vec_dot_q4_K_q8_K_x86(n, s, x, y); }
void vec_dot_n_q4_K_q8_K_avx512vnni(int64_t n, float *s, int64_t ls, const void *x, const void *y, int64_t ly, int nt) {
    vec_dot_n_q4_K_q8_K_x86(n, s, ls, x, y, ly, nt);
}
