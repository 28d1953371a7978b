/* moe_combine.cu — the MoE block's output: the routed experts' rows weighted and summed, plus the gated
 * shared expert (spec §2.5).
 *
 * Reference: native/moe.c (job C, down + combine):
 *   out[t] = sum_s w[t, s] * y[t*k + s]  +  sigmoid(shgate[t]) * sh[t]
 *   moe_combine_f32(y, w, sh, shgate, out, n, k, E, rows)
 *     y: [n*k, E] the down outputs of token t's k routed experts: slot s of token t in row t*k + s (slot order,
 *     as moe_route.cu chose them), or with rows ([n*k] int32, a permutation) in row rows[t*k + s] (the grouped
 *     GEMMs' expert-sorted output read in place: moe_sort's inverse order, no copy back);
 *     w: [n, k] routing weights;  sh: [n, E] the shared expert's down output, or NULL (no shared expert);
 *     shgate: [n] the logit w_shexp_gate . x (sigmoid applied here), ignored when sh is NULL;
 *     out: [n, E] (must not alias y or sh)
 *     launch: block MOE_COMBINE_THREADS (256) x 1 x 1, grid min(ceil(n*E/256), 65535) x 1 x 1 (grid-stride)
 * The reference sums the experts in ascending expert index, here in slot order (largest weight
 * first): the same k products added in another order, a few ulp (tests/test_gpu.py bounds it).
 * Tiers: all (one element per thread).
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k moe_combine
 */
#include "compat.cuh"

#define MOE_COMBINE_THREADS 256

extern "C" __global__ void moe_combine_f32(const float *LE_RESTRICT y, const float *LE_RESTRICT w,
                                           const float *LE_RESTRICT sh, const float *LE_RESTRICT shgate,
                                           float *LE_RESTRICT out, int n, int k, int E,
                                           const int *LE_RESTRICT rows) {
    for (size_t i = (size_t)blockIdx.x * MOE_COMBINE_THREADS + threadIdx.x; i < (size_t)n * E;
         i += (size_t)gridDim.x * MOE_COMBINE_THREADS) {
        const size_t t = i / E, e = i % E;
        float acc = 0.0f;
        for (int s = 0; s < k; s++) {
            const size_t r = rows ? (size_t)rows[t * k + s] : t * k + s;
            acc += w[t * k + s] * y[r * E + e];
        }
        if (sh) acc += 1.0f / (1.0f + expf(-shgate[t])) * sh[i];
        out[i] = acc;
    }
}
