/* rmsnorm.cu — RMSNorm of f32 rows: y = x / sqrt(mean(x^2) + eps) * w.
 *
 * Reference: native/norm.c le_rmsnorm (which sums squares in f64; here f32 per thread, then a
 * block tree: the difference is within tests/tolerances.py GPU_RMSNORM_REL).
 *   rmsnorm_f32(x, w, y, ncols, nrows, eps)
 *     x: [nrows, ncols] f32, w: [ncols] f32 or NULL (no weight), y: [nrows, ncols] f32 (may be x)
 *     launch: block RMSNORM_THREADS (256) x 1 x 1, grid min(nrows, 65535) x 1 x 1 (rows are
 *     grid-strided, so any nrows works within Fermi's 65535 grid limit).
 *   add_rmsnorm_f32(x, y, w, h, hq, ncols, nrows, eps)     a layer's residual add, the next norm and the Q8_1 of
 *     its output in one launch (a decode token runs 2 per layer: 4 launches fewer than add + rmsnorm + quantize)
 *     x: [nrows, ncols] f32, x += y (y: [nrows, ncols] f32, or NULL: x as it is);  h = rmsnorm(x) * w, [nrows,
 *     ncols] f32 (not x);  hq: NULL, or [nrows * ncols / 32] block_q8_1 of h (ncols % 32 == 0) in the layout of
 *     quantize_q8_1.cu.  The same expressions and reductions as add_f32 (elementwise.cu), rmsnorm_f32 and
 *     quantize_q8_1 in sequence, so bit-identical to them (tests/test_gpu.py test_add_rmsnorm). Rows of up to
 *     ADD_RMSNORM_REGS x RMSNORM_THREADS held in registers (add_rmsnorm_row_regs), longer ones looped.
 *     launch: as rmsnorm_f32
 * Tiers: all (fermi: the block sum is a shared-memory tree; kepler+: shuffles). The weights
 * of Qwen3.5 norms already hold 1 + w (the converter adds the 1), so this is the plain form.
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k rmsnorm
 */
#include "compat.cuh"

#define RMSNORM_THREADS 256
/* elements a thread of add_rmsnorm's register form holds: 8 spill on fermi's 63 registers */
#if LE_HAS_MANY_REGS
#define ADD_RMSNORM_REGS 8
#else
#define ADD_RMSNORM_REGS 4
#endif

extern "C" __global__ void rmsnorm_f32(const float *x, const float *w, float *y, int ncols, int nrows, float eps) {
    LE_SCRATCH(scratch, RMSNORM_THREADS);
    for (int row = blockIdx.x; row < nrows; row += gridDim.x) {
        const float *xr = x + (size_t)row * ncols;
        float *yr = y + (size_t)row * ncols;
        float ss = 0.0f;
        for (int i = threadIdx.x; i < ncols; i += RMSNORM_THREADS) {
            const float v = xr[i];
            ss += v * v;
        }
        ss = le_block_sum(ss, scratch);
        /* why not rsqrtf: it is 2 ulp off; sqrtf and the division are IEEE-rounded */
        const float scale = 1.0f / sqrtf(ss / ncols + eps);
        /* why (x * scale) * w: the reference's order, so only the sum differs */
        if (w) {
            for (int i = threadIdx.x; i < ncols; i += RMSNORM_THREADS) yr[i] = xr[i] * scale * le_ldg(w + i);
        } else {
            for (int i = threadIdx.x; i < ncols; i += RMSNORM_THREADS) yr[i] = xr[i] * scale;
        }
    }
}

/* A row of ncols <= R * RMSNORM_THREADS in registers: element k * RMSNORM_THREADS + t is thread t's v[k], so Q8_1
 * block k * (RMSNORM_THREADS / 32) + warp is warp's v[k] (no reload of h); x, y and w are all loaded before the first
 * use (the loop form below waits on a load an element: a decode token's norms are latency, ~2 per layer). Same
 * expressions in the same order as the loop form, so the same bits. */
template <int R>
__device__ __forceinline__ void add_rmsnorm_row_regs(float *xr, const float *yr, const float *LE_RESTRICT w, float *hr,
                                                     block_q8_1 *hqr, int ncols, float eps, float *scratch) {
    float v[R], wv[R];
#pragma unroll
    for (int k = 0; k < R; k++) {
        const int i = k * RMSNORM_THREADS + threadIdx.x;
        v[k] = i < ncols ? xr[i] : 0.0f;
        wv[k] = i < ncols && w ? le_ldg(w + i) : 0.0f;
    }
    if (yr) {
#pragma unroll
        for (int k = 0; k < R; k++) {
            const int i = k * RMSNORM_THREADS + threadIdx.x;
            if (i < ncols) v[k] = v[k] + yr[i];
        }
    }
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < R; k++) {
        const int i = k * RMSNORM_THREADS + threadIdx.x;
        if (i < ncols) {
            if (yr) xr[i] = v[k];
            ss += v[k] * v[k];
        }
    }
    ss = le_block_sum(ss, scratch);
    const float scale = 1.0f / sqrtf(ss / ncols + eps);
#pragma unroll
    for (int k = 0; k < R; k++) {
        const int i = k * RMSNORM_THREADS + threadIdx.x;
        v[k] = w ? v[k] * scale * wv[k] : v[k] * scale;
        if (i < ncols) hr[i] = v[k];
    }
    if (!hqr) return;
    __syncthreads(); /* fermi: the block sum's scratch is read before the warps' reductions write it */
    const int warp = threadIdx.x / LE_WARP, nb = ncols / QK8_1;
#pragma unroll
    for (int k = 0; k < R; k++)
        le_q8_1_value(k * RMSNORM_THREADS + threadIdx.x < ncols ? v[k] : 0.0f, hqr,
                      k * (RMSNORM_THREADS / LE_WARP) + warp, nb, scratch);
}

extern "C" __global__ void add_rmsnorm_f32(float *x, const float *y, const float *LE_RESTRICT w, float *h,
                                           block_q8_1 *hq, int ncols, int nrows, float eps) {
    LE_SCRATCH(scratch, RMSNORM_THREADS);
    const int warp = threadIdx.x / LE_WARP;
    for (int row = blockIdx.x; row < nrows; row += gridDim.x) {
        float *xr = x + (size_t)row * ncols, *hr = h + (size_t)row * ncols;
        const float *yr = y ? y + (size_t)row * ncols : 0;
        block_q8_1 *hqr = hq ? hq + (size_t)row * (ncols / QK8_1) : 0;
        if (ncols <= ADD_RMSNORM_REGS * RMSNORM_THREADS) { /* the presets' widths (1024, 2048) in registers */
            if (ncols <= 4 * RMSNORM_THREADS)
                add_rmsnorm_row_regs<4>(xr, yr, w, hr, hqr, ncols, eps, scratch);
            else
                add_rmsnorm_row_regs<ADD_RMSNORM_REGS>(xr, yr, w, hr, hqr, ncols, eps, scratch);
            __syncthreads(); /* fermi: the warp sums' scratch is free before the next row's block sum */
            continue;
        }
        float ss = 0.0f;
        for (int i = threadIdx.x; i < ncols; i += RMSNORM_THREADS) {
            float v = xr[i];
            if (y) {
                v = v + y[(size_t)row * ncols + i];
                xr[i] = v;
            }
            ss += v * v;
        }
        ss = le_block_sum(ss, scratch);
        const float scale = 1.0f / sqrtf(ss / ncols + eps);
        for (int i = threadIdx.x; i < ncols; i += RMSNORM_THREADS)
            hr[i] = w ? xr[i] * scale * le_ldg(w + i) : xr[i] * scale;
        if (!hq) continue;
        __syncthreads(); /* the row's h is written (and the block sum's scratch read) before the warps quantise it */
        const int nb = ncols / QK8_1;
        /* one warp per block of 32, as quantize_q8_1; the bound is the block's (fermi reductions need every thread) */
        for (int base = 0; base < nb; base += RMSNORM_THREADS / LE_WARP)
            le_q8_1_block(hr, hq + (size_t)row * nb, base + warp, nb, scratch);
        __syncthreads(); /* fermi: the warp sums' scratch is free before the next row's block sum */
    }
}
