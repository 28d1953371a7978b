/* vec_dot_q4_0_avx512vnni.c — Q4_0, Q4_1, Q5_0, Q5_1 against Q8_0 / Q8_1 (W4A8, W5A8),
 * AVX-512 VNNI (vpdpbusd on ymm: AVX512VL).
 *
 * The body is vec_dot_q4_0_x86.h, shared with the AVX2 kernels; compiled here for VNNI each
 * product is one vpdpbusd (the offset types a second one of the constant o), and Q5's 5th
 * bits come from qh as a mask register (vmovdqu8 with zero masking).
 * Oracle: vec_dot_q{4,5}_{0,1}_q8_{0,1}_ref (native/vec_dot_ref.c).
 * Build: part of the cffi extension (`pip install -e .`); the pragma below compiles this
 * file for AVX-512 VNNI whatever the baseline is; it runs only where the CPU has it.
 * Test: python -m pytest tests/test_vec_dot.py -k "avx512vnni and (q4_0 or q4_1 or q5_0 or q5_1)"
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

#include "vec_dot_q4_0_x86.h"

void vec_dot_q4_0_q8_0_avx512vnni(int64_t n, float *s, const void *x, const void *y) { vec_dot_q4_0_q8_0_x86(n, s, x, y); }
void vec_dot_q4_1_q8_1_avx512vnni(int64_t n, float *s, const void *x, const void *y) { vec_dot_q4_1_q8_1_x86(n, s, x, y); }
void vec_dot_q5_0_q8_0_avx512vnni(int64_t n, float *s, const void *x, const void *y) { vec_dot_q5_0_q8_0_x86(n, s, x, y); }
void vec_dot_q5_1_q8_1_avx512vnni(int64_t n, float *s, const void *x, const void *y) { vec_dot_q5_1_q8_1_x86(n, s, x, y); }
