/* f32_avx512.c — the f32 kernels of the decode step (le_simd.h), AVX-512F.
 *
 * gdn_step (one Gated DeltaNet v-head, one token). Written with S' = decay S + k delta^T:
 *   kv = S^T k, sq = S^T q            (pass 1: reads S)
 *   delta = beta (v - decay kv)
 *   o = S'^T q = decay sq + (k . q) delta
 *   S <- decay S + k delta^T          (pass 2: reads and writes S)
 * which is the reference's arithmetic reordered (one write pass instead of two). Columns
 * of S are independent, so the work goes in blocks of 64 columns (4 zmm): a block of a
 * 128 x 128 state is 32 KiB and stays in L1 between the two passes. dv not a multiple of
 * 16 goes to the AVX2 kernel. dot: 4 FMA accumulators of 16 lanes. gemm_tile: 4 x 4 register tiles, gemm_nn: 6
 * rows x 64 columns, exp_sub_sum and gelu_tanh: 16 lanes (below).
 * Oracle: native/f32_ref.c. Test: python -m pytest tests/test_f32_kernels.py -k avx512 */
#pragma GCC target("avx512f,avx2,fma")

#include <immintrin.h>

#include "le_simd.h"
#include "simd_x86.h"

float le_dot_f32_avx512(const float *a, const float *b, int64_t n) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps(),
           acc3 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
        acc2 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 32), _mm512_loadu_ps(b + i + 32), acc2);
        acc3 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 48), _mm512_loadu_ps(b + i + 48), acc3);
    }
    for (; i + 16 <= n; i += 16) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0, acc1), _mm512_add_ps(acc2, acc3)));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* one block of W (8, 16, 24 or 32) columns starting at c0 */
#define GDN_BLOCK(W)                                                                                   \
    static void block##W(float *S, const float *q, const float *k, const float *v, float decay,        \
                         float beta, float kq, int dk, int dv, int c0, float *o) {                     \
        enum { NV = W / 16 };                                                                           \
        __m512 kv[NV], sq[NV], d[NV];                                                                  \
        for (int b = 0; b < NV; b++) kv[b] = sq[b] = _mm512_setzero_ps();                              \
        for (int i = 0; i < dk; i++) {                                                                 \
            const float *Si = S + (int64_t)i * dv + c0;                                                \
            __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);                               \
            for (int b = 0; b < NV; b++) {                                                             \
                __m512 s = _mm512_loadu_ps(Si + 16 * b);                                                \
                kv[b] = _mm512_fmadd_ps(s, ki, kv[b]);                                                 \
                sq[b] = _mm512_fmadd_ps(s, qi, sq[b]);                                                 \
            }                                                                                          \
        }                                                                                              \
        __m512 vdecay = _mm512_set1_ps(decay), vbeta = _mm512_set1_ps(beta), vkq = _mm512_set1_ps(kq);  \
        for (int b = 0; b < NV; b++) {                                                                 \
            __m512 vv = _mm512_loadu_ps(v + c0 + 16 * b);                                               \
            d[b] = _mm512_mul_ps(vbeta, _mm512_fnmadd_ps(vdecay, kv[b], vv));                          \
            _mm512_storeu_ps(o + c0 + 16 * b, _mm512_fmadd_ps(vkq, d[b], _mm512_mul_ps(vdecay, sq[b])));\
        }                                                                                              \
        for (int i = 0; i < dk; i++) {                                                                 \
            float *Si = S + (int64_t)i * dv + c0;                                                      \
            __m512 ki = _mm512_set1_ps(k[i]);                                                          \
            for (int b = 0; b < NV; b++) {                                                             \
                __m512 s = _mm512_mul_ps(_mm512_loadu_ps(Si + 16 * b), vdecay);                         \
                _mm512_storeu_ps(Si + 16 * b, _mm512_fmadd_ps(ki, d[b], s));                            \
            }                                                                                          \
        }                                                                                              \
    }
GDN_BLOCK(16)
GDN_BLOCK(64)

void le_gdn_step_avx512(float *S, const float *q, const float *k, const float *v, float decay, float beta, int dk,
                      int dv, float *o) {
    if (dv % 16) {
        le_gdn_step_avx2(S, q, k, v, decay, beta, dk, dv, o);
        return;
    }
    float kq = le_dot_f32_avx512(k, q, dk);
    int c = 0;
    for (; c + 64 <= dv; c += 64) block64(S, q, k, v, decay, beta, kq, dk, dv, c, o);
    for (; c < dv; c += 16) block16(S, q, k, v, decay, beta, kq, dk, dv, c, o);
}

/* ---- gemm_tile: C [M, N] = A [M, K] B [N, K]^T; the body is gemm_tile_x86.h (4 rows of A x 4 rows of B in zmm), shared with the other
 * tier: here its vector operations and the reduction of a C row's 4 accumulators into 4 contiguous sums. */
static inline __m128 reduce4_512(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)); /* per 128: a02 b02 a13 b13 */
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    __m512 s = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2))); /* per 128: a b c d */
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

#define GT_VEC __m512
#define GT_LANES 16
#define GT_MR 4                        /* 16 accumulators of the 32 zmm */
#define GT_ZERO() _mm512_setzero_ps()
#define GT_LOAD(p) _mm512_loadu_ps(p)
#define GT_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define GT_MASK_T __mmask16
#define GT_MASK(n) ((__mmask16)((1u << (n)) - 1))
#define GT_MASKLOAD(m, p) _mm512_maskz_loadu_ps(m, p)
#define GT_REDUCE4 reduce4_512
#define GT_NAME le_gemm_tile_f32_avx512
#include "gemm_tile_x86.h"

/* ---- gemm_nn: C [M, N] = A [M, K] B [K, N]; the body is gemm_nn_x86.h: 6 rows x 4 zmm of B's columns (24
 * accumulators and 4 B vectors; A's broadcast is the FMA's memory operand). */
#define GT_SET1(f) _mm512_set1_ps(f)
#define GT_ADD(a, b) _mm512_add_ps(a, b)
#define GT_STORE(p, v) _mm512_storeu_ps(p, v)
#define GT_MASKSTORE(p, m, v) _mm512_mask_storeu_ps(p, m, v)
#define GN_MR 6
#define GN_NV 4
#define GN_NAME le_gemm_nn_f32_avx512
#include "gemm_nn_x86.h"

/* ---- exp_sub_sum: the body is exp_sub_sum_x86.h; the exp is simd_x86.h's le_exp_ps_512. */
#define ES_VEC __m512
#define ES_LANES 16
#define ES_SET1(f) _mm512_set1_ps(f)
#define ES_LOAD(p) _mm512_loadu_ps(p)
#define ES_STORE(p, v) _mm512_storeu_ps(p, v)
#define ES_MUL(a, b) _mm512_mul_ps(a, b)
#define ES_SUB(a, b) _mm512_sub_ps(a, b)
#define ES_MAX(a, b) _mm512_max_ps(a, b)
#define ES_HMAX(v) _mm512_reduce_max_ps(v)
#define ES_EXP(v) le_exp_ps_512(v)
#define ES_DVEC __m512d
#define ES_DZERO() _mm512_setzero_pd()
#define ES_DADD(d0, d1, v)                                                                                          \
    (d0 = _mm512_add_pd(d0, _mm512_cvtps_pd(_mm512_castps512_ps256(v))),                                           \
     d1 = _mm512_add_pd(d1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)))))
#define ES_DHSUM(d) _mm512_reduce_add_pd(d)
#define ES_NAME le_exp_sub_sum_f32_avx512
#include "exp_sub_sum_x86.h"

/* ---- gelu_tanh: the body is gelu_tanh_x86.h (the exp_sub_sum operations above). */
#define ES_ADD(a, b) _mm512_add_ps(a, b)
#define ES_DIV(a, b) _mm512_div_ps(a, b)
#define GE_NAME le_gelu_tanh_f32_avx512
#include "gelu_tanh_x86.h"

/* ---- silu: the body is silu_x86.h (the exp_sub_sum operations above). */
#define SI_NAME le_silu_f32_avx512
#include "silu_x86.h"
