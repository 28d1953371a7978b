/* moe_sort.cu — a pass's routing in expert order, made on the GPU: the work list of the grouped expert GEMMs
 * (gemm_*_ids) without reading the routing back to the host, so the host never waits for it.
 *
 *   moe_sort(ids, n_pairs, k, n_expert, eids, ptok, pinv, tiles, max_tiles, counts, tile)
 *     ids: [n_pairs] int32, moe_route's [n_tok, k] flat, every id in [0, n_expert), n_expert <= MOE_SORT_MAX_E;
 *     out, with order = the pairs sorted by expert, stable (numpy argsort(kind="stable")):
 *       eids [n_pairs] = ids[order], ptok [n_pairs] = order / k (the token of each sorted pair),
 *       pinv [n_pairs]: pinv[order[q]] = q (where pair p went);
 *       tiles [max_tiles, 3] = (expert, first sorted pair, count <= tile) for each expert's run cut in pieces of
 *         `tile` pairs (1 .. MOE_SORT_MAX_TILE: the grouped GEMM's tokens per block, 32, or 64 for gemm_mma;
 *         gpu.Kernels.expert_tiles), then (0, 0, 0) up to max_tiles (an empty tile: the GEMM's block returns);
 *         max_tiles >= ceil(n_pairs / tile) + min(n_expert, n_pairs) (the launcher checks);
 *       counts [n_expert] int32 += the pairs of each expert (routing statistics, read when the pass is done).
 *     launch: block MOE_SORT_THREADS (256) x 1 x 1, grid 1 x 1 x 1
 * One block: per-expert counts by shared-memory atomics, an exclusive scan by one thread (n_expert steps),
 * then the pairs in chunks of 256 in order: a pair's rank among the chunk's earlier pairs of its expert by a
 * scan of the chunk's ids in shared memory, so the order is the stable one whatever the atomics' order.
 * ~n_pairs / 256 x 256 shared reads per thread (16,384 pairs: a few tens of µs).
 * Reference: numpy argsort(kind="stable") and gpu.Kernels.expert_tiles (tests/test_gpu.py test_moe_sort: equal).
 * Tiers: all (shared-memory atomicAdd on int: sm_12+).
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k moe_sort
 */
#include "compat.cuh"

#define MOE_SORT_THREADS 256
#define MOE_SORT_MAX_E 512 /* Qwen3.5 MoE: 256 (35B-A3B), 512 (397B) */
#define MOE_SORT_MAX_TILE 64 /* = the largest grouped GEMM tile (gemm_q8.cuh GEMM_MMA_TT) */

extern "C" __global__ void moe_sort(const int *LE_RESTRICT ids, int n_pairs, int k, int n_expert, int *eids, int *ptok,
                                    int *pinv, int *tiles, int max_tiles, int *counts, int tile) {
    __shared__ int cnt[MOE_SORT_MAX_E], fill[MOE_SORT_MAX_E], toff[MOE_SORT_MAX_E];
    __shared__ int chunk[MOE_SORT_THREADS];
    __shared__ int n_tiles;
    const int tid = threadIdx.x;
    for (int e = tid; e < n_expert; e += MOE_SORT_THREADS) cnt[e] = 0;
    __syncthreads();
    for (int p = tid; p < n_pairs; p += MOE_SORT_THREADS) atomicAdd(&cnt[ids[p]], 1);
    __syncthreads();
    if (tid == 0) { /* exclusive scans: first sorted pair and first tile of each expert */
        int at = 0, t = 0;
        for (int e = 0; e < n_expert; e++) {
            fill[e] = at;
            toff[e] = t;
            at += cnt[e];
            t += (cnt[e] + tile - 1) / tile;
        }
        n_tiles = t;
    }
    __syncthreads();
    /* tiles of each expert's run (fill[e] is still its first sorted pair), the empty ones after */
    for (int e = tid; e < n_expert; e += MOE_SORT_THREADS) {
        counts[e] += cnt[e];
        for (int j = 0; tile * j < cnt[e]; j++) {
            int *tl = tiles + 3 * (toff[e] + j);
            tl[0] = e;
            tl[1] = fill[e] + tile * j;
            tl[2] = min(tile, cnt[e] - tile * j);
        }
    }
    for (int t = n_tiles + tid; t < max_tiles; t += MOE_SORT_THREADS)
        tiles[3 * t] = tiles[3 * t + 1] = tiles[3 * t + 2] = 0;
    __syncthreads(); /* fill[] is read above before the placement moves it */
    for (int c0 = 0; c0 < n_pairs; c0 += MOE_SORT_THREADS) {
        const int p = c0 + tid;
        const int e = p < n_pairs ? ids[p] : -1;
        chunk[tid] = e;
        __syncthreads();
        if (e >= 0) {
            int r = 0; /* earlier pairs of this chunk with the same expert */
            for (int j = 0; j < tid; j++) r += chunk[j] == e;
            const int q = fill[e] + r;
            eids[q] = e;
            ptok[q] = p / k;
            pinv[p] = q;
        }
        __syncthreads(); /* every thread has read fill[] for this chunk */
        if (e >= 0) atomicAdd(&fill[e], 1);
        __syncthreads();
    }
}
