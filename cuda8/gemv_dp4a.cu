/* gemv_dp4a.cu — decode GEMV in int8: y = W xq, W quantised (W4A8 / W8A8), xq = x as Q8_1.
 *
 *   gemv_dp4a_<type>(W, xq, y, nrows, ncols, w_1, y_1, n_1, w_2, y_2, n_2, w_3, y_3, n_3)
 *     type: q4_0 q8_0 q4_K q5_K q6_K iq4_xs
 *     W: [nrows, ncols] rows of quant blocks (as gemv_f32.cu), xq: [ncols/32] block_q8_1 in the
 *     GPU layout of quantize_q8_1.cu (d, s = sum of x), y: [nrows] f32
 *     up to GEMV_MAX_MATS (4) matrices of the same type and width on the same input in one launch (GDN's qkv,
 *     z, beta and alpha; a SwiGLU's gate and up): matrix m > 0 is n_m rows at W + w_m (bytes, may be negative)
 *     into y + y_m (floats); n_1 = 0: one matrix (quants.cuh LE_GEMV_MATS, le_gemv_mat_of)
 *     launch: block GEMV_THREADS (128 = 4 warps) x 1 x 1; one matrix: grid min(ceil(nrows/4), 65535) x 1 x 1
 *     (rows grid-strided); several: grid sum of ceil(rows_m/4) x 1 x 1 (their blocks one after another, <= 65535)
 *   gemv_dp4a_<type>_ids(W, xq, y, nrows, ncols, ids, expert_bytes, x_group, x_stride, w_z, y_z)
 *     the MoE form (as gemv_f32.cu's): grid.y = pairs p; expert ids[p], activation blocks
 *     xq + (p / x_group) * x_stride (x_stride in Q8_1 blocks), output y + p * nrows; ids[p] < 0: row zero;
 *     grid.z = 2: every expert's second matrix at the same offset w_z from its first (a SwiGLU's up)
 * Per 32-element sub-block s (weights decoded by quants.cuh to y = d[h]*q - m) against Q8_1
 * block s (values d8*q8):
 *     d8 * (d[0] * sum_{j<16} q*q8 + d[1] * sum_{j>=16} q*q8) - m * s8
 * with the integer sums by le_dp4a (__dp4a from sm_61, a byte loop below) and the min term of
 * Q4_K/Q5_K from s8 = sum of the original x (as ggml-cuda's mmvq does).
 * Reference (tests/test_gpu.py): dequantised W (le_dequantize_row) times dequantised xq, plus
 * m * (d8*sum q8 - s8) per sub-block; exact in integers, only f32 rounding of the per-block
 * terms differs (tests/tolerances.py GPU_GEMV_F32_REL).
 * Tiers: all; dp4a is the one it is written for, kepler/fermi run the same math in byte loops.
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k gemv_dp4a
 */
#include "quants.cuh"

#define GEMV_THREADS 128
#define GEMV_WARPS (GEMV_THREADS / LE_WARP)

template <class T>
__device__ __forceinline__ void gemv_dp4a(const uint8_t *LE_RESTRICT W, const block_q8_1 *LE_RESTRICT xq,
                                          float *LE_RESTRICT y, int nrows, int ncols, int blk, int nblk,
                                          float *scratch) {
    const int lane = threadIdx.x % LE_WARP, warp = threadIdx.x / LE_WARP;
    const int nsub = ncols / 32;
    const size_t row_bytes = le_row_bytes<T>(ncols);
    for (int base = blk * GEMV_WARPS; base < nrows; base += nblk * GEMV_WARPS) {
        const int row = base + warp;
        float acc = 0.0f;
        if (row < nrows) {
            const uint8_t *w = W + (size_t)row * row_bytes;
            for (int s = lane; s < nsub; s += LE_WARP) {
                le_q32 b;
                T::decode(w, s, b);
                const block_q8_1 *a = xq + s;
                const int *aq = (const int *)a->qs; /* 4-aligned: blocks are 36 bytes */
                int lo = 0, hi = 0;
#pragma unroll
                for (int k = 0; k < 4; k++) lo = le_dp4a(b.q[k], le_ldg(aq + k), lo);
#pragma unroll
                for (int k = 4; k < 8; k++) hi = le_dp4a(b.q[k], le_ldg(aq + k), hi);
                const float d8 = le_ldg_half(&a->d), s8 = le_ldg_half(&a->s);
                acc += d8 * (b.d[0] * (float)lo + b.d[1] * (float)hi) - b.m * s8;
            }
        }
        acc = le_warp_sum(acc, scratch);
        if (lane == 0 && row < nrows) y[row] = acc;
    }
}

#define LE_GEMV_DP4A(name, T)                                                                             \
    extern "C" __global__ void name(const uint8_t *W, const block_q8_1 *xq, float *y, int nrows,          \
                                    int ncols, LE_GEMV_MATS) {                                            \
        LE_SCRATCH(scratch, GEMV_THREADS);                                                                \
        const le_gemv_mat g = le_gemv_mat_of(nrows, n_1, n_2, n_3, GEMV_WARPS);                           \
        gemv_dp4a<T>(W + LE_GEMV_PICK(g.m, 0LL, w_1, w_2, w_3), xq,                                       \
                     y + LE_GEMV_PICK(g.m, 0LL, y_1, y_2, y_3), LE_GEMV_PICK(g.m, nrows, n_1, n_2, n_3), ncols, \
                     g.blk, g.nblk, scratch);                                                             \
    }

LE_GEMV_DP4A(gemv_dp4a_q4_0, le_t_q4_0)
LE_GEMV_DP4A(gemv_dp4a_q8_0, le_t_q8_0)
LE_GEMV_DP4A(gemv_dp4a_q4_K, le_t_q4_K)
LE_GEMV_DP4A(gemv_dp4a_q5_K, le_t_q5_K)
LE_GEMV_DP4A(gemv_dp4a_q6_K, le_t_q6_K)
LE_GEMV_DP4A(gemv_dp4a_iq4_xs, le_t_iq4_xs)

#define LE_GEMV_DP4A_IDS(name, T)                                                                         \
    extern "C" __global__ void name(const uint8_t *W, const block_q8_1 *xq, float *y, int nrows,          \
                                    int ncols, const int *ids, long long expert_bytes, int x_group,       \
                                    int x_stride, long long w_z, long long y_z) {                         \
        LE_SCRATCH(scratch, GEMV_THREADS);                                                                \
        const int p = blockIdx.y;                                                                         \
        W += blockIdx.z * w_z;                                                                            \
        y += blockIdx.z * y_z;                                                                            \
        if (le_zero_skipped_pair(ids[p], y + (size_t)p * nrows, nrows)) return;                           \
        gemv_dp4a<T>(W + (size_t)ids[p] * expert_bytes, xq + (size_t)(p / x_group) * x_stride,            \
                     y + (size_t)p * nrows, nrows, ncols, blockIdx.x, gridDim.x, scratch);                \
    }

LE_GEMV_DP4A_IDS(gemv_dp4a_q4_0_ids, le_t_q4_0)
LE_GEMV_DP4A_IDS(gemv_dp4a_q8_0_ids, le_t_q8_0)
LE_GEMV_DP4A_IDS(gemv_dp4a_q4_K_ids, le_t_q4_K)
LE_GEMV_DP4A_IDS(gemv_dp4a_q5_K_ids, le_t_q5_K)
LE_GEMV_DP4A_IDS(gemv_dp4a_q6_K_ids, le_t_q6_K)
LE_GEMV_DP4A_IDS(gemv_dp4a_iq4_xs_ids, le_t_iq4_xs)
