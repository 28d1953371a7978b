/* attention.c — the gated full-attention mixer (spec §2.4).
 *
 *   [q | gate] per head = W_q x   (rows interleaved per head: q_h (hd) then gate_h (hd))
 *   k = W_k x, v = W_v x;  q, k <- RMSNorm per head with q_norm / k_norm
 *   q, k <- RoPE (NeoX on the first n_rot dims, IMRoPE sections); written to the KV cache
 *   o_h = softmax(q_h K^T / sqrt(hd), causal) V   (query head h reads KV head h / (n_head/n_kv))
 *   out = W_o (o * sigmoid(gate))
 * Softmax in f32 with the row's max subtracted, its sum in double; the KV cache is f32. The core goes in tasks of
 * (row, head) pairs sharing a KV head: scores and P V are products of the f32 table (gemm_tile, gemm_nn), so each
 * key and value row is read once a task, not once a pair (a 4K-token prompt's attention was 60 % of its prefill);
 * LE_ISA_REF's table makes it the scalar reference.
 * A pass may hold several sequences (le_seqs): q, k, v are projected for all their rows at once, each sequence's K
 * and V rows go to its own caches at its positions, and a row attends over its own sequence's keys.
 * Test: tests/test_model.py, tests/test_batch_decode.py. */
#include <math.h>
#include <string.h>

#include "le_internal.h"
#include "le_ops.h"
#include "le_simd.h"

/* (row, head) pairs a task's scores hold at most: each K and V row of the task's KV head is read once for all of
 * them (a multiple of gemm_nn's 6-row register tile) */
#define ATTN_TILE 48
/* Floats of a thread's scores at most where the keys allow (4 MiB): a long context takes fewer pairs a task, not
 * more memory (a pair's bits do not depend on which task holds it) */
#define ATTN_SCORE_FLOATS (1 << 20)

typedef struct {
    const le_model *m;
    const le_seqs *sq;
    int ai;           /* the layer's index among the attention layers: each state's caches of this layer */
    const float *qg;  /* [n, n_head * 2 * hd] */
    float *o;         /* [n, n_head * hd] */
    float *scratch;   /* [n_threads][thread_floats]: a task's scores [M, ld], packed queries and outputs [M, hd] */
    int64_t thread_floats, score_floats, ld; /* ld: the scores' row stride, >= the pass's most keys */
    int hg, rows;     /* query heads of one KV head and rows of one sequence per task: M = hg * rows pairs */
    int subs;         /* tasks across a KV head's group: n_head / n_head_kv / hg */
    const int64_t *tile0; /* [n_seq + 1]: each sequence's first row tile */
} attn_job;

/* The scores' row stride for n keys and the (row, head) pairs a task takes: as many as fit ATTN_SCORE_FLOATS, at
 * least 1, at most ATTN_TILE */
static int64_t score_ld(int n_keys) { return le_floats64(n_keys); }
static int tile_pairs(int n_keys) {
    int64_t m = ATTN_SCORE_FLOATS / score_ld(n_keys);
    return m < 1 ? 1 : m > ATTN_TILE ? ATTN_TILE : (int)m;
}
/* A thread's scores for n keys: tile_pairs rows of score_ld, bounded by a form that grows with n (the plan's n_ctx
 * then covers every pass) */
static int64_t score_floats(int n_keys) {
    int64_t ld = score_ld(n_keys), most = ATTN_SCORE_FLOATS > ld ? ATTN_SCORE_FLOATS : ld;
    return ATTN_TILE * ld < most ? ATTN_TILE * ld : most;
}
static int64_t thread_floats(int n_keys, int hd) {
    return score_floats(n_keys) + 2 * le_floats64((int64_t)ATTN_TILE * hd);
}

/* One task: rows [r0, r0 + R) of sequence s, query heads h0 .. h0 + hg - 1 (all of KV head kvh): pairs i = r * hg +
 * j packed as A [M, hd]; scores S [M, keys] = A K^T (gemm_tile, the cache's rows as they are), each pair's softmax
 * numerators over its own causal keys (exp_sub_sum) and zeros beyond them, O [M, hd] = P V (gemm_nn; the zeros add
 * nothing), then each output row divided by its sum and gated. Every pair's bits depend on its own keys alone
 * (gemm_tile's and gemm_nn's contracts; padding zeros are exact), so how rows, heads and threads are cut, and whether
 * a row came in a prefill chunk or a decode step, changes no bit. */
static void attn_task(attn_job *jb, int s, int r0, int R, int kvh, int h0, int thread) {
    const le_hparams *hp = &jb->m->hp;
    const le_f32_kernels *kern = le_get_f32_kernels();
    const le_state *st = jb->sq->st[s];
    int hd = hp->head_dim, nh = hp->n_head, kvw = hp->n_head_kv * hd, hg = jb->hg, M = R * hg;
    int64_t ld = jb->ld;
    float *S = jb->scratch + (int64_t)thread * jb->thread_floats;
    float *A = S + jb->score_floats, *O = A + le_floats64((int64_t)ATTN_TILE * hd);
    const float *kc = st->k + jb->ai * st->kv_floats + kvh * hd, *vc = st->v + jb->ai * st->kv_floats + kvh * hd;
    int first = st->pos + (r0 - jb->sq->row0[s]) + 1; /* keys of the task's first row (causal: positions 0..) */
    int keys = first + R - 1;
    for (int r = 0; r < R; r++)
        for (int j = 0; j < hg; j++)
            memcpy(A + (int64_t)(r * hg + j) * hd, jb->qg + (size_t)(r0 + r) * nh * 2 * hd + (size_t)(h0 + j) * 2 * hd,
                   sizeof(float) * (size_t)hd);
    kern->gemm_tile(A, hd, kc, kvw, S, ld, M, keys, hd);
    double sum[ATTN_TILE];
    float scale = 1.0f / sqrtf((float)hd);
    for (int i = 0; i < M; i++) {
        int own = first + i / hg;
        float *row = S + i * ld;
        sum[i] = kern->exp_sub_sum(row, row, own, scale);
        for (int p = own; p < keys; p++) row[p] = 0.0f;
    }
    kern->gemm_nn(S, ld, vc, kvw, O, hd, M, hd, keys);
    for (int i = 0; i < M; i++) {
        int t = r0 + i / hg, h = h0 + i % hg;
        float inv = (float)(1.0 / sum[i]);
        const float *gate = jb->qg + (size_t)t * nh * 2 * hd + (size_t)h * 2 * hd + hd;
        float *o = jb->o + (size_t)t * nh * hd + (size_t)h * hd;
        for (int e = 0; e < hd; e++) o[e] = O[i * hd + e] * inv * le_sigmoid(gate[e]);
    }
}

/* items idx = (tile * n_head_kv + kvh) * subs + sub, tile counting every sequence's row tiles in order */
static void attn_tasks(void *ctx, int64_t i0, int64_t i1, int thread) {
    attn_job *jb = ctx;
    const le_hparams *hp = &jb->m->hp;
    int nkv = hp->n_head_kv, group = hp->n_head / nkv;
    for (int64_t idx = i0; idx < i1; idx++) {
        int sub = (int)(idx % jb->subs), kvh = (int)(idx / jb->subs % nkv), tile = (int)(idx / jb->subs / nkv);
        int s = le_piece_of(jb->tile0, jb->sq->n_seq, tile);
        int r0 = jb->sq->row0[s] + (int)(tile - jb->tile0[s]) * jb->rows, end = jb->sq->row0[s + 1];
        int R = r0 + jb->rows <= end ? jb->rows : end - r0;
        attn_task(jb, s, r0, R, kvh, kvh * group + sub * jb->hg, thread);
    }
}

/* The layer's own scratch: [q | gate] rows qg [n, n_head * 2 * hd], o [n, n_head * hd], and for several sequences
 * the new K and V rows [2][n, n_head_kv * hd] before they go to each sequence's caches */
static size_t own_floats(const le_hparams *hp, int n) {
    return (size_t)n * hp->n_head * 2 * hp->head_dim + (size_t)n * hp->n_head * hp->head_dim +
           2 * (size_t)n * hp->n_head_kv * hp->head_dim;
}

size_t le_attention_plan(const le_model *m, const le_weight *w, int n, int n_ctx) {
    const le_hparams *hp = &m->hp;
    int T = le_pool_threads(m->pool), E = hp->n_embd, kvw = hp->n_head_kv * hp->head_dim;
    static const float x_id[2]; /* distinct addresses: the plan's stand-ins for distinct inputs */
    le_mm proj[3] = {{&w[LE_W_Q], 0, x_id, n, E, NULL, 2 * hp->n_head * hp->head_dim, NULL},
                     {&w[LE_W_K], 0, x_id, n, E, NULL, kvw, NULL}, {&w[LE_W_V], 0, x_id, n, E, NULL, kvw, NULL}};
    le_mm out = {&w[LE_W_O], 0, x_id + 1, n, hp->n_head * hp->head_dim, NULL, E, NULL};
    size_t most = le_matmul_batch_plan(T, m->int8, proj, 3), outp = le_matmul_batch_plan(T, m->int8, &out, 1);
    size_t scores = (size_t)T * (size_t)thread_floats(n_ctx, hp->head_dim) * sizeof(float) +
                    le_align64(sizeof(int64_t) * (size_t)(n + 1));
    if (outp > most) most = outp;
    if (scores > most) most = scores;
    return le_align64(own_floats(hp, n) * sizeof(float)) + most;
}

/* Rows [t0, t1): each q and k head RMSNormed, then rotated (q heads at stride 2 hd: the gate half is skipped); a job
 * over the rows (le_parallel_rows). */
typedef struct {
    const le_hparams *hp;
    const float *qn, *kn_w;
    float *qg, *kn;
    const int32_t *rope_pos;
} qk_job;

static void qk_rows(void *ctx, int64_t t0, int64_t t1, int thread) {
    const qk_job *j = ctx;
    const le_hparams *hp = j->hp;
    int hd = hp->head_dim, nh = hp->n_head, nkv = hp->n_head_kv;
    for (int64_t t = t0; t < t1; t++) {
        float *qt = j->qg + (size_t)t * nh * 2 * hd, *kt = j->kn + (size_t)t * nkv * hd;
        for (int h = 0; h < nh; h++) le_rmsnorm(qt + h * 2 * hd, j->qn, hd, hp->rms_eps, qt + h * 2 * hd);
        for (int h = 0; h < nkv; h++) le_rmsnorm(kt + h * hd, j->kn_w, hd, hp->rms_eps, kt + h * hd);
        const int32_t *p = j->rope_pos + 3 * t;
        le_rope_neox(qt, nh, 2 * hd, hp->n_rot, hp->rope_sections, hp->rope_theta, p, hp->faults);
        le_rope_neox(kt, nkv, hd, hp->n_rot, hp->rope_sections, hp->rope_theta, p, hp->faults);
    }
}

int le_attention_layer(const le_model *m, le_arena *ar, const le_weight *w, const float *x, const le_seqs *sq,
                       int ai, const int32_t *rope_pos, float *out) {
    const le_hparams *hp = &m->hp;
    int E = hp->n_embd, hd = hp->head_dim, nh = hp->n_head, nkv = hp->n_head_kv;
    int qw = nh * 2 * hd, kvw = nkv * hd, n = sq->row0[sq->n_seq];
    int rc;
    size_t mark = ar->used;
    float *buf = le_arena_take(ar, own_floats(hp, n) * sizeof(float));
    if (!buf) return LE_FAIL(LE_ERR_NO_MEMORY, "attention scratch for %d tokens: beyond the plan", n);
    float *qg = buf, *o = qg + (size_t)n * qw, *kn, *vn;
    const le_state *s0 = sq->st[0];
    if (sq->n_seq == 1) { /* one sequence: its rows are contiguous in its caches, projected there directly */
        kn = s0->k + ai * s0->kv_floats + (size_t)s0->pos * kvw;
        vn = s0->v + ai * s0->kv_floats + (size_t)s0->pos * kvw;
    } else { /* several: projected together here, then copied to each sequence's caches */
        kn = o + (size_t)n * nh * hd;
        vn = kn + (size_t)n * kvw;
    }
    double tp = le_prof_start(m);
    le_mm proj[3] = {{&w[LE_W_Q], 0, x, n, E, qg, qw, NULL}, {&w[LE_W_K], 0, x, n, E, kn, kvw, NULL},
                     {&w[LE_W_V], 0, x, n, E, vn, kvw, NULL}};
    if ((rc = le_matmul_batch(m->pool, ar, m->int8, proj, 3))) goto done;
    le_prof(m, &tp, LE_PROF_ATTN_PROJ);
    qk_job qj = {hp, (const float *)w[LE_W_Q_NORM].data, (const float *)w[LE_W_K_NORM].data, qg, kn, rope_pos};
    le_parallel_rows(m->pool, n, qk_rows, &qj);
    int most_keys = 0; /* the longest sequence's keys: pos + n */
    for (int s = 0; s < sq->n_seq; s++) {
        const le_state *st = sq->st[s];
        int r0 = sq->row0[s], ns = sq->row0[s + 1] - r0;
        if (sq->n_seq > 1) {
            size_t at = (size_t)ai * st->kv_floats + (size_t)st->pos * kvw, bytes = (size_t)ns * kvw * sizeof(float);
            memcpy(st->k + at, kn + (size_t)r0 * kvw, bytes);
            memcpy(st->v + at, vn + (size_t)r0 * kvw, bytes);
        }
        if (st->pos + ns > most_keys) most_keys = st->pos + ns;
    }
    /* the tasks' shape: a KV head's query heads together where the pairs allow, fewer where tasks would not cover
     * the threads (one decode step); then rows of one sequence up to the pairs */
    size_t core = ar->used;
    int T = le_pool_threads(m->pool), group = nh / nkv, pairs = tile_pairs(most_keys), hg = group, rows = 1;
    int64_t *tile0 = le_arena_take(ar, sizeof(int64_t) * (size_t)(sq->n_seq + 1)); /* tile0[n_seq]: the tiles */
    float *scratch = le_arena_take(ar, (size_t)T * (size_t)thread_floats(most_keys, hd) * sizeof(float));
    if (!tile0 || !scratch) {
        rc = LE_FAIL(LE_ERR_NO_MEMORY, "attention scores of %d keys: beyond the plan", most_keys);
        goto done;
    }
    for (;; hg--) {
        if (group % hg || hg > pairs) continue;
        rows = pairs / hg;
        tile0[0] = 0;
        for (int s = 0; s < sq->n_seq; s++) tile0[s + 1] = tile0[s] + (sq->row0[s + 1] - sq->row0[s] + rows - 1) / rows;
        if (hg == 1 || (int64_t)tile0[sq->n_seq] * nkv * (group / hg) >= T) break;
    }
    attn_job jb = {m, sq, ai, qg, o, scratch, thread_floats(most_keys, hd), score_floats(most_keys),
                   score_ld(most_keys), hg, rows, group / hg, tile0};
    le_parallel_for(m->pool, (int64_t)tile0[sq->n_seq] * nkv * jb.subs, 1, attn_tasks, &jb);
    ar->used = core;
    le_prof(m, &tp, LE_PROF_ATTN_CORE);
    rc = le_matmul(m->pool, ar, m->int8, &w[LE_W_O], 0, o, n, nh * hd, out, E);
    le_prof(m, &tp, LE_PROF_ATTN_OUT);
done:
    ar->used = mark;
    return rc;
}
