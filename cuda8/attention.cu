/* attention.cu — gated full attention over an f32 KV cache (spec §2.4): decode (split-K) and prefill.
 *
 * Reference: native/attention.c attn_rows. q, k already RMSNormed and RoPE'd; the cache holds every key so far:
 *   qg: [n, n_head * 2 * hd] f32, per head q_h (hd) then gate_h (hd)   (attn_q's rows interleaved per head)
 *   kc, vc: [n_ctx, n_kv * hd] f32;  query head h reads kv head h / (n_head / n_kv)
 *   o_h = softmax(scale q_h K^T, causal) V * sigmoid(gate_h);  o: [n, n_head * hd]
 *
 *   attn_decode_partial_f32(qg, kc, vc, part, n_keys, n_head, n_kv, hd, scale, keys_per_split, pos_dev)
 *     one query token over keys [0, n_keys); block (h, split) takes keys [split*kps, (split+1)*kps)
 *     part: [n_head, n_split, hd + 2] f32: the split's unnormalised sum_p e^(s_p - m) v_p (hd), m, l = sum e^(s_p - m)
 *     launch: block ATTN_THREADS (128) x 1 x 1, grid n_head x n_split x 1 (n_split = ceil(n_keys / kps) <= 65535)
 *     pos_dev: NULL, or a device int holding the token's position: then n_keys = *pos_dev + 1, split over at
 *     most the grid's n_split blocks, at least ATTN_MIN_KEYS_PER_SPLIT keys each (attn_keys_per_split; a decode
 *     step replayed with fixed arguments, a LaunchPlan): the blocks past the last used split return and
 *     the merge (given pos_dev too) reads only the used ones. Without pos_dev, splits left empty (keys_per_split
 *     * split >= n_keys) hand the merge m = NEG_BIG, l = 0, which weigh nothing
 *   attn_kv_store_f32(k, v, kc, vc, pos_dev, kvw)
 *     copies this token's k and v rows [kvw] into row *pos_dev of the caches
 *     launch: block ATTN_THREADS x 1 x 1, grid ceil(kvw / ATTN_THREADS) x 1 x 1
 *   attn_decode_merge_f32(part, qg, o, n_head, hd, n_split, pos_dev)
 *     log-sum-exp merge: M = max m_s, o = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, times sigmoid(gate);
 *     the splits spread over the block's threads for M and the weights (loads in parallel, not one split after
 *     another); pos_dev as the partial kernel's (then only the used splits are read)
 *     launch: block ATTN_THREADS x 1 x 1, grid n_head x 1 x 1
 *   attn_prefill_f32(qg, kc, vc, o, n, pos, n_head, n_kv, hd, scale)
 *     n query tokens at positions pos … pos+n-1 (their keys already in the cache), token t sees keys 0 … pos+t
 *     launch: block ATTN_PREFILL_THREADS (256) x 1 x 1, grid n_head x min(ceil(n / ATTN_QTILE), 65535) x 1
 *     (query tiles grid-strided)
 *   attn_prefill_tiled_f32(same arguments)       the prefill as register-tiled products (kepler and dp4a tiers)
 *     launch: block ATTN_T_THREADS (128) x 1 x 1, grid n_head x min(ceil(n / ATTN_T_Q), 65535) x 1; hd a multiple
 *     of ATTN_T_D (32)
 *   attn_kv_planes_f16(kc, vc, planes, n_keys, n_kv, hd, nkp), then
 *   attn_prefill_mma_f32(qg, planes, o, n, pos, n_head, n_kv, hd, scale, nkp)     the prefill on f16 tensor cores at
 *     f32 grade (dp4a tier from sm_75: LE_HAS_MMA_F16): the keys 0 .. pos+n-1 as f16 hi / lo planes (nkp = their
 *     count rounded up to ATTN_M_K), then per block ATTN_M_Q (32) queries of one head, tiles of ATTN_M_K (16) keys
 *     launch: planes block ATTN_P_THREADS x 1 x 1, grid min(ceil(n_kv * nkp * hd / 2 / ATTN_P_THREADS), 65535) x 2;
 *     prefill block ATTN_M_THREADS (128) x 1 x 1, grid n_head x min(ceil(n / ATTN_M_Q), 65535) x 1; hd a multiple of 16
 *   hd: a multiple of 32, <= ATTN_MAX_HD (256, Qwen3.5's head size).
 *
 * Decode: each warp takes every ATTN_WARPS-th key of the split, ATTN_UNROLL keys a step (their K
 * rows loaded and warp-summed together, one rescale per step: a step waits for one load and one
 * sum, not four); lane l holds q and the running output for dims l, l+32, … (coalesced rows of K
 * and V); an online softmax (running max m, sum l) per warp; the block merges its warps, the
 * merge kernel the splits. All partials are f32 (the issue insists: fp16 partials lose the small weights).
 * Prefill: a block takes ATTN_QTILE queries of one head (one per warp; two per warp spill on
 * Fermi's 63 registers) and walks the keys in tiles of ATTN_KTILE = 32 through shared memory:
 * lane l scores key l of the tile against the warp's query (K rows padded to hd+1 floats:
 * conflict-free), a warp max / sum updates the online softmax, the weights go through shared
 * memory, then the V tile (in the same buffer) is accumulated into each lane's dims.
 * Shared: 8 + 32.9 + 1 + 1 KB, under Fermi's 48.
 * Masked (future) keys get ATTN_NEG_BIG, not -inf: e^(NEG_BIG - m) is 0 and m - m never makes a NaN.
 * The reference sums the softmax denominator in f64 and normalises first; here the order of
 * sums and roundings differs (bound: tests/test_gpu.py ATTN_EXTRA).
 * Tiled prefill (LE_HAS_MANY_REGS): a block takes ATTN_T_Q (32) queries of one head and walks the keys in tiles of
 * ATTN_T_K (32). Scores: thread (tq, tk) = (t / 8, t % 8) computes queries 2tq, 2tq+1 x keys 4tk … 4tk+3 over
 * the tile's queries (every dim, in shared memory) and chunks of ATTN_T_D (32) dims of K staged in shared memory,
 * each chunk fetched into registers while the one before is computed (6 shared loads per 8 FMAs; the
 * one-query-per-warp kernel makes 2 per FMA); the scores go through shared memory, where warp w updates rows 8w … 8w+7's online softmax
 * (m, l, and alpha, the old sum's factor); then P V: the thread keeps its 2 queries x (tk + 8i, i < 4) dims of
 * every 32-dim chunk of V in 64 registers (V rows read conflict-free, P broadcast).
 * Tensor-core prefill: every operand x (q, k, v, the weights p) as x_hi = f16(x), x_lo = f16(x - x_hi) and each product
 * as lo.hi + hi.lo + hi.hi on f16 mma with f32 accumulators: the dropped lo.lo and the halves' roundings leave ~2^-22
 * of each term (f32 rounds at 2^-24), within the f32 kernels' bound (tests/test_gpu.py ATTN_EXTRA); q and k after
 * their RMSNorm and v are far inside f16's range. Shared: Q's halves 32 KB + one K or V tile's 16 KB.
 * Not here yet: one block per kv head for GQA (K and V are read once per query head; the other
 * heads of the group hit L2), fp16 / quantised KV caches, and cp.async double-buffered tiles (sm_80+).
 * Tiers: all (fermi: warp sums and maxima in shared memory, plain loads).
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k attn
 */
#include "compat.cuh"

#define ATTN_THREADS 128
#define ATTN_WARPS 4 /* ATTN_THREADS / LE_WARP */
#define ATTN_MAX_HD 256
#define ATTN_DIMS 8 /* ATTN_MAX_HD / LE_WARP: dims per lane */
#define ATTN_MERGE_DIMS 2 /* ATTN_MAX_HD / ATTN_THREADS: dims per thread of the decode merge */
#if LE_HAS_MANY_REGS
#define ATTN_UNROLL 4 /* decode: keys per warp a step (their loads in flight together) */
#else
#define ATTN_UNROLL 2 /* sm_20/sm_30: 63 registers (q, acc and 2 keys' rows: no spill) */
#endif
#define ATTN_PREFILL_THREADS 256 /* prefill: 8 warps, one query each */
#define ATTN_QTILE 8             /* prefill: queries per block (= its warps) */
#define ATTN_KTILE 32 /* prefill: keys per tile, one per lane */
#define ATTN_NEG_BIG (-1e30f)
#define ATTN_T_THREADS 128 /* tiled prefill: 4 warps */
#define ATTN_T_Q 32        /* tiled prefill: queries per block, 2 per thread row group */
#define ATTN_T_K 32        /* tiled prefill: keys per tile, 4 per thread */
#define ATTN_T_D 32        /* tiled prefill: dims per staged chunk of k and v */
#define ATTN_MIN_KEYS_PER_SPLIT 32 /* decode: the fewest keys a split takes (pos_dev: in the kernels; else the launcher's) */

__device__ __forceinline__ float attn_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* a replayed decode step's split of n_keys keys over at most n_split blocks: at least ATTN_MIN_KEYS_PER_SPLIT keys
 * a split (a multiple of the warps), so a short context uses few splits and the merge reads only those */
__device__ __forceinline__ int attn_keys_per_split(int n_keys, int n_split) {
    int kps = (n_keys + n_split - 1) / n_split;
    kps = kps > ATTN_MIN_KEYS_PER_SPLIT ? kps : ATTN_MIN_KEYS_PER_SPLIT;
    return (kps + ATTN_WARPS - 1) / ATTN_WARPS * ATTN_WARPS;
}

extern "C" __global__ void attn_decode_partial_f32(const float *LE_RESTRICT qg, const float *LE_RESTRICT kc,
                                                   const float *LE_RESTRICT vc, float *LE_RESTRICT part, int n_keys,
                                                   int n_head, int n_kv, int hd, float scale, int keys_per_split,
                                                   const int *LE_RESTRICT pos_dev) {
    LE_SCRATCH(scratch, ATTN_THREADS);
    __shared__ float wm[ATTN_WARPS], wl[ATTN_WARPS];
    __shared__ float wacc[ATTN_WARPS][ATTN_MAX_HD];
    const int lane = threadIdx.x % LE_WARP, warp = threadIdx.x / LE_WARP;
    const int h = blockIdx.x, split = blockIdx.y, n_split = gridDim.y;
    const int kvh = h / (n_head / n_kv), nd = hd / LE_WARP;
    const size_t kvw = (size_t)n_kv * hd;
    const float *q = qg + (size_t)h * 2 * hd;
    float qv[ATTN_DIMS], acc[ATTN_DIMS];
#pragma unroll
    for (int r = 0; r < ATTN_DIMS; r++) {
        qv[r] = r < nd ? le_ldg(q + lane + LE_WARP * r) : 0.0f;
        acc[r] = 0.0f;
    }
    float m = ATTN_NEG_BIG, l = 0.0f;
    if (pos_dev) { /* the position lives on the device (a replayed decode step): keys [0, pos] */
        n_keys = *pos_dev + 1;
        keys_per_split = attn_keys_per_split(n_keys, n_split);
        if (split >= (n_keys + keys_per_split - 1) / keys_per_split) return; /* unused: the merge skips it */
    }
    const int k0 = split * keys_per_split;
    const int k1 = k0 + keys_per_split < n_keys ? k0 + keys_per_split : n_keys;
    /* ATTN_UNROLL keys per warp a step: their K rows are loaded and scored together (independent loads and warp
     * sums in flight: a step's latency is one load + one sum, not ATTN_UNROLL of them), then one rescale.
     * The loop bound is the block's: le_warp_sum synchronises the block on fermi */
    for (int base = k0; base < k1; base += ATTN_WARPS * ATTN_UNROLL) {
        float s[ATTN_UNROLL];
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; u++) {
            const int p = base + warp + ATTN_WARPS * u;
            const float *kp = kc + (size_t)p * kvw + (size_t)kvh * hd;
            float d = 0.0f;
#pragma unroll
            for (int r = 0; r < ATTN_DIMS; r++)
                if (p < k1 && r < nd) d += qv[r] * le_ldg(kp + lane + LE_WARP * r);
            s[u] = d;
        }
        float mn = m;
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; u++) {
            s[u] = le_warp_sum(s[u], scratch) * scale;
            if (base + warp + ATTN_WARPS * u < k1) mn = fmaxf(mn, s[u]);
        }
        const float alpha = expf(m - mn);
        l *= alpha;
#pragma unroll
        for (int r = 0; r < ATTN_DIMS; r++) acc[r] *= alpha;
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; u++) {
            const int p = base + warp + ATTN_WARPS * u;
            if (p < k1) {
                const float e = expf(s[u] - mn);
                const float *vp = vc + (size_t)p * kvw + (size_t)kvh * hd;
                l += e;
#pragma unroll
                for (int r = 0; r < ATTN_DIMS; r++)
                    if (r < nd) acc[r] += e * le_ldg(vp + lane + LE_WARP * r);
            }
        }
        m = mn;
    }
    /* merge the warps: M = max m_w; acc = sum_w e^(m_w - M) acc_w; l likewise */
    if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
    }
#pragma unroll
    for (int r = 0; r < ATTN_DIMS; r++)
        if (r < nd) wacc[warp][lane + LE_WARP * r] = acc[r];
    __syncthreads();
    float M = wm[0];
    for (int w = 1; w < ATTN_WARPS; w++) M = fmaxf(M, wm[w]);
    float *out = part + ((size_t)h * n_split + split) * (hd + 2);
    for (int e = threadIdx.x; e < hd; e += ATTN_THREADS) {
        float a = 0.0f;
        for (int w = 0; w < ATTN_WARPS; w++) a += wacc[w][e] * expf(wm[w] - M);
        out[e] = a;
    }
    if (threadIdx.x == 0) {
        float L = 0.0f;
        for (int w = 0; w < ATTN_WARPS; w++) L += wl[w] * expf(wm[w] - M);
        out[hd] = M;
        out[hd + 1] = L;
    }
}

extern "C" __global__ void attn_decode_merge_f32(const float *LE_RESTRICT part, const float *LE_RESTRICT qg,
                                                 float *LE_RESTRICT o, int n_head, int hd, int n_split,
                                                 const int *LE_RESTRICT pos_dev) {
    LE_SCRATCH(scratch, ATTN_THREADS);
    __shared__ float wsh[ATTN_THREADS];
    const int h = blockIdx.x, t = threadIdx.x;
    const float *ph = part + (size_t)h * n_split * (hd + 2); /* [n_split, hd + 2] of head h, as the grid wrote */
    if (pos_dev) { /* only the splits the partial kernel used (attn_keys_per_split) */
        const int n_keys = *pos_dev + 1, kps = attn_keys_per_split(n_keys, n_split);
        n_split = (n_keys + kps - 1) / kps;
    }
    const float *gate = qg + (size_t)h * 2 * hd + hd;
    /* M = max m_s: the splits spread over the threads, then the block's max */
    float M = ATTN_NEG_BIG;
    for (int s = t; s < n_split; s += ATTN_THREADS) M = fmaxf(M, le_ldg(ph + (size_t)s * (hd + 2) + hd));
    M = le_block_max(M, scratch);
    /* per chunk of ATTN_THREADS splits: thread t weighs split c0 + t (w = e^(m - M)) into shared memory, then each
     * thread sums its dims over the chunk (independent loads) */
    float acc[ATTN_MERGE_DIMS], L = 0.0f;
#pragma unroll
    for (int r = 0; r < ATTN_MERGE_DIMS; r++) acc[r] = 0.0f;
    for (int c0 = 0; c0 < n_split; c0 += ATTN_THREADS) {
        const int s = c0 + t;
        const float w = s < n_split ? expf(le_ldg(ph + (size_t)s * (hd + 2) + hd) - M) : 0.0f;
        if (s < n_split) L += w * le_ldg(ph + (size_t)s * (hd + 2) + hd + 1);
        __syncthreads(); /* the previous chunk's weights are read */
        wsh[t] = w;
        __syncthreads();
        const int nc = n_split - c0 < ATTN_THREADS ? n_split - c0 : ATTN_THREADS;
#pragma unroll 8
        for (int j = 0; j < nc; j++) { /* unrolled: 8 splits' loads in flight, not one after another */
            const float *ps = ph + (size_t)(c0 + j) * (hd + 2);
            const float wj = wsh[j];
#pragma unroll
            for (int r = 0; r < ATTN_MERGE_DIMS; r++) {
                const int e = t + ATTN_THREADS * r;
                if (e < hd) acc[r] += le_ldg(ps + e) * wj;
            }
        }
    }
    L = le_block_sum(L, scratch);
#pragma unroll
    for (int r = 0; r < ATTN_MERGE_DIMS; r++) {
        const int e = t + ATTN_THREADS * r;
        if (e < hd) o[(size_t)h * hd + e] = acc[r] / L * attn_sigmoid(le_ldg(gate + e));
    }
}

/* rows k0 … k0+ATTN_KTILE-1 of a cache (row p at base + p * stride, hd floats) into tile; rows >= n_keys as 0.
 * Warp w loads rows w, w + 8, …: no division per element. */
__device__ __forceinline__ void attn_load_tile(const float *LE_RESTRICT base, size_t stride, int k0, int n_keys,
                                               int hd, float (*tile)[ATTN_MAX_HD + 1]) {
    const int lane = threadIdx.x % LE_WARP;
    for (int kk = threadIdx.x / LE_WARP; kk < ATTN_KTILE; kk += ATTN_PREFILL_THREADS / LE_WARP) {
        const float *row = base + (size_t)(k0 + kk) * stride;
        const bool in = k0 + kk < n_keys;
        for (int e = lane; e < hd; e += LE_WARP) tile[kk][e] = in ? le_ldg(row + e) : 0.0f;
    }
}

extern "C" __global__ void attn_prefill_f32(const float *LE_RESTRICT qg, const float *LE_RESTRICT kc,
                                            const float *LE_RESTRICT vc, float *LE_RESTRICT o, int n, int pos,
                                            int n_head, int n_kv, int hd, float scale) {
    __shared__ float qs[ATTN_QTILE][ATTN_MAX_HD];
    __shared__ float kvs[ATTN_KTILE][ATTN_MAX_HD + 1]; /* +1: lane l reading row l is conflict-free */
    __shared__ float ps[ATTN_QTILE][ATTN_KTILE];
    LE_SCRATCH(scratch, ATTN_PREFILL_THREADS);
    const int lane = threadIdx.x % LE_WARP, qi = threadIdx.x / LE_WARP; /* warp qi takes query q0 + qi */
    const int h = blockIdx.x, kvh = h / (n_head / n_kv), nd = hd / LE_WARP;
    const size_t kvw = (size_t)n_kv * hd, qw = (size_t)n_head * 2 * hd;
    for (int q0 = blockIdx.y * ATTN_QTILE; q0 < n; q0 += gridDim.y * ATTN_QTILE) {
        __syncthreads(); /* the previous tile is done with qs */
        {
            const int tq = q0 + qi < n ? q0 + qi : n - 1; /* rows past n repeat the last (never written) */
            const float *q = qg + (size_t)tq * qw + (size_t)h * 2 * hd;
            for (int e = lane; e < hd; e += LE_WARP) qs[qi][e] = le_ldg(q + e);
        }
        const int t = q0 + qi;
        const int last = pos + (t < n ? t : n - 1); /* the last key this warp's query sees */
        float m = ATTN_NEG_BIG, l = 0.0f, acc[ATTN_DIMS];
#pragma unroll
        for (int r = 0; r < ATTN_DIMS; r++) acc[r] = 0.0f;
        const int n_keys = pos + (q0 + ATTN_QTILE < n ? q0 + ATTN_QTILE : n); /* keys of the tile's last query */
        for (int k0 = 0; k0 < n_keys; k0 += ATTN_KTILE) {
            __syncthreads(); /* qs loaded; the previous V tile consumed */
            attn_load_tile(kc + (size_t)kvh * hd, kvw, k0, n_keys, hd, kvs);
            __syncthreads();
            /* lane = key k0 + lane of the tile */
            float d = 0.0f;
            for (int e = 0; e < hd; e++) d += qs[qi][e] * kvs[lane][e];
            const bool valid = k0 + lane <= last;
            const float s = valid ? d * scale : ATTN_NEG_BIG;
            const float mn = fmaxf(m, le_warp_max(s, scratch));
            const float alpha = expf(m - mn);
            const float ex = valid ? expf(s - mn) : 0.0f;
            l = l * alpha + le_warp_sum(ex, scratch);
            m = mn;
            ps[qi][lane] = ex;
            __syncthreads(); /* scores done with the K tile; ps written */
            attn_load_tile(vc + (size_t)kvh * hd, kvw, k0, n_keys, hd, kvs);
            __syncthreads();
            const int nk = n_keys - k0 < ATTN_KTILE ? n_keys - k0 : ATTN_KTILE;
#pragma unroll
            for (int r = 0; r < ATTN_DIMS; r++) acc[r] *= alpha;
            for (int kk = 0; kk < nk; kk++) {
                const float pk = ps[qi][kk];
#pragma unroll
                for (int r = 0; r < ATTN_DIMS; r++)
                    if (r < nd) acc[r] += pk * kvs[kk][lane + LE_WARP * r];
            }
        }
        if (t < n) {
            const float *gate = qg + (size_t)t * qw + (size_t)h * 2 * hd + hd;
            float *ot = o + ((size_t)t * n_head + h) * hd;
#pragma unroll
            for (int r = 0; r < ATTN_DIMS; r++)
                if (r < nd) ot[lane + LE_WARP * r] = acc[r] / l * attn_sigmoid(le_ldg(gate + lane + LE_WARP * r));
        }
    }
}

#if LE_HAS_MANY_REGS
#define ATTN_T_PER (ATTN_T_K * ATTN_T_D / ATTN_T_THREADS) /* floats of a staged chunk per thread */

/* chunk ci (< 2 ndc) of the key tile at k0 into registers: K's dims (ci % ndc) * ATTN_T_D … for ci < ndc, then V's;
 * rows >= n_keys as 0. Loaded a chunk ahead of its use: the loads are in flight while the block computes. */
__device__ __forceinline__ void attn_t_fetch(const float *LE_RESTRICT kb, const float *LE_RESTRICT vb, size_t stride,
                                             int k0, int n_keys, int ci, int ndc, float *pf) {
    const float *base = ci < ndc ? kb : vb;
    const int d0 = (ci < ndc ? ci : ci - ndc) * ATTN_T_D;
#pragma unroll
    for (int j = 0; j < ATTN_T_PER; j++) {
        const int i = threadIdx.x + j * ATTN_T_THREADS, r = i / ATTN_T_D, d = i % ATTN_T_D;
        pf[j] = k0 + r < n_keys ? le_ldg(base + (size_t)(k0 + r) * stride + d0 + d) : 0.0f;
    }
}

/* the chunk after ci of the tile at k0 (the next tile's first when ci is its last; none after the last tile) */
__device__ __forceinline__ void attn_t_next(const float *LE_RESTRICT kb, const float *LE_RESTRICT vb, size_t stride,
                                            int k0, int n_keys, int ci, int ndc, float *pf) {
    if (ci + 1 < 2 * ndc)
        attn_t_fetch(kb, vb, stride, k0, n_keys, ci + 1, ndc, pf);
    else if (k0 + ATTN_T_K < n_keys)
        attn_t_fetch(kb, vb, stride, k0 + ATTN_T_K, n_keys, 0, ndc, pf);
}

/* the fetched chunk into shared memory (rows ATTN_T_D + 1 apart: the score loop's rows hit different banks) */
__device__ __forceinline__ void attn_t_store(const float *pf, float (*tile)[ATTN_T_D + 1]) {
    __syncthreads(); /* the previous chunk is consumed */
#pragma unroll
    for (int j = 0; j < ATTN_T_PER; j++) {
        const int i = threadIdx.x + j * ATTN_T_THREADS;
        tile[i / ATTN_T_D][i % ATTN_T_D] = pf[j];
    }
    __syncthreads();
}

extern "C" __global__ void attn_prefill_tiled_f32(const float *LE_RESTRICT qg, const float *LE_RESTRICT kc,
                                                  const float *LE_RESTRICT vc, float *LE_RESTRICT o, int n, int pos,
                                                  int n_head, int n_kv, int hd, float scale) {
    __shared__ float qs[ATTN_T_Q][ATTN_MAX_HD + 1]; /* the tile's queries, every dim */
    __shared__ float ks[ATTN_T_K][ATTN_T_D + 1];    /* a K chunk, or a V chunk */
    __shared__ float ps[ATTN_T_Q][ATTN_T_K + 1];
    __shared__ float m_s[ATTN_T_Q], l_s[ATTN_T_Q], a_s[ATTN_T_Q];
    LE_SCRATCH(scratch, ATTN_T_THREADS);
    const int t = threadIdx.x, tq = t / 8, tk = t % 8, lane = t % LE_WARP, w = t / LE_WARP;
    const int h = blockIdx.x, kvh = h / (n_head / n_kv), ndc = hd / ATTN_T_D;
    const size_t kvw = (size_t)n_kv * hd, qw = (size_t)n_head * 2 * hd;
    const float *kb = kc + (size_t)kvh * hd, *vb = vc + (size_t)kvh * hd;
    for (int q0 = blockIdx.y * ATTN_T_Q; q0 < n; q0 += gridDim.y * ATTN_T_Q) {
        const int n_keys = pos + (q0 + ATTN_T_Q < n ? q0 + ATTN_T_Q : n); /* keys of the tile's last query */
        float acc[ATTN_MAX_HD / ATTN_T_D][2][ATTN_T_D / 8], pf[ATTN_T_PER];
#pragma unroll
        for (int c = 0; c < ATTN_MAX_HD / ATTN_T_D; c++)
#pragma unroll
            for (int i = 0; i < ATTN_T_D / 8; i++) acc[c][0][i] = acc[c][1][i] = 0.0f;
        attn_t_fetch(kb, vb, kvw, 0, n_keys, 0, ndc, pf);
        __syncthreads(); /* the previous tile is done with qs, m_s, l_s */
        for (int i = t; i < ATTN_T_Q * hd; i += ATTN_T_THREADS) {
            const int r = i / hd, tok = q0 + r < n ? q0 + r : n - 1; /* rows past n repeat the last (not written) */
            qs[r][i % hd] = le_ldg(qg + (size_t)tok * qw + (size_t)h * 2 * hd + i % hd);
        }
        if (t < ATTN_T_Q) {
            m_s[t] = ATTN_NEG_BIG;
            l_s[t] = 0.0f;
        }
        for (int k0 = 0; k0 < n_keys; k0 += ATTN_T_K) {
            float sc[2][4];
#pragma unroll
            for (int j = 0; j < 4; j++) sc[0][j] = sc[1][j] = 0.0f;
#pragma unroll
            for (int c = 0; c < ATTN_MAX_HD / ATTN_T_D; c++) {
                if (c >= ndc) break;
                attn_t_store(pf, ks);
                attn_t_next(kb, vb, kvw, k0, n_keys, c, ndc, pf);
#pragma unroll 4
                for (int d = 0; d < ATTN_T_D; d++) {
                    const float a0 = qs[2 * tq][c * ATTN_T_D + d], a1 = qs[2 * tq + 1][c * ATTN_T_D + d];
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        const float b = ks[4 * tk + j][d];
                        sc[0][j] += a0 * b;
                        sc[1][j] += a1 * b;
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < 2; r++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int key = k0 + 4 * tk + j, last = pos + min(q0 + 2 * tq + r, n - 1);
                    ps[2 * tq + r][4 * tk + j] = key <= last ? sc[r][j] * scale : ATTN_NEG_BIG;
                }
            __syncthreads();
            /* warp w: the online softmax of rows 8w … 8w+7, lane = key */
            for (int r = 8 * w; r < 8 * w + 8; r++) {
                const float s = ps[r][lane], m_old = m_s[r];
                const float mn = fmaxf(m_old, le_warp_max(s, scratch));
                const float ex = s > 0.5f * ATTN_NEG_BIG ? expf(s - mn) : 0.0f;
                const float sum = le_warp_sum(ex, scratch);
                ps[r][lane] = ex;
                if (lane == 0) {
                    const float alpha = expf(m_old - mn);
                    a_s[r] = alpha;
                    l_s[r] = l_s[r] * alpha + sum;
                    m_s[r] = mn;
                }
            }
            __syncthreads();
            const float al0 = a_s[2 * tq], al1 = a_s[2 * tq + 1];
#pragma unroll
            for (int c = 0; c < ATTN_MAX_HD / ATTN_T_D; c++) {
                if (c >= ndc) break;
                attn_t_store(pf, ks);
                attn_t_next(kb, vb, kvw, k0, n_keys, ndc + c, ndc, pf);
#pragma unroll
                for (int i = 0; i < ATTN_T_D / 8; i++) {
                    acc[c][0][i] *= al0;
                    acc[c][1][i] *= al1;
                }
#pragma unroll 2
                for (int kk = 0; kk < ATTN_T_K; kk++) {
                    const float p0 = ps[2 * tq][kk], p1 = ps[2 * tq + 1][kk];
#pragma unroll
                    for (int i = 0; i < ATTN_T_D / 8; i++) {
                        const float v = ks[kk][tk + 8 * i];
                        acc[c][0][i] += p0 * v;
                        acc[c][1][i] += p1 * v;
                    }
                }
            }
        }
        __syncthreads(); /* l_s final */
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int tok = q0 + 2 * tq + r;
            if (tok >= n) continue;
            const float inv = 1.0f / l_s[2 * tq + r];
            const float *gate = qg + (size_t)tok * qw + (size_t)h * 2 * hd + hd;
            float *ot = o + ((size_t)tok * n_head + h) * hd;
#pragma unroll
            for (int c = 0; c < ATTN_MAX_HD / ATTN_T_D; c++)
#pragma unroll
                for (int i = 0; i < ATTN_T_D / 8; i++) {
                    const int e = c * ATTN_T_D + tk + 8 * i;
                    if (c < ndc) ot[e] = acc[c][r][i] * inv * attn_sigmoid(le_ldg(gate + e));
                }
        }
    }
}
#endif

#if LE_HAS_MMA_F16
#define ATTN_M_THREADS 128           /* mma prefill: 4 warps, 16 queries and half the dims each */
#define ATTN_M_Q 32                  /* queries a block */
#define ATTN_M_K 16                  /* keys a tile */
#define ATTN_M_W (ATTN_MAX_HD / 2)   /* words (f16 pairs) a row of Q or K */
#define ATTN_P_THREADS 256           /* attn_kv_planes_f16 */
#if ATTN_M_Q * 4 != ATTN_M_THREADS
#error "16 queries a warp pair"
#endif

/* Where word w (< 8 in a group of 8) of a fragment row sits: words t and t + 4, which one lane reads together, side by
 * side (one 8-byte load) */
__device__ __forceinline__ int attn_m_perm(int w) { return (w & ~7) | ((w & 3) << 1) | ((w >> 2) & 1); }
/* position p of row r of a [rows][ATTN_M_W] array: XOR-swizzled so a warp's fragment reads (rows g, positions 8k + 2t)
 * hit every bank once a wavefront */
__device__ __forceinline__ int attn_m_qk(int r, int p) { return r * ATTN_M_W + (p ^ ((r & 7) << 2)); }
/* position p of dim d's row of the transposed V tile [ATTN_MAX_HD][ATTN_M_K / 2] (dims 4 .. 7 of each 8 shifted by 4
 * words, likewise) */
__device__ __forceinline__ int attn_m_v(int d, int p) { return d * (ATTN_M_K / 2) + (p ^ (((d >> 2) & 1) << 2)); }

/* The pass's keys 0 .. n_keys - 1 as f16 hi / lo planes (le_split_f16x2), in the fragments' word order (attn_m_perm),
 * zero up to nkp (a multiple of ATTN_M_K): words [4][n_kv][nkp * hd / 2]: K hi, K lo as [kv][key][dim pair], V hi,
 * V lo transposed, [kv][dim][key pair]. The prefill then stages a tile by plain copies.
 *   launch: block ATTN_P_THREADS x 1 x 1, grid min(ceil(n_kv * nkp * hd / 2 / ATTN_P_THREADS), 65535) x 2 x 1
 *   (y = 0: K, 1: V) */
extern "C" __global__ void attn_kv_planes_f16(const float *LE_RESTRICT kc, const float *LE_RESTRICT vc,
                                              unsigned *LE_RESTRICT planes, int n_keys, int n_kv, int hd, int nkp) {
    const int hw = hd / 2, kvw = n_kv * hd;
    const long long total = (long long)n_kv * nkp * hw;
    unsigned *hi = planes + (size_t)(2 * blockIdx.y) * total, *lo = hi + total;
    for (long long i = blockIdx.x * (long long)ATTN_P_THREADS + threadIdx.x; i < total;
         i += (long long)gridDim.x * ATTN_P_THREADS) {
        float x, y;
        long long at;
        if (blockIdx.y == 0) { /* word w of key `key`: dims 2w, 2w + 1 */
            const int kv = (int)(i / ((long long)nkp * hw)), rem = (int)(i % ((long long)nkp * hw));
            const int key = rem / hw, w = rem % hw;
            const float *src = kc + (size_t)key * kvw + (size_t)kv * hd + 2 * w;
            x = key < n_keys ? src[0] : 0.0f;
            y = key < n_keys ? src[1] : 0.0f;
            at = ((long long)kv * nkp + key) * hw + attn_m_perm(w);
        } else { /* word kp of dim d: keys 2kp, 2kp + 1 */
            const int kv = (int)(i / ((long long)hd * (nkp / 2))), rem = (int)(i % ((long long)hd * (nkp / 2)));
            const int d = rem / (nkp / 2), kp = rem % (nkp / 2);
            const float *src = vc + (size_t)(2 * kp) * kvw + (size_t)kv * hd + d;
            x = 2 * kp < n_keys ? src[0] : 0.0f;
            y = 2 * kp + 1 < n_keys ? src[kvw] : 0.0f;
            at = ((long long)kv * hd + d) * (nkp / 2) + attn_m_perm(kp);
        }
        le_split_f16x2(x, y, hi[at], lo[at]);
    }
}

/* s[j] += the scores of rows r0, r0 + 8 and keys 8j + g's 16 dims at fragment position pa (= 8k + 2t): lo.hi + hi.lo +
 * hi.hi */
__device__ __forceinline__ void attn_m_scores(const unsigned *qh, const unsigned *ql, const unsigned *kvh,
                                              const unsigned *kvl, int r0, int g, int pa, float (*s)[4]) {
    const uint2 a02 = *(const uint2 *)&qh[attn_m_qk(r0, pa)], a13 = *(const uint2 *)&qh[attn_m_qk(r0 + 8, pa)];
    const uint2 l02 = *(const uint2 *)&ql[attn_m_qk(r0, pa)], l13 = *(const uint2 *)&ql[attn_m_qk(r0 + 8, pa)];
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const int at = attn_m_qk(8 * j + g, pa);
        const uint2 b = *(const uint2 *)&kvh[at], c = *(const uint2 *)&kvl[at];
        le_mma_f16_16x8x16(s[j], l02.x, l13.x, l02.y, l13.y, b.x, b.y); /* the small terms first */
        le_mma_f16_16x8x16(s[j], a02.x, a13.x, a02.y, a13.y, c.x, c.y);
        le_mma_f16_16x8x16(s[j], a02.x, a13.x, a02.y, a13.y, b.x, b.y);
    }
}

/* The tile's scores s + s2 (keys k + 8j + c % 2 for the lane's rows r0 (c < 2, last key last0) and r0 + 8 (last1))
 * masked and scaled, then the online softmax within the lane quad that holds a row: s <- the weights e^(s - m),
 * m and l updated, alpha the old sum's factor per row */
__device__ __forceinline__ void attn_m_softmax(float (*s)[4], const float (*s2)[4], int k, int last0, int last1,
                                               float scale, volatile float *no_scratch, float *m, float *l,
                                               float *alpha) {
    float mx[2] = {ATTN_NEG_BIG, ATTN_NEG_BIG}, sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int key = k + 8 * j + c % 2;
            s[j][c] = key <= (c < 2 ? last0 : last1) ? (s[j][c] + s2[j][c]) * scale : ATTN_NEG_BIG;
            mx[c / 2] = fmaxf(mx[c / 2], s[j][c]);
        }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mx[r] = fmaxf(mx[r], le_shfl_xor(mx[r], 1, no_scratch));
        mx[r] = fmaxf(mx[r], le_shfl_xor(mx[r], 2, no_scratch));
        const float mn = fmaxf(m[r], mx[r]);
        alpha[r] = expf(m[r] - mn);
        m[r] = mn;
    }
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            s[j][c] = s[j][c] > 0.5f * ATTN_NEG_BIG ? expf(s[j][c] - m[c / 2]) : 0.0f;
            sum[c / 2] += s[j][c];
        }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        sum[r] += le_shfl_xor(sum[r], 1, no_scratch);
        sum[r] += le_shfl_xor(sum[r], 2, no_scratch);
        l[r] = l[r] * alpha[r] + sum[r];
    }
}

/* A K or V tile's words in flight in registers (issued before the products that hide their latency, stored to
 * shared memory after): copy u of this thread is word group i = tid + ATTN_M_THREADS u (4 words: a uint4) of both
 * halves; ATTN_M_COPIES groups cover the largest tile (16 keys x ATTN_MAX_HD dims) */
#define ATTN_M_COPIES (ATTN_M_K * ATTN_MAX_HD / 2 / 4 / ATTN_M_THREADS)
struct attn_m_tile {
    uint4 hi[ATTN_M_COPIES], lo[ATTN_M_COPIES];
};

/* K rows k0 .. k0 + 15 (hw / 4 groups a row) from the planes into registers, then into kvh / kvl */
__device__ __forceinline__ void attn_m_fetch_k(const uint4 *kph, const uint4 *kpl, int k0, int hw, attn_m_tile &r) {
#pragma unroll
    for (int u = 0; u < ATTN_M_COPIES; u++) {
        const int i = threadIdx.x + ATTN_M_THREADS * u, row = i / (hw / 4), c = 4 * (i % (hw / 4));
        if (i < ATTN_M_K * hw / 4) {
            const size_t src = ((size_t)(k0 + row) * hw + c) / 4;
            r.hi[u] = kph[src];
            r.lo[u] = kpl[src];
        }
    }
}
__device__ __forceinline__ void attn_m_put_k(const attn_m_tile &r, int hw, unsigned *kvh, unsigned *kvl) {
#pragma unroll
    for (int u = 0; u < ATTN_M_COPIES; u++) {
        const int i = threadIdx.x + ATTN_M_THREADS * u, row = i / (hw / 4), c = 4 * (i % (hw / 4));
        if (i < ATTN_M_K * hw / 4) {
            *(uint4 *)&kvh[attn_m_qk(row, c)] = r.hi[u];
            *(uint4 *)&kvl[attn_m_qk(row, c)] = r.lo[u];
        }
    }
}
/* V^T rows of the tile: group i is dim i / 2, keys k0 + 8 (i % 2) .. + 7 */
__device__ __forceinline__ void attn_m_fetch_v(const uint4 *vph, const uint4 *vpl, int k0, int hd, int nkp,
                                               attn_m_tile &r) {
#pragma unroll
    for (int u = 0; u < ATTN_M_COPIES; u++) {
        const int i = threadIdx.x + ATTN_M_THREADS * u, d = i / 2, c = 4 * (i % 2);
        if (i < 2 * hd) {
            const size_t src = ((size_t)d * (nkp / 2) + k0 / 2 + c) / 4;
            r.hi[u] = vph[src];
            r.lo[u] = vpl[src];
        }
    }
}
__device__ __forceinline__ void attn_m_put_v(const attn_m_tile &r, int hd, unsigned *kvh, unsigned *kvl) {
#pragma unroll
    for (int u = 0; u < ATTN_M_COPIES; u++) {
        const int i = threadIdx.x + ATTN_M_THREADS * u, d = i / 2, c = 4 * (i % 2);
        if (i < 2 * hd) {
            *(uint4 *)&kvh[attn_m_v(d, c)] = r.hi[u];
            *(uint4 *)&kvl[attn_m_v(d, c)] = r.lo[u];
        }
    }
}

/* The prefill on f16 tensor cores at f32 grade: each operand split into hi + lo f16 (le_split_f16x2), each product
 * the three terms lo.hi + hi.lo + hi.hi in f32 accumulators (the dropped lo.lo is below 2^-22 of it). Warps w and
 * w + 2 take queries q0 + 16w .. + 15 (w < 2), each one half of the head's dims: both compute the same scores and
 * weights (the same instructions: the same bits), each its half of P V (64 accumulators, not 128: two warps a
 * query row hide each other's latencies). Per tile of 16 keys (copied from attn_kv_planes_f16's planes), S = Q K^T
 * (2 x 8 keys) by mma in two chains (even and odd dim steps: half the dependent mma latency), the online softmax
 * per row within the lane quad that holds it, then P (the S accumulators re-packed as A fragments, split) times
 * the V tile. The V tile's loads are in flight during the scores, the next K tile's during P V (attn_m_tile).
 * The query blocks run last first: the longest (most keys) start first. */
extern "C" __global__ void __launch_bounds__(ATTN_M_THREADS)
    attn_prefill_mma_f32(const float *LE_RESTRICT qg, const unsigned *LE_RESTRICT planes, float *LE_RESTRICT o,
                         int n, int pos, int n_head, int n_kv, int hd, float scale, int nkp) {
    __shared__ __align__(16) unsigned qh[ATTN_M_Q * ATTN_M_W], ql[ATTN_M_Q * ATTN_M_W]; /* 32 KB */
    __shared__ __align__(16) unsigned kvh[ATTN_M_K * ATTN_M_W], kvl[ATTN_M_K * ATTN_M_W]; /* 16 KB: K, then V */
    const int tid = threadIdx.x, lane = tid % 32, w = tid / 32, g = lane / 4, t = lane % 4;
    const int h = blockIdx.x, kvi = h / (n_head / n_kv), hw = hd / 2, nk16 = hd / 16;
    const int half = hd / 16, j0 = (w / 2) * half; /* this warp's dim groups 8 (j0 + j) .. + 7, j < half */
    const size_t qw = (size_t)n_head * 2 * hd, plane = (size_t)n_kv * nkp * hw;
    const uint4 *kph = (const uint4 *)(planes + (size_t)kvi * nkp * hw);
    const uint4 *kpl = (const uint4 *)((const unsigned *)kph + plane);
    const uint4 *vph = (const uint4 *)(planes + 2 * plane + (size_t)kvi * hd * (nkp / 2));
    const uint4 *vpl = (const uint4 *)((const unsigned *)vph + plane);
    const int nqb = (n + ATTN_M_Q - 1) / ATTN_M_Q;
    volatile float *const no_scratch = 0; /* sm_75+: the shuffles need none (and the 48 KB are all the tiles') */
    attn_m_tile kr, vr;
    for (int qb = nqb - 1 - (int)blockIdx.y; qb >= 0; qb -= gridDim.y) {
        const int q0 = qb * ATTN_M_Q;
        attn_m_fetch_k(kph, kpl, 0, hw, kr); /* the first K tile's loads beside Q's staging */
        __syncthreads(); /* the previous block of queries is done with qh, ql */
        for (int i = tid; i < ATTN_M_Q * hw; i += ATTN_M_THREADS) {
            const int r = i / hw, wd = i % hw, tok = min(q0 + r, n - 1); /* rows past n repeat the last (not written) */
            const float2 x = *(const float2 *)(qg + (size_t)tok * qw + (size_t)h * 2 * hd + 2 * wd);
            const int at = attn_m_qk(r, attn_m_perm(wd));
            le_split_f16x2(x.x, x.y, qh[at], ql[at]);
        }
        const int r0 = 16 * (w % 2) + g; /* the lane's rows r0, r0 + 8 of the block */
        const int last0 = pos + min(q0 + r0, n - 1), last1 = pos + min(q0 + r0 + 8, n - 1);
        const int n_keys = pos + min(q0 + ATTN_M_Q, n); /* keys of the block's last query */
        float acc[ATTN_MAX_HD / 16][4], m[2] = {ATTN_NEG_BIG, ATTN_NEG_BIG}, l[2] = {0.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < ATTN_MAX_HD / 16; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
        for (int k0 = 0; k0 < n_keys; k0 += ATTN_M_K) {
            __syncthreads(); /* Q staged; the V tile before consumed */
            attn_m_put_k(kr, hw, kvh, kvl);
            __syncthreads();
            attn_m_fetch_v(vph, vpl, k0, hd, nkp, vr); /* in flight during the scores */
            float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
            float s2[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll 1
            for (int kk = 0; kk < nk16; kk += 2) { /* even steps into s, odd into s2 */
                attn_m_scores(qh, ql, kvh, kvl, r0, g, 8 * kk + 2 * t, s);
                if (kk + 1 < nk16) attn_m_scores(qh, ql, kvh, kvl, r0, g, 8 * kk + 8 + 2 * t, s2);
            }
            /* masked scores -> the tile's weights; the online softmax of rows r0 (c < 2) and r0 + 8 */
            float alpha[2];
            attn_m_softmax(s, s2, k0 + 2 * t, last0, last1, scale, no_scratch, m, l, alpha);
            /* P as A fragments (keys 2t, 2t+1 of n-tile 0, then of n-tile 1), hi and lo */
            unsigned p[4], pl[4];
            le_split_f16x2(s[0][0], s[0][1], p[0], pl[0]);
            le_split_f16x2(s[0][2], s[0][3], p[1], pl[1]);
            le_split_f16x2(s[1][0], s[1][1], p[2], pl[2]);
            le_split_f16x2(s[1][2], s[1][3], p[3], pl[3]);
            __syncthreads(); /* every warp's scores read the K tile */
            attn_m_put_v(vr, hd, kvh, kvl);
            __syncthreads();
            if (k0 + ATTN_M_K < n_keys) attn_m_fetch_k(kph, kpl, k0 + ATTN_M_K, hw, kr); /* in flight during P V */
#pragma unroll
            for (int j = 0; j < ATTN_MAX_HD / 16; j++) {
                if (j >= half) break;
                acc[j][0] *= alpha[0];
                acc[j][1] *= alpha[0];
                acc[j][2] *= alpha[1];
                acc[j][3] *= alpha[1];
                const int d = 8 * (j0 + j) + g;
                const uint2 b = *(const uint2 *)&kvh[attn_m_v(d, 2 * t)], c = *(const uint2 *)&kvl[attn_m_v(d, 2 * t)];
                le_mma_f16_16x8x16(acc[j], pl[0], pl[1], pl[2], pl[3], b.x, b.y);
                le_mma_f16_16x8x16(acc[j], p[0], p[1], p[2], p[3], c.x, c.y);
                le_mma_f16_16x8x16(acc[j], p[0], p[1], p[2], p[3], b.x, b.y);
            }
        }
        /* o = acc / l * sigmoid(gate), rows r0 and r0 + 8, dims 8 (j0 + j) + 2t, + 1 */
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int tok = q0 + r0 + 8 * r;
            if (tok >= n) continue;
            const float inv = 1.0f / l[r];
            const float *gate = qg + (size_t)tok * qw + (size_t)h * 2 * hd + hd;
            float *ot = o + ((size_t)tok * n_head + h) * hd;
#pragma unroll
            for (int j = 0; j < ATTN_MAX_HD / 16; j++) {
                if (j >= half) break;
                const int e = 8 * (j0 + j) + 2 * t;
                ot[e] = acc[j][2 * r] * inv * attn_sigmoid(le_ldg(gate + e));
                ot[e + 1] = acc[j][2 * r + 1] * inv * attn_sigmoid(le_ldg(gate + e + 1));
            }
        }
    }
}
#endif

extern "C" __global__ void attn_kv_store_f32(const float *LE_RESTRICT k, const float *LE_RESTRICT v, float *kc, float *vc,
                                             const int *LE_RESTRICT pos_dev, int kvw) {
    const size_t row = (size_t)*pos_dev * kvw;
    for (int i = blockIdx.x * ATTN_THREADS + threadIdx.x; i < kvw; i += gridDim.x * ATTN_THREADS) {
        kc[row + i] = k[i];
        vc[row + i] = v[i];
    }
}
