/* quantize_q8_1.cu — f32 activations to block_q8_1 in CUDA's layout, for the int8 GEMVs.
 *
 * GPU layout of block_q8_1 (36 bytes, the struct of native/include/le_blocks.h):
 *   uint16 d      fp16 of d = amax/127 over the 32 values (amax = max |x|)
 *   uint16 s      fp16 of the SUM OF THE ORIGINAL FLOATS x (ggml-cuda's ds.y = sum x)
 *   int8 qs[32]   q = roundf(x / d) with the f32 d (0 when amax = 0), half away from zero
 * This is ggml-cuda's quantize_q8_1 (spec qwen35.md §4), NOT our CPU block_q8_1, whose s is
 * fp16(d * sum(q)): the GPU kernels use s to apply the min term of Q4_K/Q5_K (dmin * m * sum x).
 * The test reference (tests/test_gpu.py quantize_q8_1_gpu_ref) spells the same rules in numpy.
 *   quantize_q8_1(x, y, n)
 *     x: [n] f32 (n a multiple of 32; rows of a [tokens, K] matrix with K % 32 == 0 are flat),
 *     y: [n/32] block_q8_1
 *     launch: block Q8_THREADS (128 = 4 blocks of 32) x 1 x 1, grid min(ceil(n/128), 65535).
 *   swiglu_q8_1(g, u, y, n)   the same blocks of SiLU(g) * u (elementwise.cu swiglu_f32's expression: the same bits
 *     as swiglu_f32 then quantize_q8_1, one launch and no f32 round trip: the FFN down projection's int8 input)
 * Tiers: all (one warp per block of 32: max and sum by shuffles, shared memory on fermi).
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k quantize
 */
#include "compat.cuh"

#define Q8_THREADS 128
#define Q8_WARPS (Q8_THREADS / LE_WARP)

extern "C" __global__ void quantize_q8_1(const float *x, block_q8_1 *y, int n) {
    LE_SCRATCH(scratch, Q8_THREADS);
    const int warp = threadIdx.x / LE_WARP;
    const int nb = n / QK8_1;
    /* uniform loop bound for the whole block: the fermi reductions need every thread */
    for (int base = blockIdx.x * Q8_WARPS; base < nb; base += gridDim.x * Q8_WARPS)
        le_q8_1_block(x, y, base + warp, nb, scratch);
}

extern "C" __global__ void swiglu_q8_1(const float *g, const float *u, block_q8_1 *y, int n) {
    LE_SCRATCH(scratch, Q8_THREADS);
    const int warp = threadIdx.x / LE_WARP, lane = threadIdx.x % LE_WARP;
    const int nb = n / QK8_1;
    for (int base = blockIdx.x * Q8_WARPS; base < nb; base += gridDim.x * Q8_WARPS) {
        const int ib = base + warp;
        float xi = 0.0f;
        if (ib < nb) {
            const float x = g[(size_t)ib * QK8_1 + lane];
            xi = x / (1.0f + expf(-x)) * u[(size_t)ib * QK8_1 + lane];
        }
        le_q8_1_value(xi, y, ib, nb, scratch);
    }
}
