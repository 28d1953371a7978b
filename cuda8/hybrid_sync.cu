/* hybrid_sync.cu — the GPU's half of the hybrid decode's per-layer exchange with the CPU, through a channel in
 * page-locked host memory that both sides read and write directly (layout: native/include/le_hybrid.h).
 * No host step per layer: a whole decode token is one launch sequence (one CUDA graph), and the CPU serves
 * the layers as they come (native/hybrid.c le_hybrid_serve).
 *
 * Reference: the host-side version it replaces (the GPU model's _ffn_hybrid before 2026-11-25e) and native/hybrid.c:
 *   hybrid_publish_f32(h, ids, w, pin_idx, extra_idx, n_link, pred, n_early, meta, slot, chan, E, k)   k <= 32
 *     h: [E] device, the layer's normed input;  ids, w: [k] moe_route's choice (device);
 *     pin_idx: [n_expert] int32, expert -> its index among the layer's pinned experts, -1 where not pinned
 *       (NULL: none pinned);  extra_idx: [n_expert] int32, expert -> its place among the layer's decode extras
 *       (experts not pinned that the decode finds in VRAM: the staging holds them between prefills), -1 where not
 *       there (NULL: none): the GPU runs them from staging slot n_link + n_early + that place;
 *       n_link: how many of the experts neither pinned nor extra (the first in slot order) the GPU reads
 *       in place from the host's page-locked weight map instead of leaving them to the CPU (beside the early ones);
 *     meta: device [k gids | k lids | k lslots | k fids | k eids | 2k + 1 weights]: gids[s] = pin_idx[ids[s]];
 *       lids[s] = ids[s] for the experts the GPU runs from the link staging, else -1: the n_link fetched now
 *       (fids[s] = ids[s], lslots[s] = their rank 0..n_link-1: hybrid_fetch copies them there from the host) and
 *       the early ones (n_early > 0, the slot's EARLY_READY == SEQ and ids[s] in its EARLY: eids[s] = their place
 *       r there, where the CPU copied them; lslots[s] = n_link + r: hybrid_fetch copies them there from the
 *       early buffer) and the extras (lslots[s] = n_link + n_early + extra_idx[ids[s]], nothing to copy), else -1;
 *       an expert is pinned, else extra, else early, else fetched; weights[0] = 1 (the CPU's row),
 *       weights[1 + s] = w[s] where
 *       gids[s] >= 0, weights[1 + k + s] = w[s] where lids[s] >= 0, else 0 (the GEMVs skip ids < 0 and
 *       moe_combine sums rows 0..2k with these weights);
 *     slot: the layer's slot in the channel (host memory, device-visible): H, IDS, CPU_IDS (ids[s] where the
 *       CPU runs it, else -1), WTS, then READY = chan[SEQ] after a system-wide fence.
 *     launch: block HYBRID_THREADS (256) x 1 x 1, grid 1 x 1 x 1
 *     pred: device int32 [LE_HY_PRED_MAX], this layer's lookahead prediction (hybrid_predict_publish during the
 *       layer before), or NULL: with it the n_link experts fetched over the link are the ones predicted last (not
 *       predicted at all first; ties: the later slot), the CPU having prefetched those predicted first; without
 *       it, the first n_link experts not pinned in slot order.
 *   hybrid_predict_f32(R, h, s, logits, ne, E)           the lookahead's router: logits[e] = sum_c R[e, c] h[c] s[c]
 *     R: [ne, E] f32 (the next MoE layer's router), h: [E] this layer's normed FFN input, s: [E] the next layer's
 *     post-attention norm / this layer's (h rescaled to the next layer's norm).
 *     launch: block HYBRID_THREADS (256: a warp per row) x 1 x 1, grid ceil(ne / 8) x 1 x 1
 *   hybrid_predict_publish_i32(logits, ne, n_pred, pin_idx, pred, slot, chan, E, k)   ne <= HYBRID_PRED_E
 *     the n_pred (<= LE_HY_PRED_MAX) largest logits' experts, largest first (ties: the lower index; NaN: never),
 *     into pred (device) and the slot's PRED (-1 where pin_idx[e] >= 0: pinned on the GPU; the rest -1), then
 *     PRED_READY = chan[SEQ] after a system-wide fence.
 *     launch: block HYBRID_THREADS (256) x 1 x 1, grid 1 x 1 x 1
 *   hybrid_wait_f32(slot, chan, row, E, k, max_cycles)      E % 4 == 0 (the row is copied in 16-byte words)
 *     spins (thread 0, volatile reads of host memory) until slot DONE == chan[SEQ], then row[E] (device) = the
 *     slot's ROW. Gives up after max_cycles clock cycles (the host failed or went away) and writes NaN rows, so a
 *     lost CPU shows as NaN logits and the stream is never stuck.
 *     launch: block HYBRID_THREADS (256) x 1 x 1, grid 1 x 1 x 1
 * Every access to the channel is volatile (the CPU writes it while kernels run: nothing may be cached).
 * Tiers: all (zero-copy reads and writes of page-locked memory and __threadfence_system are sm_20's; clock64
 * too). Needs unified addressing (64-bit host, every CUDA 8+ driver): legacy_engine/gpu checks the device attribute.
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k hybrid_sync
 */
#include "compat.cuh"
#include "le_hybrid.h"

#define HYBRID_THREADS 256
#define HYBRID_FETCH_BLOCKS 64
#define HYBRID_PRED_E 1024 /* the most experts hybrid_predict_publish ranks (shared memory, 4 KiB) */
#define HYBRID_K_MAX 32 /* experts per token hybrid_publish handles (= MOE_MAX_K) */
#define HYBRID_PRED_SLOTS 32 /* = LE_HY_PRED_MAX, spelled out for the shared array (tests/lint_cuda8.py sizes it) */
#if HYBRID_PRED_SLOTS != LE_HY_PRED_MAX
#error HYBRID_PRED_SLOTS must equal LE_HY_PRED_MAX
#endif
#define HYBRID_ROW_LOADS 4 /* 16-byte loads in flight per thread in hybrid_wait's copy (E <= 4096 in one round) */

/* A volatile 16-byte load (the channel's memory changes under the kernel; p 16-byte aligned). */
__device__ __forceinline__ float4 le_ld_volatile_f4(const float *p) {
    float4 v;
    asm volatile("ld.volatile.global.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}

/* Where expert id stands in a lookahead prediction: its place, or LE_HY_PRED_MAX when not predicted. */
__device__ __forceinline__ int pred_rank(const int *pred, int id) {
    for (int r = 0; r < LE_HY_PRED_MAX; r++)
        if (pred[r] == id) return r;
    return LE_HY_PRED_MAX;
}

extern "C" __global__ void hybrid_publish_f32(const float *LE_RESTRICT h, const int *LE_RESTRICT ids,
                                              const float *LE_RESTRICT w, const int *LE_RESTRICT pin_idx,
                                              const int *LE_RESTRICT extra_idx, int n_link,
                                              const int *LE_RESTRICT pred, int n_early, int *LE_RESTRICT meta,
                                              volatile int *slot, const volatile int *chan, int E, int k) {
    /* per slot: pin index, place among the early experts, place among the extras */
    __shared__ int sg[HYBRID_K_MAX], se[HYBRID_K_MAX], sx[HYBRID_K_MAX];
    volatile float *sh = (volatile float *)(slot + LE_HY_H);
    for (int e = threadIdx.x; e < E; e += HYBRID_THREADS) sh[e] = h[e];
    const int seq = chan[LE_HY_SEQ];
    if (threadIdx.x < k) {
        const int s = threadIdx.x, id = ids[s];
        sg[s] = pin_idx ? pin_idx[id] : -1;
        sx[s] = sg[s] < 0 && extra_idx ? extra_idx[id] : -1;
        se[s] = -1;
        if (sg[s] < 0 && sx[s] < 0 && n_early > 0 && slot[LE_HY_EARLY_READY(E, k)] == seq) /* copied in time */
            for (int r = 0; r < n_early; r++)
                if (slot[LE_HY_EARLY(E, k) + r] == id) se[s] = r;
    }
    __syncthreads();
    if (threadIdx.x < k) {
        const int s = threadIdx.x, id = ids[s], g = sg[s], er = se[s], x = sx[s];
        /* rank among the experts neither pinned, extra nor copied early: by slot (no prediction), or least
         * predicted first */
        int rank = 0;
        if (pred) {
            const int key = pred_rank(pred, id) * 64 + s; /* k <= 32 < 64 */
            for (int j = 0; j < k; j++)
                if (j != s && sg[j] < 0 && se[j] < 0 && sx[j] < 0) rank += pred_rank(pred, ids[j]) * 64 + j > key;
        } else {
            for (int j = 0; j < s; j++) rank += sg[j] < 0 && se[j] < 0 && sx[j] < 0;
        }
        const int fetch = g < 0 && er < 0 && x < 0 && rank < n_link;
        const int l = er >= 0 || x >= 0 || fetch ? id : -1;
        float *mw = (float *)(meta + 5 * k);
        meta[s] = g;
        meta[k + s] = l;
        meta[2 * k + s] = er >= 0 ? n_link + er : x >= 0 ? n_link + n_early + x : fetch ? rank : -1;
        meta[3 * k + s] = fetch ? id : -1;
        meta[4 * k + s] = er;
        mw[1 + s] = g >= 0 ? w[s] : 0.0f;
        mw[1 + k + s] = l >= 0 ? w[s] : 0.0f;
        if (s == 0) mw[0] = 1.0f;
        slot[LE_HY_IDS(E) + s] = id;
        slot[LE_HY_CPU_IDS(E, k) + s] = g >= 0 || l >= 0 ? -1 : id;
        ((volatile float *)slot)[LE_HY_WTS(E, k) + s] = w[s];
    }
    __threadfence_system(); /* this thread's channel writes reach host memory before READY does */
    __syncthreads();
    if (threadIdx.x == 0) slot[LE_HY_READY] = seq;
}

extern "C" __global__ void hybrid_predict_f32(const float *LE_RESTRICT R, const float *LE_RESTRICT h,
                                              const float *LE_RESTRICT s, float *LE_RESTRICT logits, int ne, int E) {
    LE_SCRATCH(scratch, HYBRID_THREADS);
    const int lane = threadIdx.x % LE_WARP;
    const int e = blockIdx.x * (HYBRID_THREADS / LE_WARP) + threadIdx.x / LE_WARP;
    float acc = 0.0f;
    if (e < ne) { /* no early return: the fermi tier's warp sum needs every thread at its barriers */
        const float *r = R + (long long)e * E;
        for (int c = lane; c < E; c += LE_WARP) acc += le_ldg(r + c) * (le_ldg(h + c) * le_ldg(s + c));
    }
    acc = le_warp_sum(acc, scratch);
    if (e < ne && lane == 0) logits[e] = acc;
}

extern "C" __global__ void hybrid_predict_publish_i32(const float *LE_RESTRICT logits, int ne, int n_pred,
                                                      const int *LE_RESTRICT pin_idx, int *LE_RESTRICT pred,
                                                      volatile int *slot, const volatile int *chan, int E, int k) {
    __shared__ float ls[HYBRID_PRED_E];
    __shared__ int ps[HYBRID_PRED_SLOTS];
    for (int e = threadIdx.x; e < ne; e += HYBRID_THREADS) ls[e] = logits[e];
    if (threadIdx.x < LE_HY_PRED_MAX) ps[threadIdx.x] = -1;
    __syncthreads();
    for (int e = threadIdx.x; e < ne; e += HYBRID_THREADS) {
        const float v = ls[e];
        if (v != v) continue; /* NaN: no rank */
        int rank = 0;
        for (int j = 0; j < ne; j++) {
            const float q = ls[j];
            rank += q > v || (q == v && j < e);
        }
        if (rank < n_pred) ps[rank] = pin_idx && pin_idx[e] >= 0 ? -1 : e;
    }
    __syncthreads();
    if (threadIdx.x < LE_HY_PRED_MAX) {
        pred[threadIdx.x] = ps[threadIdx.x];
        slot[LE_HY_PRED(E, k) + threadIdx.x] = ps[threadIdx.x];
    }
    __threadfence_system(); /* PRED reaches host memory before PRED_READY does */
    __syncthreads();
    if (threadIdx.x == 0) slot[LE_HY_PRED_READY(E, k)] = chan[LE_HY_SEQ];
}

extern "C" __global__ void hybrid_fetch_u8(const int *LE_RESTRICT lids, const int *LE_RESTRICT lslots, int k,
                                           const uint4 *src0, uint4 *dst0, long long eb0, const uint4 *src1,
                                           uint4 *dst1, long long eb1, const uint4 *src2, uint4 *dst2, long long eb2) {
    const int s = blockIdx.y, t = blockIdx.z;
    const int id = lids[s];
    const long long eb = t == 0 ? eb0 : t == 1 ? eb1 : eb2;
    if (id < 0 || eb <= 0) return;
    const long long n = eb / 16;
    const uint4 *src = (t == 0 ? src0 : t == 1 ? src1 : src2) + (long long)id * n;
    uint4 *dst = (t == 0 ? dst0 : t == 1 ? dst1 : dst2) + (long long)lslots[s] * n;
    const long long step = (long long)HYBRID_FETCH_BLOCKS * HYBRID_THREADS;
    long long i = (long long)blockIdx.x * HYBRID_THREADS + threadIdx.x;
    for (; i + 3 * step < n; i += 4 * step) { /* four independent loads before the stores */
        const uint4 a = src[i], b = src[i + step], c = src[i + 2 * step], d = src[i + 3 * step];
        dst[i] = a;
        dst[i + step] = b;
        dst[i + 2 * step] = c;
        dst[i + 3 * step] = d;
    }
    for (; i < n; i += step) dst[i] = src[i];
}

extern "C" __global__ void hybrid_wait_f32(const volatile int *slot, const volatile int *chan,
                                           float *LE_RESTRICT row, int E, int k, long long max_cycles) {
    __shared__ int ok;
    if (threadIdx.x == 0) {
        const int seq = chan[LE_HY_SEQ];
        const long long t0 = clock64();
        ok = 1;
        while (slot[LE_HY_DONE] != seq) {
            if (clock64() - t0 > max_cycles) {
                ok = 0;
                break;
            }
        }
        __threadfence(); /* the row is read after DONE was seen */
    }
    __syncthreads();
    /* the row crosses the bus: each thread issues all its loads (16-byte words) before any store, so the copy
     * costs one round trip of the bus, not one per element a thread holds (a load then its store: 8 round trips
     * a layer at E = 2048) */
    const float *src = (const float *)(slot + LE_HY_ROW(E, k));
    float4 *row4 = (float4 *)row;
    const int n4 = E / 4;
    float4 nan4;
    nan4.x = nan4.y = nan4.z = nan4.w = __int_as_float(0x7fc00000);
    for (int base = threadIdx.x; base < n4; base += HYBRID_ROW_LOADS * HYBRID_THREADS) {
        float4 v[HYBRID_ROW_LOADS];
#pragma unroll
        for (int u = 0; u < HYBRID_ROW_LOADS; u++) {
            const int i = base + u * HYBRID_THREADS;
            if (i < n4) v[u] = le_ld_volatile_f4(src + 4 * i);
        }
#pragma unroll
        for (int u = 0; u < HYBRID_ROW_LOADS; u++) {
            const int i = base + u * HYBRID_THREADS;
            if (i < n4) row4[i] = ok ? v[u] : nan4;
        }
    }
}
