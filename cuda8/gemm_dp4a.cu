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
 *   gemm_dp4a_<type>_multi(W0..W3, xq, Y0..Y3, n0..n3, ncols, ntok)   up to four matrices of one type and width on
 *     the same xq in one launch (gemm_q8.cuh LE_GEMM_Q8_MULTI; n_m = 0: no matrix m), each row as the plain kernel's;
 *     grid sum_m ceil(n_m / GEMM_ROWS) (<= 65535) x ceil(ntok / GEMM_TT) x 1
 * Per (row, token) and 32-element sub-block s, the sum of gemv_dp4a.cu:
 *     d8 * (d[0] * sum_{j<16} q*q8 + d[1] * sum_{j>=16} q*q8) - m * s8   (d * sum_{j<32} where d[0] = d[1])
 * accumulated over s in increasing order (gemv_dp4a sums the sub-blocks of a row in another order: the
 * same terms, other roundings). Tiles, staging and the f32 update: gemm_q8.cuh (shared with gemm_mma.cu, the
 * tensor-core form, which gives the same bits).
 * Compute: lane (rl = lane % 4, tl = lane / 4) of warp w owns rows 16w + rl + 4i and tokens tl + 8j
 *     (i, j < 4) as in gemm_f32.cu; per sub-block 8 words of each -> 128 dp4a into 32 int sums, then 16
 *     scaled f32 updates. A 32-bit shared word carries 4 multiply-adds here against 1 in gemm_f32, whose
 *     limit is shared-memory traffic.
 * On tiers without __dp4a (fermi, kepler) le_dp4a is a byte loop: same results, compiled and tested there,
 * used by default only on the dp4a tier (GpuOptions int8).
 * Reference (tests/test_gpu.py test_gemm_dp4a): dequantised W times dequantised xq plus m * (d8 * sum q8 - s8)
 * per sub-block, the bound of gemv_dp4a; the _ids form equals the plain form tile by tile, bit for bit.
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k gemm_dp4a
 */
#include "gemm_q8.cuh"

/* acc[i][j] += sub-block sb's term for rows rw + 4i, tokens tt + 8j. Wide: all 32 int sums live at once
 * (sm_35+); lean (63 registers): one token and one half of the sub-block at a time, W words re-read per token. */
template <class T>
__device__ __forceinline__ void gemm_dp4a_sub(const gemm_q8_smem<GEMM_TT> &sm, int rw, int tt, int sb,
                                              float (*acc)[4]) {
    if (LE_HAS_MANY_REGS) {
        int lo[4][4], hi[4][4]; /* offset sums (gemm_q8_term); one scale: all 8 words into lo */
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) lo[i][j] = hi[i][j] = GEMM_Q8_MAGIC;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            int w[4], x[4];
#pragma unroll
            for (int i = 0; i < 4; i++) w[i] = sm.wq[rw + 4 * i][gemm_q8_slot(sb, k)];
#pragma unroll
            for (int j = 0; j < 4; j++) x[j] = sm.xq[tt + 8 * j][gemm_q8_slot(sb, k)];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    if (k < 4 || !T::TWO_SCALES) lo[i][j] = le_dp4a(w[i], x[j], lo[i][j]);
                    else hi[i][j] = le_dp4a(w[i], x[j], hi[i][j]);
                }
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float2 d = sm.wd[rw + 4 * i][sb];
            const float m = sm.wm[rw + 4 * i][sb];
#pragma unroll
            for (int j = 0; j < 4; j++)
                acc[i][j] = gemm_q8_acc<T>(acc[i][j], gemm_q8_xd(sm, sb, tt + 8 * j),
                                           gemm_q8_term<T>(d, lo[i][j], hi[i][j]), m);
        }
    } else {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            /* two scales: d[0] * lo (+ 0: exact), then + d[1] * hi; one: the whole sub-block's offset sum, then
             * gemm_q8_term (its roundings either way) */
            float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            int s4[4] = {GEMM_Q8_MAGIC, GEMM_Q8_MAGIC, GEMM_Q8_MAGIC, GEMM_Q8_MAGIC};
#pragma unroll 1
            for (int h = 0; h < 2; h++) {
#pragma unroll
                for (int i = 0; i < 4; i++)
                    if (T::TWO_SCALES) s4[i] = GEMM_Q8_MAGIC;
#pragma unroll
                for (int k = 4 * h; k < 4 * h + 4; k++) {
                    const int x = sm.xq[tt + 8 * j][gemm_q8_slot(sb, k)];
#pragma unroll
                    for (int i = 0; i < 4; i++) s4[i] = le_dp4a(sm.wq[rw + 4 * i][gemm_q8_slot(sb, k)], x, s4[i]);
                }
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const float2 d = sm.wd[rw + 4 * i][sb];
                    if (T::TWO_SCALES) p[i] = __fmaf_rn(h ? d.y : d.x, gemm_q8_float(s4[i]), p[i]);
                }
            }
#pragma unroll
            for (int i = 0; i < 4; i++)
                if (!T::TWO_SCALES) p[i] = gemm_q8_term<T>(sm.wd[rw + 4 * i][sb], s4[i], 0);
            const float2 x = gemm_q8_xd(sm, sb, tt + 8 * j);
#pragma unroll
            for (int i = 0; i < 4; i++) acc[i][j] = gemm_q8_acc<T>(acc[i][j], x, p[i], sm.wm[rw + 4 * i][sb]);
        }
    }
}

/* a step's sub-blocks into the thread's accumulators (gemm_q8_steps' consumer) */
template <class T>
struct gemm_dp4a_steps {
    int rw, tt;
    float (*acc)[4];
    __device__ __forceinline__ void operator()(const gemm_q8_smem<GEMM_TT> &sm, int sb) {
        gemm_dp4a_sub<T>(sm, rw, tt, sb, acc);
    }
};

template <class T, int TT> /* TT = GEMM_TT: the lane mapping below covers 32 tokens */
__device__ __forceinline__ void gemm_dp4a(const uint8_t *LE_RESTRICT W, const block_q8_1 *LE_RESTRICT xq,
                                          float *LE_RESTRICT Y, int nrows, int ncols, const le_gemm_tile &tl,
                                          long long expert_bytes, gemm_q8_smem<TT> &sm, int rt, int rs) {
    static_assert(TT == GEMM_TT, "gemm_dp4a: 32 tokens per block");
    /* staged a step ahead (gemm_q8_steps) on the dp4a tier (Pascal, Volta), not Q6_K (its four raw words a pair); the
     * kepler tier, which runs this GEMM only when int8 prefill is forced, keeps its registers */
    const bool AHEAD = LE_GEMM_Q8_CAN_AHEAD && LE_HAS_DP4A && sizeof(typename T::qraw_t) <= sizeof(int2);
    const int tid = threadIdx.x, lane = tid % 32;
    const int rw = 16 * (tid / 32) + lane % 4, tt = lane / 4; /* rows rw + 4i, tokens tt + 8j of the tile */
    const int nsub = ncols / 32;
    const size_t row_bytes = le_row_bytes<T>(ncols);
    for (int r0 = rt * GEMM_ROWS; r0 < nrows; r0 += rs * GEMM_ROWS) {
        float acc[4][4];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
        gemm_dp4a_steps<T> sub = {rw, tt, acc};
        gemm_q8_steps<T, TT, AHEAD>(W, expert_bytes, xq, nrows, nsub, row_bytes, r0, tl, sm, sub);
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

#define LE_GEMM_DP4A(name, T) LE_GEMM_Q8_KERNELS(name, gemm_dp4a, T, GEMM_TT, LE_GEMM_NO_ATTR)

LE_GEMM_DP4A(gemm_dp4a_q4_0, le_t_q4_0)
LE_GEMM_DP4A(gemm_dp4a_q8_0, le_t_q8_0)
LE_GEMM_DP4A(gemm_dp4a_q4_K, le_t_q4_K)
LE_GEMM_DP4A(gemm_dp4a_q5_K, le_t_q5_K)
LE_GEMM_DP4A(gemm_dp4a_q6_K, le_t_q6_K)
LE_GEMM_DP4A(gemm_dp4a_iq4_xs, le_t_iq4_xs)
