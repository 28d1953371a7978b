/* vec_dot_q8_0_avx2.c — Q8_0 weights . Q8_0 activations (W8A8), AVX2 + FMA + F16C.
 *
 * The body is vec_dot_q8_0_x86.h, shared with the AVX-512 VNNI kernel; compiled here for
 * AVX2 the products are vpmaddubsw + vpmaddwd (le_mul_sum_i8_256, simd_x86.h).
 * Oracle: vec_dot_q8_0_q8_0_ref (native/vec_dot_ref.c).
 * Build: part of the cffi extension (`pip install -e .`); the pragma below compiles this
 * file for AVX2 whatever the baseline is. Test: python -m pytest tests/test_vec_dot.py -k q8_0-avx2
 */
#pragma GCC target("avx2,fma,f16c")

#include "vec_dot_q8_0_x86.h"

void vec_dot_q8_0_q8_0_avx2(int64_t n, float *s, const void *x, const void *y) { vec_dot_q8_0_q8_0_x86(n, s, x, y); }
