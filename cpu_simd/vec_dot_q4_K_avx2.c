/* vec_dot_q4_K_avx2.c — Q4_K weights . Q8_K activations (W4A8), AVX2 + FMA + F16C.
 *
 * The body is vec_dot_q4_K_x86.h, shared with the AVX-512 VNNI kernel; compiled here for
 * AVX2 the group scales are vpmaddwd + vpaddd (le_madd_acc_256, simd_x86.h).
 * Oracle: vec_dot_q4_K_q8_K_ref (native/vec_dot_ref.c).
 * Build: part of the cffi extension (`pip install -e .`); the pragma below compiles this
 * file for AVX2 whatever the baseline is. Test: python -m pytest tests/test_vec_dot.py -k q4_K-avx2
 */
#pragma GCC target("avx2,fma,f16c")

#include "vec_dot_q4_K_x86.h"

void vec_dot_q4_K_q8_K_avx2(int64_t n, float *s, const void *x, const void *y) { vec_dot_q4_K_q8_K_x86(n, s, x, y); }
void vec_dot_n_q4_K_q8_K_avx2(int64_t n, float *s, int64_t ls, const void *x, const void *y, int64_t ly, int nt) {
    vec_dot_n_q4_K_q8_K_x86(n, s, ls, x, y, ly, nt);
}
