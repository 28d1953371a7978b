/* gemm_f32.cu — prefill GEMM with f32 activations: Y = X W^T for several tokens, W quantised.
 *
 *   gemm_f32_<type>(W, X, Y, nrows, ncols, ntok)   type: q4_0 q8_0 q4_K q5_K q6_K iq4_xs f32
 *     W: [nrows, ncols] rows of quant blocks (as gemv_f32.cu) or f32 (4-aligned), X: [ntok, ncols] f32,
 *     Y: [ntok, nrows] f32 (Y[t, r] = sum_k W[r, k] X[t, k])
 *     launch: block GEMM_THREADS (256) x 1 x 1,
 *             grid min(ceil(nrows/32), 65535) x ceil(ntok/32) x 1   (ntok <= 32 * 65535)
 *   gemm_f32_<type>_ids(W, X, Y, nrows, ncols, tiles, expert_bytes)   the grouped expert GEMM (MoE prefill)
 *     W: [n_expert] experts of [nrows, ncols] at W + e * expert_bytes; X: [pairs, ncols] f32 rows sorted by
 *     expert (gathered per (token, expert) pair), Y: [pairs, nrows]; tiles: int32 [n_tiles, 3] =
 *     (expert e, first pair p0, count <= 32): one token tile of one expert each (the host builds them from the
 *     sorted routing), so every expert's weights are read once per 32 of its tokens, not once per token.
 *     launch: grid min(ceil(nrows/32), 65535) x n_tiles x 1 (n_tiles <= 65535); a tile runs gemm_f32's code
 *     on its expert's W for tokens [p0, p0 + cnt) (t0 = p0): the same arithmetic, bit for bit.
 * Tiled: per step of 32 columns, 32 threads decode one 32-element sub-block of the tile's 32
 * rows into shared memory (Ws, transposed so both the writes and the reads are conflict-free),
 * all threads stage 32 tokens x 32 columns of X (Xs), then each thread accumulates 4 tokens
 * of one row. 8.4 KB of static shared memory; no shuffles, so every tier runs the same code
 * (fermi: plain loads; kepler+: __ldg).
 * Reference: le_dequantize_row + f64 matmul; only summation order differs
 * (tests/tolerances.py GPU_GEMV_F32_REL).
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k gemm
 */
#include "quants.cuh"

#define GEMM_THREADS 256
#define GEMM_TR 32 /* rows per tile */
#define GEMM_TT 32 /* tokens per tile */
#define GEMM_TPT (GEMM_TT / (GEMM_THREADS / GEMM_TR)) /* tokens per thread: 4 */


/* f32 weights: a row of 4-byte "blocks" of one element (only the tile loader differs). */
struct le_t_f32w {
    enum { BLOCK = 32, BYTES = 128 };
};

/* Sub-block s of a weight row into column `tid` of the tile. */
template <class T>
__device__ __forceinline__ void gemm_load(T, const uint8_t *row, int s, float (*Ws)[GEMM_TR + 1], int tid) {
    le_q32 b;
    T::decode(row, s, b);
#pragma unroll
    for (int j = 0; j < 32; j++) Ws[j][tid] = b.d[j / 16] * le_byte(b.q[j / 4], j % 4) - b.m;
}

__device__ __forceinline__ void gemm_load(le_t_f32w, const uint8_t *row, int s, float (*Ws)[GEMM_TR + 1], int tid) {
    const float *r = (const float *)row + 32 * s;
#pragma unroll
    for (int j = 0; j < 32; j++) Ws[j][tid] = le_ldg(r + j);
}

template <class T>
__device__ __forceinline__ void gemm_f32(const uint8_t *LE_RESTRICT W, const float *LE_RESTRICT X,
                                         float *LE_RESTRICT Y, int nrows, int ncols, int ntok, int t0,
                                         float (*Ws)[GEMM_TR + 1], float (*Xs)[32 + 1]) {
    const int tid = threadIdx.x, r = tid % GEMM_TR, tg = tid / GEMM_TR; /* row in tile, token group */
    const int nsub = ncols / 32;
    const size_t row_bytes = le_row_bytes<T>(ncols);
    for (int r0 = blockIdx.x * GEMM_TR; r0 < nrows; r0 += gridDim.x * GEMM_TR) {
        float acc[GEMM_TPT];
#pragma unroll
        for (int i = 0; i < GEMM_TPT; i++) acc[i] = 0.0f;
        for (int s = 0; s < nsub; s++) {
            __syncthreads(); /* the previous step's tiles are consumed */
            if (tid < GEMM_TR) {
                const int row = r0 + tid;
                if (row < nrows) {
                    gemm_load(T(), W + (size_t)row * row_bytes, s, Ws, tid);
                } else {
#pragma unroll
                    for (int j = 0; j < 32; j++) Ws[j][tid] = 0.0f;
                }
            }
            for (int i = tid; i < GEMM_TT * 32; i += GEMM_THREADS) {
                const int t = i / 32, k = i % 32;
                Xs[t][k] = t0 + t < ntok ? le_ldg(X + (size_t)(t0 + t) * ncols + 32 * s + k) : 0.0f;
            }
            __syncthreads();
#pragma unroll 8
            for (int k = 0; k < 32; k++) {
                const float w = Ws[k][r];
#pragma unroll
                for (int i = 0; i < GEMM_TPT; i++) acc[i] += w * Xs[tg * GEMM_TPT + i][k];
            }
        }
#pragma unroll
        for (int i = 0; i < GEMM_TPT; i++) {
            const int t = t0 + tg * GEMM_TPT + i;
            if (t < ntok && r0 + r < nrows) Y[(size_t)t * nrows + r0 + r] = acc[i];
        }
    }
}

#define LE_GEMM_F32(name, T)                                                                              \
    extern "C" __global__ void name(const uint8_t *W, const float *X, float *Y, int nrows, int ncols,     \
                                    int ntok) {                                                           \
        __shared__ float Ws[32][GEMM_TR + 1];                                                             \
        __shared__ float Xs[GEMM_TT][32 + 1];                                                             \
        gemm_f32<T>(W, X, Y, nrows, ncols, ntok, blockIdx.y * GEMM_TT, Ws, Xs);                           \
    }                                                                                                     \
    extern "C" __global__ void name##_ids(const uint8_t *W, const float *X, float *Y, int nrows, int ncols, \
                                          const int *tiles, long long expert_bytes) {                     \
        __shared__ float Ws[32][GEMM_TR + 1];                                                             \
        __shared__ float Xs[GEMM_TT][32 + 1];                                                             \
        const int e = tiles[3 * blockIdx.y], p0 = tiles[3 * blockIdx.y + 1], cnt = tiles[3 * blockIdx.y + 2]; \
        /* tokens [p0, p0 + cnt) of the sorted pairs: the plain kernel's tile at t0 = p0, ending at p0 + cnt */ \
        gemm_f32<T>(W + (size_t)e * (size_t)expert_bytes, X, Y, nrows, ncols, p0 + cnt, p0, Ws, Xs);     \
    }

LE_GEMM_F32(gemm_f32_q4_0, le_t_q4_0)
LE_GEMM_F32(gemm_f32_q8_0, le_t_q8_0)
LE_GEMM_F32(gemm_f32_q4_K, le_t_q4_K)
LE_GEMM_F32(gemm_f32_q5_K, le_t_q5_K)
LE_GEMM_F32(gemm_f32_q6_K, le_t_q6_K)
LE_GEMM_F32(gemm_f32_iq4_xs, le_t_iq4_xs)
LE_GEMM_F32(gemm_f32_f32, le_t_f32w)
