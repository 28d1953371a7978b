/* grid_sync.cuh — a barrier across every block of a launch, for the fused decode step (issue 26): every tier, CUDA 8.
 *
 *   le_grid_sync(bar, nblocks)   bar: two unsigned words in device memory, zero before the first launch that uses
 *     them (count, generation); every launch leaves count at 0, so a buffer serves launch after launch (a CUDA
 *     graph's replays included). All nblocks (= the grid) blocks must be resident at once: the launcher sizes the
 *     grid to what the card holds (the occupancy of the kernel, at most one block per SM when unsure), or blocks
 *     that wait spin forever on ones that never start.
 * Thread 0 of each block reads the generation, fences (its block's writes before its arrival), adds itself to the
 * count; the last to arrive resets the count and bumps the generation, the others spin on a volatile read of it;
 * the block then fences (the others' writes before its reads) and meets at __syncthreads. Cooperative groups'
 * grid.sync() does the same where the toolkit has it (CUDA 9+, sm_60+); this one is the CUDA-8 / Fermi form.
 */
#ifndef LE_GRID_SYNC_CUH
#define LE_GRID_SYNC_CUH

#include "compat.cuh"

__device__ __forceinline__ void le_grid_sync(unsigned *bar, unsigned nblocks) {
    __syncthreads(); /* the block's work of this phase is done */
    if (threadIdx.x == 0) {
        volatile unsigned *gen = bar + 1;
        const unsigned g = *gen;
        __threadfence();
        if (atomicAdd(bar, 1u) == nblocks - 1) {
            atomicExch(bar, 0u); /* no block adds before the bump below: they all wait for it */
            __threadfence();
            atomicAdd(bar + 1, 1u);
        } else {
            while (*gen == g) {
            }
        }
        __threadfence();
    }
    __syncthreads();
}

#endif
