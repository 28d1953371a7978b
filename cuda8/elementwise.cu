/* elementwise.cu — the f32 elementwise ops between the matmuls of a layer.
 *
 *   swiglu_f32(g, u, out, n)        out = SiLU(g) * u = g / (1 + e^-g) * u   (native/moe.c swiglu; out may be g or u)
 *   add_f32(a, b, out, n)           out = a + b                               (the residual adds; out may be a or b)
 *   add_scaled_f32(acc, y, w, n)    acc += w * y                              (moe.c: an expert's output, weighted)
 *     all [n] f32;  launch: block EW_THREADS (256) x 1 x 1, grid min(ceil(n/256), 65535) x 1 x 1 (grid-stride)
 * SiLU is the reference's le_silu formula with expf (<= 2 ulp); add is exact (IEEE f32, as numpy);
 * add_scaled may contract to one FMA (one rounding where the reference has two).
 * Tiers: all (one element per thread, nothing shared).
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k elementwise
 */
#include "compat.cuh"

#define EW_THREADS 256

#define EW_LOOP(i, n) \
    for (size_t i = (size_t)blockIdx.x * EW_THREADS + threadIdx.x; i < (size_t)(n); i += (size_t)gridDim.x * EW_THREADS)

extern "C" __global__ void swiglu_f32(const float *g, const float *u, float *out, int n) {
    EW_LOOP(i, n) {
        const float x = g[i];
        out[i] = x / (1.0f + expf(-x)) * u[i];
    }
}

extern "C" __global__ void add_f32(const float *a, const float *b, float *out, int n) {
    EW_LOOP(i, n) out[i] = a[i] + b[i];
}

extern "C" __global__ void add_scaled_f32(float *acc, const float *LE_RESTRICT y, float w, int n) {
    EW_LOOP(i, n) acc[i] += w * y[i];
}
