/* gemm_tile.cuh — the token tile of a prefill GEMM block, for gemm_f32.cu and gemm_dp4a.cu.
 *
 * A block computes rows x tokens of Y; its tokens are [t0, t0 + n) of the activation rows and its weights those
 * of expert e (W + e * expert_bytes; e = 0 for the plain GEMM). The tile lives in shared memory and is read where it
 * is used rather than held in registers (Fermi's 63 are all taken by the accumulators and the staging).
 *   plain GEMM over ntok tokens:  block y takes tokens [tt * y, tt * y + tt) clipped to ntok
 *   grouped (_ids) GEMM:          block y takes tiles[y] = (expert, first pair, count <= tt); count 0: an empty tile
 *                                 (moe_sort.cu pads its list to a fixed length): the block has nothing to do
 * Both set the tile by thread 0 and synchronise the block: every thread must call them.
 */
#ifndef LE_GEMM_TILE_CUH
#define LE_GEMM_TILE_CUH

#include "compat.cuh"

struct le_gemm_tile {
    int e, t0, n;
};

__device__ __forceinline__ void le_gemm_tile_plain(le_gemm_tile &tl, int ntok, int tt) {
    if (threadIdx.x == 0) {
        tl.e = 0;
        tl.t0 = blockIdx.y * tt;
        tl.n = min(tt, ntok - tl.t0);
    }
    __syncthreads();
}

/* The block's weights: expert tl.e's matrix */
__device__ __forceinline__ const uint8_t *le_gemm_weights(const uint8_t *W, const le_gemm_tile &tl,
                                                          long long expert_bytes) {
    return W + (size_t)tl.e * (size_t)expert_bytes;
}

/* -> whether the tile has tokens (uniform over the block) */
__device__ __forceinline__ bool le_gemm_tile_ids(le_gemm_tile &tl, const int *tiles) {
    if (threadIdx.x == 0) {
        tl.e = tiles[3 * blockIdx.y];
        tl.t0 = tiles[3 * blockIdx.y + 1];
        tl.n = tiles[3 * blockIdx.y + 2];
    }
    __syncthreads();
    return tl.n > 0;
}

#endif
