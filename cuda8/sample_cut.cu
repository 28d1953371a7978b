/* sample_cut.cu — sampling where the logits are: the tokens top-k / top-p / min-p can keep, chosen on the GPU so
 * that a few kilobytes cross the link instead of the 1 MB row (native/sample.c le_sample_cand then draws from
 * them as le_sample would from the whole row); where top-p keeps more tokens than may cross (a flat row), only the
 * bin its cut lies in crosses (le_sample_window_cut finds the cut) and the draw runs here (sample_draw_*).
 *
 * Reference: tests/sample_cut_ref.py (numpy: bins, masses, cut, sets) and tests/test_gpu.py::test_sample_cut /
 * test_sample_draw; le_sample_cand / le_sample_window_cut check what they are given (the kept set must lie among
 * the candidates, top-p's target must be crossed in the window), else the host samples the whole row.
 * The bins: d_i = m - x_i (float; m = max x), bin_i = floor(d_i * SAMPLE_BINS_PER_NAT), the last bin holding every
 * d beyond; bin_i never decreases as x_i decreases, so {bin_i <= c} is a head of the order "logit descending".
 * Masses are fixed point, q_i = round(exp(x_i - m) * 2^SAMPLE_FIX_BITS), summed as 64-bit integers: exact and the
 * same in any order (the histogram's atomics), so every launch gives the same bits; 2^-41 per token (1.1e-7 of
 * the row's mass at 248k tokens) is far inside the sampler's SAMPLING_CUT_MASS_REL.
 * The cut bin c: the first bin where, for any filter on,
 *   top_k > 0:  the tokens of bins <= c number >= top_k
 *   top_p < 1:  their mass >= top_p * Z
 *   min_p > 0:  c >= min_p_bin (the caller's floor(-log(min_p) * SAMPLE_BINS_PER_NAT) + 1: a bin of slack)
 * (none: every token). Mode 0 (candidates): the tokens of bins <= c, when at most cap. Mode 1 (window): top-p's
 * bin alone, when it set c, the head holds more than cap and that bin at most cap; head.base = the mass before it.
 *
 *   sample_max_f32(x, n, part)                 pass 1: part[block] = max of its grid-strided share (NaN: it saw a
 *                                              NaN or an infinity, which check_logits refuses)
 *     x: [n] f32; part: [n_part] f32;  launch: block SAMPLE_THREADS (256), grid n_part (<= SAMPLE_MAX_PARTS)
 *   sample_hist_f32(x, n, part, n_part, hm, hc)     pass 2: the share's bin masses and counts added to hm / hc
 *     hm: [SAMPLE_BINS] u64, hc: [SAMPLE_BINS] int32, zero on entry (the cut pass zeroes them after reading)
 *     launch: block SAMPLE_THREADS, grid n_part
 *   sample_cut_f32(part, n_part, hm, hc, top_k, top_p, min_p_bin, cap, head)   pass 3, one block: the head
 *     head: le_sample_head (n_cand -1: a non-finite logit; -2: more than cap either way)
 *     launch: block SAMPLE_THREADS, grid 1
 *   sample_compact_f32(x, n, head, cand)     pass 4: cand[j] = (id, x bits) of every token of the chosen bins, in
 *                                            no order (the host sorts them); head.rest_key = the largest logit
 *                                            left out (le_order_key)
 *     cand: [cap] int2;  launch: block SAMPLE_THREADS, grid n_part
 *   sample_draw_blocks_f32(x, n, head, bsum)   the draw (head: m, inv_t, cut_x, cut_id, u), 1: per block of
 *                                            SAMPLE_DRAW_BLOCK tokens, sum of w_i = exp((x_i - m) * inv_t) over the
 *                                            kept ones (x_i > cut_x, or x_i == cut_x and i <= cut_id), f64
 *     bsum: [ceil(n / SAMPLE_DRAW_BLOCK)] f64;  launch: block SAMPLE_DRAW_BLOCK (256), grid min(blocks, 65535)
 *   sample_draw_pick_f32(x, n, head, bsum)     the draw, 2, one block: u * W inverted over the block sums in
 *                                            index order, then inside the block (le_sample's pass_draw); head.token
 *     launch: block SAMPLE_DRAW_BLOCK, grid 1
 * Tiers: all (fermi: the reductions go through shared memory; __syncthreads_or and 64-bit shared atomics: sm_20).
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k sample
 */
#include "compat.cuh"

#define SAMPLE_THREADS 256
#define SAMPLE_MAX_PARTS 256
#define SAMPLE_BINS 1024
#define SAMPLE_BINS_PER_NAT 32
#define SAMPLE_BINS_PER_THREAD (SAMPLE_BINS / SAMPLE_THREADS)
#define SAMPLE_FIX_BITS 40
#define SAMPLE_DRAW_BLOCK 256

typedef unsigned long long le_u64;

/* 72 bytes, read by legacy_engine/gpu.py (SAMPLE_HEAD); the draw's fields written by the host (Kernels.set_draw),
 * so that the draw's launches are the same every token (recorded once, replayed) */
struct le_sample_head {
    int n_cand;    /* candidates written; -1: a non-finite row; -2: more than cap */
    int cut;       /* the cut bin */
    int mode;      /* 0: candidates (bins <= cut); 1: window (bin cut alone) */
    int rest_key;  /* the largest logit not a candidate (mode 0), as le_order_key (INT_MIN: none) */
    float m;       /* the max logit */
    int written;   /* the compaction's slot counter */
    le_u64 z;      /* the row's mass, fixed point */
    le_u64 base;   /* the mass of the bins before the window (mode 1), fixed point */
    int token;     /* sample_draw_pick's token */
    int pad;
    float inv_t;   /* the draw: 1 / temperature ... */
    float cut_x;   /* ... the kept set: x > cut_x, or x == cut_x and id <= cut_id ... */
    int cut_id;
    int pad2;
    double u;      /* ... and u in [0, 1) */
};

/* A float's order as a signed int (-0 below +0; NaN not expected). */
__device__ __forceinline__ int le_order_key(float v) {
    const int b = __float_as_int(v);
    return b >= 0 ? b : b ^ 0x7fffffff;
}

__device__ __forceinline__ int le_sample_bin(float m, float x) {
    const float d = (m - x) * (float)SAMPLE_BINS_PER_NAT;
    return d < (float)(SAMPLE_BINS - 1) ? (int)d : SAMPLE_BINS - 1;
}

__device__ __forceinline__ float le_pos_inf() { return __int_as_float(0x7f800000); }

extern "C" __global__ void sample_max_f32(const float *LE_RESTRICT x, int n, float *LE_RESTRICT part) {
    LE_SCRATCH(scratch, SAMPLE_THREADS);
    float v = le_neg_inf();
    int bad = 0;
    for (int i = blockIdx.x * SAMPLE_THREADS + threadIdx.x; i < n; i += gridDim.x * SAMPLE_THREADS) {
        const float xi = le_ldg(x + i);
        bad |= !(fabsf(xi) < le_pos_inf());   /* NaN or an infinity */
        v = fmaxf(v, xi);
    }
    bad = __syncthreads_or(bad);
    v = le_block_max(v, scratch);
    if (threadIdx.x == 0) part[blockIdx.x] = bad ? __int_as_float(0x7fffffff) : v;
}

/* m from the partials, NaN when a block saw a bad value (fmaxf would drop it). Every thread gets it. */
__device__ __forceinline__ float le_sample_max(const float *part, int n_part, float *scratch) {
    float v = le_neg_inf();
    int bad = 0;
    for (int j = threadIdx.x; j < n_part; j += SAMPLE_THREADS) {
        const float p = part[j];
        bad |= p != p;
        v = fmaxf(v, p);
    }
    bad = __syncthreads_or(bad);
    v = le_block_max(v, scratch);
    return bad ? __int_as_float(0x7fffffff) : v;
}

__device__ __forceinline__ le_u64 le_fix_mass(float x, float m) {
    return __float2ull_rn(expf(x - m) * (float)(1ull << SAMPLE_FIX_BITS));
}

extern "C" __global__ void sample_hist_f32(const float *LE_RESTRICT x, int n, const float *LE_RESTRICT part,
                                           int n_part, le_u64 *LE_RESTRICT hm, int *LE_RESTRICT hc) {
    LE_SCRATCH(scratch, SAMPLE_THREADS);
    __shared__ le_u64 sm[SAMPLE_BINS];
    __shared__ int sc[SAMPLE_BINS];
    const float m = le_sample_max(part, n_part, scratch);
    if (!(m > le_neg_inf() && m < le_pos_inf())) return;   /* the cut pass reports it */
    for (int b = threadIdx.x; b < SAMPLE_BINS; b += SAMPLE_THREADS) {
        sm[b] = 0;
        sc[b] = 0;
    }
    __syncthreads();
    for (int i = blockIdx.x * SAMPLE_THREADS + threadIdx.x; i < n; i += gridDim.x * SAMPLE_THREADS) {
        const float xi = le_ldg(x + i);
        const int b = le_sample_bin(m, xi);
        atomicAdd(&sm[b], le_fix_mass(xi, m));
        atomicAdd(&sc[b], 1);
    }
    __syncthreads();
    for (int b = threadIdx.x; b < SAMPLE_BINS; b += SAMPLE_THREADS)
        if (sc[b]) {
            atomicAdd(hm + b, sm[b]);
            atomicAdd(hc + b, sc[b]);
        }
}

extern "C" __global__ void sample_cut_f32(const float *LE_RESTRICT part, int n_part, le_u64 *LE_RESTRICT hm,
                                          int *LE_RESTRICT hc, int top_k, float top_p, int min_p_bin, int cap,
                                          le_sample_head *LE_RESTRICT head) {
    LE_SCRATCH(scratch, SAMPLE_THREADS);
    __shared__ int scc[SAMPLE_THREADS];
    __shared__ le_u64 scm[SAMPLE_THREADS];
    __shared__ int cut, cut_p;
    const int t = threadIdx.x;
    const float m = le_sample_max(part, n_part, scratch);
    const int ok = m > le_neg_inf() && m < le_pos_inf();
    /* thread t owns bins [4t, 4t + 4): their counts and masses, then inclusive scans over the threads */
    int c[SAMPLE_BINS_PER_THREAD], ct = 0;
    le_u64 w[SAMPLE_BINS_PER_THREAD], wt = 0;
    for (int j = 0; j < SAMPLE_BINS_PER_THREAD; j++) {
        const int b = t * SAMPLE_BINS_PER_THREAD + j;
        c[j] = ok ? hc[b] : 0;
        w[j] = ok ? hm[b] : 0;
        hc[b] = 0;   /* for the next row */
        hm[b] = 0;
        ct += c[j];
        wt += w[j];
    }
    scc[t] = ct;
    scm[t] = wt;
    if (t == 0) cut = cut_p = SAMPLE_BINS - 1;
    __syncthreads();
    for (int off = 1; off < SAMPLE_THREADS; off <<= 1) {   /* Hillis-Steele */
        const int ca = t >= off ? scc[t - off] : 0;
        const le_u64 wa = t >= off ? scm[t - off] : 0;
        __syncthreads();
        scc[t] += ca;
        scm[t] += wa;
        __syncthreads();
    }
    const le_u64 z = scm[SAMPLE_THREADS - 1];
    const double want = (double)top_p * (double)z;
    int cc = t > 0 ? scc[t - 1] : 0;   /* exclusive: the bins before this thread's */
    le_u64 cw = t > 0 ? scm[t - 1] : 0;
    for (int j = 0; j < SAMPLE_BINS_PER_THREAD; j++) {
        const int b = t * SAMPLE_BINS_PER_THREAD + j;
        cc += c[j];
        cw += w[j];
        const int by_p = top_p < 1.0f && (double)cw >= want;
        if (by_p) atomicMin(&cut_p, b);
        if ((top_k > 0 && cc >= top_k) || by_p || (min_p_bin > 0 && b >= min_p_bin)) {
            atomicMin(&cut, b);
            break;
        }
    }
    __syncthreads();
    const int lo = t * SAMPLE_BINS_PER_THREAD;   /* the owner of the cut's bin writes the head */
    if (cut >= lo && cut < lo + SAMPLE_BINS_PER_THREAD) {
        int before = t > 0 ? scc[t - 1] : 0;
        le_u64 mass = t > 0 ? scm[t - 1] : 0;
        for (int j = 0; j < cut - lo; j++) {
            before += c[j];
            mass += w[j];
        }
        const int in_bin = c[cut - lo];
        int mode = 0, n_cand = before + in_bin;
        if (n_cand > cap) {
            mode = cut == cut_p && top_k == 0 && in_bin <= cap ? 1 : 0;
            n_cand = mode ? in_bin : -2;
        }
        head->n_cand = ok ? n_cand : -1;
        head->cut = cut;
        head->mode = mode;
        head->rest_key = (int)0x80000000u;
        head->m = m;
        head->written = 0;
        head->z = z;
        head->base = mode ? mass : 0;
        head->token = -1;
        head->pad = 0;
    }
}

extern "C" __global__ void sample_compact_f32(const float *LE_RESTRICT x, int n, le_sample_head *LE_RESTRICT head,
                                              int2 *LE_RESTRICT cand) {
    LE_SCRATCH(scratch, SAMPLE_THREADS);
    const int n_cand = head->n_cand, cut = head->cut;
    const int first = head->mode ? cut : 0;   /* the window: bin cut alone */
    const float m = head->m;
    if (n_cand < 0) return;   /* uniform: every thread read the same head */
    float rest = le_neg_inf();
    int any = 0;
    for (int i = blockIdx.x * SAMPLE_THREADS + threadIdx.x; i < n; i += gridDim.x * SAMPLE_THREADS) {
        const float xi = le_ldg(x + i);
        const int b = le_sample_bin(m, xi);
        if (b <= cut && b >= first) {
            const int j = atomicAdd(&head->written, 1);
            if (j < n_cand) cand[j] = make_int2(i, __float_as_int(xi));
        } else if (b > cut) {
            rest = fmaxf(rest, xi);
            any = 1;
        }
    }
    any = __syncthreads_or(any);
    rest = le_block_max(rest, scratch);
    if (threadIdx.x == 0 && any) atomicMax(&head->rest_key, le_order_key(rest));
}

/* ---- the draw over a kept set given by its cut (window mode) ------------------------------------------------- */

__device__ __forceinline__ float le_draw_weight(const float *x, int i, float m, float inv_t, float cut_x, int cut_id) {
    const float xi = le_ldg(x + i);
    return xi > cut_x || (xi == cut_x && i <= cut_id) ? expf((xi - m) * inv_t) : 0.0f;
}

/* Sum over the block in double (tree in shared memory: the same order on every tier). */
__device__ __forceinline__ double le_block_sum_f64(double v, double *s) {
    const int t = threadIdx.x;
    __syncthreads();
    s[t] = v;
    __syncthreads();
    for (int h = SAMPLE_DRAW_BLOCK / 2; h > 0; h >>= 1) {
        if (t < h) s[t] += s[t + h];
        __syncthreads();
    }
    return s[0];
}

extern "C" __global__ void sample_draw_blocks_f32(const float *LE_RESTRICT x, int n,
                                                  const le_sample_head *LE_RESTRICT head, double *LE_RESTRICT bsum) {
    __shared__ double s[SAMPLE_DRAW_BLOCK];
    const float m = head->m, inv_t = head->inv_t, cut_x = head->cut_x;
    const int cut_id = head->cut_id;
    const int nb = (n + SAMPLE_DRAW_BLOCK - 1) / SAMPLE_DRAW_BLOCK;
    for (int b = blockIdx.x; b < nb; b += gridDim.x) {   /* uniform across the block */
        const int i = b * SAMPLE_DRAW_BLOCK + threadIdx.x;
        const float w = i < n ? le_draw_weight(x, i, m, inv_t, cut_x, cut_id) : 0.0f;
        const double sb = le_block_sum_f64((double)w, s);
        if (threadIdx.x == 0) bsum[b] = sb;
    }
}

/* Inclusive scan of a double over the block (Hillis-Steele in shared memory). */
__device__ __forceinline__ double le_block_scan_f64(double v, double *s) {
    const int t = threadIdx.x;
    __syncthreads();
    s[t] = v;
    __syncthreads();
    for (int off = 1; off < SAMPLE_DRAW_BLOCK; off <<= 1) {
        const double a = t >= off ? s[t - off] : 0.0;
        __syncthreads();
        s[t] += a;
        __syncthreads();
    }
    return s[t];
}

extern "C" __global__ void sample_draw_pick_f32(const float *LE_RESTRICT x, int n, le_sample_head *LE_RESTRICT head,
                                                const double *LE_RESTRICT bsum) {
    __shared__ double s[SAMPLE_DRAW_BLOCK];
    __shared__ int pick_b, last_b, first_i, last_i;
    __shared__ double before_b;
    const int t = threadIdx.x;
    const int nb = (n + SAMPLE_DRAW_BLOCK - 1) / SAMPLE_DRAW_BLOCK;
    const int per = (nb + SAMPLE_DRAW_BLOCK - 1) / SAMPLE_DRAW_BLOCK;   /* thread t: blocks [t per, t per + per) */
    const double u = head->u;
    const float inv_t = head->inv_t, cut_x = head->cut_x;
    const int cut_id = head->cut_id;
    double own = 0.0;
    int last = -1;   /* this thread's last block with weight */
    for (int b = t * per; b < nb && b < (t + 1) * per; b++) {
        own += bsum[b];
        if (bsum[b] > 0.0) last = b;
    }
    if (t == 0) {
        pick_b = LE_INT_MAX;
        last_b = -1;
        first_i = LE_INT_MAX;
        last_i = -1;
        before_b = 0.0;
    }
    const double incl = le_block_scan_f64(own, s);
    const double excl = t > 0 ? s[t - 1] : 0.0;
    const double target = u * s[SAMPLE_DRAW_BLOCK - 1];   /* u * W */
    if (own > 0.0 && excl <= target && target < incl) {   /* one thread's blocks hold it: walk them */
        double cum = excl;
        for (int b = t * per; b < nb && b < (t + 1) * per; b++) {
            if (bsum[b] > 0.0 && cum + bsum[b] > target) {
                pick_b = b;
                before_b = cum;
                break;
            }
            cum += bsum[b];
        }
    }
    if (last >= 0) atomicMax(&last_b, last);
    __syncthreads();
    /* u * W rounded up to W (or the walk fell short by a rounding): the last block with weight, its last token */
    const int past = pick_b == LE_INT_MAX;
    const int b = past ? last_b : pick_b;
    const int i = b * SAMPLE_DRAW_BLOCK + t;
    const float w = b >= 0 && i < n ? le_draw_weight(x, i, head->m, inv_t, cut_x, cut_id) : 0.0f;
    const double cum = before_b + le_block_scan_f64((double)w, s);
    if (w > 0.0f) {
        if (!past && cum > target) atomicMin(&first_i, i);
        atomicMax(&last_i, i);
    }
    __syncthreads();
    if (t == 0) head->token = first_i != LE_INT_MAX ? first_i : last_i;
}
