/* attention_bidir.c — the vision tower's attention core: bidirectional (no mask) within each frame, run on the
 * pool; a tile of queries' scores and its P V product are calls of the f32 table's gemm_nn, the softmax's exp its
 * exp_sub_sum (le_simd.h).
 *   o_h[i] = sum_j softmax_j(q_h[i] . k_h[j] / sqrt(hd)) v_h[j],   i, j in the same segment (frame) of seg_len
 * (transformers splits the packed sequence at cu_seqlens: one segment per frame). Softmax in f32 with the row's
 * max subtracted, its sum in double; the normalisation is applied to the output row (hd multiplies, not seg_len).
 * One task = a tile of query rows of one head: its result does not depend on which thread runs it, so every thread
 * count gives the same bits.
 * Test: tests/test_vision_tower.py (against numpy). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "le_internal.h"
#include "le_ops.h"
#include "le_simd.h"
#include "le_vision_ops.h"

/* Query rows per task: each packed key and value row is read once for all of them (the panels of 1 MiB each at 4096
 * keys come from L2/L3 once per tile); a multiple of gemm_nn's 6-row register tile; 48 rows' scores over 4096 keys
 * are 768 KiB, which stay in L2 between the three passes over them. */
#define BIDIR_TILE 48

typedef struct {
    const float *qkv; /* [n, 3H] */
    float *out;       /* [n, H] */
    float *scores;    /* [n_threads][row_floats]: a task's scores [BIDIR_TILE][seg_len], K^T [hd][kt_ld], V [seg][hd] */
    int64_t row_floats, seg_len, tiles; /* tiles: query tiles per segment */
    int n_head, head_dim;
} bidir_job;

/* Row stride of the transposed keys: seg_len rounded up to 16 floats, plus 16. why: with a power-of-two stride
 * (4096 keys: 16 KiB) the 64 rows of a gemm_nn panel all fall into the same L1 sets. */
static int64_t kt_ld(int64_t seg_len) { return (seg_len + 15) / 16 * 16 + 16; }

int64_t le_attention_bidir_row_floats(int64_t seg_len, int head_dim) {
    return le_floats64(BIDIR_TILE * seg_len) + le_floats64((int64_t)head_dim * kt_ld(seg_len)) +
           le_floats64((int64_t)head_dim * seg_len);
}

/* items idx = (segment * n_head + h) * tiles + tile in [t0, t1): query rows [r0, r0 + R) of one segment, one head.
 * The keys go transposed (kt [hd, seg]) and the values packed (vp [seg, hd]) into the thread's scratch once per run
 * of tasks of one (segment, head); then scores [R, seg] = Q [R, hd] kt, each row's numerators exp(s scale - max s
 * scale) and their sum (exp_sub_sum), out [R, hd] = P [R, seg] vp, and out's row divided by its sum. Each output's
 * sums are fixed by hd and seg alone (gemm_nn's contract), so the cut and the thread change no bit. */
static void bidir_tiles(void *ctx, int64_t t0, int64_t t1, int thread) {
    bidir_job *jb = ctx;
    int hd = jb->head_dim, nh = jb->n_head;
    int64_t H = (int64_t)nh * hd, ld = 3 * H, seg = jb->seg_len, ldk = kt_ld(seg), have = -1; /* (segment, head) */
    float scale = 1.0f / sqrtf((float)hd);
    const le_f32_kernels *kern = le_get_f32_kernels();
    float *sc = jb->scores + (int64_t)thread * jb->row_floats, *kt = sc + le_floats64(BIDIR_TILE * seg);
    float *vp = kt + le_floats64((int64_t)hd * ldk);
    for (int64_t idx = t0; idx < t1; idx++) {
        int64_t sh = idx / jb->tiles, h = sh % nh, s0 = sh / nh * seg;
        int64_t r0 = s0 + idx % jb->tiles * BIDIR_TILE;
        int R = (int)(r0 + BIDIR_TILE <= s0 + seg ? BIDIR_TILE : s0 + seg - r0);
        if (have != sh) { /* kt in blocks of 16 keys: 16 rows read, one line of kt written per e */
            const float *k = jb->qkv + s0 * ld + H + h * hd, *v = k + H;
            for (int64_t j0 = 0; j0 < seg; j0 += 16)
                for (int e = 0; e < hd; e++)
                    for (int64_t j = j0; j < j0 + 16 && j < seg; j++) kt[e * ldk + j] = k[j * ld + e];
            for (int64_t j = 0; j < seg; j++) memcpy(vp + j * hd, v + j * ld, sizeof(float) * (size_t)hd);
            have = sh;
        }
        kern->gemm_nn(jb->qkv + r0 * ld + h * hd, ld, kt, ldk, sc, seg, R, (int)seg, hd);
        double sum[BIDIR_TILE];
        for (int r = 0; r < R; r++) sum[r] = kern->exp_sub_sum(sc + r * seg, sc + r * seg, seg, scale);
        float *o = jb->out + r0 * H + h * hd;
        kern->gemm_nn(sc, seg, vp, hd, o, H, R, hd, (int)seg);
        for (int r = 0; r < R; r++) {
            float inv = (float)(1.0 / sum[r]);
            for (int e = 0; e < hd; e++) o[r * H + e] *= inv;
        }
    }
}

/* qkv: [n, 3H]; scores: [n_threads][le_attention_bidir_row_floats(seg_len, head_dim)]; out: [n, H] */
void le_attention_bidir(le_pool *pool, const float *qkv, int64_t n, int64_t seg_len, int n_head, int head_dim,
                        float *scores, float *out) {
    int64_t tiles = (seg_len + BIDIR_TILE - 1) / BIDIR_TILE;
    bidir_job jb = {qkv, out, scores, le_attention_bidir_row_floats(seg_len, head_dim), seg_len, tiles, n_head,
                    head_dim};
    int64_t items = n / seg_len * tiles * n_head, T = le_pool_threads(pool);
    /* grain: one (segment, head) per chunk where there are >= 4 per thread (its keys and values packed once), else
     * ~8 chunks per thread; a task (R rows' softmax over seg_len keys) is long enough for the atomic either way */
    int64_t grain = items / tiles >= 4 * T ? tiles : items / (8 * T) + 1;
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
