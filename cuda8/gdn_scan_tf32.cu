/* gdn_scan_tf32.cu — the chunked GDN's scan with its products on tf32 tensor cores at f32 grade (sm_80+).
 *
 *   gdn_chunk_scan_tf32(u, W, Uo, P, Gc, S, o, n, conv_dim, Hk, Hv, dk, dv, tiled)
 *     gdn_chunked.cu's gdn_chunk_scan_f32 with the same arguments and launch (block GDNC_THREADS, grid
 *     Hv x ceil(dv / GDNC_COLS)), after the same prep; other bits, within the same bound (tests/test_gpu.py
 *     GDN_CHUNK_FACTOR). Only where the variant has the instruction (compat.cuh LE_HAS_MMA_TF32: the dp4a tier
 *     from compute_80, toolchain.has_tf32); dk a multiple of 16, 16-byte aligned rows (Kernels.gdn_chunked checks).
 * Reference: native/gdn.c gdn_chunked_head (and gdn_chunk_scan_f32, the same rule in f32 FMAs).
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k gdn_chunk
 */
#include "gdn_chunked.cuh"

#if LE_HAS_MMA_TF32
/* The same rule and arguments as gdn_chunk_scan_f32 (other bits: its products are le_split_tf32 halves, hi.hi + hi.lo
 * + lo.hi, ~2^-21 a product instead of f32's 2^-24); dk a multiple of 16 (<= GDNC_MAX_DK), conv_dim of 4 (16-byte
 * fragment loads); launch: block GDNC_THREADS, grid Hv x ceil(dv / GDNC_COLS), as the f32 scan. The f32 scan's chunk
 * was a chain of small FMA phases, each waiting on its tile (one block an SM, 8 warps: ~12 us a chunk on an H200);
 * here a chunk is three mma phases on operands fetched a phase or more ahead straight into fragment registers:
 *   1. W S and Q S: warp w rows 16 (w % 4) .., dims 64 (w / 4) .. of S (B from S^T in shared memory); the two dim
 *      halves' partial sums exchanged, so that warp w holds tile (rows 16 (w % 4), columns 8 (w / 4)) of both
 *   2. V' = U - W S into shared memory (V'^T); O = e^G (Q S) + P V' for the same tile (P lower triangular: its
 *      token groups past the tile's rows are skipped)
 *   3. S <- e^{G_L} S + (e^{G_L - G} K)^T V': warp w dims 16 w .., both column groups; S stays in registers (C
 *      fragments, f32) and goes to S^T for the next chunk's phase 1.
 * Within a fragment the k index runs over dims (tokens) 4t + 2s, 4t + 2s + 1 of each 16 (s: the k-step), so a lane's
 * A elements are one 16-byte load and its B elements one 16-byte shared read. */
#define GDNT_SP (GDNC_MAX_DK + 16) /* S^T rows: 16 mod 32 banks, a quarter warp's 16-byte reads on 32 banks */
#define GDNT_VP (GDNC_C + 16)      /* V'^T rows: likewise */
#if GDNC_COLS != 16 || GDNC_THREADS != 256 || GDNC_MAX_DK != 128 || GDNC_C != 64
#error "gdn_chunk_scan_tf32: 8 warps = 4 row tiles x 2 column tiles of a chunk and 8 x 16 dims of S"
#endif

/* f32-grade products into two accumulators: small += a_lo b_hi + a_hi b_lo, big += a_hi b_hi */
__device__ __forceinline__ void gdnt_mma3(float *big, float *small, const unsigned *ah, const unsigned *al,
                                          unsigned bh0, unsigned bh1, unsigned bl0, unsigned bl1) {
    le_mma_tf32_16x8x8(small, al[0], al[1], al[2], al[3], bh0, bh1);
    le_mma_tf32_16x8x8(small, ah[0], ah[1], ah[2], ah[3], bl0, bl1);
    le_mma_tf32_16x8x8(big, ah[0], ah[1], ah[2], ah[3], bh0, bh1);
}

/* an A fragment (a0 .. a3) as tf32 halves */
__device__ __forceinline__ void gdnt_split_a(float a0, float a1, float a2, float a3, unsigned *h, unsigned *l) {
    le_split_tf32(a0, h[0], l[0]);
    le_split_tf32(a1, h[1], l[1]);
    le_split_tf32(a2, h[2], l[2]);
    le_split_tf32(a3, h[3], l[3]);
}

/* The B operands (S^T, V'^T) live in shared memory as tf32 halves, split once by the thread that writes them (the 4
 * or 8 warps that read an element would each split it): plane 0 hi, plane 1 lo */
__device__ __forceinline__ void gdnt_put_b(unsigned *hi, unsigned *lo, float x) {
    le_split_tf32(x, *hi, *lo);
}

/* a B fragment pair's halves (k = 4t .. 4t + 3 of a group of 16: k-step s takes elements 2s, 2s + 1): two 16-byte
 * shared reads */
__device__ __forceinline__ void gdnt_get_b(const unsigned *hi, const unsigned *lo, unsigned *h, unsigned *l) {
    const uint4 a = *reinterpret_cast<const uint4 *>(hi), b = *reinterpret_cast<const uint4 *>(lo);
    h[0] = a.x, h[1] = a.y, h[2] = a.z, h[3] = a.w;
    l[0] = b.x, l[1] = b.y, l[2] = b.z, l[3] = b.w;
}

/* element i (a constant after unrolling) of v */
__device__ __forceinline__ float gdnt_f4(float4 v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

/* k-step s (< 2) of a group of 16 whose A rows g and g + 8 are the 16-byte words a[0], a[1], against NT column tiles'
 * B halves (gdnt_get_b): big[nt], small[nt] accumulate */
template <int NT>
__device__ __forceinline__ void gdnt_kstep(const float4 *a, int s, const unsigned (*bh)[4], const unsigned (*bl)[4],
                                           float (*big)[4], float (*small)[4]) {
    unsigned ah[4], al[4];
    gdnt_split_a(gdnt_f4(a[0], 2 * s), gdnt_f4(a[1], 2 * s), gdnt_f4(a[0], 2 * s + 1), gdnt_f4(a[1], 2 * s + 1), ah,
                 al);
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
        gdnt_mma3(big[nt], small[nt], ah, al, bh[nt][2 * s], bh[nt][2 * s + 1], bl[nt][2 * s], bl[nt][2 * s + 1]);
}

__device__ __forceinline__ float4 gdnt_ld4(const float *p, bool ok) {
    return ok ? *reinterpret_cast<const float4 *>(p) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

/* phase 1's operands of the chunk at t1: W's and Q's rows 16 mt + g + 8r, dims 64 half + 16 kk + 4t .. + 3 */
__device__ __forceinline__ void gdnt_fetch_wq(const float *LE_RESTRICT W, const float *LE_RESTRICT Qb, int t1, int n,
                                              int Hv, int j, int dk, int conv_dim, int mt, int half, int g, int t,
                                              float4 (*aw)[2], float4 (*aq)[2]) {
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int tok = t1 + 16 * mt + g + 8 * r, d = 64 * half + 16 * kk + 4 * t;
            const bool ok = tok < n && 64 * half + 16 * kk < dk;
            aw[kk][r] = gdnt_ld4(W + ((size_t)tok * Hv + j) * dk + d, ok);
            aq[kk][r] = gdnt_ld4(Qb + (size_t)tok * conv_dim + d, ok);
        }
}

/* threads tid < GDNC_C: G_{t1 + tid} (0 past n) and the chunk's last G */
__device__ __forceinline__ void gdnt_fetch_g(const float *LE_RESTRICT Gc, int t1, int n, int Hv, int j, float &gv,
                                             float &gl) {
    if (threadIdx.x < GDNC_C) {
        gv = t1 + (int)threadIdx.x < n ? Gc[(size_t)(t1 + threadIdx.x) * Hv + j] : 0.0f;
        gl = Gc[(size_t)(min(t1 + GDNC_C, n) - 1) * Hv + j];
    }
}

extern "C" __global__ void __launch_bounds__(GDNC_THREADS, 1)
    gdn_chunk_scan_tf32(const float *LE_RESTRICT u, const float *LE_RESTRICT W, const float *LE_RESTRICT Uo,
                        const float *LE_RESTRICT P, const float *LE_RESTRICT Gc, float *S, float *o, int n,
                        int conv_dim, int Hk, int Hv, int dk, int dv, int tiled) {
    __shared__ __align__(16) unsigned St[2][GDNC_COLS][GDNT_SP]; /* S^T: [hi | lo][column][dim] */
    __shared__ __align__(16) unsigned Vt[2][GDNC_COLS][GDNT_VP]; /* V'^T: [hi | lo][column][row] */
    __shared__ float red[GDNC_THREADS / 32][8][32];       /* phase 1's partial sums for the other column tile */
    __shared__ float G[GDNC_C], D[GDNC_C];                 /* G, and e^{G_L - G} */
    const int tid = threadIdx.x, lane = tid % 32, w = tid / 32, g = lane / 4, t = lane % 4;
    const int j = blockIdx.x, c0 = blockIdx.y * GDNC_COLS, kh = gdnc_k_head(j, Hk, Hv, tiled);
    /* phases 1, 2: rows 16 mt ..; phase 1 dims 64 half .., then columns 8 half .. */
    const int mt = w % 4, half = w / 4;
    const float *Qb = u + (size_t)kh * dk, *Kb = u + (size_t)(Hk + kh) * dk;
    float *Sj = S + (size_t)j * dk * dv;
    /* the state: dims 16 w + g (+ 8), columns 8 nt + 2t (+ 1) as C fragments sr[nt] */
    float sr[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int dim = 16 * w + g + 8 * (c / 2), cl = 8 * nt + 2 * t + c % 2;
            sr[nt][c] = dim < dk && c0 + cl < dv ? Sj[(size_t)dim * dv + c0 + cl] : 0.0f;
            gdnt_put_b(&St[0][cl][dim], &St[1][cl][dim], sr[nt][c]);
        }
    float4 aw[4][2], aq[4][2];
    float gv = 0.0f, gl = 0.0f; /* threads tid < GDNC_C: the chunk's G_tid and G_{L-1}, loaded a chunk ahead */
    gdnt_fetch_wq(W, Qb, 0, n, Hv, j, dk, conv_dim, mt, half, g, t, aw, aq);
    gdnt_fetch_g(Gc, 0, n, Hv, j, gv, gl);
    __syncthreads(); /* S^T written */
    for (int t0 = 0; t0 < n; t0 += GDNC_C) {
        const int L = min(GDNC_C, n - t0);
        if (tid < GDNC_C) { /* their readers of the chunk before passed its last barrier */
            G[tid] = gv;
            D[tid] = tid < L ? expf(gl - gv) : 0.0f;
        }
        /* phase 2's operands: P's rows of the tile (token groups kg <= mt), U of the tile */
        float4 ap[4][2];
        const float *Pc = P + ((size_t)(t0 / GDNC_C) * Hv + j) * GDNC_C * GDNC_C;
#pragma unroll
        for (int kg = 0; kg < 4; kg++)
#pragma unroll
            for (int r = 0; r < 2; r++)
                ap[kg][r] = gdnt_ld4(Pc + (size_t)(16 * mt + g + 8 * r) * GDNC_C + 16 * kg + 4 * t, kg <= mt);
        float uv[4];
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int row = 16 * mt + g + 8 * (c / 2), col = c0 + 8 * half + 2 * t + c % 2;
            uv[c] = row < L && col < dv ? Uo[((size_t)(t0 + row) * Hv + j) * dv + col] : 0.0f;
        }
        /* phase 1: W S and Q S, this warp's dims, both column tiles */
        float wb[2][4], wl[2][4], qb[2][4], ql[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int c = 0; c < 4; c++) wb[nt][c] = wl[nt][c] = qb[nt][c] = ql[nt][c] = 0.0f;
        if (16 * mt < L) {
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                const int d0 = 64 * half + 16 * kk;
                if (d0 >= dk) break;
                unsigned bh[2][4], bl[2][4];
#pragma unroll
                for (int nt = 0; nt < 2; nt++)
                    gdnt_get_b(&St[0][8 * nt + g][d0 + 4 * t], &St[1][8 * nt + g][d0 + 4 * t], bh[nt], bl[nt]);
#pragma unroll
                for (int s = 0; s < 2; s++) {
                    gdnt_kstep<2>(aw[kk], s, bh, bl, wb, wl);
                    gdnt_kstep<2>(aq[kk], s, bh, bl, qb, ql);
                }
            }
        }
        /* phase 3's operands (K's rows 16 kg + 4t + i, dims 16 w + g + 8r) and the next chunk's phase 1, in flight
         * from here */
        float ak[4][4][2];
#pragma unroll
        for (int kg = 0; kg < 4; kg++)
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    const int tok = t0 + 16 * kg + 4 * t + i;
                    ak[kg][i][r] = tok < n && 16 * w < dk ? Kb[(size_t)tok * conv_dim + 16 * w + g + 8 * r] : 0.0f;
                }
        if (t0 + GDNC_C < n) {
            gdnt_fetch_wq(W, Qb, t0 + GDNC_C, n, Hv, j, dk, conv_dim, mt, half, g, t, aw, aq);
            gdnt_fetch_g(Gc, t0 + GDNC_C, n, Hv, j, gv, gl);
        }
        /* the exchange: the other column tile's partial sums to its owner (warp w ^ 4), then this tile's whole sums
         * (the two halves' partials added: commutative, the same bits in either warp) */
#pragma unroll
        for (int c = 0; c < 4; c++) { /* (selected, not indexed by half: an indexed register array lives in memory) */
            red[w][c][lane] = half ? wb[0][c] + wl[0][c] : wb[1][c] + wl[1][c];
            red[w][4 + c][lane] = half ? qb[0][c] + ql[0][c] : qb[1][c] + ql[1][c];
        }
        __syncthreads();
        float qs[4];
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const float ws = (half ? wb[1][c] + wl[1][c] : wb[0][c] + wl[0][c]) + red[w ^ 4][c][lane];
            qs[c] = (half ? qb[1][c] + ql[1][c] : qb[0][c] + ql[0][c]) + red[w ^ 4][4 + c][lane];
            const int row = 16 * mt + g + 8 * (c / 2), cl = 8 * half + 2 * t + c % 2;
            gdnt_put_b(&Vt[0][cl][row], &Vt[1][cl][row], row < L && c0 + cl < dv ? uv[c] - ws : 0.0f); /* U - W S */
        }
        __syncthreads();
        /* phase 2: O = e^G (Q S) + P V' */
        {
            float ob[4] = {0.0f, 0.0f, 0.0f, 0.0f}, ol[4] = {0.0f, 0.0f, 0.0f, 0.0f}; /* big, small terms */
#pragma unroll
            for (int kg = 0; kg < 4; kg++) {
                if (kg > mt || 16 * kg >= L) break;
                unsigned bh[1][4], bl[1][4];
                gdnt_get_b(&Vt[0][8 * half + g][16 * kg + 4 * t], &Vt[1][8 * half + g][16 * kg + 4 * t], bh[0], bl[0]);
#pragma unroll
                for (int s = 0; s < 2; s++) gdnt_kstep<1>(ap[kg], s, bh, bl, &ob, &ol);
            }
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int row = 16 * mt + g + 8 * (c / 2), col = c0 + 8 * half + 2 * t + c % 2;
                if (row < L && col < dv)
                    o[(size_t)(t0 + row) * Hv * dv + (size_t)j * dv + col] = expf(G[row]) * qs[c] + (ob[c] + ol[c]);
            }
        }
        /* phase 3: S <- e^{G_L} S + (D K)^T V' */
        if (16 * w < dk) {
            float sb[2][4], sl[2][4];
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int c = 0; c < 4; c++) sb[nt][c] = sl[nt][c] = 0.0f;
#pragma unroll
            for (int kg = 0; kg < 4; kg++) {
                if (16 * kg >= L) break;
                unsigned bh[2][4], bl[2][4];
#pragma unroll
                for (int nt = 0; nt < 2; nt++)
                    gdnt_get_b(&Vt[0][8 * nt + g][16 * kg + 4 * t], &Vt[1][8 * nt + g][16 * kg + 4 * t], bh[nt],
                               bl[nt]);
#pragma unroll
                for (int s = 0; s < 2; s++) {
                    const float d0 = D[16 * kg + 4 * t + 2 * s], d1 = D[16 * kg + 4 * t + 2 * s + 1];
                    unsigned ah[4], al[4];
                    gdnt_split_a(d0 * ak[kg][2 * s][0], d0 * ak[kg][2 * s][1], d1 * ak[kg][2 * s + 1][0],
                                 d1 * ak[kg][2 * s + 1][1], ah, al);
#pragma unroll
                    for (int nt = 0; nt < 2; nt++)
                        gdnt_mma3(sb[nt], sl[nt], ah, al, bh[nt][2 * s], bh[nt][2 * s + 1], bl[nt][2 * s],
                                  bl[nt][2 * s + 1]);
                }
            }
            const float el = expf(G[L - 1]);
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    sr[nt][c] = el * sr[nt][c] + (sb[nt][c] + sl[nt][c]);
                    const int cl = 8 * nt + 2 * t + c % 2, dim = 16 * w + g + 8 * (c / 2);
                    gdnt_put_b(&St[0][cl][dim], &St[1][cl][dim], sr[nt][c]);
                }
        }
        __syncthreads(); /* S^T, V'^T, G, D and the exchange free for the next chunk */
    }
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int dim = 16 * w + g + 8 * (c / 2), col = c0 + 8 * nt + 2 * t + c % 2;
            if (dim < dk && col < dv) Sj[(size_t)dim * dv + col] = sr[nt][c];
        }
}
#endif
