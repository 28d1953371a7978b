/* attention_bidir.cu — the vision tower's attention: bidirectional (no mask) within each frame, f32.
 *
 * Reference: native/attention_bidir.c le_attention_bidir (transformers splits the packed patches at cu_seqlens:
 * one segment per frame):
 *   o_h[i] = sum_j softmax_j(scale q_h[i] . k_h[j]) v_h[j],   i, j in the same segment of seg rows
 *   attn_bidir_f32(qkv, o, n, seg, n_head, hd, scale)
 *     qkv: [n, 3H] f32 (H = n_head * hd; q | k | v, each head-major: the fused qkv rows after rope_vision.cu)
 *     o: [n, H] f32;  n a multiple of seg;  hd <= ATTNB_MAX_HD (256), any size (lanes past hd idle);
 *     scale: 1/sqrt(hd) in f32 (the reference's 1.0f / sqrtf(hd))
 *     launch: block ATTNB_THREADS (256) x 1 x 1, grid n_head x min((n / seg) * ceil(seg / ATTNB_QTILE), 65535) x 1
 *     (query tiles grid-strided; a tile never crosses a segment)
 * A block takes ATTNB_QTILE (8) queries of one head and segment, one per warp, and walks the segment's keys in
 * tiles of ATTNB_KTILE (32) through shared memory (as attention.cu's attn_prefill_f32): lane l scores key l of the
 * tile against the warp's query (K rows padded to hd + 1 floats: conflict-free), a warp max / sum updates the online
 * softmax (running max m, sum l), the weights go through shared memory, then the V tile (in the same buffer) is
 * accumulated into each lane's dims (lane l: dims l, l + 32, …). Memory is O(tile), never O(seg^2): a 16k-patch
 * image needs no score matrix.
 * Shared: 8 + 32.9 + 1 + 1 KB, under Fermi's 48. Keys past the segment score ATTNB_NEG_BIG (e^(NEG_BIG - m) = 0).
 * The reference normalises the weights first and sums the denominator in f64; here o = acc / l at the end: the
 * order of sums and roundings differs (tests/tolerances.py GPU_ATTN_BIDIR_REL).
 * Tiers: all (fermi: the warp sums and maxima in shared memory, plain loads).
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu_vision.py -m gpu -k attn_bidir
 */
#include "compat.cuh"

#define ATTNB_THREADS 256 /* 8 warps, one query each */
#define ATTNB_QTILE 8     /* queries per block (= its warps) */
#define ATTNB_KTILE 32    /* keys per tile, one per lane */
#define ATTNB_MAX_HD 256
#define ATTNB_DIMS 8 /* ATTNB_MAX_HD / LE_WARP: dims per lane */
#define ATTNB_NEG_BIG (-1e30f)

/* keys k0 … k0+ATTNB_KTILE-1 of a segment (key j at base + j * stride, hd floats) into tile; keys >= seg as 0.
 * Warp w loads rows w, w + 8, … */
__device__ __forceinline__ void attnb_load_tile(const float *LE_RESTRICT base, size_t stride, int k0, int seg, int hd,
                                                float (*tile)[ATTNB_MAX_HD + 1]) {
    const int lane = threadIdx.x % LE_WARP;
    for (int kk = threadIdx.x / LE_WARP; kk < ATTNB_KTILE; kk += ATTNB_THREADS / LE_WARP) {
        const float *row = base + (size_t)(k0 + kk) * stride;
        const bool in = k0 + kk < seg;
        for (int e = lane; e < hd; e += LE_WARP) tile[kk][e] = in ? le_ldg(row + e) : 0.0f;
    }
}

extern "C" __global__ void attn_bidir_f32(const float *LE_RESTRICT qkv, float *LE_RESTRICT o, int n, int seg,
                                          int n_head, int hd, float scale) {
    __shared__ float qs[ATTNB_QTILE][ATTNB_MAX_HD];
    __shared__ float kvs[ATTNB_KTILE][ATTNB_MAX_HD + 1]; /* +1: lane l reading row l is conflict-free */
    __shared__ float ps[ATTNB_QTILE][ATTNB_KTILE];
    LE_SCRATCH(scratch, ATTNB_THREADS);
    const int lane = threadIdx.x % LE_WARP, qi = threadIdx.x / LE_WARP; /* warp qi takes query q0 + qi */
    const int h = blockIdx.x, H = n_head * hd;
    const size_t ld = (size_t)3 * H;
    const int tiles_per_seg = (seg + ATTNB_QTILE - 1) / ATTNB_QTILE, n_tiles = n / seg * tiles_per_seg;
    for (int tile = blockIdx.y; tile < n_tiles; tile += gridDim.y) {
        const int s0 = tile / tiles_per_seg * seg, q0 = s0 + tile % tiles_per_seg * ATTNB_QTILE;
        const bool live = q0 + qi < s0 + seg; /* queries past the segment repeat its last row, never written */
        __syncthreads(); /* the previous tile is done with qs */
        {
            const float *q = qkv + (size_t)(live ? q0 + qi : s0 + seg - 1) * ld + (size_t)h * hd;
            for (int e = lane; e < hd; e += LE_WARP) qs[qi][e] = le_ldg(q + e);
        }
        const float *kb = qkv + (size_t)s0 * ld + H + (size_t)h * hd; /* key 0 of the segment; V is H further */
        float m = ATTNB_NEG_BIG, l = 0.0f, acc[ATTNB_DIMS];
#pragma unroll
        for (int r = 0; r < ATTNB_DIMS; r++) acc[r] = 0.0f;
        for (int k0 = 0; k0 < seg; k0 += ATTNB_KTILE) {
            __syncthreads(); /* qs loaded; the previous V tile consumed */
            attnb_load_tile(kb, ld, k0, seg, hd, kvs);
            __syncthreads();
            float d = 0.0f; /* lane = key k0 + lane of the tile */
            for (int e = 0; e < hd; e++) d += qs[qi][e] * kvs[lane][e];
            const bool valid = k0 + lane < seg;
            const float s = valid ? d * scale : ATTNB_NEG_BIG;
            const float mn = fmaxf(m, le_warp_max(s, scratch));
            const float alpha = expf(m - mn);
            const float ex = valid ? expf(s - mn) : 0.0f;
            l = l * alpha + le_warp_sum(ex, scratch);
            m = mn;
            ps[qi][lane] = ex;
            __syncthreads(); /* scores done with the K tile; ps written */
            attnb_load_tile(kb + H, ld, k0, seg, hd, kvs);
            __syncthreads();
            const int nk = seg - k0 < ATTNB_KTILE ? seg - k0 : ATTNB_KTILE;
#pragma unroll
            for (int r = 0; r < ATTNB_DIMS; r++) acc[r] *= alpha;
            for (int kk = 0; kk < nk; kk++) {
                const float pk = ps[qi][kk];
#pragma unroll
                for (int r = 0; r < ATTNB_DIMS; r++)
                    if (lane + LE_WARP * r < hd) acc[r] += pk * kvs[kk][lane + LE_WARP * r];
            }
        }
        if (live) {
            float *ot = o + (size_t)(q0 + qi) * H + (size_t)h * hd;
#pragma unroll
            for (int r = 0; r < ATTNB_DIMS; r++)
                if (lane + LE_WARP * r < hd) ot[lane + LE_WARP * r] = acc[r] / l;
        }
    }
}
