/* f32_avx2.c — the f32 kernels of the decode step (le_simd.h), AVX2 + FMA.
 *
 * gdn_step (one Gated DeltaNet v-head, one token). Written with S' = decay S + k delta^T:
 *   kv = S^T k, sq = S^T q            (pass 1: reads S)
 *   delta = beta (v - decay kv)
 *   o = S'^T q = decay sq + (k . q) delta
 *   S <- decay S + k delta^T          (pass 2: reads and writes S)
 * which is the reference's arithmetic reordered (one write pass instead of two). Columns
 * of S are independent, so the work goes in blocks of 32 columns (4 ymm): a block of a
 * 128 x 128 state is 16 KiB and stays in L1 between the two passes. dv not a multiple of
 * 8 goes to the reference. dot: 4 FMA accumulators of 8 lanes. gemm_tile: 3 x 4 register tiles, gemm_nn: 6 rows x
 * 16 columns, exp_sub_sum and gelu_tanh: 8 lanes (below).
 * Oracle: native/f32_ref.c. Test: python -m pytest tests/test_f32_kernels.py -k avx2 */
#pragma GCC target("avx2,fma")

#include "le_simd.h"
#include "simd_x86.h"

float le_dot_f32_avx2(const float *a, const float *b, int64_t n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps(),
           acc3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
        acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), acc2);
        acc3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), acc3);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    float s = le_hsum_ps_256(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* one block of W (8, 16, 24 or 32) columns starting at c0 */
#define GDN_BLOCK(W)                                                                                   \
    static void block##W(float *S, const float *q, const float *k, const float *v, float decay,        \
                         float beta, float kq, int dk, int dv, int c0, float *o) {                     \
        enum { NV = W / 8 };                                                                           \
        __m256 kv[NV], sq[NV], d[NV];                                                                  \
        for (int b = 0; b < NV; b++) kv[b] = sq[b] = _mm256_setzero_ps();                              \
        for (int i = 0; i < dk; i++) {                                                                 \
            const float *Si = S + (int64_t)i * dv + c0;                                                \
            __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);                               \
            for (int b = 0; b < NV; b++) {                                                             \
                __m256 s = _mm256_loadu_ps(Si + 8 * b);                                                \
                kv[b] = _mm256_fmadd_ps(s, ki, kv[b]);                                                 \
                sq[b] = _mm256_fmadd_ps(s, qi, sq[b]);                                                 \
            }                                                                                          \
        }                                                                                              \
        __m256 vdecay = _mm256_set1_ps(decay), vbeta = _mm256_set1_ps(beta), vkq = _mm256_set1_ps(kq);  \
        for (int b = 0; b < NV; b++) {                                                                 \
            __m256 vv = _mm256_loadu_ps(v + c0 + 8 * b);                                               \
            d[b] = _mm256_mul_ps(vbeta, _mm256_fnmadd_ps(vdecay, kv[b], vv));                          \
            _mm256_storeu_ps(o + c0 + 8 * b, _mm256_fmadd_ps(vkq, d[b], _mm256_mul_ps(vdecay, sq[b])));\
        }                                                                                              \
        for (int i = 0; i < dk; i++) {                                                                 \
            float *Si = S + (int64_t)i * dv + c0;                                                      \
            __m256 ki = _mm256_set1_ps(k[i]);                                                          \
            for (int b = 0; b < NV; b++) {                                                             \
                __m256 s = _mm256_mul_ps(_mm256_loadu_ps(Si + 8 * b), vdecay);                         \
                _mm256_storeu_ps(Si + 8 * b, _mm256_fmadd_ps(ki, d[b], s));                            \
            }                                                                                          \
        }                                                                                              \
    }
GDN_BLOCK(8)
GDN_BLOCK(32)

void le_gdn_step_avx2(float *S, const float *q, const float *k, const float *v, float decay, float beta, int dk,
                      int dv, float *o) {
    if (dv % 8) {
        le_gdn_step_ref(S, q, k, v, decay, beta, dk, dv, o);
        return;
    }
    float kq = le_dot_f32_avx2(k, q, dk);
    int c = 0;
    for (; c + 32 <= dv; c += 32) block32(S, q, k, v, decay, beta, kq, dk, dv, c, o);
    for (; c < dv; c += 8) block8(S, q, k, v, decay, beta, kq, dk, dv, c, o);
}

/* ---- gemm_tile: C [M, N] = A [M, K] B [N, K]^T; the body is gemm_tile_x86.h (3 rows of A x 4 rows of B in ymm), shared with the other
 * tier: here its vector operations and the reduction of a C row's 4 accumulators into 4 contiguous sums. */
static inline __m128 reduce4_256(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b)); /* per 128: a02 b02 a13 b13 */
    __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
    __m256 s = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2))); /* per 128: a b c d */
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

#define GT_VEC __m256
#define GT_LANES 8
#define GT_MR 3                        /* 12 accumulators + 4 B vectors = the 16 ymm (A is an FMA memory operand) */
#define GT_ZERO() _mm256_setzero_ps()
#define GT_LOAD(p) _mm256_loadu_ps(p)
#define GT_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define GT_MASK_T __m256i
#define GT_MASK(n) _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
#define GT_MASKLOAD(m, p) _mm256_maskload_ps(p, m)
#define GT_REDUCE4 reduce4_256
#define GT_NAME le_gemm_tile_f32_avx2
#include "gemm_tile_x86.h"

/* ---- gemm_nn: C [M, N] = A [M, K] B [K, N]; the body is gemm_nn_x86.h: 6 rows x 2 ymm of B's columns (12
 * accumulators, 2 B vectors and the broadcast of A: 15 of the 16 ymm). */
#define GT_SET1(f) _mm256_set1_ps(f)
#define GT_ADD(a, b) _mm256_add_ps(a, b)
#define GT_STORE(p, v) _mm256_storeu_ps(p, v)
#define GT_MASKSTORE(p, m, v) _mm256_maskstore_ps(p, m, v)
#define GN_MR 6
#define GN_NV 2
#define GN_NAME le_gemm_nn_f32_avx2
#include "gemm_nn_x86.h"

/* ---- exp_sub_sum: the body is exp_sub_sum_x86.h; the exp is simd_x86.h's le_exp_ps_256. */
static inline float hmax_256(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
static inline double hsum_pd_256(__m256d v) {
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}
#define ES_VEC __m256
#define ES_LANES 8
#define ES_SET1(f) _mm256_set1_ps(f)
#define ES_LOAD(p) _mm256_loadu_ps(p)
#define ES_STORE(p, v) _mm256_storeu_ps(p, v)
#define ES_MUL(a, b) _mm256_mul_ps(a, b)
#define ES_SUB(a, b) _mm256_sub_ps(a, b)
#define ES_MAX(a, b) _mm256_max_ps(a, b)
#define ES_HMAX(v) hmax_256(v)
#define ES_EXP(v) le_exp_ps_256(v)
#define ES_DVEC __m256d
#define ES_DZERO() _mm256_setzero_pd()
#define ES_DADD(d0, d1, v)                                                                                          \
    (d0 = _mm256_add_pd(d0, _mm256_cvtps_pd(_mm256_castps256_ps128(v))),                                           \
     d1 = _mm256_add_pd(d1, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1))))
#define ES_DHSUM(d) hsum_pd_256(d)
#define ES_NAME le_exp_sub_sum_f32_avx2
#include "exp_sub_sum_x86.h"

/* ---- gelu_tanh: the body is gelu_tanh_x86.h (the exp_sub_sum operations above). */
#define ES_ADD(a, b) _mm256_add_ps(a, b)
#define ES_DIV(a, b) _mm256_div_ps(a, b)
#define GE_NAME le_gelu_tanh_f32_avx2
#include "gelu_tanh_x86.h"

/* ---- silu: the body is silu_x86.h (the exp_sub_sum operations above). */
#define SI_NAME le_silu_f32_avx2
#include "silu_x86.h"
