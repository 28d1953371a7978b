/* hybrid_sync.cu — the GPU's half of the hybrid decode's per-layer exchange with the CPU, through a channel in
 * page-locked host memory that both sides read and write directly (layout: native/include/le_hybrid.h).
 * No host step per layer: a whole decode token is one launch sequence (one CUDA graph), and the CPU serves
 * the layers as they come (native/hybrid.c le_hybrid_serve).
 *
 * Reference: the host-side version it replaces (gpu_model._ffn_hybrid before 2026-11-25e) and native/hybrid.c:
 *   hybrid_publish_f32(h, ids, w, pin_idx, n_link, meta, slot, chan, E, k)
 *     h: [E] device, the layer's normed input;  ids, w: [k] moe_route's choice (device);
 *     pin_idx: [n_expert] int32, expert -> its index among the layer's pinned experts, -1 where not pinned
 *       (NULL: none pinned);  n_link: how many of the experts not pinned (the first in slot order) the GPU reads
 *       in place from the host's page-locked weight map instead of leaving them to the CPU;
 *     meta: device [k gids | k lids | k lslots | 2k + 1 weights]: gids[s] = pin_idx[ids[s]]; lids[s] = ids[s] for
 *       the n_link experts read over the link, else -1, lslots[s] their rank 0..n_link-1 (their place in the
 *       link staging buffer, hybrid_fetch), else -1; weights[0] = 1 (the CPU's row), weights[1 + s] = w[s] where
 *       gids[s] >= 0, weights[1 + k + s] = w[s] where lids[s] >= 0, else 0 (the GEMVs skip ids < 0 and
 *       moe_combine sums rows 0..2k with these weights);
 *     slot: the layer's slot in the channel (host memory, device-visible): H, IDS, CPU_IDS (ids[s] where the
 *       CPU runs it, else -1), WTS, then READY = chan[SEQ] after a system-wide fence.
 *     launch: block HYBRID_THREADS (256) x 1 x 1, grid 1 x 1 x 1
 *   hybrid_wait_f32(slot, chan, row, E, k, max_cycles)      E % 4 == 0 (the row is copied in 16-byte words)
 *     spins (thread 0, volatile reads of host memory) until slot DONE == chan[SEQ], then row[E] (device) = the
 *     slot's ROW. Gives up after max_cycles clock cycles (the host failed or went away) and writes NaN rows, so a
 *     lost CPU shows as NaN logits and the stream is never stuck.
 *     launch: block HYBRID_THREADS (256) x 1 x 1, grid 1 x 1 x 1
 * Every access to the channel is volatile (the CPU writes it while kernels run: nothing may be cached).
 * Tiers: all (zero-copy reads and writes of page-locked memory and __threadfence_system are sm_20's; clock64
 * too). Needs unified addressing (64-bit host, every CUDA 8+ driver): gpu_model checks the device attribute.
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k hybrid_sync
 */
#include "compat.cuh"
#include "le_hybrid.h"

#define HYBRID_THREADS 256
#define HYBRID_FETCH_BLOCKS 64
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

extern "C" __global__ void hybrid_publish_f32(const float *LE_RESTRICT h, const int *LE_RESTRICT ids,
                                              const float *LE_RESTRICT w, const int *LE_RESTRICT pin_idx, int n_link,
                                              int *LE_RESTRICT meta, volatile int *slot, const volatile int *chan,
                                              int E, int k) {
    volatile float *sh = (volatile float *)(slot + LE_HY_H);
    for (int e = threadIdx.x; e < E; e += HYBRID_THREADS) sh[e] = h[e];
    if (threadIdx.x < k) {
        const int s = threadIdx.x, id = ids[s];
        const int g = pin_idx ? pin_idx[id] : -1;
        int rank = 0; /* experts not pinned in the slots before s */
        for (int j = 0; j < s; j++) rank += (pin_idx ? pin_idx[ids[j]] : -1) < 0;
        const int l = g < 0 && rank < n_link ? id : -1;
        float *mw = (float *)(meta + 3 * k);
        meta[s] = g;
        meta[k + s] = l;
        meta[2 * k + s] = l >= 0 ? rank : -1;
        mw[1 + s] = g >= 0 ? w[s] : 0.0f;
        mw[1 + k + s] = l >= 0 ? w[s] : 0.0f;
        if (s == 0) mw[0] = 1.0f;
        slot[LE_HY_IDS(E) + s] = id;
        slot[LE_HY_CPU_IDS(E, k) + s] = g >= 0 || l >= 0 ? -1 : id;
        ((volatile float *)slot)[LE_HY_WTS(E, k) + s] = w[s];
    }
    __threadfence_system(); /* this thread's channel writes reach host memory before READY does */
    __syncthreads();
    if (threadIdx.x == 0) slot[LE_HY_READY] = chan[LE_HY_SEQ];
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
