/* peak.cu — the arithmetic peak of the instruction each prefill GEMM multiplies with, measured on the card it runs
 * on: `bench gpu --profile` and `bench split` give the GEMMs' rate as a % of it (the tier's peak).
 *
 *   peak_fma_f32(out, iters, m, b)     gemm_f32's product: PEAK_CHAINS independent chains a = a * m + b per thread
 *     out: [gridDim.x * PEAK_THREADS] f32, each thread's chains summed (chain c starts at c)
 *   peak_dp4a_s8(out, iters, a, b)     gemm_dp4a's: PEAK_CHAINS chains acc = le_dp4a(a, b, acc) (the tier's dp4a:
 *     __dp4a from sm_61, the byte loop below)          out: [gridDim.x * PEAK_THREADS] int32, as above
 *   peak_mma_s8(out, iters, a, b)      gemm_mma's: PEAK_MMA_CHAINS chains of accumulating 16 x 8 x 16 s8 products
 *     per warp (m16n8k16 from sm_80, two m8n8k16 on sm_75), every A and B byte from a and b; only where
 *     LE_HAS_MMA_INT8            out: [gridDim.x * PEAK_THREADS] int32, the lane's accumulators summed
 *   launch: block PEAK_THREADS x 1 x 1, grid g x 1 x 1 (the caller fills the card: several blocks per SM)
 * Operations counted as the GEMMs count theirs (2 per multiply-add): FMA 2, dp4a 8, a warp's m16n8k16 4096.
 * The inputs are arguments and the sums are written, so the loops cannot be folded or dropped; with m = 1 and small
 * integers every value is exact, and the test (tests/test_gpu.py test_peak_kernels) checks them against the host's.
 * Tiers: all (peak_mma_s8 only in the dp4a tier's PTX for compute_75+).
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k peak
 */
#include "compat.cuh"

#define PEAK_THREADS 256
#define PEAK_CHAINS 8     /* independent chains per thread: enough to hide the FMA / IMAD latency */
#define PEAK_MMA_CHAINS 4 /* independent accumulator tiles per warp: the mma pipe's latency */

extern "C" __global__ void peak_fma_f32(float *LE_RESTRICT out, int iters, float m, float b) {
    float a[PEAK_CHAINS];
#pragma unroll
    for (int c = 0; c < PEAK_CHAINS; c++) a[c] = (float)c;
    for (int i = 0; i < iters; i++)
#pragma unroll
        for (int c = 0; c < PEAK_CHAINS; c++) a[c] = fmaf(a[c], m, b);
    float s = 0.0f;
#pragma unroll
    for (int c = 0; c < PEAK_CHAINS; c++) s += a[c];
    out[blockIdx.x * PEAK_THREADS + threadIdx.x] = s;
}

extern "C" __global__ void peak_dp4a_s8(int *LE_RESTRICT out, int iters, int a, int b) {
    int acc[PEAK_CHAINS];
#pragma unroll
    for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = c;
    for (int i = 0; i < iters; i++)
#pragma unroll
        for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = le_dp4a(a, b, acc[c]);
    int s = 0;
#pragma unroll
    for (int c = 0; c < PEAK_CHAINS; c++) s += acc[c];
    out[blockIdx.x * PEAK_THREADS + threadIdx.x] = s;
}

#if LE_HAS_MMA_INT8
/* d[16 x 8] += A B as le_mma_s8_16x8x16's fragments, accumulating in place (the GEMM's form starts at 0) */
__device__ __forceinline__ void peak_mma_acc(int *d, int a0, int a1, int b) {
#if LE_HAS_MMA_16816
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
                 "{%0, %1, %2, %3};"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a0), "r"(a1), "r"(b));
#else
    asm volatile("mma.sync.aligned.m8n8k16.row.col.s32.s8.s8.s32 {%0, %1}, {%2}, {%3}, {%0, %1};"
                 : "+r"(d[0]), "+r"(d[1])
                 : "r"(a0), "r"(b));
    asm volatile("mma.sync.aligned.m8n8k16.row.col.s32.s8.s8.s32 {%0, %1}, {%2}, {%3}, {%0, %1};"
                 : "+r"(d[2]), "+r"(d[3])
                 : "r"(a1), "r"(b));
#endif
}

extern "C" __global__ void peak_mma_s8(int *LE_RESTRICT out, int iters, int a, int b) {
    int d[PEAK_MMA_CHAINS][4];
#pragma unroll
    for (int c = 0; c < PEAK_MMA_CHAINS; c++)
#pragma unroll
        for (int j = 0; j < 4; j++) d[c][j] = 0;
    for (int i = 0; i < iters; i++)
#pragma unroll
        for (int c = 0; c < PEAK_MMA_CHAINS; c++) peak_mma_acc(d[c], a, a, b);
    int s = 0;
#pragma unroll
    for (int c = 0; c < PEAK_MMA_CHAINS; c++)
#pragma unroll
        for (int j = 0; j < 4; j++) s += d[c][j];
    out[blockIdx.x * PEAK_THREADS + threadIdx.x] = s;
}
#endif
