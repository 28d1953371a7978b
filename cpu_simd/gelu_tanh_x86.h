/* gelu_tanh_x86.h — the tanh-form GELU (gelu_pytorch_tanh, the vision blocks' MLP; le_simd.h gelu_tanh): the one
 * body of the AVX2 and AVX-512 kernels, included by f32_avx2.c and f32_avx512.c after exp_sub_sum_x86.h's vector
 * operations (ES_*) and ES_ADD, ES_DIV, GE_NAME.
 *   0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)),   u = sqrt(2/pi) (x + 0.044715 x^3)
 * The right side has no cancellation where tanh(u) is near -1 (the reference's 1 + tanhf loses the low bits there),
 * and its exp is simd_x86.h's vector expf: within a few ulps of the reference where |gelu| is not tiny, closer to
 * the exact value where it is. Large |x|: exp gives 0 (out = x) or inf (out = -0), as the reference's 0.5 x (1 +/- 1).
 * The tail (< ES_LANES) goes through the same vector code, padded. Oracle: le_gelu_tanh_ref (native/gelu.c). */
#ifndef LE_GELU_TANH_X86_H
#define LE_GELU_TANH_X86_H

#include <stdint.h>

static inline ES_VEC ge_vec(ES_VEC x) {
    const ES_VEC beta = ES_SET1(0.7978845608028654f), kappa = ES_SET1(0.044715f), m2 = ES_SET1(-2.0f);
    ES_VEC u = ES_MUL(beta, ES_ADD(x, ES_MUL(kappa, ES_MUL(ES_MUL(x, x), x))));
    return ES_DIV(x, ES_ADD(ES_SET1(1.0f), ES_EXP(ES_MUL(m2, u))));
}

/* x, out: [n] (in place allowed): exp_sub_sum_x86.h's element-wise driver */
ES_MAP_KERNEL(GE_NAME, ge_vec)

#endif
