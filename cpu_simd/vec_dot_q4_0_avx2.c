/* vec_dot_q4_0_avx2.c — Q4_0, Q4_1, Q5_0, Q5_1 against Q8_0 / Q8_1 (W4A8, W5A8), AVX2 + FMA + F16C.
 *
 * The body is vec_dot_q4_0_x86.h, shared with the AVX-512 VNNI kernels; compiled here for
 * AVX2 its products are vpmaddubsw + vpmaddwd, and Q5's 5th bits come from qh by a vpshufb
 * byte spread (le_bits_to_bytes_32).
 * Oracle: vec_dot_q{4,5}_{0,1}_q8_{0,1}_ref (native/vec_dot_ref.c).
 * Build: part of the cffi extension (`pip install -e .`); the pragma below compiles this
 * file for AVX2 whatever the baseline is.
 * Test: python -m pytest tests/test_vec_dot.py -k "q4_0-avx2 or q4_1-avx2 or q5_0-avx2 or q5_1-avx2"
 */
#pragma GCC target("avx2,fma,f16c")

#include "vec_dot_q4_0_x86.h"

void vec_dot_q4_0_q8_0_avx2(int64_t n, float *s, const void *x, const void *y) { vec_dot_q4_0_q8_0_x86(n, s, x, y); }
void vec_dot_q4_1_q8_1_avx2(int64_t n, float *s, const void *x, const void *y) { vec_dot_q4_1_q8_1_x86(n, s, x, y); }
void vec_dot_q5_0_q8_0_avx2(int64_t n, float *s, const void *x, const void *y) { vec_dot_q5_0_q8_0_x86(n, s, x, y); }
void vec_dot_q5_1_q8_1_avx2(int64_t n, float *s, const void *x, const void *y) { vec_dot_q5_1_q8_1_x86(n, s, x, y); }
