/* vec_dot_q8_0_avx512vnni.c — Q8_0 weights . Q8_0 activations (W8A8), AVX-512 VNNI
 * (vpdpbusd on 256-bit registers: AVX512VL).
 *
 * The body is vec_dot_q8_0_x86.h, shared with the AVX2 kernel; compiled here for VNNI each
 * block's products are one vpdpbusd, 4 unsigned x signed byte products per int32 lane
 * without the int16 stage of pmaddubsw (le_mul_sum_i8_256, simd_x86.h).
 * Oracle: vec_dot_q8_0_q8_0_ref (native/vec_dot_ref.c).
 * Build: part of the cffi extension (`pip install -e .`); the pragma below compiles this
 * file for AVX-512 VNNI whatever the baseline is (it compiles on any x86-64 gcc >= 8; it
 * runs only where le_isa_supported(LE_ISA_AVX512VNNI)).
 * Test: python -m pytest tests/test_vec_dot.py -k q8_0-avx512vnni (on a host with AVX-512 VNNI)
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

#include "vec_dot_q8_0_x86.h"

void vec_dot_q8_0_q8_0_avx512vnni(int64_t n, float *s, const void *x, const void *y) { vec_dot_q8_0_q8_0_x86(n, s, x, y); }
