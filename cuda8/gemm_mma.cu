/* gemm_mma.cu — the int8 prefill GEMM on tensor cores (sm_75+): gemm_dp4a.cu's products by mma.sync.
 *
 *   gemm_mma_<type>(W, xq, Y, nrows, ncols, ntok)            as gemm_dp4a_<type>   type: q4_0 q8_0 q4_K q5_K q6_K iq4_xs
 *     but GEMM_MMA_TT (64) tokens per block: grid min(ceil(nrows/GEMM_ROWS), 65535) x ceil(ntok/GEMM_MMA_TT) x 1
 *   gemm_mma32_<type>(same)   the plain form with GEMM_TT (32) tokens a block (grid y: ceil(ntok / 32))
 *   gemm_mma_<type>_multi, gemm_mma32_<type>_multi(W0..W3, xq, Y0..Y3, n0..n3, ncols, ntok)   up to four matrices
 *     on the same xq in one launch (gemm_q8.cuh LE_GEMM_Q8_MULTI): grid sum ceil(n_m / GEMM_ROWS) x ceil(ntok / TT)
 *   gemm_mma_<type>_ids(W, xq, Y, nrows, ncols, tiles, expert_bytes)   as gemm_dp4a_<type>_ids, but tiles of up
 *     to GEMM_MMA_TT (64) pairs (moe_sort / expert_tiles with tile = 64)
 *     same arguments, block (GEMM_THREADS x 1 x 1) and shared memory (gemm_q8.cuh), staged a step ahead
 *     (gemm_q8_fetch / gemm_q8_put: the next step's loads in flight while this one's products run; not Q6_K's
 *     64-token form, see gemm_mma)
 * Compute: warp w owns rows 16w .. 16w+15 of the tile and all its TT tokens, as TT/8 16 x 8 mma tiles; per
 * sub-block one le_mma_s8_16x8x32 per token group (two le_mma_s8_16x8x16 for Q6_K: elements 0-15 and 16-31 have
 * their own scales) gives the integer sums exactly as gemm_dp4a's dp4a loops do, and the f32 update is
 * gemm_q8.cuh's: the output equals gemm_dp4a's bit for bit. Lane (g = lane / 4, t = lane % 4) holds rows
 * 16w + g, 16w + g + 8 and tokens 8j + 2t, 8j + 2t + 1 (j < TT/8): the mma accumulator layout.
 * Per sub-block and warp: 8 mma (16 x 8 x 32) from 20 shared words per lane, against 128 dp4a from 64 words
 * per lane in gemm_dp4a.
 * Only where compat.cuh's LE_HAS_MMA_INT8 (dp4a tier at compute_75+, CUDA 10.1+): below that this file holds
 * no kernel (the capability table, gpu.Kernels.has_mma, never asks for one). Fermi/Kepler/Pascal/Volta run
 * gemm_dp4a; a card whose tensor cores are throttled (CMP 100-210: sm_70) has none here either.
 * Reference (tests/test_gpu.py test_gemm_mma): gemm_dp4a of the same variant, bit for bit, plain and _ids.
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k gemm_mma
 */
#include "gemm_q8.cuh"

#if LE_HAS_MMA_INT8

/* acc[j][c] += sub-block sb's term for the lane's rows (c < 2: 16w + g, else + 8) and tokens 8j + 2t + c % 2:
 * the whole sub-block's sums from one k = 32 product where the type has one scale, its two halves' from two k = 16
 * products where it has two (Q6_K) */
template <class T, int TT>
__device__ __forceinline__ void gemm_mma_sub(const gemm_q8_smem<TT> &sm, int r, int g, int t, int sb,
                                             float (*acc)[4]) {
    const int2 a0 = *(const int2 *)&sm.wq[r][8 * sb + 2 * t];     /* words t, t + 4 (gemm_q8_slot) of row r */
    const int2 a1 = *(const int2 *)&sm.wq[r + 8][8 * sb + 2 * t]; /* and of row r + 8 */
    const float2 d0 = sm.wd[r][sb], d1 = sm.wd[r + 8][sb];
    const float m0 = sm.wm[r][sb], m1 = sm.wm[r + 8][sb];
#pragma unroll
    for (int j = 0; j < TT / 8; j++) {
        const int2 b = *(const int2 *)&sm.xq[8 * j + g][8 * sb + 2 * t];
        int lo[4], hi[4] = {0, 0, 0, 0}; /* offset sums (gemm_q8_term) */
        if (T::TWO_SCALES) {
            le_mma_s8_16x8x16(lo, a0.x, a1.x, b.x, GEMM_Q8_MAGIC);
            le_mma_s8_16x8x16(hi, a0.y, a1.y, b.y, GEMM_Q8_MAGIC);
        } else {
            le_mma_s8_16x8x32(lo, a0.x, a1.x, a0.y, a1.y, b.x, b.y, GEMM_Q8_MAGIC);
        }
        const float4 x = sm.xd[sb][4 * j + t]; /* (d8, s8) of tokens 8j + 2t and 8j + 2t + 1 */
        const float2 x0 = make_float2(x.x, x.y), x1 = make_float2(x.z, x.w);
        acc[j][0] = gemm_q8_acc<T>(acc[j][0], x0, gemm_q8_term<T>(d0, lo[0], hi[0]), m0);
        acc[j][1] = gemm_q8_acc<T>(acc[j][1], x1, gemm_q8_term<T>(d0, lo[1], hi[1]), m0);
        acc[j][2] = gemm_q8_acc<T>(acc[j][2], x0, gemm_q8_term<T>(d1, lo[2], hi[2]), m1);
        acc[j][3] = gemm_q8_acc<T>(acc[j][3], x1, gemm_q8_term<T>(d1, lo[3], hi[3]), m1);
    }
}

/* a step's sub-blocks into the warp's accumulators (gemm_q8_steps' consumer) */
template <class T, int TT>
struct gemm_mma_steps {
    int r, g, t;
    float (*acc)[4];
    __device__ __forceinline__ void operator()(const gemm_q8_smem<TT> &sm, int sb) {
        gemm_mma_sub<T, TT>(sm, r, g, t, sb, acc);
    }
};

template <class T, int TT>
__device__ __forceinline__ void gemm_mma(const uint8_t *LE_RESTRICT W, const block_q8_1 *LE_RESTRICT xq,
                                         float *LE_RESTRICT Y, int nrows, int ncols, const le_gemm_tile &tl,
                                         long long expert_bytes, gemm_q8_smem<TT> &sm, int rt, int rs) {
    /* staged a step ahead (gemm_q8_fetch) but where a 64-token block's fetch registers would spill under its bound
     * of 128 (Q6_K's four raw words a pair: 120-184 bytes of spills; it stages synchronously there) */
    const bool AHEAD = TT == GEMM_TT || sizeof(typename T::qraw_t) <= sizeof(int2);
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int r = 16 * (threadIdx.x / 32) + g; /* the lane's first row in the tile; the second is r + 8 */
    const int nsub = ncols / 32;
    const size_t row_bytes = le_row_bytes<T>(ncols);
    for (int r0 = rt * GEMM_ROWS; r0 < nrows; r0 += rs * GEMM_ROWS) {
        float acc[TT / 8][4];
#pragma unroll
        for (int j = 0; j < TT / 8; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[j][c] = 0.0f;
        gemm_mma_steps<T, TT> sub = {r, g, t, acc};
        gemm_q8_steps<T, TT, AHEAD>(W, expert_bytes, xq, nrows, nsub, row_bytes, r0, tl, sm, sub);
#pragma unroll
        for (int j = 0; j < TT / 8; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int tok = 8 * j + 2 * t + c % 2, row = r0 + r + 8 * (c / 2);
                if (tok < tl.n && row < nrows) Y[(size_t)(tl.t0 + tok) * nrows + row] = acc[j][c];
            }
    }
}

/* The 64-token form held to two blocks an SM (128 registers): its grids have more blocks than SMs */
#define LE_GEMM_MMA(name, T) LE_GEMM_Q8_KERNELS(name, gemm_mma, T, GEMM_MMA_TT, __launch_bounds__(GEMM_THREADS, 2))

/* gemm_mma32_<type>: the plain GEMM with GEMM_TT (32) tokens a block, for grids that the 64-token tiles leave short of
 * one block an SM (a 512-token pass's 1024-row projections on an H200: 64 blocks for 132 SMs); the launcher chooses
 * (Kernels.gemm_mma). A row's sums run in the same order whatever the tile: the same bits. */
#define LE_GEMM_MMA32(name, T)                                                                                 \
    LE_GEMM_Q8_PLAIN(name, gemm_mma, T, GEMM_TT, LE_GEMM_NO_ATTR)                                              \
    LE_GEMM_Q8_MULTI(name, gemm_mma, T, GEMM_TT, LE_GEMM_NO_ATTR)

LE_GEMM_MMA(gemm_mma_q4_0, le_t_q4_0)
LE_GEMM_MMA(gemm_mma_q8_0, le_t_q8_0)
LE_GEMM_MMA(gemm_mma_q4_K, le_t_q4_K)
LE_GEMM_MMA(gemm_mma_q5_K, le_t_q5_K)
LE_GEMM_MMA(gemm_mma_q6_K, le_t_q6_K)
LE_GEMM_MMA(gemm_mma_iq4_xs, le_t_iq4_xs)
LE_GEMM_MMA32(gemm_mma32_q4_0, le_t_q4_0)
LE_GEMM_MMA32(gemm_mma32_q8_0, le_t_q8_0)
LE_GEMM_MMA32(gemm_mma32_q4_K, le_t_q4_K)
LE_GEMM_MMA32(gemm_mma32_q5_K, le_t_q5_K)
LE_GEMM_MMA32(gemm_mma32_q6_K, le_t_q6_K)
LE_GEMM_MMA32(gemm_mma32_iq4_xs, le_t_iq4_xs)

#endif
