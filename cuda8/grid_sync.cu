/* grid_sync.cu — le_grid_sync (grid_sync.cuh) under test and under the clock.
 *
 *   grid_sync_check_u32(bar, cells, rounds)   cells: uint32 [gridDim.x], zero before; in each of `rounds` rounds block b
 *     adds 1 to its cell, meets the grid, then checks that every cell holds the round's count (a block past the
 *     barrier before another arrived would see an old count) and counts each mismatch into cells[gridDim.x] ...
 *     the caller reads the extra word: 0 mismatches means every barrier held.
 *     launch: block GRID_SYNC_THREADS (128) x 1 x 1, grid n x 1 x 1 with n blocks co-resident, cells [n + 1]
 *   grid_sync_time_u32(bar, rounds)          `rounds` barriers and nothing else: the cost of one, timed by the caller
 *     launch: as above
 *   grid_sync_stream_u32(bar, src, n16, phases, sink)   a fused step's skeleton: `phases` phases, each reading its own
 *     n16 x 16 bytes of src (uint4 [phases x n16], distinct so that no phase hits the cache behind another) over the
 *     grid, one barrier after each; sink [1] is written only if the sum is a value no input gives (keeps the loads).
 *     Its bytes over its time against one phase of them all: what the barriers cost a weight stream.
 *     launch: as above
 *   grid_sync_stream_ahead_u32(...)   the same with GRID_SYNC_AHEAD uint4 a thread of the next phase loaded before
 *     each barrier and used after it (the form a fused step takes: weights do not wait for the phase before)
 * Tiers: all.
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k grid_sync
 */
#include "grid_sync.cuh"

#define GRID_SYNC_THREADS 128
#define GRID_SYNC_AHEAD 4   /* uint4 a thread of the next phase in flight across a barrier */

extern "C" __global__ void grid_sync_check_u32(unsigned *bar, unsigned *cells, int rounds) {
    const unsigned n = gridDim.x;
    for (int r = 1; r <= rounds; r++) {
        if (threadIdx.x == 0) atomicAdd(cells + blockIdx.x, 1u);
        le_grid_sync(bar, n);
        for (unsigned c = threadIdx.x; c < n; c += GRID_SYNC_THREADS)
            if (((volatile unsigned *)cells)[c] != (unsigned)r) atomicAdd(cells + n, 1u);
        le_grid_sync(bar, n); /* every block has checked round r before any adds for round r + 1 */
    }
}

extern "C" __global__ void grid_sync_time_u32(unsigned *bar, int rounds) {
    for (int r = 0; r < rounds; r++) le_grid_sync(bar, gridDim.x);
}

/* AHEAD uint4 a thread of the next phase loaded before the barrier (into registers: every tier has them), used
 * after it: the weights of a decode step do not depend on the phase before, only its activations do */
template <int AHEAD>
__device__ __forceinline__ void stream_phases(unsigned *bar, const uint4 *src, long long n16, int phases,
                                              unsigned *sink) {
    unsigned acc = 0;
    const long long stride = (long long)gridDim.x * GRID_SYNC_THREADS;
    const long long i0 = (long long)blockIdx.x * GRID_SYNC_THREADS + threadIdx.x;
    uint4 pre[AHEAD > 0 ? AHEAD : 1];
#pragma unroll
    for (int j = 0; j < AHEAD; j++) pre[j] = i0 + j * stride < n16 ? src[i0 + j * stride] : make_uint4(0, 0, 0, 0);
    for (int p = 0; p < phases; p++) {
        const uint4 *s = src + (long long)p * n16;
#pragma unroll
        for (int j = 0; j < AHEAD; j++) acc ^= pre[j].x + pre[j].y + pre[j].z + pre[j].w;
#pragma unroll 4
        for (long long i = i0 + AHEAD * stride; i < n16; i += stride) {
            const uint4 v = s[i];
            acc ^= v.x + v.y + v.z + v.w;
        }
        if (p + 1 < phases) {
#pragma unroll
            for (int j = 0; j < AHEAD; j++)
                pre[j] = i0 + j * stride < n16 ? s[n16 + i0 + j * stride] : make_uint4(0, 0, 0, 0);
        }
        le_grid_sync(bar, gridDim.x);
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}

extern "C" __global__ void grid_sync_stream_u32(unsigned *bar, const uint4 *src, long long n16, int phases,
                                                unsigned *sink) {
    stream_phases<0>(bar, src, n16, phases, sink);
}

extern "C" __global__ void grid_sync_stream_ahead_u32(unsigned *bar, const uint4 *src, long long n16, int phases,
                                                      unsigned *sink) {
    stream_phases<GRID_SYNC_AHEAD>(bar, src, n16, phases, sink);
}
