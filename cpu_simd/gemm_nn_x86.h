/* gemm_nn_x86.h — C [M, N] = A [M, K] B [K, N] (A's rows K-contiguous, B's rows N-contiguous; le_simd.h gemm_nn):
 * the one body of the AVX2 and AVX-512 kernels. f32_avx2.c and f32_avx512.c define, after their #pragma GCC
 * target, the vector operations of gemm_tile_x86.h (GT_VEC, GT_LANES, GT_ZERO, GT_LOAD, GT_FMA, GT_MASK_T,
 * GT_MASK, GT_MASKLOAD) and GT_SET1(f), GT_ADD, GT_STORE(p, v), GT_MASKSTORE(p, m, v), GN_MR x GN_NV (the register
 * tile: GN_MR rows of A x GN_NV vectors of B's columns), GN_NAME, then include this file.
 * Outer products: per k, GN_NV vectors of B's row k and GN_MR broadcasts of A[i, k], one FMA per accumulator, so
 * no horizontal sums (the attention's QK^T, K = head_dim = 64, and P V, N = head_dim). K goes in blocks of
 * LE_GEMM_NN_KB: each block's sum is one FMA chain from 0 held in registers, added to C after the first block.
 * Every lane is one C element whose chain is the same wherever it sits (missing columns of a tail are masked
 * lanes, missing rows are not computed): an element's bits depend on K alone. The loops go k-block, column block,
 * row block, so a column block's B panel (LE_GEMM_NN_KB x GN_NV vectors) stays in L1 across the row blocks.
 * Oracle: le_gemm_nn_f32_ref (native/f32_ref.c). */
#ifndef LE_GEMM_NN_X86_H
#define LE_GEMM_NN_X86_H

#include <stdint.h>

_Static_assert(GN_MR == 6 && GN_NV >= 2 && GN_NV <= 4, "gn_tile's cases cover 6 rows and 2 to 4 vectors");

/* One register tile: MR rows x NV vectors (the last one masked by m when TAIL), K terms; add: C += the sums. */
static inline __attribute__((always_inline)) void gn_micro(const float *A, int64_t lda, const float *B, int64_t ldb,
                                                           float *C, int64_t ldc, int K, int add, GT_MASK_T m,
                                                           const int MR, const int NV, const int TAIL) {
    GT_VEC acc[GN_MR][GN_NV];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++) acc[i][v] = GT_ZERO();
    for (int k = 0; k < K; k++) {
        GT_VEC b[GN_NV];
        const float *bk = B + k * ldb;
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++)
            b[v] = TAIL && v == NV - 1 ? GT_MASKLOAD(m, bk + v * GT_LANES) : GT_LOAD(bk + v * GT_LANES);
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            GT_VEC a = GT_SET1(A[i * lda + k]);
#pragma GCC unroll 8
            for (int v = 0; v < NV; v++) acc[i][v] = GT_FMA(a, b[v], acc[i][v]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++) {
            float *c = C + i * ldc + v * GT_LANES;
            if (TAIL && v == NV - 1) {
                GT_MASKSTORE(c, m, add ? GT_ADD(GT_MASKLOAD(m, c), acc[i][v]) : acc[i][v]);
            } else {
                GT_STORE(c, add ? GT_ADD(GT_LOAD(c), acc[i][v]) : acc[i][v]);
            }
        }
}

#define GN_CASE(mr, nv)                                                                                             \
    case (mr) * 16 + (nv) * 2: gn_micro(A, lda, B, ldb, C, ldc, K, add, m, mr, nv, 0); break;                       \
    case (mr) * 16 + (nv) * 2 + 1: gn_micro(A, lda, B, ldb, C, ldc, K, add, m, mr, nv, 1); break;
#define GN_ROW(mr) GN_CASE(mr, 1) GN_CASE(mr, 2) GN_CASE_3(mr) GN_CASE_4(mr)
#if GN_NV >= 3
#define GN_CASE_3(mr) GN_CASE(mr, 3)
#else
#define GN_CASE_3(mr)
#endif
#if GN_NV >= 4
#define GN_CASE_4(mr) GN_CASE(mr, 4)
#else
#define GN_CASE_4(mr)
#endif

/* any tile: mr <= GN_MR rows, nv <= GN_NV vectors, the last masked when tail (mr, nv, tail as runtime values) */
static void gn_tile(const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc, int K, int add,
                    GT_MASK_T m, int mr, int nv, int tail) {
    switch (mr * 16 + nv * 2 + tail) {
        GN_ROW(1) GN_ROW(2) GN_ROW(3) GN_ROW(4) GN_ROW(5) GN_ROW(6)
    default: break;
    }
}

void GN_NAME(const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc, int M, int N, int K) {
    const int NR = GN_NV * GT_LANES; /* columns of a full tile */
    for (int k0 = 0; k0 < K || k0 == 0; k0 += LE_GEMM_NN_KB) {
        int kb = K - k0 < LE_GEMM_NN_KB ? K - k0 : LE_GEMM_NN_KB, add = k0 > 0;
        for (int j = 0; j < N; j += NR) {
            int cols = N - j < NR ? N - j : NR, nv = (cols + GT_LANES - 1) / GT_LANES, rem = cols % GT_LANES;
            GT_MASK_T m = GT_MASK(rem ? rem : GT_LANES - 1); /* unused unless rem */
            for (int i = 0; i < M; i += GN_MR) {
                int mr = M - i < GN_MR ? M - i : GN_MR;
                const float *a = A + i * lda + k0, *b = B + k0 * ldb + j;
                float *c = C + i * ldc + j;
                if (mr == GN_MR && nv == GN_NV && !rem) gn_micro(a, lda, b, ldb, c, ldc, kb, add, m, GN_MR, GN_NV, 0);
                else gn_tile(a, lda, b, ldb, c, ldc, kb, add, m, mr, nv, rem != 0);
            }
        }
        if (K == 0) break;
    }
}

#endif
