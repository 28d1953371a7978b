/* gemm_q8.cuh — what the two int8 prefill GEMMs (gemm_dp4a.cu, gemm_mma.cu) share: the tile sizes, the shared
 * memory of one step, its staging from global memory, and the f32 update of a sub-block's integer sums.
 *
 * A block computes GEMM_ROWS (128) rows x GEMM_TT (32) tokens of Y over steps of GEMM_Q8_SUBS (4) sub-blocks of 32
 * columns (fewer in the last step when ncols % 128 != 0). Staging (gemm_q8_stage): thread tid copies word
 * k = tid % 8 of 16 (row, sub-block) pairs of W (T::qword: the int of 4 signed elements; eight lanes read one
 * sub-block together), the scales and min of 2 of the step's 512 (row, sub-block) pairs (T::scale: decoded once
 * per sub-block, not per word; the 63-register tiers decode them with each word instead) and word k of 4 Q8_1
 * blocks of token tid / 8; ints stay ints, the per-sub-block scales go beside them. Tokens per tile: a template
 * argument TT (GEMM_TT = 32; GEMM_MMA_TT = 64 for the tensor-core GEMM: twice the tokens per staged weight word).
 * Rows past nrows and tokens past the tile read row r0 / token t0 instead (their outputs are not stored).
 * Shared rows are GEMM_Q8_PAD (36) ints apart for gemm_dp4a: 36 = 4 mod 32 banks, so its reads (4 rows, or 8
 * tokens, at one word) hit different banks; 40 for gemm_mma, whose 8-byte fragment pairs (gemm_q8_slot) need 8.
 * Per (row, token) and sub-block the update is  acc + d8 * (d[0] * lo + d[1] * hi) - m * s8  (lo, hi: the integer
 * sums of elements 0-15 and 16-31; d * (lo + hi) where the type has one scale, no m term where it has no min), with
 * its roundings spelled out (gemm_q8_term, gemm_q8_acc) so that every kernel and tier gives the same bits for the
 * same integer sums.
 */
#ifndef LE_GEMM_Q8_CUH
#define LE_GEMM_Q8_CUH

#include "gemm_tile.cuh"
#include "quants.cuh"

#define GEMM_THREADS 256
#define GEMM_ROWS 128       /* rows per tile: 8 warps x 16 */
#define GEMM_TT 32          /* tokens per tile (the grouped GEMMs' tiles, moe_sort.cu's) */
#define GEMM_MMA_TT 64      /* gemm_mma (plain and grouped): twice the tokens per staged weight */
#define GEMM_Q8_SUBS 4      /* 32-element sub-blocks per step */
/* ints per row of Wq and Xq: 8 * GEMM_Q8_SUBS + 4 (see above); + 1 on the 63-register tiers, where 36's address
 * arithmetic costs the registers that keep ptxas from spilling (rows still start in different banks) */
#define GEMM_Q8_PAD (LE_HAS_MANY_REGS ? 36 : 33)

/* The integer sums of a sub-block start at GEMM_Q8_MAGIC instead of 0: a sum a = GEMM_Q8_MAGIC + s (|s| <= 32 * 128
 * * 127 < 2^22) read as f32 is 12582912 + s exactly, so the f32 update needs no conversion instruction (from sm_70
 * the conversion unit converts 16 values a clock per SM) and the offset comes off inside a fused multiply-add
 * (gemm_q8_term). */
#define GEMM_Q8_MAGIC 0x4B400000 /* 12582912.0f = 1.5 * 2^23 */
#define GEMM_Q8_MAGIC_F 12582912.0f

/* s (exactly) from a = GEMM_Q8_MAGIC + s */
__device__ __forceinline__ float gemm_q8_float(int a) {
    return __fsub_rn(__int_as_float(a), GEMM_Q8_MAGIC_F);
}

/* What a row's sub-block keeps in gemm_q8_smem::wd: (d[0], d[1]) where the type has two scales (Q6_K), else
 * (d, -d * 12582912), exact: d = half * small int has at most 19 significant bits, 12582912 = 3 * 2^22 adds 2 */
template <class T>
__device__ __forceinline__ float2 gemm_q8_wd(float d0, float d1) {
    return make_float2(d0, T::TWO_SCALES ? d1 : __fmul_rn(-d0, GEMM_Q8_MAGIC_F));
}

/* A sub-block's term before the activation's scale, from the offset sums lo, hi (GEMM_Q8_MAGIC + the sums of its
 * elements 0-15 and 16-31) and wd (gemm_q8_wd): two scales: d[0] * lo + d[1] * hi (a product, then a fused
 * multiply-add); one scale: lo is the whole sub-block's offset sum, and d * s = fma(d, 12582912 + s, -d * 12582912)
 * with one rounding (= the product d * s rounded; the tensor-core GEMM gets the sum from one k = 32 product) */
template <class T>
__device__ __forceinline__ float gemm_q8_term(float2 wd, int lo, int hi) {
    if (T::TWO_SCALES) return __fmaf_rn(wd.y, gemm_q8_float(hi), __fmul_rn(wd.x, gemm_q8_float(lo)));
    return __fmaf_rn(wd.x, __int_as_float(lo), wd.y);
}

template <int TT> /* tokens per tile: GEMM_TT, or GEMM_MMA_TT for gemm_mma (plain and grouped) */
struct gemm_q8_smem {
    /* gemm_mma reads 8-byte fragment pairs of 8 rows x 4 pairs: rows 40 ints apart (8 mod 32 banks) keep a half-warp
     * on 32 different banks */
    enum { PAD = TT == GEMM_MMA_TT ? 40 : GEMM_Q8_PAD };
    int wq[GEMM_ROWS][PAD];                   /* W words: [row][gemm_q8_slot(sub, k)] */
    float2 wd[GEMM_ROWS][GEMM_Q8_SUBS + 1];   /* per row and sub-block: gemm_q8_wd (+ 1: 8 rows on 16 banks) */
    float wm[GEMM_ROWS][GEMM_Q8_SUBS];        /* m */
    int xq[TT][PAD];                          /* Q8_1 words: [token][gemm_q8_slot(sub, k)] */
    float4 xd[GEMM_Q8_SUBS][TT / 2];          /* (d8, s8) of tokens 2i, 2i + 1 (one 16-byte read for the mma's pair) */
};

/* Where word k (elements 4k .. 4k+3) of sub-block sb sits in a row of wq / xq: words k and k + 4 side by side, so
 * that the mma's fragment pair (words t, t + 4) is one 8-byte read */
__device__ __forceinline__ int gemm_q8_slot(int sb, int k) {
    return 8 * sb + 2 * (k % 4) + k / 4;
}

/* (d8, s8) of token tok in sub-block sb (xd[sb] read as TT float2) */
template <int TT>
__device__ __forceinline__ float2 &gemm_q8_xd(gemm_q8_smem<TT> &sm, int sb, int tok) {
    return ((float2 *)sm.xd[sb])[tok];
}
template <int TT>
__device__ __forceinline__ float2 gemm_q8_xd(const gemm_q8_smem<TT> &sm, int sb, int tok) {
    return ((const float2 *)sm.xd[sb])[tok];
}

/* (d, s) of a Q8_1 block from its first word (little-endian f16 halves) */
__device__ __forceinline__ float2 gemm_q8_ds(unsigned ds) {
    return make_float2(le_half_to_float((uint16_t)(ds & 0xFFFFu)), le_half_to_float((uint16_t)(ds >> 16)));
}

/* Pair i (< 16) of this thread's (row, sub-block) pairs of step st: word k of row g + 32 (i / 4), sub-block i % 4
 * (a row's 4 sub-blocks in one unrolled group: Q4_K's / Q5_K's sub-blocks 2m, 2m + 1 share their bytes, one load).
 * with_scales (the 63-register tiers): the word's scale and min too, stored by lanes 0 and 4 of the sub-block (the
 * decode of each word is repeated, but a separate pass over the scales costs registers Fermi does not have). */
template <class T, int TT>
__device__ __forceinline__ void gemm_q8_word(const uint8_t *LE_RESTRICT W, int nrows, size_t row_bytes, int r0,
                                             int st, int nsb, int i, int k, int g, bool with_scales,
                                             gemm_q8_smem<TT> &sm) {
    const int row = g + 32 * (i / 4), sb = i % 4;
    if (sb >= nsb) return;
    const uint8_t *w = W + (size_t)(r0 + row < nrows ? r0 + row : r0) * row_bytes;
    const int s = GEMM_Q8_SUBS * st + sb;
    if (!with_scales) {
        sm.wq[row][gemm_q8_slot(sb, k)] = T::qword(w, s, k);
        return;
    }
    float d, m;
    sm.wq[row][gemm_q8_slot(sb, k)] = le_word<T>(w, s, k, d, m);
    if (k == 0) {
        sm.wd[row][sb] = gemm_q8_wd<T>(d, d); /* d[1] comes with word 4 where there are two */
        sm.wm[row][sb] = m;
    } else if (k == 4 && T::TWO_SCALES) {
        sm.wd[row][sb].y = d;
    }
}

/* The 16-byte header of a block (4 words) into h[] of each of the GEMM_Q8_SUBS lanes that share it: each loads
 * word `part` and the four exchange them (one 16-byte piece per row instead of each lane's bytes); every lane of
 * the warp calls it. Without shuffles (sm_20), each lane loads all four. */
__device__ __forceinline__ void gemm_q8_hdr_words(const int *LE_RESTRICT blk, int part, int *h) {
#if LE_HAS_SHFL
    const int mine = le_ldg(blk + part);
#pragma unroll
    for (int i = 0; i < 4; i++) h[i] = le_shfl_idx(mine, i, GEMM_Q8_SUBS);
#else
#pragma unroll
    for (int i = 0; i < 4; i++) h[i] = le_ldg(blk + i);
#endif
}

/* T::scale_hdr where the type has it (HDR = 1); never called for the others */
template <class T, int HDR>
struct gemm_q8_hdr_scale {
    static __device__ __forceinline__ void get(const int *, int, float &d, float &m) { d = m = 0.0f; }
};
template <class T>
struct gemm_q8_hdr_scale<T, 1> {
    static __device__ __forceinline__ void get(const int *h, int s, float &d, float &m) { T::scale_hdr(h, s, d, m); }
};

/* The scales of pair p (< GEMM_ROWS * GEMM_Q8_SUBS) of step st: row p / GEMM_Q8_SUBS, sub-block p % GEMM_Q8_SUBS
 * (a warp reads 8 rows' headers, 4 lanes each, not 32 rows' bytes: those loads were most of the step's L1
 * traffic); decoded once per sub-block (its 8 words take none). Types whose scales sit in their block's header
 * (T::HDR) read it as 4 words shared by the row's 4 lanes: a step's 4 sub-blocks lie in one 8-sub-block block. */
template <class T, int TT>
__device__ __forceinline__ void gemm_q8_scales(const uint8_t *LE_RESTRICT W, int nrows, size_t row_bytes, int r0,
                                               int st, int nsb, int p, gemm_q8_smem<TT> &sm) {
    static_assert(GEMM_Q8_SUBS == 4, "gemm_q8_scales: a step's sub-blocks in one block, 4 lanes a header");
    const int row = p / GEMM_Q8_SUBS, sb = p % GEMM_Q8_SUBS;
    const uint8_t *w = W + (size_t)(r0 + row < nrows ? r0 + row : r0) * row_bytes;
    const int s = GEMM_Q8_SUBS * st + sb;
    float d0, d1, m;
    if (T::HDR) {
        int h[4];
        gemm_q8_hdr_words((const int *)(w + (size_t)(GEMM_Q8_SUBS * st * 32 / T::BLOCK) * T::BYTES), sb, h);
        if (sb >= nsb) return; /* after the exchange: every lane takes part */
        gemm_q8_hdr_scale<T, T::HDR>::get(h, s, d0, m);
        sm.wm[row][sb] = m;
        d1 = d0;
    } else {
        if (sb >= nsb) return;
        T::scale(w, s, 0, d0, sm.wm[row][sb]);
        if (T::TWO_SCALES) T::scale(w, s, 1, d1, m);
        else d1 = d0;
    }
    sm.wd[row][sb] = gemm_q8_wd<T>(d0, d1);
}

/* Step st (its nsb sub-blocks from GEMM_Q8_SUBS st on; fewer in the last step) of the weights and activations
 * into shared memory. Four words' loads in flight at a time where registers allow, one at a time with 63. */
template <class T, int TT>
__device__ __forceinline__ void gemm_q8_stage(const uint8_t *LE_RESTRICT W, const block_q8_1 *LE_RESTRICT xq,
                                              int nrows, int nsub, size_t row_bytes, int r0,
                                              const le_gemm_tile &tl, int st, int nsb, gemm_q8_smem<TT> &sm) {
    const int tid = threadIdx.x, k = tid % 8, g = tid / 8;
    if (LE_HAS_MANY_REGS) {
#pragma unroll 4
        for (int i = 0; i < 16; i++) gemm_q8_word<T, TT>(W, nrows, row_bytes, r0, st, nsb, i, k, g, false, sm);
#pragma unroll
        for (int p = tid; p < GEMM_ROWS * GEMM_Q8_SUBS; p += GEMM_THREADS)
            gemm_q8_scales<T, TT>(W, nrows, row_bytes, r0, st, nsb, p, sm);
    } else {
#pragma unroll 1
        for (int i = 0; i < 16; i++) gemm_q8_word<T, TT>(W, nrows, row_bytes, r0, st, nsb, i, k, g, true, sm);
    }
#pragma unroll
    for (int tg = g; tg < TT; tg += GEMM_THREADS / 8) {
        const int t = tg < tl.n ? tl.t0 + tg : tl.t0;
#pragma unroll
        for (int sb = 0; sb < GEMM_Q8_SUBS; sb++) {
            if (sb >= nsb) break;
            const block_q8_1 *b = xq + (size_t)t * nsub + GEMM_Q8_SUBS * st + sb;
            sm.xq[tg][gemm_q8_slot(sb, k)] = le_ldg((const int *)b->qs + k); /* 4-aligned: blocks are 36 bytes */
            if (k == 0) { /* d and s: one 4-byte load (little-endian halves) */
                const unsigned ds = (unsigned)le_ldg((const int *)b);
                gemm_q8_xd(sm, sb, tg) = gemm_q8_ds(ds);
            }
        }
    }
}

#define LE_GEMM_Q8_CAN_AHEAD (LE_HAS_SHFL && LE_HAS_MANY_REGS)
#if LE_GEMM_Q8_CAN_AHEAD
/* ---- staging a step ahead (tiers with shuffles and many registers: LE_GEMM_Q8_CAN_AHEAD): gemm_q8_fetch issues
 * every global load of step st into registers at once (gemm_q8_regs), before the tensor cores consume step st - 1;
 * gemm_q8_put then decodes them into shared memory as gemm_q8_stage does (same words, scales, slots: the same
 * bits). Staged synchronously, a step was a chain of ~7 memory round trips (groups of 4 word loads, then scales,
 * then tokens): ~5 us of a lone block on an H200, what a short grid (a 512-token pass) waited on. ---- */
template <class T, int TT>
struct gemm_q8_regs {
    typename T::qraw_t w[16];                      /* pair i of gemm_q8_word: word k of row g + 32 (i / 4), sb i % 4 */
    int2 sc[GEMM_ROWS * GEMM_Q8_SUBS / GEMM_THREADS]; /* pair p = tid + 256 q: header word sb (HDR) or T::sraw */
    int x[TT / 32][GEMM_Q8_SUBS];                  /* word k of token g + 32 u, sub-block sb */
    int ds[TT / 32][GEMM_Q8_SUBS];                 /* its Q8_1 block's (d, s) halves (used by lanes k = 0) */
};

/* A step's scale words: the type's raw scale words (T::sraw) or, where the scales sit in the block's header (HDR),
 * header word sb, exchanged between the row's 4 lanes at put (gemm_q8_scales' exchange) */
template <class T, int HDR>
struct gemm_q8_sc {
    static __device__ __forceinline__ int2 fetch(const uint8_t *w, int s, int) { return T::sraw(w, s); }
    static __device__ __forceinline__ void put(int2 r, int s, float &d0, float &d1, float &m) {
        T::sfin(r, s, 0, d0, m);
        if (T::TWO_SCALES) T::sfin(r, s, 1, d1, m);
        else d1 = d0;
    }
};
template <class T>
struct gemm_q8_sc<T, 1> {
    static __device__ __forceinline__ int2 fetch(const uint8_t *w, int s, int sb) {
        return make_int2(le_ldg((const int *)(w + (size_t)(s / 8) * T::BYTES) + sb), 0);
    }
    static __device__ __forceinline__ void put(int2 r, int s, float &d0, float &d1, float &m) {
        int h[4];
#pragma unroll
        for (int i = 0; i < 4; i++) h[i] = le_shfl_idx(r.x, i, GEMM_Q8_SUBS);
        T::scale_hdr(h, s, d0, m);
        d1 = d0;
    }
};

template <class T, int TT>
__device__ __forceinline__ void gemm_q8_fetch(const uint8_t *LE_RESTRICT W, const block_q8_1 *LE_RESTRICT xq,
                                              int nrows, int nsub, size_t row_bytes, int r0,
                                              const le_gemm_tile &tl, int st, int nsb, gemm_q8_regs<T, TT> &rg) {
    const int tid = threadIdx.x, k = tid % 8, g = tid / 8;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const int row = g + 32 * (i / 4), sb = i % 4;
        const uint8_t *w = W + (size_t)(r0 + row < nrows ? r0 + row : r0) * row_bytes;
        if (sb < nsb) rg.w[i] = T::qraw(w, GEMM_Q8_SUBS * st + sb, k);
    }
#pragma unroll
    for (int q = 0; q < GEMM_ROWS * GEMM_Q8_SUBS / GEMM_THREADS; q++) {
        const int p = tid + GEMM_THREADS * q, row = p / GEMM_Q8_SUBS, sb = p % GEMM_Q8_SUBS;
        const uint8_t *w = W + (size_t)(r0 + row < nrows ? r0 + row : r0) * row_bytes;
        if (T::HDR || sb < nsb) rg.sc[q] = gemm_q8_sc<T, T::HDR>::fetch(w, GEMM_Q8_SUBS * st + sb, sb);
    }
#pragma unroll
    for (int u = 0; u < TT / 32; u++) {
        const int tg = g + 32 * u, t = tg < tl.n ? tl.t0 + tg : tl.t0;
#pragma unroll
        for (int sb = 0; sb < GEMM_Q8_SUBS; sb++) {
            if (sb >= nsb) break;
            const block_q8_1 *b = xq + (size_t)t * nsub + GEMM_Q8_SUBS * st + sb;
            rg.x[u][sb] = le_ldg((const int *)b->qs + k);
            if (k == 0) rg.ds[u][sb] = le_ldg((const int *)b);
        }
    }
}

template <class T, int TT>
__device__ __forceinline__ void gemm_q8_put(const gemm_q8_regs<T, TT> &rg, int st, int nsb, gemm_q8_smem<TT> &sm) {
    const int tid = threadIdx.x, k = tid % 8, g = tid / 8;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const int row = g + 32 * (i / 4), sb = i % 4;
        if (sb < nsb) sm.wq[row][gemm_q8_slot(sb, k)] = T::qfin(rg.w[i], GEMM_Q8_SUBS * st + sb, k);
    }
#pragma unroll
    for (int q = 0; q < GEMM_ROWS * GEMM_Q8_SUBS / GEMM_THREADS; q++) {
        const int p = tid + GEMM_THREADS * q, row = p / GEMM_Q8_SUBS, sb = p % GEMM_Q8_SUBS;
        float d0, d1, m;
        if (T::HDR || sb < nsb) gemm_q8_sc<T, T::HDR>::put(rg.sc[q], GEMM_Q8_SUBS * st + sb, d0, d1, m);
        if (sb >= nsb) continue; /* after the put: every lane takes part in HDR's exchange */
        sm.wm[row][sb] = m;
        sm.wd[row][sb] = gemm_q8_wd<T>(d0, d1);
    }
#pragma unroll
    for (int u = 0; u < TT / 32; u++) {
        const int tg = g + 32 * u;
#pragma unroll
        for (int sb = 0; sb < GEMM_Q8_SUBS; sb++) {
            if (sb >= nsb) break;
            sm.xq[tg][gemm_q8_slot(sb, k)] = rg.x[u][sb];
            if (k == 0) {
                const unsigned ds = (unsigned)rg.ds[u][sb];
                gemm_q8_xd(sm, sb, tg) = gemm_q8_ds(ds);
            }
        }
    }
}
#endif

/* A tile's steps (rows r0 .., the tile's tokens), each staged into shared memory and then consumed by sub(sb) for
 * its sub-blocks: AHEAD (only where LE_GEMM_Q8_CAN_AHEAD) with the step's loads issued while the step before is
 * consumed (gemm_q8_fetch, then gemm_q8_put after the barrier), else synchronously (gemm_q8_stage). The same shared
 * contents either way. The weights' address is taken at each use (live across the loop, it spilled on fermi); sub
 * gets the shared memory by reference from here (held in the functor, its address space was lost: generic loads). */
template <class T, int TT, bool AHEAD, class Sub>
__device__ __forceinline__ void gemm_q8_steps(const uint8_t *LE_RESTRICT W, long long expert_bytes,
                                              const block_q8_1 *LE_RESTRICT xq, int nrows, int nsub, size_t row_bytes,
                                              int r0, const le_gemm_tile &tl, gemm_q8_smem<TT> &sm, Sub &sub) {
    const int nstep = (nsub + GEMM_Q8_SUBS - 1) / GEMM_Q8_SUBS;
#if LE_GEMM_Q8_CAN_AHEAD
    gemm_q8_regs<T, TT> rg;
    if (AHEAD)
        gemm_q8_fetch<T, TT>(le_gemm_weights(W, tl, expert_bytes), xq, nrows, nsub, row_bytes, r0, tl, 0,
                             min(GEMM_Q8_SUBS, nsub), rg);
#endif
    for (int st = 0; st < nstep; st++) {
        const int nsb = min(GEMM_Q8_SUBS, nsub - GEMM_Q8_SUBS * st); /* the last step may be partial */
        __syncthreads(); /* the previous step is consumed */
#if LE_GEMM_Q8_CAN_AHEAD
        if (AHEAD) gemm_q8_put<T, TT>(rg, st, nsb, sm);
        else
#endif
            gemm_q8_stage<T, TT>(le_gemm_weights(W, tl, expert_bytes), xq, nrows, nsub, row_bytes, r0, tl, st, nsb, sm);
        __syncthreads();
#if LE_GEMM_Q8_CAN_AHEAD
        if (AHEAD && st + 1 < nstep) /* in flight while this step's products run */
            gemm_q8_fetch<T, TT>(le_gemm_weights(W, tl, expert_bytes), xq, nrows, nsub, row_bytes, r0, tl, st + 1,
                                 min(GEMM_Q8_SUBS, nsub - GEMM_Q8_SUBS * (st + 1)), rg);
#endif
#pragma unroll 1
        for (int sb = 0; sb < nsb; sb++) sub(sm, sb);
    }
}

/* acc + d8 * p - m * s8 for x = (d8, s8): two fused multiply-adds in this order; the second only where the type has
 * a min (T::HAS_MIN; m = 0 elsewhere, and acc, from +0, is never -0: skipping it keeps the bits) */
template <class T>
__device__ __forceinline__ float gemm_q8_acc(float acc, float2 x, float p, float m) {
    const float a = __fmaf_rn(x.x, p, acc);
    return T::HAS_MIN ? __fmaf_rn(-m, x.y, a) : a;
}

/* The plain kernel `name` of an int8 GEMM: `fn` is a device function template <class T, int TT> (W, xq, Y, nrows,
 * ncols, tile, expert_bytes, smem, rt, rs) of TT tokens per block (gemm_dp4a, gemm_mma) that takes row tiles rt,
 * rt + rs, ... of W. */
#define LE_GEMM_Q8_PLAIN(name, fn, T, TT, ATTR)                                                                \
    extern "C" __global__ void ATTR name(const uint8_t *W, const block_q8_1 *xq, float *Y, int nrows,          \
                                         int ncols, int ntok) {                                                \
        __shared__ gemm_q8_smem<TT> sm;                                                                        \
        __shared__ le_gemm_tile tl;                                                                            \
        le_gemm_tile_plain(tl, ntok, TT);                                                                      \
        fn<T, TT>(W, xq, Y, nrows, ncols, tl, 0, sm, blockIdx.x, gridDim.x);                                   \
    }

#if LE_HAS_MANY_REGS /* the fermi tier has none: with 63 registers the selected matrix spilled (toolchain.many_regs) */
/* The multi kernel `name##_multi`: up to four matrices of one type and width on the same activations (a layer's
 * projections of one input: q/k/v, the GDN's qkv/z/beta/alpha, the FFN's gate/up) in one launch, grid.x their row
 * tiles one after another (matrix m: ceil(n_m / GEMM_ROWS) tiles; n_m = 0: none). A matrix's rows get the plain
 * kernel's bits; its few row tiles no longer make a launch of their own (16-row beta / alpha: 16 blocks). */
#define LE_GEMM_Q8_MULTI(name, fn, T, TT, ATTR)                                                                \
    extern "C" __global__ void ATTR name##_multi(const uint8_t *W0, const uint8_t *W1, const uint8_t *W2,       \
                                                 const uint8_t *W3, const block_q8_1 *xq, float *Y0, float *Y1, \
                                                 float *Y2, float *Y3, int n0, int n1, int n2, int n3,         \
                                                 int ncols, int ntok) {                                        \
        __shared__ gemm_q8_smem<TT> sm;                                                                        \
        __shared__ le_gemm_tile tl;                                                                            \
        le_gemm_tile_plain(tl, ntok, TT);                                                                      \
        const int t0 = (n0 + GEMM_ROWS - 1) / GEMM_ROWS, t1 = (n1 + GEMM_ROWS - 1) / GEMM_ROWS;                \
        const int t2 = (n2 + GEMM_ROWS - 1) / GEMM_ROWS;                                                       \
        const int b = blockIdx.x, m = b < t0 ? 0 : b < t0 + t1 ? 1 : b < t0 + t1 + t2 ? 2 : 3;                 \
        const int rt = b - (m > 0 ? t0 : 0) - (m > 1 ? t1 : 0) - (m > 2 ? t2 : 0);                             \
        /* stride gridDim.x (>= any matrix's tiles): one row tile a block */                                  \
        fn<T, TT>(m == 0 ? W0 : m == 1 ? W1 : m == 2 ? W2 : W3, xq, m == 0 ? Y0 : m == 1 ? Y1 : m == 2 ? Y2 : Y3, \
                  m == 0 ? n0 : m == 1 ? n1 : m == 2 ? n2 : n3, ncols, tl, 0, sm, rt, gridDim.x);              \
    }
#else
#define LE_GEMM_Q8_MULTI(name, fn, T, TT, ATTR)
#endif

/* The plain, grouped (_ids) and multi kernels `name`, `name##_ids`, `name##_multi`; ATTR goes before the names
 * (launch bounds, or LE_GEMM_NO_ATTR) */
#define LE_GEMM_NO_ATTR
#define LE_GEMM_Q8_KERNELS(name, fn, T, TT, ATTR)                                                              \
    LE_GEMM_Q8_PLAIN(name, fn, T, TT, ATTR)                                                                    \
    extern "C" __global__ void ATTR name##_ids(const uint8_t *W, const block_q8_1 *xq, float *Y, int nrows,    \
                                               int ncols, const int *tiles, long long expert_bytes) {          \
        __shared__ gemm_q8_smem<TT> sm;                                                                        \
        __shared__ le_gemm_tile tl;                                                                            \
        if (le_gemm_tile_ids(tl, tiles)) fn<T, TT>(W, xq, Y, nrows, ncols, tl, expert_bytes, sm, blockIdx.x,    \
                                                   gridDim.x);                                                 \
    }                                                                                                          \
    LE_GEMM_Q8_MULTI(name, fn, T, TT, ATTR)

#endif
