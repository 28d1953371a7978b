/* vec_dot_iq4_nl_avx2.c — IQ4_NL and MXFP4 against Q8_0 activations (W4A8), AVX2 + FMA + F16C.
 *
 * The body is vec_dot_iq4_nl_x86.h, shared with the AVX-512 VNNI kernels; compiled here for
 * AVX2 the products are vpmaddubsw + vpmaddwd (le_mul_sum_i8_256, simd_x86.h).
 * Oracle: vec_dot_{iq4_nl,mxfp4}_q8_0_ref (native/vec_dot_ref.c).
 * Build: part of the cffi extension (`pip install -e .`); the pragma below compiles this
 * file for AVX2 whatever the baseline is.
 * Test: python -m pytest tests/test_vec_dot.py -k "iq4_nl-avx2 or mxfp4-avx2"
 */
#pragma GCC target("avx2,fma,f16c")

#include "vec_dot_iq4_nl_x86.h"

void vec_dot_iq4_nl_q8_0_avx2(int64_t n, float *s, const void *x, const void *y) { vec_dot_iq4_nl_q8_0_x86(n, s, x, y); }
void vec_dot_mxfp4_q8_0_avx2(int64_t n, float *s, const void *x, const void *y) { vec_dot_mxfp4_q8_0_x86(n, s, x, y); }
