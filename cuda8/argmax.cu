/* argmax.cu — the index of the largest value of each f32 row (greedy decoding over a 248k vocabulary).
 *
 * Reference: np.argmax / native sampling's greedy pick: the first maximum (ties: the lower index).
 *   argmax_partial_f32(x, n, part_v, part_i)       pass 1: each block's best of its grid-strided share
 *     x: [n_rows, n] f32;  part_v, part_i: [n_rows, n_part] f32 / int32 (n_part = gridDim.x)
 *     launch: block ARGMAX_THREADS (256) x 1 x 1, grid n_part x n_rows x 1 (n_part <= ARGMAX_MAX_PARTS, n_rows <= 65535)
 *   argmax_final_i32(part_v, part_i, n_part, out)   pass 2: one block per row over its n_part partials
 *     out: [n_rows] int32
 *     launch: block ARGMAX_THREADS x 1 x 1, grid n_rows x 1 x 1
 * Two passes instead of one block per row: a 248k row read by one block runs on one SM;
 * ARGMAX_MAX_PARTS blocks spread it over the card. A thread keeps the first maximum of its
 * increasing indices (strict >); the block and final reductions break ties on the index
 * (le_block_argmax), so the result is the first maximum whatever the split.
 * NaN never wins (x > v is false); a row of -inf (or NaN) only returns 0.
 * Tiers: all (fermi: the butterflies go through shared memory).
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k argmax
 */
#include "compat.cuh"

#define ARGMAX_THREADS 256
#define ARGMAX_MAX_PARTS 256

extern "C" __global__ void argmax_partial_f32(const float *LE_RESTRICT x, int n, float *LE_RESTRICT part_v,
                                              int *LE_RESTRICT part_i) {
    LE_SCRATCH(scratch, ARGMAX_THREADS);
    const float *xr = x + (size_t)blockIdx.y * n;
    float v = le_neg_inf();
    int bi = LE_INT_MAX;
    for (int i = blockIdx.x * ARGMAX_THREADS + threadIdx.x; i < n; i += gridDim.x * ARGMAX_THREADS) {
        const float xi = le_ldg(xr + i);
        if (xi > v) {
            v = xi;
            bi = i;
        }
    }
    le_block_argmax(v, bi, scratch);
    if (threadIdx.x == 0) {
        part_v[(size_t)blockIdx.y * gridDim.x + blockIdx.x] = v;
        part_i[(size_t)blockIdx.y * gridDim.x + blockIdx.x] = bi;
    }
}

extern "C" __global__ void argmax_final_i32(const float *LE_RESTRICT part_v, const int *LE_RESTRICT part_i,
                                            int n_part, int *LE_RESTRICT out) {
    LE_SCRATCH(scratch, ARGMAX_THREADS);
    const size_t row = blockIdx.x;
    float v = le_neg_inf();
    int bi = LE_INT_MAX;
    for (int j = threadIdx.x; j < n_part; j += ARGMAX_THREADS) {
        const float pv = le_ldg(part_v + row * n_part + j);
        const int pi = le_ldg(part_i + row * n_part + j);
        if (le_argmax_better(pv, pi, v, bi)) {
            v = pv;
            bi = pi;
        }
    }
    le_block_argmax(v, bi, scratch);
    if (threadIdx.x == 0) out[row] = bi == LE_INT_MAX ? 0 : bi;
}
