/* rope.cu — the q/k preparation of a gated-attention layer: per-head RMSNorm, then rotary embedding.
 *
 * Reference: native/attention.c (le_rmsnorm per head with q_norm / k_norm) and native/rope.c
 * (le_rope_neox: NeoX pairs (i, i + n_rot/2) of the first n_rot dims, IMRoPE positions).
 *   qk_norm_rope_f32(x, w, cs, n, n_heads, head_stride, row_stride, hd, half, eps, pos_dev)
 *     x: token t's head h at x + t*row_stride + h*head_stride, hd floats, in place:
 *        q: head_stride = 2*hd (the gate half of each head is skipped), row_stride = n_head*2*hd;
 *        k: head_stride = hd, row_stride = n_kv*hd (the cache rows of this batch)
 *     w: [hd] the norm weight (GGUF holds 1 + w);  cs: [n, half] float2 (cos, sin) of token t's
 *        angles, slot i rotating (x[i], x[i + half]); half = n_rot/2 <= hd/2
 *     pos_dev: NULL, or a device int p: token t then reads row p + t of cs (cs = the whole table; a decode
 *        step replayed with fixed arguments, a LaunchPlan)
 *     launch: block ROPE_THREADS (128) x 1 x 1, grid min(n*n_heads, 65535) x 1 x 1 (head rows grid-strided)
 * The angles come from a table the host fills once per model (legacy_engine/gpu/scratch.py rope_table:
 * p_i * theta^(-2i/n_rot) in f64 with IMRoPE's per-slot position, cos/sin rounded to f32, exactly
 * as rope.c computes them), so the GPU sees the reference's very cos/sin values; only the norm's
 * sum of squares is ordered differently (f32 block tree vs f64) and the rotation may contract to FMA.
 * Tiers: all (block sum through le_block_sum; fermi: shared-memory tree).
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k rope
 */
#include "compat.cuh"

#define ROPE_THREADS 128
#define ROPE_MAX_HD 512

extern "C" __global__ void qk_norm_rope_f32(float *x, const float *LE_RESTRICT w, const float2 *LE_RESTRICT cs,
                                            int n, int n_heads, int head_stride, int row_stride, int hd, int half,
                                            float eps, const int *LE_RESTRICT pos_dev) {
    LE_SCRATCH(scratch, ROPE_THREADS);
    __shared__ float v[ROPE_MAX_HD];
    for (int row = blockIdx.x; row < n * n_heads; row += gridDim.x) {
        const int t = row / n_heads, h = row % n_heads;
        float *xr = x + (size_t)t * row_stride + (size_t)h * head_stride;
        float ss = 0.0f;
        for (int i = threadIdx.x; i < hd; i += ROPE_THREADS) {
            const float a = xr[i];
            ss += a * a;
        }
        ss = le_block_sum(ss, scratch);
        const float scale = 1.0f / sqrtf(ss / hd + eps); /* as rmsnorm.cu: IEEE sqrt and division */
        for (int i = threadIdx.x; i < hd; i += ROPE_THREADS) v[i] = xr[i] * scale * le_ldg(w + i);
        __syncthreads();
        const float2 *c = cs + ((size_t)t + (pos_dev ? *pos_dev : 0)) * half;
        for (int i = threadIdx.x; i < hd; i += ROPE_THREADS) {
            float out = v[i];
            if (i < half) {
                const float2 a = c[i];
                out = v[i] * a.x - v[i + half] * a.y;
            } else if (i < 2 * half) {
                const float2 a = c[i - half];
                out = v[i - half] * a.y + v[i] * a.x;
            }
            xr[i] = out;
        }
        __syncthreads(); /* v is reused by the next row */
    }
}
