/* attention_bidir.c — the vision tower's attention core: bidirectional (no mask) within each frame, scalar
 * reference run on the pool.
 *   o_h[i] = sum_j softmax_j(q_h[i] . k_h[j] / sqrt(hd)) v_h[j],   i, j in the same segment (frame) of seg_len
 * (transformers splits the packed sequence at cu_seqlens: one segment per frame). Softmax in f32 with the row's
 * max subtracted, its sum in double. One task = one (row, head): its result does not depend on which thread runs
 * it, so every thread count gives the same bits.
 * Test: tests/test_vision_tower.py (against numpy). */
#include <math.h>
#include <stdlib.h>

#include "le_internal.h"
#include "le_ops.h"
#include "le_simd.h"
#include "le_vision_ops.h"

typedef struct {
    const float *qkv; /* [n, 3H] */
    float *out;       /* [n, H] */
    float *scores;    /* [n_threads][row_floats] */
    int64_t row_floats, seg_len;
    int n_head, head_dim;
} bidir_job;

int64_t le_attention_bidir_row_floats(int64_t seg_len) { return le_floats64(seg_len); }

/* items idx = i * n_head + h in [i0, i1) */
static void bidir_rows(void *ctx, int64_t i0, int64_t i1, int thread) {
    bidir_job *jb = ctx;
    int hd = jb->head_dim, nh = jb->n_head;
    int64_t H = (int64_t)nh * hd, ld = 3 * H;
    float scale = 1.0f / sqrtf((float)hd);
    le_dot_f32_fn dot = le_get_f32_kernels()->dot;
    float *sc = jb->scores + (int64_t)thread * jb->row_floats;
    for (int64_t idx = i0; idx < i1; idx++) {
        int64_t i = idx / nh, h = idx % nh;
        int64_t s0 = i / jb->seg_len * jb->seg_len; /* the row's segment [s0, s0 + seg_len) */
        const float *q = jb->qkv + i * ld + h * hd;
        const float *k = jb->qkv + s0 * ld + H + h * hd, *v = k + H;
        float mx = -INFINITY;
        for (int64_t j = 0; j < jb->seg_len; j++) {
            sc[j] = dot(q, k + j * ld, hd) * scale;
            if (sc[j] > mx) mx = sc[j];
        }
        double sum = 0.0;
        for (int64_t j = 0; j < jb->seg_len; j++) {
            sc[j] = expf(sc[j] - mx);
            sum += sc[j];
        }
        float inv = (float)(1.0 / sum);
        float *o = jb->out + i * H + h * hd;
        for (int e = 0; e < hd; e++) o[e] = 0.0f;
        for (int64_t j = 0; j < jb->seg_len; j++) {
            const float *vj = v + j * ld;
            float p = sc[j] * inv;
            for (int e = 0; e < hd; e++) o[e] += p * vj[e];
        }
    }
}

/* qkv: [n, 3H]; scores: [n_threads][le_attention_bidir_row_floats(seg_len)]; out: [n, H] */
void le_attention_bidir(le_pool *pool, const float *qkv, int64_t n, int64_t seg_len, int n_head, int head_dim,
                        float *scores, float *out) {
    bidir_job jb = {qkv, out, scores, le_attention_bidir_row_floats(seg_len), seg_len, n_head, head_dim};
    int64_t items = n * n_head;
    /* grain: ~8 tasks per thread; a task (one row's softmax over seg_len keys) is long enough for the atomic */
    int64_t grain = items / (8 * le_pool_threads(pool)) + 1;
    le_parallel_for(pool, items, grain, bidir_rows, &jb);
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
