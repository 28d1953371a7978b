/* gelu.cu — the vision tower's elementwise ops after its matmuls: the two GELUs (each with the Linear's bias
 * folded in) and the bias adds (the GEMMs of gemm_f32.cu add no bias).
 *
 * Reference: native/gelu.c (le_gelu_tanh_ref, le_gelu_erf_ref) and vision.c's row jobs (RJ_GELU_*, RJ_RESID,
 * RJ_EMBED, RJ_BIAS), in the same order of additions:
 *   gelu_tanh_f32(x, b, n, ncols)   x = gelu_tanh(x + b)  0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3)))  (ViT MLP)
 *   gelu_erf_f32(x, b, n, ncols)    x = gelu_erf(x + b)   0.5 v (1 + erf(v / sqrt(2)))                      (merger)
 *   bias_add_f32(x, b, r, n, ncols)         x = (x + b) + r   (r NULL: x + b; the patch embedding: conv + bias + pos)
 *   bias_residual_f32(x, y, b, n, ncols)    x = x + (y + b)   (a Linear's output with its bias into the residual)
 *     x, r, y: [n / ncols, ncols] f32 (n elements, row-major), in place on x;  b: [ncols] f32 (NULL: no bias)
 *     launch: block GELU_THREADS (256) x 1 x 1, grid min(ceil(n / 256), 65535) x 1 x 1 (grid-stride)
 * tanhf / erff are CUDA's (<= 2 ulp, as libm's); the products may contract to FMA where the reference rounds twice
 * (tests/tolerances.py GPU_GELU_REL). The adds are exact IEEE f32 in the reference's order: bit-equal.
 * Tiers: all (one element per thread, nothing shared).
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu_vision.py -m gpu -k "gelu or bias"
 */
#include "compat.cuh"

#define GELU_THREADS 256

#define GELU_LOOP(i, n) \
    for (size_t i = (size_t)blockIdx.x * GELU_THREADS + threadIdx.x; i < (size_t)(n); i += (size_t)gridDim.x * GELU_THREADS)

/* b[i % ncols], or 0 without a bias (0 + v is v: no rounding) */
__device__ __forceinline__ float gelu_bias(const float *LE_RESTRICT b, size_t i, int ncols) {
    return b ? le_ldg(b + i % (size_t)ncols) : 0.0f;
}

extern "C" __global__ void gelu_tanh_f32(float *x, const float *LE_RESTRICT b, int n, int ncols) {
    const float beta = 0.7978845608028654f; /* sqrt(2/pi), as gelu.c and torch's kBeta */
    const float kappa = 0.044715f;
    GELU_LOOP(i, n) {
        const float v = x[i] + gelu_bias(b, i, ncols);
        const float inner = beta * (v + kappa * v * v * v);
        x[i] = 0.5f * v * (1.0f + tanhf(inner));
    }
}

extern "C" __global__ void gelu_erf_f32(float *x, const float *LE_RESTRICT b, int n, int ncols) {
    const float inv_sqrt2 = 0.7071067811865476f;
    GELU_LOOP(i, n) {
        const float v = x[i] + gelu_bias(b, i, ncols);
        x[i] = 0.5f * v * (1.0f + erff(v * inv_sqrt2));
    }
}

extern "C" __global__ void bias_add_f32(float *x, const float *LE_RESTRICT b, const float *LE_RESTRICT r, int n,
                                        int ncols) {
    GELU_LOOP(i, n) {
        const float v = x[i] + gelu_bias(b, i, ncols);
        x[i] = r ? v + r[i] : v;
    }
}

extern "C" __global__ void bias_residual_f32(float *x, const float *LE_RESTRICT y, const float *LE_RESTRICT b, int n,
                                             int ncols) {
    GELU_LOOP(i, n) x[i] += y[i] + gelu_bias(b, i, ncols);
}
