/* gdn_chunked.cu — the Gated DeltaNet recurrence in its chunked form (prefill), every tier.
 *
 * Reference: native/gdn.c gdn_chunked_head (the CPU's chunked form, C = 64, chunks counted from the call's first row,
 * so a call that starts at a multiple of 64 chunks as a fresh prefill does). gdn.cu's gdn_recurrent_f32 is the same
 * rule token by token. Per v-head j (k-head kh = j % Hk when tiled, else j / (Hv/Hk)) and chunk of L <= 64 rows, with
 * G the chunk's cumulative log decay and E_ab = exp(G_a - G_b):
 *   A = strictly lower (beta_a k_a.k_b E_ab);  T = (I + A)^-1;  U = T (beta V);  W = T (beta e^G K)
 *   P = lower incl. diagonal (q_a.k_b E_ab)
 *   V' = U - W S;  O = e^G (Q S) + P V';  S <- e^{G_L} S + (e^{G_L - G} K)^T V'
 * Two launches:
 *   gdn_chunk_prep_f32(u, g, beta, W, Uo, P, Gc, n, conv_dim, Hk, Hv, dk, dv, tiled)
 *     every (chunk, head) at once (no state): Gc [n, Hv] (G), W [n, Hv, dk], Uo [n, Hv, dv], P [chunks, Hv, 64, 64]
 *     launch: block GDNC_THREADS (256), grid ceil(n / 64) x Hv
 *   gdn_chunk_prep_ahead_f32(same)   the same bits with each tile's loads a tile ahead, two blocks an SM (not fermi)
 *   gdn_chunk_scan_f32(u, W, Uo, P, Gc, S, o, n, conv_dim, Hk, Hv, dk, dv, tiled)
 *     the chunks in order per (head, GDNC_COLS columns of S; columns are independent): S [Hv, dk, dv] in place,
 *     o [n, Hv * dv]
 *     launch: block GDNC_THREADS (256), grid Hv x ceil(dv / GDNC_COLS)
 *   the scan on tf32 tensor cores (gdn_chunk_scan_tf32): gdn_scan_tf32.cu; the constants both take: gdn_chunked.cuh
 * u, g, beta as gdn_recurrent_f32 takes them (q, k normalised, q scaled; g and beta gated: gdn_gates_f32).
 * dk <= GDNC_MAX_DK; tiles of GDNC_TILE dims through shared memory (<= 34 KB a block: Fermi's and Kepler's 48 KB).
 * Sums run in a fixed order per element whatever the launch: a call's bits depend only on its inputs and its chunk
 * boundaries (a snapshot at a chunk boundary equals a recompute). Bound against the f64 rule: tests/test_gpu.py
 * (GDN_CHUNK_FACTOR). Tiers: all (shared memory and barriers; the prep's inverse by warp shuffles where the tier has
 * them, by barriers on fermi: the same bits).
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k gdn_chunk
 */
#include "gdn_chunked.cuh"

#define GDNC_OC 4        /* V' and O outputs per thread: GDNC_C * GDNC_COLS / GDNC_THREADS */
#define GDNC_SC 8        /* S outputs per thread: GDNC_MAX_DK * GDNC_COLS / GDNC_THREADS */
#if GDNC_OC != 4 || GDNC_SC != 8
#error "the scan reads its operands as float4: one for O's columns, two for S's"
#endif
/* The scan's loops: rolled on the fermi tier (63 registers: unrolled they spill), the compiler's choice elsewhere
 * (unrolled: about twice as fast). The prep's stay rolled on every tier (unrolled: slower). Timings:
 * benchmarks/results/gdn_scan_prefetch_2026-11-29.md. */
#if LE_HAS_MANY_REGS
#define GDNC_ROLLED
#else
#define GDNC_ROLLED _Pragma("unroll 1")
#endif

/* acc[0..3] += a * v (inlined: acc stays in registers) */
__device__ __forceinline__ void gdnc_axpy4(float *acc, float a, float4 v) {
    acc[0] += a * v.x;
    acc[1] += a * v.y;
    acc[2] += a * v.z;
    acc[3] += a * v.w;
}

#define GDNC_PT (GDNC_C * GDNC_TILE / GDNC_THREADS) /* 8: a tile's elements a thread */
/* operands loaded a tile (prep) or a phase (scan) ahead: the tiers with registers for it (fermi's 63 would spill) */
#if LE_HAS_MANY_REGS
#define GDNC_AHEAD 1
#else
#define GDNC_AHEAD 0
#endif

/* Elements tid + GDNC_THREADS i (row e / GDNC_TILE, dim d0 + e % GDNC_TILE; 0 outside the chunk's L rows and the
 * width) of the tiles of A and B at d0 into r[0], r[1]: loaded a tile ahead of the products that wait on them (the
 * prep's one block an SM at 512 tokens had each tile's latency exposed). B = A loads A once. */
__device__ __forceinline__ void gdnc_prep_fetch(const float *A, const float *B, int conv_dim, int L, int width, int d0,
                                                float (*r)[GDNC_PT]) {
#pragma unroll
    for (int i = 0; i < GDNC_PT; i++) {
        const int e = threadIdx.x + GDNC_THREADS * i, row = e / GDNC_TILE, d = e % GDNC_TILE;
        const bool in = row < L && d0 + d < width;
        r[0][i] = in ? A[(size_t)row * conv_dim + d0 + d] : 0.0f;
        if (B != A) r[1][i] = in ? B[(size_t)row * conv_dim + d0 + d] : 0.0f;
    }
}

/* One (chunk, head): the chunk's rows t0 .. t0 + L - 1. AHEAD (GDNC_AHEAD tiers): each tile's loads issued before
 * the products of the tile before (gdnc_prep_fetch); the same shared contents and sums either way: the same bits. */
struct gdnc_prep_smem { /* declared by each prep kernel (a device function's __shared__ would be every kernel's) */
    float T[GDNC_C][GDNC_C + 1];         /* A, then T = (I + A)^-1 */
    __align__(16) float tab[2][GDNC_C][GDNC_TILE + 1]; /* one buffer: At and xt below span it */
    float G[GDNC_C], B[GDNC_C];
};

#if LE_HAS_SHFL
/* T (holding A, strictly lower) <- (I + A)^-1 in place, rows >= L: the identity's. Warp w takes columns w + 8k (k < 8),
 * lane l their rows l and l + 32 in registers; at step m each column's T_mc comes from lane m % 32 by a shuffle, so
 * the steps need no barrier (pivot by pivot, one barrier a step, they had been most of the prep). The same terms in
 * the same order as the barrier form: the same bits. */
__device__ __forceinline__ void gdnc_invert_warps(float (*T)[GDNC_C + 1], int L) {
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32, nw = GDNC_THREADS / 32;
    float t[GDNC_C / (GDNC_THREADS / 32)][2]; /* [k][h]: T[lane + 32 h][w + 8 k] */
#pragma unroll
    for (int k = 0; k < GDNC_C / nw; k++) t[k][0] = t[k][1] = 0.0f;
    for (int m = 0; m + 1 < L; m++) {
        const float a0 = T[lane][m], a1 = T[lane + 32][m]; /* A's column m at this lane's rows */
#pragma unroll
        for (int k = 0; k < GDNC_C / nw; k++) {
            const int c = w + nw * k;
            const float mine = m < 32 ? t[k][0] : t[k][1]; /* (selected: m is uniform) */
            const float tm = c == m ? 1.0f : __int_as_float(le_shfl_idx(__float_as_int(mine), m % 32, 32));
            if (c <= m) {
                if (lane > m && lane < L) t[k][0] -= a0 * tm;
                if (lane + 32 > m && lane + 32 < L) t[k][1] -= a1 * tm;
            }
        }
    }
    __syncthreads(); /* A read by every warp */
#pragma unroll
    for (int k = 0; k < GDNC_C / nw; k++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = lane + 32 * h, c = w + nw * k;
            T[r][c] = r == c ? 1.0f : r < L && c < r ? t[k][h] : 0.0f;
        }
    __syncthreads();
}
#endif

/* row r's factor in the U (pass 0) / W (pass 1) input tiles: beta, or beta e^G; 0 past the chunk's L rows */
__device__ __forceinline__ float gdnc_row_scale(int pass, int r, int L, const float *B, const float *G) {
    return r < L ? (pass ? B[r] * expf(G[r]) : B[r]) : 0.0f;
}

template <bool AHEAD>
__device__ __forceinline__ void gdnc_prep(const float *LE_RESTRICT u, const float *LE_RESTRICT g,
                                          const float *LE_RESTRICT beta, float *W, float *Uo, float *P, float *Gc,
                                          int n, int conv_dim, int Hk, int Hv, int dk, int dv, int tiled,
                                          gdnc_prep_smem &sm) {
    float(*T)[GDNC_C + 1] = sm.T;
    float(*tab)[GDNC_C][GDNC_TILE + 1] = sm.tab;
    float(*ta)[GDNC_TILE + 1] = tab[0]; /* a tile of K (then of beta e^G K, beta V) */
    float(*tb)[GDNC_TILE + 1] = tab[1]; /* a tile of Q */
    float *G = sm.G, *B = sm.B;
    const int tid = threadIdx.x, c = blockIdx.x, j = blockIdx.y;
    const int t0 = c * GDNC_C, L = min(GDNC_C, n - t0), kh = gdnc_k_head(j, Hk, Hv, tiled);
    const float *K = u + (size_t)t0 * conv_dim + (size_t)(Hk + kh) * dk;
    const float *Q = u + (size_t)t0 * conv_dim + (size_t)kh * dk;
    const float *V = u + (size_t)t0 * conv_dim + (size_t)2 * Hk * dk + (size_t)j * dv;
    if (tid < GDNC_C) {
        B[tid] = tid < L ? beta[(size_t)(t0 + tid) * Hv + j] : 0.0f;
        G[tid] = tid < L ? g[(size_t)(t0 + tid) * Hv + j] : 0.0f;
    }
    __syncthreads();
    if (tid == 0) { /* G: the running sum in row order (the reference's), from shared memory: one thread's chain of
                     * global loads (which may alias Gc's stores) had cost a whole launch's worth of latency */
        float run = 0.0f;
        for (int a = 0; a < L; a++) {
            run += G[a];
            G[a] = run;
        }
    }
    /* K K^T and Q K^T: thread (ty, tx) owns rows ty*4 .. +3 and columns tx*4 .. +3 of both */
    const int ty = tid / 16, tx = tid % 16;
    float kk[4][4], qk[4][4];
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < 4; b++) kk[a][b] = qk[a][b] = 0.0f;
    float kq[2][GDNC_PT]; /* AHEAD: this thread's elements of the next K and Q tiles (gdnc_prep_fetch) */
    if (AHEAD) gdnc_prep_fetch(K, Q, conv_dim, L, dk, 0, kq);
    for (int d0 = 0; d0 < dk; d0 += GDNC_TILE) {
        if (AHEAD) {
#pragma unroll
            for (int i = 0; i < GDNC_PT; i++) {
                const int e = tid + GDNC_THREADS * i, r = e / GDNC_TILE, d = e % GDNC_TILE;
                ta[r][d] = kq[0][i];
                tb[r][d] = kq[1][i];
            }
            __syncthreads();
            if (d0 + GDNC_TILE < dk) /* in flight meanwhile */
                gdnc_prep_fetch(K, Q, conv_dim, L, dk, d0 + GDNC_TILE, kq);
        } else {
#pragma unroll 1
            for (int e = tid; e < GDNC_C * GDNC_TILE; e += GDNC_THREADS) {
                const int r = e / GDNC_TILE, d = e % GDNC_TILE;
                const bool in = r < L && d0 + d < dk;
                ta[r][d] = in ? K[(size_t)r * conv_dim + d0 + d] : 0.0f;
                tb[r][d] = in ? Q[(size_t)r * conv_dim + d0 + d] : 0.0f;
            }
            __syncthreads();
        }
#pragma unroll 1
        for (int d = 0; d < GDNC_TILE; d++)
#pragma unroll
            for (int a = 0; a < 4; a++) {
                const float ka = ta[ty * 4 + a][d], qa = tb[ty * 4 + a][d];
#pragma unroll
                for (int b = 0; b < 4; b++) {
                    const float kb = ta[tx * 4 + b][d];
                    kk[a][b] += ka * kb;
                    qk[a][b] += qa * kb;
                }
            }
        __syncthreads();
    }
    if (tid < L) Gc[(size_t)(t0 + tid) * Hv + j] = G[tid]; /* G was final at the tiles' first barrier */
    float *Pc = P + ((size_t)c * Hv + j) * GDNC_C * GDNC_C;
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < 4; b++) {
            const int r = ty * 4 + a, s = tx * 4 + b;
            const bool live = r < L && s < L;
            const float e = live && s <= r ? expf(G[r] - G[s]) : 0.0f;
            T[r][s] = live && s < r ? B[r] * kk[a][b] * e : 0.0f;
            Pc[r * GDNC_C + s] = live && s <= r ? qk[a][b] * e : 0.0f;
        }
    __syncthreads();
    /* T = (I + A)^-1 by forward substitution, T_rc = -sum_{m=c}^{r-1} A_rm T_mc (T_cc = 1), the terms in increasing m
     * as row by row would take them, but pivot by pivot: at step m every row r > m takes its term m. */
#if LE_HAS_SHFL
    gdnc_invert_warps(T, L);
#else
    /* without shuffles (fermi): A's column m read from a copy (At, in the tile buffers) while T fills in: one barrier
     * a step, 4 rows a thread */
    float(*At)[GDNC_C] = (float(*)[GDNC_C])tab; /* 2 * 64 * 33 >= 64 * 64 floats, free until U and W */
    for (int e = tid; e < GDNC_C * GDNC_C; e += GDNC_THREADS) {
        const int r = e / GDNC_C, s = e % GDNC_C;
        At[r][s] = T[r][s];
    }
    __syncthreads();
    for (int e = tid; e < GDNC_C * GDNC_C; e += GDNC_THREADS) T[e / GDNC_C][e % GDNC_C] = 0.0f;
    __syncthreads();
    const int sc = tid % GDNC_C, sr = tid / GDNC_C; /* column sc, rows m + 1 + sr + 4k */
    for (int m = 0; m + 1 < L; m++) {
        if (sc <= m) {
            const float tm = sc == m ? 1.0f : T[m][sc];
            GDNC_ROLLED
            for (int r = m + 1 + sr; r < L; r += GDNC_THREADS / GDNC_C) T[r][sc] -= At[r][m] * tm;
        }
        __syncthreads();
    }
    if (tid < GDNC_C) T[tid][tid] = 1.0f;
    __syncthreads();
#endif
    /* U = T (beta V), W = T (beta e^G K): thread rows p and 63 - p (p = tid / 8: a pair's rows take 65 terms
     * together, so every warp's loop is about as long; by row, warps 0 .. 7 had taken 8 .. 64), columns c4 .. c4 + 3
     * of a tile, read as one 16-byte word a term (xt: 16-byte rows, in the tile buffers) */
    float(*xt)[GDNC_TILE + 4] = (float(*)[GDNC_TILE + 4])tab;
    const int p = tid / 8, c4 = (tid % 8) * 4;
    for (int pass = 0; pass < 2; pass++) {
        const int width = pass ? dk : dv;
        const float *X = pass ? K : V;
        float *out = pass ? W + (size_t)j * dk : Uo + (size_t)j * dv;
        const size_t stride = (size_t)Hv * width;
        float xr[2][GDNC_PT]; /* AHEAD: the next tile's elements of X (xr[0]; xr[1] unused) */
        if (AHEAD) gdnc_prep_fetch(X, X, conv_dim, L, width, 0, xr);
        for (int d0 = 0; d0 < width; d0 += GDNC_TILE) {
            if (AHEAD) {
#pragma unroll
                for (int i = 0; i < GDNC_PT; i++) {
                    const int e = tid + GDNC_THREADS * i, r = e / GDNC_TILE, d = e % GDNC_TILE;
                    const float scale = gdnc_row_scale(pass, r, L, B, G);
                    xt[r][d] = r < L && d0 + d < width ? scale * xr[0][i] : 0.0f;
                }
                __syncthreads();
                if (d0 + GDNC_TILE < width) gdnc_prep_fetch(X, X, conv_dim, L, width, d0 + GDNC_TILE, xr);
            } else {
#pragma unroll 1
                for (int e = tid; e < GDNC_C * GDNC_TILE; e += GDNC_THREADS) {
                    const int r = e / GDNC_TILE, d = e % GDNC_TILE;
                    const float scale = gdnc_row_scale(pass, r, L, B, G);
                    xt[r][d] = r < L && d0 + d < width ? scale * X[(size_t)r * conv_dim + d0 + d] : 0.0f;
                }
                __syncthreads();
            }
            float lo[4] = {0.0f, 0.0f, 0.0f, 0.0f}, hi[4] = {0.0f, 0.0f, 0.0f, 0.0f}; /* rows p, 63 - p */
            const int mend = min(GDNC_C - 1 - p, L - 1);
#pragma unroll 4
            for (int m = 0; m <= mend; m++) { /* T is lower triangular: row r takes terms m <= r, in order */
                const float4 x = *reinterpret_cast<const float4 *>(&xt[m][c4]);
                gdnc_axpy4(hi, T[GDNC_C - 1 - p][m], x);
                if (m <= p) gdnc_axpy4(lo, T[p][m], x);
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int row = h ? GDNC_C - 1 - p : p;
                if (row < L)
#pragma unroll
                    for (int b = 0; b < 4; b++)
                        if (d0 + c4 + b < width) out[(size_t)(t0 + row) * stride + d0 + c4 + b] = h ? hi[b] : lo[b];
            }
            __syncthreads();
        }
    }
}

#define LE_GDNC_PREP_ARGS                                                                                      \
    const float *LE_RESTRICT u, const float *LE_RESTRICT g, const float *LE_RESTRICT beta, float *W, float *Uo,     \
        float *P, float *Gc, int n, int conv_dim, int Hk, int Hv, int dk, int dv, int tiled
extern "C" __global__ void gdn_chunk_prep_f32(LE_GDNC_PREP_ARGS) {
    __shared__ gdnc_prep_smem sm;
    gdnc_prep<false>(u, g, beta, W, Uo, P, Gc, n, conv_dim, Hk, Hv, dk, dv, tiled, sm);
}
#if GDNC_AHEAD
/* two blocks an SM (102 registers on sm_90; unbounded it took 135: one): the launcher runs it where the grid has at
 * most a block an SM (Kernels.gdn_chunked), the plain form above where occupancy hides the loads */
extern "C" __global__ void __launch_bounds__(GDNC_THREADS, 2) gdn_chunk_prep_ahead_f32(LE_GDNC_PREP_ARGS) {
    __shared__ gdnc_prep_smem sm;
    gdnc_prep<true>(u, g, beta, W, Uo, P, Gc, n, conv_dim, Hk, Hv, dk, dv, tiled, sm);
}
#endif

/* The scan's operands that do not depend on S come in phases of GDNC_PF floats a thread: phases 0 .. nt - 1 the W and
 * Q tiles of dims 32p .. 32p + 31 (nt = ceil(dk / 32)), phase nt the P block, phases nt + 1 and nt + 2 K's halves of
 * 32 rows. On the many-register tiers a phase's loads are issued before the phase before it is computed, so the
 * chunk's chain (W S -> V' -> K^T V' -> S) never waits on memory (H200, 0.8B shapes: one block an SM, every phase's
 * latency was exposed); fermi (63 registers) loads each element as it stores it. The shared contents are the same
 * either way, and so are the bits. */
#define GDNC_PF (2 * GDNC_C * GDNC_TILE / GDNC_THREADS) /* 16 */
#if GDNC_PF * GDNC_THREADS != GDNC_C * GDNC_C || GDNC_PF * GDNC_THREADS != GDNC_C / 2 * GDNC_MAX_DK
#error "every scan phase (a W | Q tile, P, half of K) is GDNC_PF floats a thread"
#endif

struct gdnc_scan_args {
    const float *u, *W, *P;
    int n, conv_dim, Hk, Hv, dk, j, kh, nt;
};

/* a phase's loads: elements k < GDNC_PF / 2 of a half read p[k * step], valid while row + k * rstep < L (and dok) */
struct gdnc_half {
    const float *p;
    size_t step;
    int row, rstep;
};

/* where this thread's elements of phase ph of the chunk at t0 are (element k < H of half h: h.p[k * h.step]). Pointers
 * run by a stride, not an address per element: kept live across the chunk loop, those took every register. */
__device__ __forceinline__ void gdnc_scan_src(const gdnc_scan_args &a, int t0, int ph, gdnc_half &h0, gdnc_half &h1,
                                              bool &dok) {
    const int tid = threadIdx.x, H = GDNC_PF / 2;
    const float *rows = a.u + (size_t)t0 * a.conv_dim;
    dok = true;
    if (ph < a.nt) { /* W's rows tid / 32 + 8k of the tile, then Q's */
        const int r = tid / GDNC_TILE, d = ph * GDNC_TILE + tid % GDNC_TILE;
        dok = d < a.dk;
        h0 = {a.W + ((size_t)(t0 + r) * a.Hv + a.j) * a.dk + d, (size_t)8 * a.Hv * a.dk, r, 8};
        h1 = {rows + (size_t)r * a.conv_dim + (size_t)a.kh * a.dk + d, (size_t)8 * a.conv_dim, r, 8};
    } else if (ph == a.nt) { /* P: [64][64] as prep wrote it */
        const float *Pc = a.P + ((size_t)(t0 / GDNC_C) * a.Hv + a.j) * GDNC_C * GDNC_C + tid;
        h0 = {Pc, GDNC_THREADS, 0, 0};
        h1 = {Pc + H * GDNC_THREADS, GDNC_THREADS, 0, 0};
    } else { /* K's rows m0 + tid / 128 + 2k */
        const int m = (ph - a.nt - 1) * (GDNC_C / 2) + tid / GDNC_MAX_DK, d = tid % GDNC_MAX_DK;
        dok = d < a.dk;
        h0 = {rows + (size_t)m * a.conv_dim + (size_t)(a.Hk + a.kh) * a.dk + d, (size_t)2 * a.conv_dim, m, 2};
        h1 = {h0.p + (size_t)2 * H * a.conv_dim, h0.step, m + 2 * H, 2};
    }
}

/* element k of a half; 0 outside the chunk's L rows and dk */
__device__ __forceinline__ float gdnc_scan_get(const gdnc_half &h, int k, bool dok, int L) {
    return dok && h.row + k * h.rstep < L ? h.p[k * h.step] : 0.0f;
}

/* element i (< GDNC_PF) of phase ph into the shared buffer: tw | tq [64][33], Ps [64][65], or Kh [32][128] times D */
__device__ __forceinline__ void gdnc_scan_put(int nt, int ph, int i, float x, float *tiles, const float *D) {
    const int tid = threadIdx.x, H = GDNC_PF / 2;
    if (ph < nt)
        tiles[(i / H) * GDNC_C * (GDNC_TILE + 1) + (tid / GDNC_TILE + (i % H) * 8) * (GDNC_TILE + 1) +
              tid % GDNC_TILE] = x;
    else if (ph == nt)
        tiles[(tid / GDNC_C + i * (GDNC_THREADS / GDNC_C)) * (GDNC_C + 1) + tid % GDNC_C] = x;
    else
        tiles[tid + i * GDNC_THREADS] = D[(ph - nt - 1) * (GDNC_C / 2) + tid / GDNC_MAX_DK + 2 * i] * x;
}

/* this thread's GDNC_PF elements of phase ph of the chunk at t0 (its L rows) into pf (GDNC_AHEAD: a phase ahead) */
__device__ __forceinline__ void gdnc_scan_fetch(const gdnc_scan_args &a, int t0, int L, int ph, float *pf) {
    const int H = GDNC_PF / 2;
    gdnc_half h0, h1;
    bool dok;
    gdnc_scan_src(a, t0, ph, h0, h1, dok);
#pragma unroll
    for (int i = 0; i < GDNC_PF; i++) pf[i] = gdnc_scan_get(i < H ? h0 : h1, i % H, dok, L);
}

/* phase ph of the chunk at t0 into shared memory. GDNC_AHEAD: pf holds it already, and the next phase's loads (this
 * chunk's next, or the next chunk's first) are issued before the barrier; fermi loads each element as it stores it. */
__device__ __forceinline__ void gdnc_scan_phase(const gdnc_scan_args &a, int t0, int ph, float *pf, float *tiles,
                                                const float *D) {
    __syncthreads(); /* the buffer's readers of the phase before are done */
    if (GDNC_AHEAD) {
#pragma unroll
        for (int i = 0; i < GDNC_PF; i++) gdnc_scan_put(a.nt, ph, i, pf[i], tiles, D);
        const bool last = ph + 1 == a.nt + 3;
        const int t1 = last ? t0 + GDNC_C : t0, L1 = min(GDNC_C, a.n - t1);
        if (t1 < a.n) gdnc_scan_fetch(a, t1, L1, last ? 0 : ph + 1, pf);
    } else {
        const int H = GDNC_PF / 2;
        gdnc_half h0, h1;
        bool dok;
        gdnc_scan_src(a, t0, ph, h0, h1, dok);
        const int L = min(GDNC_C, a.n - t0);
        GDNC_ROLLED
        for (int k = 0; k < H; k++) { /* the halves' elements k together: two loads in flight, no spill */
            const float x0 = gdnc_scan_get(h0, k, dok, L), x1 = gdnc_scan_get(h1, k, dok, L);
            gdnc_scan_put(a.nt, ph, k, x0, tiles, D);
            gdnc_scan_put(a.nt, ph, H + k, x1, tiles, D);
        }
    }
    __syncthreads();
}

/* the chunk's G_t (t = tid < L), G_{L-1}, and U's row `row`, columns col .. col + GDNC_OC - 1 (0 outside) */
__device__ __forceinline__ void gdnc_scan_chunk_vals(const float *LE_RESTRICT Gc, const float *LE_RESTRICT Uo, int t0,
                                                     int L, int Hv, int j, int dv, int row, int col, float &gv,
                                                     float &gl, float *uv) {
    const int tid = threadIdx.x;
    if (tid < L) {
        gv = Gc[(size_t)(t0 + tid) * Hv + j];
        gl = Gc[(size_t)(t0 + L - 1) * Hv + j];
    }
#pragma unroll
    for (int b = 0; b < GDNC_OC; b++)
        uv[b] = row < L && col + b < dv ? Uo[((size_t)(t0 + row) * Hv + j) * dv + col + b] : 0.0f;
}

/* The chunks of one (head j, columns c0 .. c0 + GDNC_COLS - 1) in order; S's slice lives in shared memory, and every
 * operand a thread reads more than once comes through shared tiles (Kepler's L1 does not cache global loads, Fermi
 * has no __ldg): W and Q in tiles of GDNC_TILE dims, then P, then K in halves of 32 rows, in one buffer. */
extern "C" __global__ void gdn_chunk_scan_f32(const float *LE_RESTRICT u, const float *LE_RESTRICT W,
                                              const float *LE_RESTRICT Uo, const float *LE_RESTRICT P,
                                              const float *LE_RESTRICT Gc, float *S, float *o, int n, int conv_dim,
                                              int Hk, int Hv, int dk, int dv, int tiled) {
    __shared__ __align__(16) float Ss[GDNC_MAX_DK][GDNC_COLS];
    __shared__ float tiles[2 * GDNC_C * (GDNC_TILE + 1)]; /* W | Q tiles [64][33] each; P [64][65]; K half [32][128] */
    __shared__ __align__(16) float Vp[GDNC_C][GDNC_COLS + 4]; /* V' (rows of 16-byte multiples: float4 reads) */
    __shared__ float G[GDNC_C], D[GDNC_C];                /* G, and e^{G_L - G} */
    float(*tw)[GDNC_TILE + 1] = (float(*)[GDNC_TILE + 1])tiles;
    float(*tq)[GDNC_TILE + 1] = (float(*)[GDNC_TILE + 1])(tiles + GDNC_C * (GDNC_TILE + 1));
    float(*Ps)[GDNC_C + 1] = (float(*)[GDNC_C + 1])tiles;
    float(*Kh)[GDNC_MAX_DK] = (float(*)[GDNC_MAX_DK])tiles;
    const int tid = threadIdx.x, j = blockIdx.x, c0 = blockIdx.y * GDNC_COLS;
    const gdnc_scan_args a = {u, W, P, n, conv_dim, Hk, Hv, dk, j, gdnc_k_head(j, Hk, Hv, tiled),
                              (dk + GDNC_TILE - 1) / GDNC_TILE};
    float *Sj = S + (size_t)j * dk * dv;
    GDNC_ROLLED
    for (int e = tid; e < dk * GDNC_COLS; e += GDNC_THREADS) {
        const int i = e / GDNC_COLS, cc = e % GDNC_COLS;
        Ss[i][cc] = c0 + cc < dv ? Sj[(size_t)i * dv + c0 + cc] : 0.0f;
    }
    /* V' and O: row, columns c8 .. c8 + GDNC_OC - 1; S: row si, columns s16 .. s16 + GDNC_SC - 1 */
    const int row = tid / (GDNC_COLS / GDNC_OC), c8 = (tid % (GDNC_COLS / GDNC_OC)) * GDNC_OC;
    const int si = tid / (GDNC_COLS / GDNC_SC), s16 = (tid % (GDNC_COLS / GDNC_SC)) * GDNC_SC;
    float pf[GDNC_PF];
    if (GDNC_AHEAD) gdnc_scan_fetch(a, 0, min(GDNC_C, n), 0, pf);
    for (int t0 = 0; t0 < n; t0 += GDNC_C) {
        const int L = min(GDNC_C, n - t0);
        /* W S and Q S over dk in tiles */
        float ws[GDNC_OC], qs[GDNC_OC], uv[GDNC_OC], gv = 0.0f, gl = 0.0f;
#pragma unroll
        for (int b = 0; b < GDNC_OC; b++) ws[b] = qs[b] = 0.0f;
        for (int p = 0; p < a.nt; p++) {
            gdnc_scan_phase(a, t0, p, pf, tiles, D);
            if (p == 0 && GDNC_AHEAD) /* used after the tiles: in flight while they are computed */
                gdnc_scan_chunk_vals(Gc, Uo, t0, L, Hv, j, dv, row, c0 + c8, gv, gl, uv);
            const int d0 = p * GDNC_TILE, dn = min(GDNC_TILE, dk - d0);
            GDNC_ROLLED
            for (int d = 0; d < dn; d++) {
                const float w = tw[row][d], q = tq[row][d];
                const float4 sv = *reinterpret_cast<const float4 *>(&Ss[d0 + d][c8]);
                gdnc_axpy4(ws, w, sv);
                gdnc_axpy4(qs, q, sv);
            }
        }
        /* V' = U - W S; the chunk's G and D (their readers of the chunk before passed the tiles' barriers) */
        if (!GDNC_AHEAD) gdnc_scan_chunk_vals(Gc, Uo, t0, L, Hv, j, dv, row, c0 + c8, gv, gl, uv);
#pragma unroll
        for (int b = 0; b < GDNC_OC; b++) Vp[row][c8 + b] = row < L && c0 + c8 + b < dv ? uv[b] - ws[b] : 0.0f;
        if (tid < GDNC_C) {
            G[tid] = gv;
            D[tid] = tid < L ? expf(gl - gv) : 0.0f;
        }
        gdnc_scan_phase(a, t0, a.nt, pf, tiles, D); /* P; V', G and D written */
        /* O = e^G (Q S) + P V' */
        if (row < L) {
            const float eg = expf(G[row]);
            float acc[GDNC_OC];
#pragma unroll
            for (int b = 0; b < GDNC_OC; b++) acc[b] = 0.0f;
            GDNC_ROLLED
            for (int m = 0; m <= row; m++) {
                const float pm = Ps[row][m];
                gdnc_axpy4(acc, pm, *reinterpret_cast<const float4 *>(&Vp[m][c8]));
            }
#pragma unroll
            for (int b = 0; b < GDNC_OC; b++) {
                const int col = c0 + c8 + b;
                if (col < dv) o[(size_t)(t0 + row) * Hv * dv + (size_t)j * dv + col] = eg * qs[b] + acc[b];
            }
        }
        /* S <- e^{G_L} S + (e^{G_L - G} K)^T V', K in halves of 32 rows */
        float acc[GDNC_SC];
#pragma unroll
        for (int b = 0; b < GDNC_SC; b++) acc[b] = 0.0f;
        for (int h = 0; h < 2; h++) {
            gdnc_scan_phase(a, t0, a.nt + 1 + h, pf, tiles, D);
            const int m0 = h * (GDNC_C / 2), mn = min(GDNC_C / 2, L - m0);
            GDNC_ROLLED
            for (int m = 0; m < mn; m++) {
                const float kd = Kh[m][si];
                gdnc_axpy4(acc, kd, *reinterpret_cast<const float4 *>(&Vp[m0 + m][s16]));
                gdnc_axpy4(acc + 4, kd, *reinterpret_cast<const float4 *>(&Vp[m0 + m][s16 + 4]));
            }
        }
        if (si < dk) {
            const float el = expf(G[L - 1]);
#pragma unroll
            for (int b = 0; b < GDNC_SC; b++) Ss[si][s16 + b] = el * Ss[si][s16 + b] + acc[b];
        }
    }
    __syncthreads();
    GDNC_ROLLED
    for (int e = tid; e < dk * GDNC_COLS; e += GDNC_THREADS) {
        const int i = e / GDNC_COLS, cc = e % GDNC_COLS;
        if (c0 + cc < dv) Sj[(size_t)i * dv + c0 + cc] = Ss[i][cc];
    }
}
