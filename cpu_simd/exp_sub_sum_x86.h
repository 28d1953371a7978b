/* exp_sub_sum_x86.h — the softmax's numerators of one row and their sum (le_simd.h exp_sub_sum): the one body of
 * the AVX2 and AVX-512 kernels. f32_avx2.c and f32_avx512.c define, after their #pragma GCC target, the vector
 * type and its operations, then include this file:
 *   ES_VEC, ES_LANES, ES_SET1(f), ES_LOAD(p), ES_STORE(p, v), ES_MUL, ES_SUB, ES_MAX, ES_HMAX(v) (the lanes' max),
 *   ES_EXP(v) (simd_x86.h's le_exp_ps_*), ES_DVEC (doubles of half a vector), ES_DZERO(), ES_DADD(d0, d1, v) (the
 *   two halves of v, widened, added to d0 and d1), ES_DHSUM(d) (the lanes' sum), ES_NAME.
 *   y[j] = exp(fl(x[j] scale) - fl(max_k x[k] scale)),  returns sum_j y[j] (in double, as the reference)
 * Two passes: the max (exact in any order, so the same as the reference's), then exp and the sum. The product is
 * kept apart from the subtraction (ES_OPAQUE: no FMA contraction), so the exponent's argument has the reference's
 * bits and the row's max gives exactly 1. The tail (< ES_LANES) goes through the same vector exp, padded with
 * -inf (exp: 0, adds nothing). Oracle: le_exp_sub_sum_f32_ref (native/f32_ref.c). */
#ifndef LE_EXP_SUB_SUM_X86_H
#define LE_EXP_SUB_SUM_X86_H

#include <math.h>
#include <stdint.h>

/* why: gcc contracts the intrinsics' mul and sub into an FMA under -ffp-contract=fast (GNU C's default) */
#define ES_OPAQUE(v) __asm__("" : "+v"(v))

double ES_NAME(const float *x, float *y, int64_t n, float scale) {
    ES_VEC vm = ES_SET1(-INFINITY);
    int64_t i = 0;
    for (; i + ES_LANES <= n; i += ES_LANES) vm = ES_MAX(vm, ES_LOAD(x + i));
    float mx = ES_HMAX(vm);
    for (; i < n; i++)
        if (x[i] > mx) mx = x[i];
    const ES_VEC vs = ES_SET1(scale), vsub = ES_SET1(mx * scale);
    ES_DVEC d0 = ES_DZERO(), d1 = ES_DZERO();
    for (i = 0; i + ES_LANES <= n; i += ES_LANES) {
        ES_VEC t = ES_MUL(ES_LOAD(x + i), vs);
        ES_OPAQUE(t);
        ES_VEC e = ES_EXP(ES_SUB(t, vsub));
        ES_STORE(y + i, e);
        ES_DADD(d0, d1, e);
    }
    if (i < n) {
        float buf[ES_LANES];
        for (int k = 0; k < ES_LANES; k++) buf[k] = i + k < n ? x[i + k] : -INFINITY;
        ES_VEC t = ES_MUL(ES_LOAD(buf), vs);
        ES_OPAQUE(t);
        ES_VEC e = ES_EXP(ES_SUB(t, vsub));
        ES_STORE(buf, e);
        for (int k = 0; i + k < n; k++) y[i + k] = buf[k];
        ES_DADD(d0, d1, e);
    }
    return ES_DHSUM(d0) + ES_DHSUM(d1);
}

/* An element-wise kernel NAME(x, n, out) (in place allowed) of VECFN (ES_VEC -> ES_VEC): whole vectors, then the tail
 * (< ES_LANES) padded with 0 through the same VECFN, so an element's value does not depend on where it sits or how
 * many are computed with it (gelu_tanh_x86.h, silu_x86.h). */
#define ES_MAP_KERNEL(NAME, VECFN)                                                                                  \
    void NAME(const float *x, int64_t n, float *out) {                                                              \
        int64_t i = 0;                                                                                              \
        for (; i + ES_LANES <= n; i += ES_LANES) ES_STORE(out + i, VECFN(ES_LOAD(x + i)));                          \
        if (i < n) {                                                                                                \
            float buf[ES_LANES];                                                                                    \
            for (int k = 0; k < ES_LANES; k++) buf[k] = i + k < n ? x[i + k] : 0.0f;                                \
            ES_STORE(buf, VECFN(ES_LOAD(buf)));                                                                     \
            for (int k = 0; i + k < n; k++) out[i + k] = buf[k];                                                    \
        }                                                                                                           \
    }

#endif
