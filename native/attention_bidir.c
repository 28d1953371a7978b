/* attention_bidir.c — the vision tower's attention core: bidirectional (no mask) within each frame, run on the
 * pool; a tile of queries' scores and its P V product are calls of the f32 table's gemm_tile (le_simd.h).
 *   o_h[i] = sum_j softmax_j(q_h[i] . k_h[j] / sqrt(hd)) v_h[j],   i, j in the same segment (frame) of seg_len
 * (transformers splits the packed sequence at cu_seqlens: one segment per frame). Softmax in f32 with the row's
 * max subtracted, its sum in double. One task = a tile of query rows of one head: its result does not depend on
 * which thread runs it, so every thread count gives the same bits.
 * Test: tests/test_vision_tower.py (against numpy). */
#include <math.h>
#include <stdlib.h>

#include "le_internal.h"
#include "le_ops.h"
#include "le_simd.h"
#include "le_vision_ops.h"

#define BIDIR_TILE 32 /* query rows per task: each key and value row is read once for all of them */

typedef struct {
    const float *qkv; /* [n, 3H] */
    float *out;       /* [n, H] */
    float *scores;    /* [n_threads][row_floats]: a task's [BIDIR_TILE][seg_len] scores, then V^T [hd][seg_len] */
    int64_t row_floats, seg_len, tiles; /* tiles: query tiles per segment */
    int n_head, head_dim;
} bidir_job;

int64_t le_attention_bidir_row_floats(int64_t seg_len, int head_dim) {
    return le_floats64(BIDIR_TILE * seg_len) + le_floats64((int64_t)head_dim * seg_len);
}

/* The softmax of each of R score rows [R][seg] in place (max subtracted, sum in double), normalised. */
static void softmax_rows(float *sc, int R, int64_t seg) {
    for (int r = 0; r < R; r++) {
        float *s = sc + r * seg, mx = -INFINITY;
        for (int64_t j = 0; j < seg; j++)
            if (s[j] > mx) mx = s[j];
        double sum = 0.0;
        for (int64_t j = 0; j < seg; j++) {
            s[j] = expf(s[j] - mx);
            sum += s[j];
        }
        float inv = (float)(1.0 / sum);
        for (int64_t j = 0; j < seg; j++) s[j] *= inv;
    }
}

/* items idx = (segment * n_head + h) * tiles + tile in [t0, t1): query rows [r0, r0 + R) of one segment, one head.
 * Both products are gemm_tile calls: scores [R, seg] = Q [R, hd] K [seg, hd]^T, then out [R, hd] = P [R, seg]
 * (V^T [hd, seg])^T, V^T transposed into the thread's scratch once per run of tasks of one (segment, head). Each
 * output's sums are fixed by hd and seg alone (gemm_tile's contract), so the cut and the thread change no bit. */
static void bidir_tiles(void *ctx, int64_t t0, int64_t t1, int thread) {
    bidir_job *jb = ctx;
    int hd = jb->head_dim, nh = jb->n_head;
    int64_t H = (int64_t)nh * hd, ld = 3 * H, seg = jb->seg_len, have = -1; /* (segment, head) held in vt */
    float scale = 1.0f / sqrtf((float)hd);
    le_gemm_tile_f32_fn gemm = le_get_f32_kernels()->gemm_tile;
    float *sc = jb->scores + (int64_t)thread * jb->row_floats, *vt = sc + le_floats64(BIDIR_TILE * seg);
    for (int64_t idx = t0; idx < t1; idx++) {
        int64_t sh = idx / jb->tiles, h = sh % nh, s0 = sh / nh * seg;
        int64_t r0 = s0 + idx % jb->tiles * BIDIR_TILE;
        int R = (int)(r0 + BIDIR_TILE <= s0 + seg ? BIDIR_TILE : s0 + seg - r0);
        const float *k = jb->qkv + s0 * ld + H + h * hd, *v = k + H;
        if (have != sh) { /* vt [hd, seg] = V [seg, hd]^T */
            for (int64_t j = 0; j < seg; j++)
                for (int e = 0; e < hd; e++) vt[e * seg + j] = v[j * ld + e];
            have = sh;
        }
        gemm(jb->qkv + r0 * ld + h * hd, ld, k, ld, sc, seg, R, (int)seg, hd);
        for (int64_t j = 0; j < R * seg; j++) sc[j] *= scale;
        softmax_rows(sc, R, seg);
        gemm(sc, seg, vt, seg, jb->out + r0 * H + h * hd, H, R, hd, (int)seg);
    }
}

/* qkv: [n, 3H]; scores: [n_threads][le_attention_bidir_row_floats(seg_len, head_dim)]; out: [n, H] */
void le_attention_bidir(le_pool *pool, const float *qkv, int64_t n, int64_t seg_len, int n_head, int head_dim,
                        float *scores, float *out) {
    int64_t tiles = (seg_len + BIDIR_TILE - 1) / BIDIR_TILE;
    bidir_job jb = {qkv, out, scores, le_attention_bidir_row_floats(seg_len, head_dim), seg_len, tiles, n_head,
                    head_dim};
    int64_t items = n / seg_len * tiles * n_head;
    /* grain: ~8 tasks per thread; a task (R rows' softmax over seg_len keys) is long enough for the atomic */
    int64_t grain = items / (8 * le_pool_threads(pool)) + 1;
    le_parallel_for(pool, items, grain, bidir_tiles, &jb);
}

int le_vision_op_attention(const float *qkv, int64_t n, int64_t seg_len, int n_head, int head_dim, int n_threads,
                           float *out) {
    if (!qkv || !out || n < 1 || seg_len < 1 || n % seg_len || n_head < 1 || head_dim < 1 || n_threads < 1)
        return LE_FAIL(LE_ERR_INVALID_ARG, "attention: n %lld, segment %lld, %d heads of %d, %d threads",
                       (long long)n, (long long)seg_len, n_head, head_dim, n_threads);
    le_pool *pool;
    int rc = le_pool_create(n_threads, &pool);
    if (rc != LE_OK) return rc;
    float *scores = malloc(sizeof(float) * (size_t)(n_threads * le_attention_bidir_row_floats(seg_len, head_dim)));
    if (!scores) {
        le_pool_free(pool);
        return LE_FAIL(LE_ERR_NO_MEMORY, "attention scores for %d threads", n_threads);
    }
    le_attention_bidir(pool, qkv, n, seg_len, n_head, head_dim, scores, out);
    free(scores);
    le_pool_free(pool);
    return LE_OK;
}
