/* rope_vision.cu — the vision tower's qkv bias and 2-D axial RoPE on the fused qkv rows, in place.
 *
 * Reference: native/vision.c RJ_QKV (x += b over the whole row, then rope_2d.c le_rope2d_row_ref on the q and the
 * k third): every head of q and of k rotates its NeoX pairs (i, i + hd/2) by the row's angles,
 *   x1' = x1 cos - x2 sin,  x2' = x2 cos + x1 sin.
 *   rope_vision_f32(qkv, b, cs, n, seg, n_head, hd)
 *     qkv: [n, 3H] f32 (H = n_head * hd; q | k | v, each head-major), in place;  b: [3H] f32 or NULL (no bias)
 *     cs: [seg, hd/2] float2 (cos, sin): row t of qkv reads row t % seg (every frame of seg patches has the same
 *         angles). The host fills it with the reference's own values (le_rope2d_table: row angles in the first
 *         quarter of the pairs, column angles after, f32 cosf / sinf), so only the rotation itself runs here.
 *     launch: block ROPEV_THREADS (128) x 1 x 1, grid min(n, 65535) x 1 x 1 (rows grid-strided)
 * Thread j of a row takes pairs j, j + 128, … of the row's 2 n_head (hd/2) q and k pairs, then the v third's bias.
 * The products are __fmul_rn (never contracted into an FMA) so the rotation rounds as the reference does, bit for
 * bit (tests/test_gpu_vision.py test_rope_vision: exact against the C op).
 * Tiers: all (nothing shared, no shuffles).
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu_vision.py -m gpu -k rope
 */
#include "compat.cuh"

#define ROPEV_THREADS 128

extern "C" __global__ void rope_vision_f32(float *qkv, const float *LE_RESTRICT b, const float2 *LE_RESTRICT cs, int n,
                                           int seg, int n_head, int hd) {
    const int half = hd / 2, H = n_head * hd, pairs = 2 * n_head * half; /* q's then k's pairs */
    for (int row = blockIdx.x; row < n; row += gridDim.x) {
        float *x = qkv + (size_t)row * 3 * H;
        const float2 *c = cs + (size_t)(row % seg) * half;
        for (int p = threadIdx.x; p < pairs; p += ROPEV_THREADS) {
            const int head = p / half, i = p % half; /* head 0 … 2 n_head - 1: q heads, then k heads */
            const int e1 = head * hd + i, e2 = e1 + half;
            float x1 = x[e1], x2 = x[e2];
            if (b) {
                x1 += le_ldg(b + e1);
                x2 += le_ldg(b + e2);
            }
            const float2 a = le_ldg(c + i);
            x[e1] = __fmul_rn(x1, a.x) - __fmul_rn(x2, a.y);
            x[e2] = __fmul_rn(x2, a.x) + __fmul_rn(x1, a.y);
        }
        if (b)
            for (int e = 2 * H + threadIdx.x; e < 3 * H; e += ROPEV_THREADS) x[e] += le_ldg(b + e);
    }
}
