/* gemm_dp4a.cu — prefill GEMM in int8: Y = Xq W^T for several tokens, W quantised (W4A8 / W8A8), X as Q8_1.
 *
 *   gemm_dp4a_<type>(W, xq, Y, nrows, ncols, ntok)   type: q4_0 q8_0 q4_K q5_K q6_K iq4_xs
 *     W: [nrows, ncols] rows of quant blocks (as gemv_f32.cu), xq: [ntok, ncols/32] block_q8_1 in the GPU
 *     layout of quantize_q8_1.cu (d, s = sum of x; one flat quantize_q8_1 of the [ntok, ncols] f32 rows),
 *     Y: [ntok, nrows] f32
 *     launch: block GEMM_THREADS (256) x 1 x 1,
 *             grid min(ceil(nrows/GEMM_ROWS), 65535) x ceil(ntok/GEMM_TT) x 1   (as gemm_f32.cu)
 *   gemm_dp4a_<type>_ids(W, xq, Y, nrows, ncols, tiles, expert_bytes)   the grouped expert GEMM (MoE prefill)
 *     as gemm_f32_<type>_ids with xq [pairs, ncols/32] Q8_1 rows sorted by expert; tiles int32 [n_tiles, 3]
 *     (expert, first pair, count <= 32; 0: empty); grid min(ceil(nrows/GEMM_ROWS), 65535) x n_tiles x 1.
 * Per (row, token) and 32-element sub-block s, the sum of gemv_dp4a.cu:
 *     d8 * (d[0] * sum_{j<16} q*q8 + d[1] * sum_{j>=16} q*q8) - m * s8
 * accumulated over s in increasing order (gemv_dp4a sums the sub-blocks of a row in another order: the
 * same terms, other roundings).
 * Tiled as gemm_f32.cu, GEMM_ROWS (128) rows x GEMM_TT (32) tokens per block, GEMM_DP4A_SUBS (4) sub-blocks
 * (128 columns; fewer in the last step when ncols % 128 != 0) per step:
 *   - stage: thread tid copies word k = tid % 8 of 16 (row, sub-block) pairs of W (T::word: the int of 4
 *     signed elements with its scale and min; eight lanes read one sub-block together) and word k of 4 Q8_1
 *     blocks of token tid / 8; ints stay ints, the per-sub-block scales go beside them. Rows past nrows and
 *     tokens past the tile read row r0 / token t0 instead (their outputs are not stored).
 *   - compute: lane (rl = lane % 4, tl = lane / 4) of warp w owns rows 16w + rl + 4i and tokens tl + 8j
 *     (i, j < 4) as in gemm_f32.cu; per sub-block 8 words of each -> 128 dp4a into 32 int sums, then 16
 *     scaled f32 updates. A 32-bit shared word carries 4 multiply-adds here against 1 in gemm_f32, whose
 *     limit is shared-memory traffic.
 * On tiers without __dp4a (fermi, kepler) le_dp4a is a byte loop: same results, compiled and tested there,
 * used by default only on the dp4a tier (gpu_model int8).
 * Reference (tests/test_gpu.py test_gemm_dp4a): dequantised W times dequantised xq plus m * (d8 * sum q8 - s8)
 * per sub-block, the bound of gemv_dp4a; the _ids form equals the plain form tile by tile, bit for bit.
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k gemm_dp4a
 */
#include "gemm_tile.cuh"
#include "quants.cuh"

#define GEMM_THREADS 256
#define GEMM_ROWS 128       /* rows per tile: 8 warps x 16 */
#define GEMM_TT 32          /* tokens per tile */
#define GEMM_DP4A_SUBS 4    /* 32-element sub-blocks per step */
#define GEMM_DP4A_PAD 33    /* ints per row of Wq and Xq: 8 * GEMM_DP4A_SUBS + 1 (rows start in different banks) */

struct gemm_dp4a_smem {
    int wq[GEMM_ROWS][GEMM_DP4A_PAD];           /* W words: [row][8 sub + k] */
    float2 wd[GEMM_ROWS][GEMM_DP4A_SUBS];       /* (d[0], d[1]) per row and sub-block */
    float wm[GEMM_ROWS][GEMM_DP4A_SUBS];        /* m */
    int xq[GEMM_TT][GEMM_DP4A_PAD];             /* Q8_1 words: [token][8 sub + k] */
    float2 xd[GEMM_TT][GEMM_DP4A_SUBS];         /* (d8, s8) */
};

/* Pair i (< 16) of this thread's (row, sub-block) pairs of step st: word k of row g + 32 (i % 4), sub-block i / 4. */
template <class T>
__device__ __forceinline__ void gemm_dp4a_word(const uint8_t *LE_RESTRICT W, int nrows, size_t row_bytes, int r0,
                                               int st, int nsb, int i, int k, int g, gemm_dp4a_smem &sm) {
    const int row = g + 32 * (i % 4), sb = i / 4;
    if (sb >= nsb) return;
    const int r = r0 + row < nrows ? r0 + row : r0;
    float d, m;
    sm.wq[row][8 * sb + k] = T::word(W + (size_t)r * row_bytes, GEMM_DP4A_SUBS * st + sb, k, d, m);
    if (k == 0) {
        sm.wd[row][sb].x = d;
        sm.wm[row][sb] = m;
    } else if (k == 4) {
        sm.wd[row][sb].y = d;
    }
}

/* Step st (its nsb sub-blocks from GEMM_DP4A_SUBS st on; fewer in the last step) of the weights and activations
 * into shared memory. Four words' loads in flight at a time where registers allow, one at a time with 63. */
template <class T>
__device__ __forceinline__ void gemm_dp4a_stage(const uint8_t *LE_RESTRICT W, const block_q8_1 *LE_RESTRICT xq,
                                                int nrows, int nsub, size_t row_bytes, int r0,
                                                const le_gemm_tile &tl, int st, int nsb, gemm_dp4a_smem &sm) {
    const int tid = threadIdx.x, k = tid % 8, g = tid / 8;
    if (LE_HAS_MANY_REGS) {
#pragma unroll 4
        for (int i = 0; i < 16; i++) gemm_dp4a_word<T>(W, nrows, row_bytes, r0, st, nsb, i, k, g, sm);
    } else {
#pragma unroll 1
        for (int i = 0; i < 16; i++) gemm_dp4a_word<T>(W, nrows, row_bytes, r0, st, nsb, i, k, g, sm);
    }
    const int t = g < tl.n ? tl.t0 + g : tl.t0;
#pragma unroll
    for (int sb = 0; sb < GEMM_DP4A_SUBS; sb++) {
        if (sb >= nsb) break;
        const block_q8_1 *b = xq + (size_t)t * nsub + GEMM_DP4A_SUBS * st + sb;
        sm.xq[g][8 * sb + k] = le_ldg((const int *)b->qs + k); /* 4-aligned: blocks are 36 bytes */
        if (k == 0) sm.xd[g][sb] = make_float2(le_ldg_half(&b->d), le_ldg_half(&b->s));
    }
}

/* acc[i][j] += sub-block sb's term for rows rw + 4i, tokens tt + 8j. Wide: all 32 int sums live at once
 * (sm_35+); lean (63 registers): one token and one half of the sub-block at a time, W words re-read per token. */
__device__ __forceinline__ void gemm_dp4a_sub(const gemm_dp4a_smem &sm, int rw, int tt, int sb, float (*acc)[4]) {
    if (LE_HAS_MANY_REGS) {
        int lo[4][4], hi[4][4];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) lo[i][j] = hi[i][j] = 0;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            int w[4], x[4];
#pragma unroll
            for (int i = 0; i < 4; i++) w[i] = sm.wq[rw + 4 * i][8 * sb + k];
#pragma unroll
            for (int j = 0; j < 4; j++) x[j] = sm.xq[tt + 8 * j][8 * sb + k];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    if (k < 4) lo[i][j] = le_dp4a(w[i], x[j], lo[i][j]);
                    else hi[i][j] = le_dp4a(w[i], x[j], hi[i][j]);
                }
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float2 d = sm.wd[rw + 4 * i][sb];
            const float m = sm.wm[rw + 4 * i][sb];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float2 x = sm.xd[tt + 8 * j][sb];
                acc[i][j] += x.x * (d.x * (float)lo[i][j] + d.y * (float)hi[i][j]) - m * x.y;
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            float p[4] = {0.0f, 0.0f, 0.0f, 0.0f}; /* d[0] * lo + d[1] * hi */
#pragma unroll 1
            for (int h = 0; h < 2; h++) {
                int s4[4] = {0, 0, 0, 0};
#pragma unroll
                for (int k = 4 * h; k < 4 * h + 4; k++) {
                    const int x = sm.xq[tt + 8 * j][8 * sb + k];
#pragma unroll
                    for (int i = 0; i < 4; i++) s4[i] = le_dp4a(sm.wq[rw + 4 * i][8 * sb + k], x, s4[i]);
                }
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const float2 d = sm.wd[rw + 4 * i][sb];
                    p[i] += (h ? d.y : d.x) * (float)s4[i];
                }
            }
            const float2 x = sm.xd[tt + 8 * j][sb];
#pragma unroll
            for (int i = 0; i < 4; i++) acc[i][j] += x.x * p[i] - sm.wm[rw + 4 * i][sb] * x.y;
        }
    }
}

template <class T>
__device__ __forceinline__ void gemm_dp4a(const uint8_t *LE_RESTRICT W, const block_q8_1 *LE_RESTRICT xq,
                                          float *LE_RESTRICT Y, int nrows, int ncols, const le_gemm_tile &tl,
                                          long long expert_bytes, gemm_dp4a_smem &sm) {
    const int tid = threadIdx.x, lane = tid % 32;
    const int rw = 16 * (tid / 32) + lane % 4, tt = lane / 4; /* rows rw + 4i, tokens tt + 8j of the tile */
    const int nsub = ncols / 32, nstep = (nsub + GEMM_DP4A_SUBS - 1) / GEMM_DP4A_SUBS;
    const size_t row_bytes = le_row_bytes<T>(ncols);
    for (int r0 = blockIdx.x * GEMM_ROWS; r0 < nrows; r0 += gridDim.x * GEMM_ROWS) {
        float acc[4][4];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
        for (int st = 0; st < nstep; st++) {
            const int nsb = min(GEMM_DP4A_SUBS, nsub - GEMM_DP4A_SUBS * st); /* the last step may be partial */
            __syncthreads(); /* the previous step is consumed */
            gemm_dp4a_stage<T>(le_gemm_weights(W, tl, expert_bytes), xq, nrows, nsub, row_bytes, r0, tl, st, nsb,
                               sm);
            __syncthreads();
#pragma unroll 1
            for (int sb = 0; sb < nsb; sb++) gemm_dp4a_sub(sm, rw, tt, sb, acc);
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int t = tt + 8 * j;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int r = r0 + rw + 4 * i;
                if (t < tl.n && r < nrows) Y[(size_t)(tl.t0 + t) * nrows + r] = acc[i][j];
            }
        }
    }
}

#define LE_GEMM_DP4A(name, T)                                                                             \
    extern "C" __global__ void name(const uint8_t *W, const block_q8_1 *xq, float *Y, int nrows, int ncols, \
                                    int ntok) {                                                           \
        __shared__ gemm_dp4a_smem sm;                                                                     \
        __shared__ le_gemm_tile tl;                                                                       \
        le_gemm_tile_plain(tl, ntok, GEMM_TT);                                                            \
        gemm_dp4a<T>(W, xq, Y, nrows, ncols, tl, 0, sm);                                                  \
    }                                                                                                     \
    extern "C" __global__ void name##_ids(const uint8_t *W, const block_q8_1 *xq, float *Y, int nrows,      \
                                          int ncols, const int *tiles, long long expert_bytes) {          \
        __shared__ gemm_dp4a_smem sm;                                                                     \
        __shared__ le_gemm_tile tl;                                                                       \
        if (le_gemm_tile_ids(tl, tiles)) gemm_dp4a<T>(W, xq, Y, nrows, ncols, tl, expert_bytes, sm);      \
    }

LE_GEMM_DP4A(gemm_dp4a_q4_0, le_t_q4_0)
LE_GEMM_DP4A(gemm_dp4a_q8_0, le_t_q8_0)
LE_GEMM_DP4A(gemm_dp4a_q4_K, le_t_q4_K)
LE_GEMM_DP4A(gemm_dp4a_q5_K, le_t_q5_K)
LE_GEMM_DP4A(gemm_dp4a_q6_K, le_t_q6_K)
LE_GEMM_DP4A(gemm_dp4a_iq4_xs, le_t_iq4_xs)
