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
 * 8 goes to the reference. dot: 4 FMA accumulators of 8 lanes.
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
