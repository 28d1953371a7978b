/* f32_ssse3.c — the f32 kernels of the SSSE3 tier (le_simd.h): gemm_nn on 128-bit vectors; the others are the
 * references (a 2011 host's SSE has nothing to gain there that the compiler does not already take).
 *
 * gemm_nn: gemm_nn_x86.h on __m128, 6 rows x 8 columns (12 accumulators + 2 B vectors + 1 broadcast of the 16 xmm).
 * No FMA on these CPUs: a product is rounded, then added, as the reference's C does, so each element has the
 * reference's bits (K in the same blocks, the same order). Tail columns go through a small buffer (SSE has no
 * masked load/store). It is the chunked GDN prefill's GEMM (native/gdn.c) and the vision tower's.
 * Oracle: le_gemm_nn_f32_ref (native/f32_ref.c). Test: python -m pytest tests/test_f32_kernels.py -k ssse3 */
#pragma GCC target("ssse3")

#include <string.h>

#include <immintrin.h>

#include "le_simd.h"

/* the first m (1..3) floats at p, zeros after */
static inline __m128 load_first(const float *p, int m) {
    float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    memcpy(t, p, (size_t)m * sizeof(float));
    return _mm_loadu_ps(t);
}

static inline void store_first(float *p, int m, __m128 v) {
    float t[4];
    _mm_storeu_ps(t, v);
    memcpy(p, t, (size_t)m * sizeof(float));
}

#define GT_VEC __m128
#define GT_LANES 4
#define GT_ZERO() _mm_setzero_ps()
#define GT_LOAD(p) _mm_loadu_ps(p)
#define GT_FMA(a, b, c) _mm_add_ps(_mm_mul_ps(a, b), c)
#define GT_MASK_T int
#define GT_MASK(n) (n)
#define GT_MASKLOAD(m, p) load_first(p, m)
#define GT_SET1(f) _mm_set1_ps(f)
#define GT_ADD(a, b) _mm_add_ps(a, b)
#define GT_STORE(p, v) _mm_storeu_ps(p, v)
#define GT_MASKSTORE(p, m, v) store_first(p, m, v)
#define GN_MR 6
#define GN_NV 2
#define GN_NAME le_gemm_nn_f32_ssse3
#include "gemm_nn_x86.h"
