/* gdn.cu — the Gated DeltaNet mixer's GPU steps after the projections (spec §2.3), recurrent form.
 *
 * Reference: native/gdn.c (le_gdn_layer, gdn_recurrent_head). In the order a layer runs them:
 *   gdn_gates_f32(beta, g, dt_bias, ssm_a, n, Hv)                       in place, [n, Hv] each
 *     beta <- sigmoid(beta);  g <- softplus(g + dt_bias[h]) * ssm_a[h]   (ssm_a = -exp(A_log) < 0)
 *     launch: block GDN_EW_THREADS (256), grid min(ceil(n*Hv/256), 65535) (grid-stride)
 *   (conv1d.cu: u = SiLU(conv(qkv)))
 *   gdn_l2norm_qk_f32(u, n, conv_dim, Hk, dk, qscale, eps)             in place
 *     u: [n, conv_dim], row = q (Hk*dk) | k (Hk*dk) | v (Hv*dv); every q and k head <- x / sqrt(sum x^2 + eps),
 *     q heads then * qscale (= 1/sqrt(dk))
 *     launch: block GDN_NORM_THREADS (128), grid min(n*2*Hk, 65535) (one head row per block, grid-stride)
 *   gdn_recurrent_f32(u, g, beta, S, o, n, conv_dim, Hk, Hv, dk, dv, tiled, dt_bias, ssm_a)
 *     per v-head j (k-head kh = j % Hk when tiled, the GGUF order of qwen35*; else j / (Hv/Hk)), tokens in order:
 *       S <- e^g S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q
 *     dt_bias, ssm_a: NULL (g and beta already gated by gdn_gates_f32), or [Hv] each: the gates taken here where a
 *     token's inputs are used (gdn_gates_f32's expressions: the same bits, one launch fewer; on the serial path
 *     of a long prefill they cost more than that launch, so the GPU model uses it for decode steps)
 *     S: [Hv, dk, dv] f32, updated in place; o: [n, Hv*dv]; g, beta: [n, Hv]; dk <= GDN_MAX_DK
 *     launch: block GDN_THREADS (256) x 1 x 1, grid Hv x ceil(dv / GDN_COLS) x 1
 *   gdn_gated_rmsnorm_f32(o, z, w, y, yq, nrows, dv, eps)              y may be o
 *     per row of dv (nrows = n*Hv): y = RMSNorm(o) * w * SiLU(z)  (w: ssm_norm [dv], stored without +1);
 *     yq: NULL, or y's Q8_1 blocks [nrows * dv / 32] (dv % 32 == 0), bit-identical to quantize_q8_1 of y (the
 *     out projection's int8 input: no launch of its own)
 *     launch: block GDN_NORM_THREADS (128), grid min(nrows, 65535) (grid-stride)
 *
 * The recurrence: columns c of S are independent (delta[c] needs only column c), so a block takes
 * GDN_COLS columns of one head: thread (slice, col) owns column col of the block and the rows
 * i = slice, slice + GDN_SLICES, … (<= GDN_ROWS of them, in registers for all n tokens: S is read
 * once and written once per launch). S^T k and S^T q are summed per thread over its rows, then
 * over the GDN_SLICES slices in shared memory in a fixed order (red_kv, red_o: two buffers, so a
 * token takes three barriers). A half-warp reads 16 consecutive floats of a row (64-byte
 * segments). q and k of the token are staged in shared memory; token t + 1's q, k, v, g and beta
 * are loaded into registers while token t computes, so no global load sits on the serial path.
 * Only the summation order, FMA contraction and expf differ from the reference
 * (tests/test_gpu.py GDN_STEP_EXTRA has the bound).
 * The chunked form of the same rule, for prefill, is gdn_chunked.cu (the tiers where it is the faster: gpu/kernels.py
 * GDN_CHUNKED_TIERS); passes of several tokens on the others run this recurrence token by token.
 * Tiers: all (the recurrence exchanges through shared memory only; the norms reduce as compat.cuh does per tier).
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k gdn
 */
#include "compat.cuh"

#define GDN_COLS 16     /* columns (of dv) per block: a warp takes 2 slices x 16 columns */
#define GDN_SLICES 16   /* row slices per column */
#define GDN_THREADS 256 /* GDN_COLS * GDN_SLICES */
#define GDN_MAX_DK 128  /* Qwen3.5: d_k = 128 */
#define GDN_ROWS 8      /* GDN_MAX_DK / GDN_SLICES: state registers per thread (16 spill on Fermi's 63) */
#define GDN_NORM_THREADS 128
#define GDN_EW_THREADS 256

/* as native/le_ops.h: le_silu, le_sigmoid, le_softplus */
__device__ __forceinline__ float gdn_silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float gdn_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float gdn_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
/* the decay's log from the alpha projection: one expression for gdn_gates_f32 and the recurrence's own gates */
__device__ __forceinline__ float gdn_gate_g(float a, float dt_bias, float ssm_a) {
    return gdn_softplus(a + dt_bias) * ssm_a;
}

extern "C" __global__ void gdn_gates_f32(float *beta, float *g, const float *LE_RESTRICT dt_bias,
                                         const float *LE_RESTRICT ssm_a, int n, int Hv) {
    const size_t total = (size_t)n * Hv;
    for (size_t i = (size_t)blockIdx.x * GDN_EW_THREADS + threadIdx.x; i < total; i += (size_t)gridDim.x * GDN_EW_THREADS) {
        const int h = (int)(i % Hv);
        beta[i] = gdn_sigmoid(beta[i]);
        g[i] = gdn_gate_g(g[i], le_ldg(dt_bias + h), le_ldg(ssm_a + h));
    }
}

extern "C" __global__ void gdn_l2norm_qk_f32(float *u, int n, int conv_dim, int Hk, int dk, float qscale, float eps) {
    LE_SCRATCH(scratch, GDN_NORM_THREADS);
    const int rows = n * 2 * Hk;
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const int t = r / (2 * Hk), h = r % (2 * Hk); /* heads 0 … Hk-1 are q, Hk … 2Hk-1 are k */
        float *x = u + (size_t)t * conv_dim + (size_t)h * dk;
        float ss = 0.0f;
        for (int i = threadIdx.x; i < dk; i += GDN_NORM_THREADS) ss += x[i] * x[i];
        ss = le_block_sum(ss, scratch);
        const float scale = 1.0f / sqrtf(ss + eps);
        /* why two multiplications for q: the reference rounds x * scale, then * qscale */
        for (int i = threadIdx.x; i < dk; i += GDN_NORM_THREADS) {
            const float v = x[i] * scale;
            x[i] = h < Hk ? v * qscale : v;
        }
    }
}

/* GATES: the gates taken here (dt_bias, ssm_a given); a template parameter, so the long recurrence without them
 * carries no per-token select of their transcendentals on its serial path */
template <bool GATES>
__device__ __forceinline__ void gdn_recurrent(const float *LE_RESTRICT u, const float *LE_RESTRICT g,
                                              const float *LE_RESTRICT beta, float *S, float *o, int n, int conv_dim,
                                              int Hk, int Hv, int dk, int dv, int tiled,
                                              const float *LE_RESTRICT dt_bias, const float *LE_RESTRICT ssm_a,
                                              float *qs, float *ks, float (*red_kv)[GDN_COLS],
                                              float (*red_o)[GDN_COLS]) {
    const int tid = threadIdx.x, j = blockIdx.x; /* v-head */
    const int lane = tid % GDN_COLS, slice = tid / GDN_COLS;
    const int c = blockIdx.y * GDN_COLS + lane;
    const bool col = c < dv;
    const int kh = tiled ? j % Hk : j / (Hv / Hk);
    float *Sj = S + (size_t)j * dk * dv;

    float s[GDN_ROWS]; /* s[r] = S[slice + r*GDN_SLICES][c] */
#pragma unroll
    for (int r = 0; r < GDN_ROWS; r++) {
        const int i = slice + r * GDN_SLICES;
        s[r] = col && i < dk ? Sj[(size_t)i * dv + c] : 0.0f;
    }
    /* token t + 1's inputs, loaded while token t computes: q[tid], k[tid] (tid < dk <= GDN_MAX_DK <= GDN_THREADS),
     * v[c], g, beta */
    float qn = 0.0f, kn = 0.0f, vn = 0.0f, gn = 0.0f, bn = 0.0f;
#define GDN_PREFETCH(t)                                                                    \
    do {                                                                                   \
        const float *row_ = u + (size_t)(t) * conv_dim;                                    \
        if (tid < dk) {                                                                    \
            qn = row_[(size_t)kh * dk + tid];                                              \
            kn = row_[(size_t)(Hk + kh) * dk + tid];                                       \
        }                                                                                  \
        vn = col ? row_[(size_t)2 * Hk * dk + (size_t)j * dv + c] : 0.0f;                  \
        gn = le_ldg(g + (size_t)(t) * Hv + j);                                             \
        bn = le_ldg(beta + (size_t)(t) * Hv + j);                                          \
    } while (0)
    /* the gates (dt_bias given): gdn_gates_f32's expressions where the prefetched values are used, not where they
     * are loaded (the loads stay in flight during the token before) */
    const float dtj = GATES ? le_ldg(dt_bias + j) : 0.0f, aj = GATES ? le_ldg(ssm_a + j) : 0.0f;
    if (n > 0) GDN_PREFETCH(0);
    for (int t = 0; t < n; t++) {
        /* the previous token's readers of qs, ks are past its last barrier */
        if (tid < dk) {
            qs[tid] = qn;
            ks[tid] = kn;
        }
        const float decay = expf(GATES ? gdn_gate_g(gn, dtj, aj) : gn);
        const float b = GATES ? gdn_sigmoid(bn) : bn, v = vn;
        __syncthreads();
        if (t + 1 < n) GDN_PREFETCH(t + 1);
        /* S <- decay S;  kv = S^T k (this thread's rows) */
        float part = 0.0f;
#pragma unroll
        for (int r = 0; r < GDN_ROWS; r++) {
            const int i = slice + r * GDN_SLICES;
            if (i < dk) {
                s[r] *= decay;
                part += s[r] * ks[i];
            }
        }
        red_kv[slice][lane] = part;
        __syncthreads();
        float kv = 0.0f;
#pragma unroll
        for (int q = 0; q < GDN_SLICES; q++) kv += red_kv[q][lane]; /* the same order in every slice */
        const float delta = b * (v - kv);
        /* S += k delta^T;  o = S^T q */
        part = 0.0f;
#pragma unroll
        for (int r = 0; r < GDN_ROWS; r++) {
            const int i = slice + r * GDN_SLICES;
            if (i < dk) {
                s[r] += ks[i] * delta;
                part += s[r] * qs[i];
            }
        }
        red_o[slice][lane] = part; /* red_o's readers of the previous token are past this token's first barrier */
        __syncthreads();
        if (slice == 0 && col) {
            float oc = 0.0f;
#pragma unroll
            for (int q = 0; q < GDN_SLICES; q++) oc += red_o[q][lane];
            o[(size_t)t * Hv * dv + (size_t)j * dv + c] = oc;
        }
    }
#undef GDN_PREFETCH
#pragma unroll
    for (int r = 0; r < GDN_ROWS; r++) {
        const int i = slice + r * GDN_SLICES;
        if (col && i < dk) Sj[(size_t)i * dv + c] = s[r];
    }
}

extern "C" __global__ void gdn_recurrent_f32(const float *LE_RESTRICT u, const float *LE_RESTRICT g,
                                             const float *LE_RESTRICT beta, float *S, float *o, int n, int conv_dim,
                                             int Hk, int Hv, int dk, int dv, int tiled,
                                             const float *LE_RESTRICT dt_bias, const float *LE_RESTRICT ssm_a) {
    __shared__ float qs[GDN_MAX_DK], ks[GDN_MAX_DK]; /* one set for either form */
    __shared__ float red_kv[GDN_SLICES][GDN_COLS], red_o[GDN_SLICES][GDN_COLS];
    if (dt_bias)
        gdn_recurrent<true>(u, g, beta, S, o, n, conv_dim, Hk, Hv, dk, dv, tiled, dt_bias, ssm_a, qs, ks, red_kv,
                            red_o);
    else
        gdn_recurrent<false>(u, g, beta, S, o, n, conv_dim, Hk, Hv, dk, dv, tiled, dt_bias, ssm_a, qs, ks, red_kv,
                             red_o);
}

extern "C" __global__ void gdn_gated_rmsnorm_f32(const float *o, const float *LE_RESTRICT z,
                                                 const float *LE_RESTRICT w, float *y, block_q8_1 *yq, int nrows,
                                                 int dv, float eps) {
    LE_SCRATCH(scratch, GDN_NORM_THREADS);
    const int warp = threadIdx.x / LE_WARP;
    for (int r = blockIdx.x; r < nrows; r += gridDim.x) {
        const float *x = o + (size_t)r * dv;
        const float *zr = z + (size_t)r * dv;
        float *yr = y + (size_t)r * dv;
        float ss = 0.0f;
        for (int i = threadIdx.x; i < dv; i += GDN_NORM_THREADS) ss += x[i] * x[i];
        ss = le_block_sum(ss, scratch);
        const float scale = 1.0f / sqrtf(ss / dv + eps);
        /* the reference's order: (x * scale) * w, then * SiLU(z) */
        for (int i = threadIdx.x; i < dv; i += GDN_NORM_THREADS) yr[i] = x[i] * scale * le_ldg(w + i) * gdn_silu(zr[i]);
        if (!yq) continue;
        __syncthreads(); /* the row is written (and the block sum's scratch read) before the warps quantise it */
        const int nb = dv / QK8_1;
        /* one warp per block of 32, add_rmsnorm_f32's (= quantize_q8_1's) expressions; the bound is the block's */
        for (int base = 0; base < nb; base += GDN_NORM_THREADS / LE_WARP)
            le_q8_1_block(yr, yq + (size_t)r * nb, base + warp, nb, scratch);
        __syncthreads(); /* fermi: the warp sums' scratch is free before the next row's block sum */
    }
}
