/* silu_x86.h — SiLU, x / (1 + exp(-x)) (the SwiGLU gate, the GDN conv's and gated norm's activation; le_simd.h
 * silu): the one body of the AVX2 and AVX-512 kernels, included by f32_avx2.c and f32_avx512.c after
 * exp_sub_sum_x86.h's vector operations (ES_*), ES_ADD, ES_DIV and SI_NAME.
 * Its exp is simd_x86.h's vector expf (within a few ulps of libm's: the reference le_silu_f32_ref's), and the tail
 * (< ES_LANES) goes through the same vector code, padded: an element's value does not depend on where it sits or
 * how many are computed with it, so a token's activations are the same bits in a batch of any size.
 * Large |x|: exp gives 0 (out = x) or inf (out = -0), as the reference. Oracle: le_silu_f32_ref (native/f32_ref.c).
 * Test: tests/test_f32_kernels.py -k silu */
#ifndef LE_SILU_X86_H
#define LE_SILU_X86_H

#include <stdint.h>

static inline ES_VEC si_vec(ES_VEC x) {
    return ES_DIV(x, ES_ADD(ES_SET1(1.0f), ES_EXP(ES_MUL(ES_SET1(-1.0f), x))));
}

/* x, out: [n] (in place allowed): exp_sub_sum_x86.h's element-wise driver */
ES_MAP_KERNEL(SI_NAME, si_vec)

#endif
