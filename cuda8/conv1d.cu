/* conv1d.cu — the GDN causal depthwise convolution + SiLU over n tokens, with its conv state.
 *
 * Reference: native/gdn.c le_gdn_layer (the conv block):
 *   xin = [state (K-1 rows, oldest first) ; x (n rows)]           [(K-1)+n, conv_dim]
 *   y[t, c] = SiLU(sum_k w[c, k] * xin[t + k, c])                 (tap K-1 is token t itself)
 *   state  <- the last K-1 rows of xin
 *
 *   conv1d_silu_f32(x, w, state, y, n, conv_dim, K)
 *     x: [n, conv_dim] f32 (the raw qkv projection), w: [conv_dim, K] f32, state: [K-1, conv_dim] f32
 *     (read only here), y: [n, conv_dim] f32 (not x); K <= CONV_MAX_K
 *     launch: block CONV_THREADS (128) x 1 x 1, grid ceil(conv_dim/128) x min(ceil(n/CONV_TOKENS), 65535) x 1
 *   conv1d_state_f32(x, state, n, conv_dim, K)                     the state update, launched after
 *     launch: block CONV_THREADS x 1 x 1, grid ceil(conv_dim/128) x 1 x 1
 *   conv1d_step_l2norm_f32(x, w, state, y, conv_dim, K, Hk, dk, qscale, eps)   a decode step's three in one
 *     one token: conv1d_silu_f32, conv1d_state_f32, then gdn.cu's gdn_l2norm_qk_f32 on y (rows q | k | v: the Hk q
 *     and Hk k heads of dk channels l2-normalised, q then * qscale), the same bits as the three launches (each
 *     channel's taps summed in the same order, the heads' squares by the same block sum); dk <= CONV_THREADS.
 *     Block b < 2 Hk takes head b's dk channels, the rest the v channels CONV_THREADS at a time; every thread
 *     reads its channel's state before it writes it (no other thread touches that channel).
 *     launch: block CONV_THREADS x 1 x 1, grid 2 Hk + ceil((conv_dim - 2 Hk dk) / CONV_THREADS) x 1 x 1
 * One thread per channel (reads and writes of a token row are coalesced); grid.y splits the tokens
 * into runs of CONV_TOKENS, each starting from the K-1 inputs before it (from x, or the state for
 * the first ones). why the state update is its own kernel: the run of the first tokens reads the
 * old state while the run of the last tokens would write the new one, with no order between
 * blocks; a second launch on the same stream orders them.
 * The window lives in registers: CONV_MAX_K slots, the kernel's K right-aligned (every index a
 * constant after unrolling, so nothing goes to local memory); the sum runs k = 0 … K-1 like the
 * reference, so only FMA contraction and expf (<= 2 ulp) differ.
 * Tiers: all (no warp or block exchange at all).
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k conv1d
 */
#include "compat.cuh"

#define CONV_THREADS 128
#define CONV_TOKENS 64 /* tokens per block along grid.y */
#define CONV_MAX_K 8   /* Qwen3.5 / Qwen3-Next: K = 4 */

/* SiLU as the reference's le_silu: x / (1 + e^-x) */
__device__ __forceinline__ float conv_silu(float x) { return x / (1.0f + expf(-x)); }

extern "C" __global__ void conv1d_silu_f32(const float *LE_RESTRICT x, const float *LE_RESTRICT w,
                                           const float *LE_RESTRICT state, float *LE_RESTRICT y, int n,
                                           int conv_dim, int K) {
    const int c = blockIdx.x * CONV_THREADS + threadIdx.x;
    if (c >= conv_dim) return;
    const int lo = CONV_MAX_K - K; /* slots [lo, CONV_MAX_K) hold taps 0 … K-1 */
    float wk[CONV_MAX_K];
#pragma unroll
    for (int s = 0; s < CONV_MAX_K; s++) wk[s] = s >= lo ? le_ldg(w + (size_t)c * K + (s - lo)) : 0.0f;
    for (int t0 = blockIdx.y * CONV_TOKENS; t0 < n; t0 += gridDim.y * CONV_TOKENS) {
        /* window slot s holds the input of token t - (CONV_MAX_K-1-s); slot CONV_MAX_K-1 is token t */
        float win[CONV_MAX_K];
#pragma unroll
        for (int s = 0; s < CONV_MAX_K - 1; s++) {
            const int tt = t0 - (CONV_MAX_K - 1 - s); /* < t0; the state row K-1+tt when negative */
            win[s] = 0.0f;
            if (s >= lo) win[s] = tt >= 0 ? x[(size_t)tt * conv_dim + c] : le_ldg(state + (size_t)(K - 1 + tt) * conv_dim + c);
        }
        const int t1 = t0 + CONV_TOKENS < n ? t0 + CONV_TOKENS : n;
        for (int t = t0; t < t1; t++) {
            win[CONV_MAX_K - 1] = x[(size_t)t * conv_dim + c];
            float acc = 0.0f;
#pragma unroll
            for (int s = 0; s < CONV_MAX_K; s++)
                if (s >= lo) acc += wk[s] * win[s];
            y[(size_t)t * conv_dim + c] = conv_silu(acc);
#pragma unroll
            for (int s = 0; s < CONV_MAX_K - 1; s++) win[s] = win[s + 1];
        }
    }
}

/* One token's output of channel c (conv1d_silu_f32's window and sum for t = 0 of a one-token run) before the SiLU;
 * its state row r <- row r + 1, the last <- x (conv1d_state_f32 for n = 1), after the window is read. */
__device__ __forceinline__ float conv_step_channel(const float *LE_RESTRICT x, const float *LE_RESTRICT w,
                                                   float *state, int conv_dim, int K, int c) {
    const int lo = CONV_MAX_K - K;
    float wk[CONV_MAX_K], win[CONV_MAX_K];
#pragma unroll
    for (int s = 0; s < CONV_MAX_K; s++) wk[s] = s >= lo ? le_ldg(w + (size_t)c * K + (s - lo)) : 0.0f;
#pragma unroll
    for (int s = 0; s < CONV_MAX_K - 1; s++) {
        const int tt = -(CONV_MAX_K - 1 - s);
        win[s] = s >= lo ? state[(size_t)(K - 1 + tt) * conv_dim + c] : 0.0f;
    }
    win[CONV_MAX_K - 1] = x[c];
    float acc = 0.0f;
#pragma unroll
    for (int s = 0; s < CONV_MAX_K; s++)
        if (s >= lo) acc += wk[s] * win[s];
    for (int r = 0; r < K - 1; r++)
        state[(size_t)r * conv_dim + c] = r + 1 < K - 1 ? state[(size_t)(r + 1) * conv_dim + c] : x[c];
    return acc;
}

extern "C" __global__ void conv1d_step_l2norm_f32(const float *LE_RESTRICT x, const float *LE_RESTRICT w, float *state,
                                                  float *LE_RESTRICT y, int conv_dim, int K, int Hk, int dk,
                                                  float qscale, float eps) {
    LE_SCRATCH(scratch, CONV_THREADS);
    const int b = blockIdx.x, tid = threadIdx.x;
    if (b >= 2 * Hk) { /* v channels: conv and SiLU only */
        const int c = 2 * Hk * dk + (b - 2 * Hk) * CONV_THREADS + tid;
        if (c < conv_dim) y[c] = conv_silu(conv_step_channel(x, w, state, conv_dim, K, c));
        return;
    }
    const int c = b * dk + tid; /* head b: q heads 0 … Hk-1, k heads Hk … 2Hk-1 */
    const bool on = tid < dk;
    const float v = on ? conv_silu(conv_step_channel(x, w, state, conv_dim, K, c)) : 0.0f;
    float ss = 0.0f;
    if (on) ss += v * v;
    ss = le_block_sum(ss, scratch);
    const float scale = 1.0f / sqrtf(ss + eps);
    /* why two multiplications for q: the reference rounds x * scale, then * qscale (gdn_l2norm_qk_f32) */
    if (on) {
        const float r = v * scale;
        y[c] = b < Hk ? r * qscale : r;
    }
}

/* state[r] <- xin[n + r], r = 0 … K-2: an older state row while n + r < K-1, else x[n + r - (K-1)].
 * In place: row r reads row n + r > r, which is overwritten only later (r increasing). */
extern "C" __global__ void conv1d_state_f32(const float *LE_RESTRICT x, float *state, int n, int conv_dim, int K) {
    const int c = blockIdx.x * CONV_THREADS + threadIdx.x;
    if (c >= conv_dim) return;
    for (int r = 0; r < K - 1; r++) {
        const int src = r + n;
        state[(size_t)r * conv_dim + c] =
            src < K - 1 ? state[(size_t)src * conv_dim + c] : x[(size_t)(src - (K - 1)) * conv_dim + c];
    }
}
