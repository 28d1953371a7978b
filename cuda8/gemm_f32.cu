/* gemm_f32.cu — prefill GEMM with f32 activations: Y = X W^T for several tokens, W quantised.
 *
 *   gemm_f32_<type>(W, X, Y, nrows, ncols, ntok)   type: q4_0 q8_0 q4_K q5_K q6_K iq4_xs f32
 *     W: [nrows, ncols] rows of quant blocks (as gemv_f32.cu) or f32 (4-aligned), X: [ntok, ncols] f32,
 *     Y: [ntok, nrows] f32 (Y[t, r] = sum_k W[r, k] X[t, k])
 *     launch: block GEMM_THREADS (256) x 1 x 1,
 *             grid min(ceil(nrows/GEMM_ROWS), 65535) x ceil(ntok/GEMM_TT) x 1   (ntok <= 32 * 65535)
 *   gemm_f32_<type>_ids(W, X, Y, nrows, ncols, tiles, expert_bytes)   the grouped expert GEMM (MoE prefill)
 *     W: [n_expert] experts of [nrows, ncols] at W + e * expert_bytes; X: [pairs, ncols] f32 rows sorted by
 *     expert (gathered per (token, expert) pair), Y: [pairs, nrows]; tiles: int32 [n_tiles, 3] =
 *     (expert e, first pair p0, count <= 32; count 0: an empty tile, the block returns): one token tile of one
 *     expert each (expert_tiles on the host or moe_sort.cu on the GPU build them from the sorted routing), so
 *     every expert's weights are read once per 32 of its tokens, not once per token.
 *     launch: grid min(ceil(nrows/GEMM_ROWS), 65535) x n_tiles x 1 (n_tiles <= 65535); a tile runs gemm_f32's
 *     code on its expert's W for tokens [p0, p0 + cnt) (t0 = p0): the same arithmetic, bit for bit.
 * Tiled, GEMM_ROWS (128) rows x GEMM_TT (32) tokens per block, in steps of 32 columns:
 *   - stage: thread tid holds word k = tid % 8 (4 columns) of rows tid / 8 + 32 i (i < 4): eight lanes read
 *     one row's sub-block together (le_word: the int and its scale and min), so a warp's load touches 4 rows;
 *     and 4 consecutive columns (one float4) of token tid / 8 of X. Where registers allow (LE_HAS_MANY_REGS:
 *     sm_35+) step s + 1's loads are issued before step s computes, so their latency hides behind the
 *     arithmetic (with 63 registers each word goes to shared memory as soon as it is loaded);
 *   - store: Ws[row][k] and Xs[token][k], rows padded to GEMM_PAD (36) floats: 16-byte aligned for float4
 *     access, and 8 consecutive rows start in 8 different 4-bank groups;
 *   - compute: warp w owns rows 16w … 16w+15 and all 32 tokens; lane (rl = lane % 4, tl = lane / 4) owns
 *     rows 16w + rl + 4i and tokens tl + 8j (i, j < 4): per 4 columns 4 float4 of W and 4 of X for 64 FMAs.
 *     Measured (ncu, H200, q4_K): shared memory / L1 is the limit (~82 % busy; a 128-bit shared load costs
 *     4 wavefronts however few its distinct addresses), the FMA pipes ~58 %: 22 TFLOPS dense, 17.5 grouped,
 *     against 12 and 10 for the 32 x 32 tile with one token column per thread that it replaced.
 * Every output is one accumulator summed over k in increasing order with w = d * q - m, as in the
 * reference's row dequantisation; 23 KB of static shared memory; no shuffles, so every tier runs the
 * same code (fermi: plain loads; kepler+: __ldg).
 * Reference: le_dequantize_row + f64 matmul; only summation order differs
 * (tests/tolerances.py GPU_GEMV_F32_REL).
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k gemm
 */
#include "gemm_tile.cuh"
#include "quants.cuh"

#define GEMM_THREADS 256
#define GEMM_ROWS 128 /* rows per tile: 8 warps x 16 */
#define GEMM_TT 32    /* tokens per tile */
#define GEMM_PAD 36   /* floats per row of Ws and Xs (32 columns + 4) */

/* f32 weights: a row of 4-byte "blocks" of one element (only the loaders differ). */
struct le_t_f32w {
    enum { BLOCK = 32, BYTES = 128 };
};

/* 4 consecutive floats of a padded shared row (16-byte aligned: row starts at multiples of 36 floats, c % 4 == 0). */
__device__ __forceinline__ float4 &gemm_f4(float (*A)[GEMM_PAD], int row, int c) {
    return *reinterpret_cast<float4 *>(&A[row][c]);
}

/* What a thread holds of one step's weights between the load and the store: word k = tid % 8 (columns 4k … 4k+3) of
 * the tile's rows tid / 8 + 32 m (m < 4). Eight consecutive lanes read one row's sub-block together (32
 * contiguous bytes for 4-bit types), so a warp's load touches 4 rows, not 32. Quant types keep the raw int (4
 * elements) with its scale and min (le_word, the same values as T::decode) and convert at the store; f32 keeps
 * the 4 floats. */
template <class T> struct gemm_stage {
    int q[4];
    float d[4], m[4];
    __device__ __forceinline__ void load(const uint8_t *W, size_t row_bytes, int r0, int nrows, int s, int tid) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int row = r0 + tid / 8 + 32 * i;
            if (row < nrows) q[i] = le_word<T>(W + (size_t)row * row_bytes, s, tid % 8, d[i], m[i]);
        }
    }
    __device__ __forceinline__ void store(float (*Ws)[GEMM_PAD], int r0, int nrows, int tid) const {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int row = tid / 8 + 32 * i;
            gemm_f4(Ws, row, 4 * (tid % 8)) =
                r0 + row < nrows ? make_float4(d[i] * le_byte(q[i], 0) - m[i], d[i] * le_byte(q[i], 1) - m[i],
                                               d[i] * le_byte(q[i], 2) - m[i], d[i] * le_byte(q[i], 3) - m[i])
                                 : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }
};

template <> struct gemm_stage<le_t_f32w> {
    float w[4][4];
    __device__ __forceinline__ void load(const uint8_t *W, size_t row_bytes, int r0, int nrows, int s, int tid) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int row = r0 + tid / 8 + 32 * i;
            const float *p = (const float *)(W + (size_t)row * row_bytes) + 32 * s + 4 * (tid % 8);
#pragma unroll
            for (int c = 0; c < 4; c++) w[i][c] = row < nrows ? le_ldg(p + c) : 0.0f;
        }
    }
    __device__ __forceinline__ void store(float (*Ws)[GEMM_PAD], int, int, int tid) const {
#pragma unroll
        for (int i = 0; i < 4; i++)
            gemm_f4(Ws, tid / 8 + 32 * i, 4 * (tid % 8)) = make_float4(w[i][0], w[i][1], w[i][2], w[i][3]);
    }
};

/* 63 registers (!LE_HAS_MANY_REGS): nothing is held across the compute; each of the thread's 4 words goes to shared
 * memory as soon as it is loaded. */
template <class T>
__device__ __forceinline__ void gemm_copy(const uint8_t *W, size_t row_bytes, int r0, int nrows, int s,
                                          float (*Ws)[GEMM_PAD], int tid) {
#pragma unroll 1
    for (int i = 0; i < 4; i++) {
        const int row = r0 + tid / 8 + 32 * i;
        float d, m; /* a row past the end reads row r0 (values unused) */
        const int q = le_word<T>(W + (size_t)(row < nrows ? row : r0) * row_bytes, s, tid % 8, d, m);
        gemm_f4(Ws, tid / 8 + 32 * i, 4 * (tid % 8)) =
            row < nrows ? make_float4(d * le_byte(q, 0) - m, d * le_byte(q, 1) - m, d * le_byte(q, 2) - m,
                                      d * le_byte(q, 3) - m)
                        : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}

template <>
__device__ __forceinline__ void gemm_copy<le_t_f32w>(const uint8_t *W, size_t row_bytes, int r0, int nrows, int s,
                                                     float (*Ws)[GEMM_PAD], int tid) {
#pragma unroll 1
    for (int i = 0; i < 4; i++) {
        const int row = r0 + tid / 8 + 32 * i;
        const float *p = (const float *)(W + (size_t)row * row_bytes) + 32 * s + 4 * (tid % 8);
        gemm_f4(Ws, tid / 8 + 32 * i, 4 * (tid % 8)) =
            row < nrows ? make_float4(le_ldg(p), le_ldg(p + 1), le_ldg(p + 2), le_ldg(p + 3))
                        : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}

/* This thread's 4 columns of step s's X tile: token t0 + tid / 8, columns 32 s + 4 (tid % 8) … (one float4: X is
 * 16-byte aligned and ncols % 32 == 0, the launcher checks); tokens >= t_end read as 0. */
__device__ __forceinline__ float4 gemm_load_x(const float *LE_RESTRICT X, int ncols, int t_end, int t0, int s,
                                              int tid) {
    const int t = t0 + tid / 8;
    return t < t_end ? le_ldg((const float4 *)(X + (size_t)t * ncols + 32 * s + 4 * (tid % 8)))
                     : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

/* acc[j] += the 4 columns of w times those of x[j], column by column (j < n: 4, or 1 for one token) */
template <int n>
__device__ __forceinline__ void gemm_fma4_n(float *acc, const float4 &w, const float4 *x) {
#pragma unroll
    for (int j = 0; j < n; j++) {
        acc[j] += w.x * x[j].x;
        acc[j] += w.y * x[j].y;
        acc[j] += w.z * x[j].z;
        acc[j] += w.w * x[j].w;
    }
}

template <class T>
__device__ __forceinline__ void gemm_f32(const uint8_t *LE_RESTRICT W, const float *LE_RESTRICT X,
                                         float *LE_RESTRICT Y, int nrows, int ncols, const le_gemm_tile &tl,
                                         long long expert_bytes, float (*Ws)[GEMM_PAD], float (*Xs)[GEMM_PAD]) {
    const int tid = threadIdx.x, lane = tid % 32, rl = lane % 4, tl8 = lane / 4;
    const int wrow = 16 * (tid / 32) + rl; /* this thread's rows in the tile: wrow + 4 i */
    const int nsub = ncols / 32;
    const size_t row_bytes = le_row_bytes<T>(ncols);
    for (int r0 = blockIdx.x * GEMM_ROWS; r0 < nrows; r0 += gridDim.x * GEMM_ROWS) {
        float acc[4][4]; /* [row i][token j] */
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
        gemm_stage<T> st;
        float4 xv;
        if (LE_HAS_MANY_REGS) {
            st.load(le_gemm_weights(W, tl, expert_bytes), row_bytes, r0, nrows, 0, tid);
            xv = gemm_load_x(X, ncols, tl.t0 + tl.n, tl.t0, 0, tid);
        }
        for (int s = 0; s < nsub; s++) {
            __syncthreads(); /* the previous step's tiles are consumed */
            if (LE_HAS_MANY_REGS) {
                st.store(Ws, r0, nrows, tid);
            } else { /* 63 registers: no second step in flight, loaded just before the store */
                gemm_copy<T>(le_gemm_weights(W, tl, expert_bytes), row_bytes, r0, nrows, s, Ws, tid);
                xv = gemm_load_x(X, ncols, tl.t0 + tl.n, tl.t0, s, tid);
            }
            gemm_f4(Xs, tid / 8, 4 * (tid % 8)) = xv;
            __syncthreads();
            if (LE_HAS_MANY_REGS && s + 1 < nsub) { /* step s + 1's loads, in flight while step s computes */
                st.load(le_gemm_weights(W, tl, expert_bytes), row_bytes, r0, nrows, s + 1, tid);
                xv = gemm_load_x(X, ncols, tl.t0 + tl.n, tl.t0, s + 1, tid);
            }
            if (LE_HAS_MANY_REGS) {
#pragma unroll 2
                for (int kq = 0; kq < 8; kq++) {
                    float4 x[4];
#pragma unroll
                    for (int j = 0; j < 4; j++) x[j] = gemm_f4(Xs, tl8 + 8 * j, 4 * kq);
#pragma unroll
                    for (int i = 0; i < 4; i++) gemm_fma4_n<4>(acc[i], gemm_f4(Ws, wrow + 4 * i, 4 * kq), x);
                }
            } else { /* 63 registers: X re-read per row instead of held for all four */
#pragma unroll 1
                for (int kq = 0; kq < 8; kq++) {
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const float4 w = gemm_f4(Ws, wrow + 4 * i, 4 * kq);
#pragma unroll
                        for (int j = 0; j < 4; j++) {
                            const float4 x = gemm_f4(Xs, tl8 + 8 * j, 4 * kq);
                            gemm_fma4_n<1>(acc[i] + j, w, &x);
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int t = tl.t0 + tl8 + 8 * j;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int r = r0 + wrow + 4 * i;
                if (t < tl.t0 + tl.n && r < nrows) Y[(size_t)t * nrows + r] = acc[i][j];
            }
        }
    }
}

#define LE_GEMM_F32(name, T)                                                                              \
    extern "C" __global__ void name(const uint8_t *W, const float *X, float *Y, int nrows, int ncols,     \
                                    int ntok) {                                                           \
        __shared__ __align__(16) float Ws[GEMM_ROWS][GEMM_PAD];                                           \
        __shared__ __align__(16) float Xs[GEMM_TT][GEMM_PAD];                                             \
        __shared__ le_gemm_tile tl;                                                                       \
        le_gemm_tile_plain(tl, ntok, GEMM_TT);                                                            \
        gemm_f32<T>(W, X, Y, nrows, ncols, tl, 0, Ws, Xs);                                                \
    }                                                                                                     \
    extern "C" __global__ void name##_ids(const uint8_t *W, const float *X, float *Y, int nrows, int ncols, \
                                          const int *tiles, long long expert_bytes) {                     \
        __shared__ __align__(16) float Ws[GEMM_ROWS][GEMM_PAD];                                           \
        __shared__ __align__(16) float Xs[GEMM_TT][GEMM_PAD];                                             \
        __shared__ le_gemm_tile tl;                                                                       \
        if (le_gemm_tile_ids(tl, tiles)) gemm_f32<T>(W, X, Y, nrows, ncols, tl, expert_bytes, Ws, Xs);    \
    }

LE_GEMM_F32(gemm_f32_q4_0, le_t_q4_0)
LE_GEMM_F32(gemm_f32_q8_0, le_t_q8_0)
LE_GEMM_F32(gemm_f32_q4_K, le_t_q4_K)
LE_GEMM_F32(gemm_f32_q5_K, le_t_q5_K)
LE_GEMM_F32(gemm_f32_q6_K, le_t_q6_K)
LE_GEMM_F32(gemm_f32_iq4_xs, le_t_iq4_xs)
LE_GEMM_F32(gemm_f32_f32, le_t_f32w)
