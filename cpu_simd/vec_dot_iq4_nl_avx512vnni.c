/* vec_dot_iq4_nl_avx512vnni.c — IQ4_NL and MXFP4 against Q8_0 activations (W4A8),
 * AVX-512 VNNI (vpdpbusd on ymm: AVX512VL).
 *
 * The body is vec_dot_iq4_nl_x86.h, shared with the AVX2 kernels; compiled here for VNNI
 * each block's products are one vpdpbusd (le_mul_sum_i8_256, simd_x86.h).
 * Oracle: vec_dot_{iq4_nl,mxfp4}_q8_0_ref (native/vec_dot_ref.c).
 * Build: part of the cffi extension (`pip install -e .`); the pragma below compiles this
 * file for AVX-512 VNNI whatever the baseline is; it runs only where the CPU has it.
 * Test: python -m pytest tests/test_vec_dot.py -k "iq4_nl-avx512vnni or mxfp4-avx512vnni"
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

#include "vec_dot_iq4_nl_x86.h"

void vec_dot_iq4_nl_q8_0_avx512vnni(int64_t n, float *s, const void *x, const void *y) { vec_dot_iq4_nl_q8_0_x86(n, s, x, y); }
void vec_dot_mxfp4_q8_0_avx512vnni(int64_t n, float *s, const void *x, const void *y) { vec_dot_mxfp4_q8_0_x86(n, s, x, y); }
