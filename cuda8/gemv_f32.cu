/* gemv_f32.cu — decode GEMV with f32 activations: y = W x, W quantised, dequantised on the fly.
 *
 *   gemv_f32_<type>(W, x, y, nrows, ncols, w_1, y_1, n_1, w_2, y_2, n_2, w_3, y_3, n_3)
 *     type: q4_0 q8_0 q4_K q5_K q6_K iq4_xs f32
 *     W: [nrows, ncols] rows of quant blocks (row r at W + r * ncols/BLOCK*BYTES; W 4-byte aligned),
 *        or f32 rows (16-byte aligned, ncols % 4 == 0)
 *     x: [ncols] f32 (16-byte aligned), y: [nrows] f32; ncols a multiple of the block size
 *     up to GEMV_MAX_MATS (4) matrices of the same type and width on the same input in one launch (GDN's qkv,
 *     z, beta and alpha; a SwiGLU's gate and up): matrix m > 0 is n_m rows at W + w_m (bytes, may be negative)
 *     into y + y_m (floats); n_1 = 0: one matrix (quants.cuh LE_GEMV_MATS, le_gemv_mat_of)
 *     launch: block GEMV_THREADS (128 = 4 warps) x 1 x 1; one matrix: grid min(ceil(nrows/4), 65535) x 1 x 1
 *     (rows grid-strided); several: grid sum of ceil(rows_m/4) x 1 x 1 (their blocks one after another, <= 65535)
 *   gemv_f32_<type>_ids(W, x, y, nrows, ncols, ids, expert_bytes, x_group, x_stride, w_z, y_z)
 *     the MoE form: grid.y = number of (token, slot) pairs p; pair p multiplies expert ids[p]
 *     (W + ids[p] * expert_bytes) with x + (p / x_group) * x_stride into y + p * nrows
 *     (gate/up: x_group = k, the token's input; down: x_group = 1, the pair's own activation);
 *     ids[p] < 0: the pair is skipped and its output row is zero (the hybrid decode's CPU-side experts);
 *     grid.z = 2: every expert's second matrix at the same offset w_z from its first (gate and up)
 * One warp per row (rows grid-strided); lane l takes the 4-element words l, l+32, … of the row
 * (quants.cuh word() decodes one to the reference's exact weights), so that a warp reads 128
 * consecutive elements of x and the matching weight bytes per step (coalesced), multiplies in
 * f32, and the warp sums the lanes. Reference: le_dequantize_row + an f64 dot product;
 * only the summation order differs (tests/tolerances.py GPU_GEMV_F32_REL).
 * Tiers: all (fermi: warp sum in shared memory, plain loads; kepler: shuffles, __ldg from sm_35).
 * Bandwidth-bound: the weights are read once; x (a few KB) stays in L1/L2.
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k gemv_f32
 */
#include "quants.cuh"

#define GEMV_THREADS 128
#define GEMV_WARPS (GEMV_THREADS / LE_WARP)

template <class T>
__device__ __forceinline__ void gemv_f32(const uint8_t *LE_RESTRICT W, const float *LE_RESTRICT x,
                                         float *LE_RESTRICT y, int nrows, int ncols, int blk, int nblk,
                                         float *scratch) {
    const int lane = threadIdx.x % LE_WARP, warp = threadIdx.x / LE_WARP;
    const int nsub = ncols / 32;
    const size_t row_bytes = le_row_bytes<T>(ncols);
    /* the loop bound is the block's, not the warp's: le_warp_sum synchronises the block on fermi */
    for (int base = blk * GEMV_WARPS; base < nrows; base += nblk * GEMV_WARPS) {
        const int row = base + warp;
        float acc = 0.0f;
        if (row < nrows) {
            const uint8_t *w = W + (size_t)row * row_bytes;
            for (int i = lane; i < 8 * nsub; i += LE_WARP) {
                float d, m;
                const int q = le_word<T>(w, i / 8, i % 8, d, m);
                const float4 xx = le_ldg((const float4 *)x + i); /* elements 4i..4i+3 */
                acc += (d * le_byte(q, 0) - m) * xx.x;
                acc += (d * le_byte(q, 1) - m) * xx.y;
                acc += (d * le_byte(q, 2) - m) * xx.z;
                acc += (d * le_byte(q, 3) - m) * xx.w;
            }
        }
        acc = le_warp_sum(acc, scratch);
        if (lane == 0 && row < nrows) y[row] = acc;
    }
}

#define LE_GEMV_F32(name, T)                                                                              \
    extern "C" __global__ void name(const uint8_t *W, const float *x, float *y, int nrows, int ncols,     \
                                    LE_GEMV_MATS) {                                                       \
        LE_SCRATCH(scratch, GEMV_THREADS);                                                                \
        const le_gemv_mat g = le_gemv_mat_of(nrows, n_1, n_2, n_3, GEMV_WARPS);                           \
        gemv_f32<T>(W + LE_GEMV_PICK(g.m, 0LL, w_1, w_2, w_3), x, y + LE_GEMV_PICK(g.m, 0LL, y_1, y_2, y_3),  \
                    LE_GEMV_PICK(g.m, nrows, n_1, n_2, n_3), ncols, g.blk, g.nblk, scratch);              \
    }

#define LE_GEMV_F32_IDS(name, T)                                                                          \
    extern "C" __global__ void name(const uint8_t *W, const float *x, float *y, int nrows, int ncols,     \
                                    const int *ids, long long expert_bytes, int x_group, int x_stride,    \
                                    long long w_z, long long y_z) {                                       \
        LE_SCRATCH(scratch, GEMV_THREADS);                                                                \
        const int p = blockIdx.y;                                                                         \
        W += blockIdx.z * w_z;                                                                            \
        y += blockIdx.z * y_z;                                                                            \
        if (le_zero_skipped_pair(ids[p], y + (size_t)p * nrows, nrows)) return;                           \
        gemv_f32<T>(W + (size_t)ids[p] * expert_bytes, x + (size_t)(p / x_group) * x_stride,              \
                    y + (size_t)p * nrows, nrows, ncols, blockIdx.x, gridDim.x, scratch);                 \
    }

LE_GEMV_F32(gemv_f32_q4_0, le_t_q4_0)
LE_GEMV_F32(gemv_f32_q8_0, le_t_q8_0)
LE_GEMV_F32(gemv_f32_q4_K, le_t_q4_K)
LE_GEMV_F32(gemv_f32_q5_K, le_t_q5_K)
LE_GEMV_F32(gemv_f32_q6_K, le_t_q6_K)
LE_GEMV_F32(gemv_f32_iq4_xs, le_t_iq4_xs)
LE_GEMV_F32_IDS(gemv_f32_q4_0_ids, le_t_q4_0)
LE_GEMV_F32_IDS(gemv_f32_q8_0_ids, le_t_q8_0)
LE_GEMV_F32_IDS(gemv_f32_q4_K_ids, le_t_q4_K)
LE_GEMV_F32_IDS(gemv_f32_q5_K_ids, le_t_q5_K)
LE_GEMV_F32_IDS(gemv_f32_q6_K_ids, le_t_q6_K)
LE_GEMV_F32_IDS(gemv_f32_iq4_xs_ids, le_t_iq4_xs)

/* f32 weights (the oracle's f32 files; small f32 tensors of quantised files): lane l takes the
 * float4 words l, l+32, … of the row, as the quantised path takes its 4-element words. */
__device__ __forceinline__ void gemv_f32w(const float *LE_RESTRICT W, const float *LE_RESTRICT x,
                                          float *LE_RESTRICT y, int nrows, int ncols, int blk, int nblk,
                                          float *scratch) {
    const int lane = threadIdx.x % LE_WARP, warp = threadIdx.x / LE_WARP;
    for (int base = blk * GEMV_WARPS; base < nrows; base += nblk * GEMV_WARPS) {
        const int row = base + warp;
        float acc = 0.0f;
        if (row < nrows) {
            const float4 *w = (const float4 *)(W + (size_t)row * ncols);
            for (int i = lane; i < ncols / 4; i += LE_WARP) {
                const float4 ww = le_ldg(w + i), xx = le_ldg((const float4 *)x + i);
                acc += ww.x * xx.x;
                acc += ww.y * xx.y;
                acc += ww.z * xx.z;
                acc += ww.w * xx.w;
            }
        }
        acc = le_warp_sum(acc, scratch);
        if (lane == 0 && row < nrows) y[row] = acc;
    }
}

extern "C" __global__ void gemv_f32_f32(const float *W, const float *x, float *y, int nrows, int ncols,
                                        LE_GEMV_MATS) {
    LE_SCRATCH(scratch, GEMV_THREADS);
    const le_gemv_mat g = le_gemv_mat_of(nrows, n_1, n_2, n_3, GEMV_WARPS);
    gemv_f32w((const float *)((const uint8_t *)W + LE_GEMV_PICK(g.m, 0LL, w_1, w_2, w_3)), x,
              y + LE_GEMV_PICK(g.m, 0LL, y_1, y_2, y_3), LE_GEMV_PICK(g.m, nrows, n_1, n_2, n_3), ncols, g.blk, g.nblk,
              scratch);
}

extern "C" __global__ void gemv_f32_f32_ids(const float *W, const float *x, float *y, int nrows, int ncols,
                                            const int *ids, long long expert_bytes, int x_group, int x_stride,
                                            long long w_z, long long y_z) {
    LE_SCRATCH(scratch, GEMV_THREADS);
    const int p = blockIdx.y;
    W = (const float *)((const uint8_t *)W + blockIdx.z * w_z);
    y += blockIdx.z * y_z;
    if (le_zero_skipped_pair(ids[p], y + (size_t)p * nrows, nrows)) return;
    gemv_f32w((const float *)((const uint8_t *)W + (size_t)ids[p] * expert_bytes),
              x + (size_t)(p / x_group) * x_stride, y + (size_t)p * nrows, nrows, ncols, blockIdx.x, gridDim.x,
              scratch);
}
