/* layernorm.cu — LayerNorm of f32 rows with weight and bias (the vision tower's norm1 / norm2 / merger norm).
 *
 * Reference: native/layernorm.c le_layernorm_ref: y = (x - mean) / sqrt(var + eps) * w + b, var the biased
 * variance (torch.nn.LayerNorm), two passes (mean, then the sum of squared deviations).
 *   layernorm_f32(x, w, b, y, ncols, nrows, eps)
 *     x: [nrows, ncols] f32;  w, b: [ncols] f32 or NULL (no weight / no bias);  y: [nrows, ncols] f32 (may be x:
 *     every element is read by the thread that writes it, after the block's two sums)
 *     launch: block LN_THREADS (256) x 1 x 1, grid min(nrows, 65535) x 1 x 1 (rows grid-strided)
 * The reference sums in f64; here each thread sums its columns in f32 and the block adds the partials as a tree
 * (le_block_sum), two passes as the reference (so an offset mean costs no precision). The difference is a few ulps
 * of the row's scale: tests/tolerances.py GPU_LAYERNORM_REL.
 * Tiers: all (fermi: the block sums are shared-memory trees; kepler+: shuffles).
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu_vision.py -m gpu -k layernorm
 */
#include "compat.cuh"

#define LN_THREADS 256

extern "C" __global__ void layernorm_f32(const float *x, const float *LE_RESTRICT w, const float *LE_RESTRICT b,
                                         float *y, int ncols, int nrows, float eps) {
    LE_SCRATCH(scratch, LN_THREADS);
    for (int row = blockIdx.x; row < nrows; row += gridDim.x) {
        const float *xr = x + (size_t)row * ncols;
        float *yr = y + (size_t)row * ncols;
        float s = 0.0f;
        for (int i = threadIdx.x; i < ncols; i += LN_THREADS) s += xr[i];
        const float mean = le_block_sum(s, scratch) / ncols;
        float ss = 0.0f;
        for (int i = threadIdx.x; i < ncols; i += LN_THREADS) {
            const float d = xr[i] - mean;
            ss += d * d;
        }
        ss = le_block_sum(ss, scratch);
        /* why not rsqrtf: it is 2 ulp off; sqrtf and the division are IEEE-rounded (as rmsnorm.cu) */
        const float rstd = 1.0f / sqrtf(ss / ncols + eps);
        /* the reference's order: ((x - mean) * rstd) * w, then + b */
        for (int i = threadIdx.x; i < ncols; i += LN_THREADS) {
            float v = (xr[i] - mean) * rstd;
            if (w) v *= le_ldg(w + i);
            if (b) v += le_ldg(b + i);
            yr[i] = v;
        }
        __syncthreads(); /* fermi: the next row's first block sum reuses scratch (le_block_sum syncs before, too) */
    }
}
