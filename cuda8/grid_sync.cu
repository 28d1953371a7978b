/* grid_sync.cu — le_grid_sync (grid_sync.cuh) under test and under the clock.
 *
 *   grid_sync_check_u32(bar, cells, rounds)   cells: uint32 [gridDim.x], zero before; in each of `rounds` rounds block b
 *     adds 1 to its cell, meets the grid, then checks that every cell holds the round's count (a block past the
 *     barrier before another arrived would see an old count) and counts each mismatch into cells[gridDim.x] ...
 *     the caller reads the extra word: 0 mismatches means every barrier held.
 *     launch: block GRID_SYNC_THREADS (128) x 1 x 1, grid n x 1 x 1 with n blocks co-resident, cells [n + 1]
 *   grid_sync_time_u32(bar, rounds)          `rounds` barriers and nothing else: the cost of one, timed by the caller
 *     launch: as above
 * Tiers: all.
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k grid_sync
 */
#include "grid_sync.cuh"

#define GRID_SYNC_THREADS 128

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
