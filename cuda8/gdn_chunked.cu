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
 *   gdn_chunk_scan_f32(u, W, Uo, P, Gc, S, o, n, conv_dim, Hk, Hv, dk, dv, tiled)
 *     the chunks in order per (head, GDNC_COLS columns of S; columns are independent): S [Hv, dk, dv] in place,
 *     o [n, Hv * dv]
 *     launch: block GDNC_THREADS (256), grid Hv x ceil(dv / GDNC_COLS)
 * u, g, beta as gdn_recurrent_f32 takes them (q, k normalised, q scaled; g and beta gated: gdn_gates_f32).
 * dk <= GDNC_MAX_DK; tiles of GDNC_TILE dims through shared memory (<= 34 KB a block: Fermi's and Kepler's 48 KB).
 * Sums run in a fixed order per element whatever the launch: a call's bits depend only on its inputs and its chunk
 * boundaries (a snapshot at a chunk boundary equals a recompute). Bound against the f64 rule: tests/test_gpu.py
 * (GDN_CHUNK_FACTOR). Tiers: all (shared memory and barriers only).
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k gdn_chunk
 */
#include "compat.cuh"

#define GDNC_C 64        /* chunk rows: native/gdn.c GDN_CHUNK */
#define GDNC_THREADS 256
#define GDNC_TILE 32     /* dims of K, Q, V, W per shared tile */
#define GDNC_COLS 16     /* columns of S per scan block: Hv * dv / 16 blocks (256 for the 35B: two an SM) */
#define GDNC_OC 4        /* V' and O outputs per thread: GDNC_C * GDNC_COLS / GDNC_THREADS */
#define GDNC_SC 8        /* S outputs per thread: GDNC_MAX_DK * GDNC_COLS / GDNC_THREADS */
#if GDNC_OC != 4 || GDNC_SC != 8
#error "the scan reads its operands as float4: one for O's columns, two for S's"
#endif
#define GDNC_MAX_DK 128
/* The scan's loops: rolled on the fermi tier (63 registers: unrolled they spill), the compiler's choice elsewhere
 * (H200, 2048 tokens: the scan 0.82 ms unrolled, 1.46 ms rolled). The prep's stay rolled on every tier (0.34 ms,
 * 0.40 unrolled). */
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

__device__ __forceinline__ int gdnc_k_head(int j, int Hk, int Hv, int tiled) { return tiled ? j % Hk : j / (Hv / Hk); }

/* One (chunk, head): the chunk's rows t0 .. t0 + L - 1. */
extern "C" __global__ void gdn_chunk_prep_f32(const float *LE_RESTRICT u, const float *LE_RESTRICT g,
                                              const float *LE_RESTRICT beta, float *W, float *Uo, float *P, float *Gc,
                                              int n, int conv_dim, int Hk, int Hv, int dk, int dv, int tiled) {
    __shared__ float T[GDNC_C][GDNC_C + 1];      /* A, then T = (I + A)^-1 */
    __shared__ float ta[GDNC_C][GDNC_TILE + 1];  /* a tile of K (then of beta e^G K, beta V) */
    __shared__ float tb[GDNC_C][GDNC_TILE + 1];  /* a tile of Q */
    __shared__ float G[GDNC_C], B[GDNC_C];
    const int tid = threadIdx.x, c = blockIdx.x, j = blockIdx.y;
    const int t0 = c * GDNC_C, L = min(GDNC_C, n - t0), kh = gdnc_k_head(j, Hk, Hv, tiled);
    const float *K = u + (size_t)t0 * conv_dim + (size_t)(Hk + kh) * dk;
    const float *Q = u + (size_t)t0 * conv_dim + (size_t)kh * dk;
    const float *V = u + (size_t)t0 * conv_dim + (size_t)2 * Hk * dk + (size_t)j * dv;
    if (tid < GDNC_C) B[tid] = tid < L ? beta[(size_t)(t0 + tid) * Hv + j] : 0.0f;
    if (tid == 0) { /* G: the running sum in row order (the reference's) */
        float run = 0.0f;
        for (int a = 0; a < L; a++) {
            run += g[(size_t)(t0 + a) * Hv + j];
            G[a] = run;
            Gc[(size_t)(t0 + a) * Hv + j] = run;
        }
    }
    /* K K^T and Q K^T: thread (ty, tx) owns rows ty*4 .. +3 and columns tx*4 .. +3 of both */
    const int ty = tid / 16, tx = tid % 16;
    float kk[4][4], qk[4][4];
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < 4; b++) kk[a][b] = qk[a][b] = 0.0f;
    for (int d0 = 0; d0 < dk; d0 += GDNC_TILE) {
#pragma unroll 1
        for (int e = tid; e < GDNC_C * GDNC_TILE; e += GDNC_THREADS) {
            const int r = e / GDNC_TILE, d = e % GDNC_TILE;
            const bool in = r < L && d0 + d < dk;
            ta[r][d] = in ? K[(size_t)r * conv_dim + d0 + d] : 0.0f;
            tb[r][d] = in ? Q[(size_t)r * conv_dim + d0 + d] : 0.0f;
        }
        __syncthreads();
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
    /* T = (I + A)^-1 by forward substitution, row by row in place: T_r = e_r - sum_{m<r} A_rm T_m (T_m done) */
    for (int r = 1; r < L; r++) {
        float x = 0.0f;
        if (tid < r) {
            for (int m = tid; m < r; m++) x -= T[r][m] * (m == tid ? 1.0f : T[m][tid]);
        }
        __syncthreads();
        if (tid < r) T[r][tid] = x;
        __syncthreads();
    }
    if (tid < GDNC_C) T[tid][tid] = 1.0f;
    __syncthreads();
    /* U = T (beta V), W = T (beta e^G K): thread row = tid / 4 (64 rows), columns (tid % 4) * 8 .. +7 of a tile */
    const int row = tid / 4, c8 = (tid % 4) * 8;
    for (int pass = 0; pass < 2; pass++) {
        const int width = pass ? dk : dv;
        const float *X = pass ? K : V;
        float *out = pass ? W + (size_t)j * dk : Uo + (size_t)j * dv;
        const size_t stride = (size_t)Hv * width;
        for (int d0 = 0; d0 < width; d0 += GDNC_TILE) {
#pragma unroll 1
            for (int e = tid; e < GDNC_C * GDNC_TILE; e += GDNC_THREADS) {
                const int r = e / GDNC_TILE, d = e % GDNC_TILE;
                const float scale = r < L ? (pass ? B[r] * expf(G[r]) : B[r]) : 0.0f;
                ta[r][d] = r < L && d0 + d < width ? scale * X[(size_t)r * conv_dim + d0 + d] : 0.0f;
            }
            __syncthreads();
            float acc[8];
#pragma unroll
            for (int b = 0; b < 8; b++) acc[b] = 0.0f;
#pragma unroll 1
            for (int m = 0; m <= row && m < L; m++) { /* T is lower triangular */
                const float tm = T[row][m];
#pragma unroll
                for (int b = 0; b < 8; b++) acc[b] += tm * ta[m][c8 + b];
            }
            if (row < L)
#pragma unroll
                for (int b = 0; b < 8; b++)
                    if (d0 + c8 + b < width) out[(size_t)(t0 + row) * stride + d0 + c8 + b] = acc[b];
            __syncthreads();
        }
    }
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
    const int kh = gdnc_k_head(j, Hk, Hv, tiled);
    float *Sj = S + (size_t)j * dk * dv;
    GDNC_ROLLED
    for (int e = tid; e < dk * GDNC_COLS; e += GDNC_THREADS) {
        const int i = e / GDNC_COLS, cc = e % GDNC_COLS;
        Ss[i][cc] = c0 + cc < dv ? Sj[(size_t)i * dv + c0 + cc] : 0.0f;
    }
    /* V' and O: row, columns c8 .. c8 + GDNC_OC - 1; S: row si, columns s16 .. s16 + GDNC_SC - 1 */
    const int row = tid / (GDNC_COLS / GDNC_OC), c8 = (tid % (GDNC_COLS / GDNC_OC)) * GDNC_OC;
    const int si = tid / (GDNC_COLS / GDNC_SC), s16 = (tid % (GDNC_COLS / GDNC_SC)) * GDNC_SC;
    for (int t0 = 0; t0 < n; t0 += GDNC_C) {
        const int L = min(GDNC_C, n - t0), c = t0 / GDNC_C;
        const float *Q = u + (size_t)t0 * conv_dim + (size_t)kh * dk;
        const float *K = u + (size_t)t0 * conv_dim + (size_t)(Hk + kh) * dk;
        /* W S and Q S over dk in tiles */
        float ws[GDNC_OC], qs[GDNC_OC];
#pragma unroll
        for (int b = 0; b < GDNC_OC; b++) ws[b] = qs[b] = 0.0f;
        for (int d0 = 0; d0 < dk; d0 += GDNC_TILE) {
            __syncthreads(); /* the buffer's and G's readers of the chunk before, and its S update, are done */
            if (d0 == 0 && tid < GDNC_C) G[tid] = tid < L ? Gc[(size_t)(t0 + tid) * Hv + j] : 0.0f;
            GDNC_ROLLED
            for (int e = tid; e < GDNC_C * GDNC_TILE; e += GDNC_THREADS) {
                const int r = e / GDNC_TILE, d = e % GDNC_TILE;
                const bool in = r < L && d0 + d < dk;
                tw[r][d] = in ? W[((size_t)(t0 + r) * Hv + j) * dk + d0 + d] : 0.0f;
                tq[r][d] = in ? Q[(size_t)r * conv_dim + d0 + d] : 0.0f;
            }
            __syncthreads();
            const int dn = min(GDNC_TILE, dk - d0);
            GDNC_ROLLED
            for (int d = 0; d < dn; d++) {
                const float w = tw[row][d], q = tq[row][d];
                const float4 sv = *reinterpret_cast<const float4 *>(&Ss[d0 + d][c8]);
                gdnc_axpy4(ws, w, sv);
                gdnc_axpy4(qs, q, sv);
            }
        }
        /* V' = U - W S */
#pragma unroll
        for (int b = 0; b < GDNC_OC; b++) {
            const int col = c0 + c8 + b;
            Vp[row][c8 + b] = row < L && col < dv ? Uo[((size_t)(t0 + row) * Hv + j) * dv + col] - ws[b] : 0.0f;
        }
        if (tid < GDNC_C) D[tid] = tid < L ? expf(G[L - 1] - G[tid]) : 0.0f;
        __syncthreads(); /* V' and D written; the W and Q tiles read */
        const float *Pc = P + ((size_t)c * Hv + j) * GDNC_C * GDNC_C;
        GDNC_ROLLED
        for (int e = tid; e < GDNC_C * GDNC_C; e += GDNC_THREADS) Ps[e / GDNC_C][e % GDNC_C] = Pc[e];
        __syncthreads();
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
        for (int m0 = 0; m0 < L; m0 += GDNC_C / 2) {
            __syncthreads(); /* P's readers, or the half before's, are done */
            GDNC_ROLLED
            for (int e = tid; e < GDNC_C / 2 * GDNC_MAX_DK; e += GDNC_THREADS) {
                const int m = e / GDNC_MAX_DK, d = e % GDNC_MAX_DK;
                Kh[m][d] = m0 + m < L && d < dk ? D[m0 + m] * K[(size_t)(m0 + m) * conv_dim + d] : 0.0f;
            }
            __syncthreads();
            const int mn = min(GDNC_C / 2, L - m0);
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
