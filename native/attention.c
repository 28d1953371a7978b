/* attention.c — the gated full-attention mixer (spec §2.4), scalar reference.
 *
 *   [q | gate] per head = W_q x   (rows interleaved per head: q_h (hd) then gate_h (hd))
 *   k = W_k x, v = W_v x;  q, k <- RMSNorm per head with q_norm / k_norm
 *   q, k <- RoPE (NeoX on the first n_rot dims, IMRoPE sections); written to the KV cache
 *   o_h = softmax(q_h K^T / sqrt(hd), causal) V   (query head h reads KV head h / (n_head/n_kv))
 *   out = W_o (o * sigmoid(gate))
 * Softmax in f32 with the running max subtracted; the KV cache is f32.
 * A pass may hold several sequences (le_seqs): q, k, v are projected for all their rows at once, each sequence's K
 * and V rows go to its own caches at its positions, and a row attends over its own sequence's keys.
 * Test: tests/test_model.py, tests/test_batch_decode.py. */
#include <math.h>
#include <string.h>

#include "le_internal.h"
#include "le_ops.h"
#include "le_simd.h"

typedef struct {
    const le_model *m;
    const le_seqs *sq;
    int ai;           /* the layer's index among the attention layers: each state's caches of this layer */
    const float *qg;  /* [n, n_head * 2 * hd] */
    float *o;         /* [n, n_head * hd] */
    float *scores;    /* [n_threads][score_floats]: each thread's softmax row, >= every sequence's pos + n */
    int64_t score_floats;
} attn_job;

/* Floats of one thread's scores for n_keys keys (the plan: n_ctx, not pos + n, so that a decode step's scratch does
 * not grow with its position). */
static int64_t score_floats(int n_keys) { return le_floats64(n_keys); }

/* The sequence holding row t: the last s with row0[s] <= t. */
static int seq_of_row(const le_seqs *sq, int t) {
    int lo = 0, hi = sq->n_seq - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (sq->row0[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Items (row t, query head h): softmax over the keys of t's sequence at positions 0 .. its own, in its caches. */
static void attn_rows(void *ctx, int64_t i0, int64_t i1, int thread) {
    attn_job *jb = ctx;
    const le_hparams *hp = &jb->m->hp;
    int hd = hp->head_dim, nh = hp->n_head, kvw = hp->n_head_kv * hd, group = nh / hp->n_head_kv;
    float scale = 1.0f / sqrtf((float)hd);
    le_dot_f32_fn dot = le_get_f32_kernels()->dot;
    float *sc = jb->scores + (int64_t)thread * jb->score_floats;
    for (int64_t idx = i0; idx < i1; idx++) { /* idx = t * n_head + h */
        int t = (int)(idx / nh), h = (int)(idx % nh), kvh = h / group;
        int s = seq_of_row(jb->sq, t);
        const le_state *st = jb->sq->st[s];
        const float *kc = st->k + jb->ai * st->kv_floats, *vc = st->v + jb->ai * st->kv_floats;
        const float *q = jb->qg + (size_t)t * nh * 2 * hd + (size_t)h * 2 * hd;
        int n_keys = st->pos + (t - jb->sq->row0[s]) + 1; /* causal: keys at positions 0..pos+i */
        float mx = -INFINITY;
        for (int p = 0; p < n_keys; p++) {
            sc[p] = dot(q, kc + (size_t)p * kvw + kvh * hd, hd) * scale;
            if (sc[p] > mx) mx = sc[p];
        }
        double sum = 0.0;
        for (int p = 0; p < n_keys; p++) {
            sc[p] = expf(sc[p] - mx);
            sum += sc[p];
        }
        float inv = (float)(1.0 / sum);
        float *o = jb->o + (size_t)t * nh * hd + (size_t)h * hd;
        for (int e = 0; e < hd; e++) o[e] = 0.0f;
        for (int p = 0; p < n_keys; p++) {
            const float *v = vc + (size_t)p * kvw + kvh * hd;
            float wgt = sc[p] * inv;
            for (int e = 0; e < hd; e++) o[e] += wgt * v[e];
        }
        const float *gate = q + hd;
        for (int e = 0; e < hd; e++) o[e] *= le_sigmoid(gate[e]);
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
    size_t scores = (size_t)T * (size_t)score_floats(n_ctx) * sizeof(float);
    if (outp > most) most = outp;
    if (scores > most) most = scores;
    return le_align64(own_floats(hp, n) * sizeof(float)) + most;
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
    const float *qn = (const float *)w[LE_W_Q_NORM].data, *knw = (const float *)w[LE_W_K_NORM].data;
    for (int t = 0; t < n; t++) {
        float *qt = qg + (size_t)t * qw, *kt = kn + (size_t)t * kvw;
        for (int h = 0; h < nh; h++) le_rmsnorm(qt + h * 2 * hd, qn, hd, hp->rms_eps, qt + h * 2 * hd);
        for (int h = 0; h < nkv; h++) le_rmsnorm(kt + h * hd, knw, hd, hp->rms_eps, kt + h * hd);
        /* rotate q heads (stride 2*hd: the gate half is skipped) and k heads */
        const int32_t *p = rope_pos + 3 * t;
        le_rope_neox(qt, nh, 2 * hd, hp->n_rot, hp->rope_sections, hp->rope_theta, p, hp->faults);
        le_rope_neox(kt, nkv, hd, hp->n_rot, hp->rope_sections, hp->rope_theta, p, hp->faults);
    }
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
    /* each thread's scores for the longest sequence's keys (the plan holds n_ctx) */
    size_t core = ar->used;
    attn_job jb = {m, sq, ai, qg, o, NULL, score_floats(most_keys)};
    size_t bytes = (size_t)le_pool_threads(m->pool) * (size_t)jb.score_floats * sizeof(float);
    if (!(jb.scores = le_arena_take(ar, bytes))) {
        rc = LE_FAIL(LE_ERR_NO_MEMORY, "attention scores of %d keys: beyond the plan", most_keys);
        goto done;
    }
    le_parallel_for(m->pool, (int64_t)n * nh, 1, attn_rows, &jb);
    ar->used = core;
    le_prof(m, &tp, LE_PROF_ATTN_CORE);
    rc = le_matmul(m->pool, ar, m->int8, &w[LE_W_O], 0, o, n, nh * hd, out, E);
    le_prof(m, &tp, LE_PROF_ATTN_OUT);
done:
    ar->used = mark;
    return rc;
}
