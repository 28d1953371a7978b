/* attention_bidir.c — the vision tower's attention core: bidirectional (no mask) within each frame, scalar
 * reference run on the pool.
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

#define BIDIR_TILE 8 /* query rows per task: each key and value row is read once for all of them */

typedef struct {
    const float *qkv; /* [n, 3H] */
    float *out;       /* [n, H] */
    float *scores;    /* [n_threads][row_floats]: a task's [BIDIR_TILE][seg_len] scores */
    int64_t row_floats, seg_len, tiles; /* tiles: query tiles per segment */
    int n_head, head_dim;
} bidir_job;

int64_t le_attention_bidir_row_floats(int64_t seg_len) { return le_floats64(BIDIR_TILE * seg_len); }

/* The softmax of each of R score rows [R][seg] in place (max subtracted, sum in double) -> inv[r] = 1 / sum. */
static void softmax_rows(float *sc, int R, int64_t seg, float *inv) {
    for (int r = 0; r < R; r++) {
        float *s = sc + r * seg, mx = -INFINITY;
        for (int64_t j = 0; j < seg; j++)
            if (s[j] > mx) mx = s[j];
        double sum = 0.0;
        for (int64_t j = 0; j < seg; j++) {
            s[j] = expf(s[j] - mx);
            sum += s[j];
        }
        inv[r] = (float)(1.0 / sum);
    }
}

/* items idx = tile * n_head + h in [t0, t1): query rows [r0, r0 + R) of one segment, one head. Each row's
 * arithmetic is in the same order as a row alone (scores j ascending, the weighted sum j ascending), so the tile
 * changes no bit: it only reads each key and value row once for R queries. */
static void bidir_tiles(void *ctx, int64_t t0, int64_t t1, int thread) {
    bidir_job *jb = ctx;
    int hd = jb->head_dim, nh = jb->n_head;
    int64_t H = (int64_t)nh * hd, ld = 3 * H, seg = jb->seg_len;
    float scale = 1.0f / sqrtf((float)hd), inv[BIDIR_TILE];
    le_dot_f32_fn dot = le_get_f32_kernels()->dot;
    float *sc = jb->scores + (int64_t)thread * jb->row_floats;
    for (int64_t idx = t0; idx < t1; idx++) {
        int64_t h = idx % nh, tile = idx / nh, s0 = tile / jb->tiles * seg;
        int64_t r0 = s0 + tile % jb->tiles * BIDIR_TILE;
        int R = (int)(r0 + BIDIR_TILE <= s0 + seg ? BIDIR_TILE : s0 + seg - r0);
        const float *k = jb->qkv + s0 * ld + H + h * hd, *v = k + H;
        for (int64_t j = 0; j < seg; j++)
            for (int r = 0; r < R; r++) sc[r * seg + j] = dot(jb->qkv + (r0 + r) * ld + h * hd, k + j * ld, hd) * scale;
        softmax_rows(sc, R, seg, inv);
        for (int r = 0; r < R; r++)
            for (int e = 0; e < hd; e++) jb->out[(r0 + r) * H + h * hd + e] = 0.0f;
        for (int64_t j = 0; j < seg; j++) {
            const float *vj = v + j * ld;
            for (int r = 0; r < R; r++) {
                float *o = jb->out + (r0 + r) * H + h * hd, p = sc[r * seg + j] * inv[r];
                for (int e = 0; e < hd; e++) o[e] += p * vj[e];
            }
        }
    }
}

/* qkv: [n, 3H]; scores: [n_threads][le_attention_bidir_row_floats(seg_len)]; out: [n, H] */
void le_attention_bidir(le_pool *pool, const float *qkv, int64_t n, int64_t seg_len, int n_head, int head_dim,
                        float *scores, float *out) {
    int64_t tiles = (seg_len + BIDIR_TILE - 1) / BIDIR_TILE;
    bidir_job jb = {qkv, out, scores, le_attention_bidir_row_floats(seg_len), seg_len, tiles, n_head, head_dim};
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
    float *scores = malloc(sizeof(float) * (size_t)(n_threads * le_attention_bidir_row_floats(seg_len)));
    if (!scores) {
        le_pool_free(pool);
        return LE_FAIL(LE_ERR_NO_MEMORY, "attention scores for %d threads", n_threads);
    }
    le_attention_bidir(pool, qkv, n, seg_len, n_head, head_dim, scores, out);
    free(scores);
    le_pool_free(pool);
    return LE_OK;
}
