/* gemm_tile_x86.h — C [M, N] = A [M, K] B [N, K]^T (both operands K-contiguous): the one body of the AVX2 and
 * AVX-512 gemm_tile kernels. f32_avx2.c and f32_avx512.c define, after their #pragma GCC target, the vector type and
 * its operations, then include this file:
 *   GT_VEC, GT_LANES (floats per vector), GT_MR (rows of A per register tile: 3 with 16 ymm, 4 with 32 zmm),
 *   GT_ZERO(), GT_LOAD(p), GT_FMA(a, b, acc), GT_MASK_T, GT_MASK(n) (the first n < GT_LANES lanes),
 *   GT_MASKLOAD(m, p) (zeros outside the mask), GT_REDUCE4(a, b, c, d) (the 4 accumulators of a C row -> 4 sums),
 *   GT_NAME (the kernel's name).
 * Register blocking: GT_MR rows of A x 4 rows of B, one accumulator per C element, FMA over K GT_LANES floats at a
 * time, the last < GT_LANES with masked loads (zeros add nothing). A missing row or column of a tail tile is a zero
 * accumulator: each lane's tree is the same whatever its neighbours hold, so an element's sum does not depend on
 * where it sits in the tile, or the tile in C. Oracle: le_gemm_tile_f32_ref (native/f32_ref.c). */
#ifndef LE_GEMM_TILE_X86_H
#define LE_GEMM_TILE_X86_H

#include <stdint.h>

static inline __attribute__((always_inline)) void gt_micro(const float *A, int64_t lda, const float *B, int64_t ldb,
                                                           float *C, int64_t ldc, int K, const int MR, const int NR) {
    GT_VEC acc[4][4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) acc[i][j] = GT_ZERO();
    int k = 0;
    for (; k + GT_LANES <= K; k += GT_LANES) {
        GT_VEC b[4];
#pragma GCC unroll 4
        for (int j = 0; j < NR; j++) b[j] = GT_LOAD(B + j * ldb + k);
#pragma GCC unroll 4
        for (int i = 0; i < MR; i++) {
            GT_VEC a = GT_LOAD(A + i * lda + k);
#pragma GCC unroll 4
            for (int j = 0; j < NR; j++) acc[i][j] = GT_FMA(a, b[j], acc[i][j]);
        }
    }
    if (k < K) {
        GT_MASK_T m = GT_MASK(K - k);
        GT_VEC b[4];
#pragma GCC unroll 4
        for (int j = 0; j < NR; j++) b[j] = GT_MASKLOAD(m, B + j * ldb + k);
#pragma GCC unroll 4
        for (int i = 0; i < MR; i++) {
            GT_VEC a = GT_MASKLOAD(m, A + i * lda + k);
#pragma GCC unroll 4
            for (int j = 0; j < NR; j++) acc[i][j] = GT_FMA(a, b[j], acc[i][j]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++) {
        __m128 s = GT_REDUCE4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
        if (NR == 4) {
            _mm_storeu_ps(C + i * ldc, s);
        } else {
            float t[4];
            _mm_storeu_ps(t, s);
            for (int j = 0; j < NR; j++) C[i * ldc + j] = t[j];
        }
    }
}

#define GT_CASE(mr, nr)                                                                                             \
    case (mr) * 8 + (nr): gt_micro(A, lda, B, ldb, C, ldc, K, mr, nr); break;

/* a tail tile: mr <= GT_MR rows, nr <= 4 columns (not both full) */
static void gt_tail(const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc, int K, int mr,
                    int nr) {
    switch (mr * 8 + nr) {
        GT_CASE(1, 1) GT_CASE(1, 2) GT_CASE(1, 3) GT_CASE(1, 4)
        GT_CASE(2, 1) GT_CASE(2, 2) GT_CASE(2, 3) GT_CASE(2, 4)
        GT_CASE(3, 1) GT_CASE(3, 2) GT_CASE(3, 3) GT_CASE(3, 4)
        GT_CASE(4, 1) GT_CASE(4, 2) GT_CASE(4, 3)
    default: break;
    }
}

void GT_NAME(const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc, int M, int N, int K) {
    for (int i = 0; i < M; i += GT_MR) {
        int mr = M - i < GT_MR ? M - i : GT_MR;
        for (int j = 0; j < N; j += 4) {
            int nr = N - j < 4 ? N - j : 4;
            const float *a = A + i * lda, *b = B + j * ldb;
            float *c = C + i * ldc + j;
            if (mr == GT_MR && nr == 4) gt_micro(a, lda, b, ldb, c, ldc, K, GT_MR, 4);
            else gt_tail(a, lda, b, ldb, c, ldc, K, mr, nr);
        }
    }
}

#endif
