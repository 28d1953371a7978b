/* attention.c — the gated full-attention mixer (spec §2.4), scalar reference.
 *
 *   [q | gate] per head = W_q x   (rows interleaved per head: q_h (hd) then gate_h (hd))
 *   k = W_k x, v = W_v x;  q, k <- RMSNorm per head with q_norm / k_norm
 *   q, k <- RoPE (NeoX on the first n_rot dims, IMRoPE sections); written to the KV cache
 *   o_h = softmax(q_h K^T / sqrt(hd), causal) V   (query head h reads KV head h / (n_head/n_kv))
 *   out = W_o (o * sigmoid(gate))
 * Softmax in f32 with the running max subtracted; the KV cache is f32.
 * Test: tests/test_model.py. */
#include <math.h>
#include <string.h>

#include "le_internal.h"
#include "le_ops.h"
#include "le_simd.h"

typedef struct {
    const le_model *m;
    const float *qg;  /* [n, n_head * 2 * hd] */
    const float *kc, *vc;
    float *o;         /* [n, n_head * hd] */
    float *scores;    /* [n_threads][score_floats]: each thread's softmax row, pos + n <= score_floats */
    int64_t score_floats;
    int n, pos;
} attn_job;

/* Floats of one thread's scores for n_keys keys (the plan: n_ctx, not pos + n, so that a decode step's scratch does
 * not grow with its position). */
static int64_t score_floats(int n_keys) { return le_floats64(n_keys); }

static void attn_rows(void *ctx, int64_t i0, int64_t i1, int thread) {
    attn_job *jb = ctx;
    const le_hparams *hp = &jb->m->hp;
    int hd = hp->head_dim, nh = hp->n_head, kvw = hp->n_head_kv * hd, group = nh / hp->n_head_kv;
    float scale = 1.0f / sqrtf((float)hd);
    le_dot_f32_fn dot = le_get_f32_kernels()->dot;
    float *sc = jb->scores + (int64_t)thread * jb->score_floats;
    for (int64_t idx = i0; idx < i1; idx++) { /* idx = t * n_head + h */
        int t = (int)(idx / nh), h = (int)(idx % nh), kvh = h / group;
        const float *q = jb->qg + (size_t)t * nh * 2 * hd + (size_t)h * 2 * hd;
        int n_keys = jb->pos + t + 1; /* causal: keys at positions 0..pos+t */
        float mx = -INFINITY;
        for (int p = 0; p < n_keys; p++) {
            sc[p] = dot(q, jb->kc + (size_t)p * kvw + kvh * hd, hd) * scale;
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
            const float *v = jb->vc + (size_t)p * kvw + kvh * hd;
            float wgt = sc[p] * inv;
            for (int e = 0; e < hd; e++) o[e] += wgt * v[e];
        }
        const float *gate = q + hd;
        for (int e = 0; e < hd; e++) o[e] *= le_sigmoid(gate[e]);
    }
}

/* The layer's own scratch: [q | gate] rows qg [n, n_head * 2 * hd], o [n, n_head * hd] */
static size_t own_floats(const le_hparams *hp, int n) {
    return (size_t)n * hp->n_head * 2 * hp->head_dim + (size_t)n * hp->n_head * hp->head_dim;
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

int le_attention_layer(const le_model *m, le_arena *ar, const le_weight *w, const float *x, int n, int pos,
                       const int32_t *rope_pos, float *kc, float *vc, float *out) {
    const le_hparams *hp = &m->hp;
    int E = hp->n_embd, hd = hp->head_dim, nh = hp->n_head, nkv = hp->n_head_kv;
    int qw = nh * 2 * hd, kvw = nkv * hd;
    int rc;
    size_t mark = ar->used;
    float *buf = le_arena_take(ar, own_floats(hp, n) * sizeof(float));
    if (!buf) return LE_FAIL(LE_ERR_NO_MEMORY, "attention scratch for %d tokens: beyond the plan", n);
    float *qg = buf, *o = qg + (size_t)n * qw;
    float *kn = kc + (size_t)pos * kvw, *vn = vc + (size_t)pos * kvw; /* this batch's cache rows */
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
    /* each thread's scores for pos + n keys (the plan holds n_ctx) */
    size_t core = ar->used;
    attn_job jb = {m, qg, kc, vc, o, NULL, score_floats(pos + n), n, pos};
    size_t bytes = (size_t)le_pool_threads(m->pool) * (size_t)jb.score_floats * sizeof(float);
    if (!(jb.scores = le_arena_take(ar, bytes))) {
        rc = LE_FAIL(LE_ERR_NO_MEMORY, "attention scores of %d keys: beyond the plan", pos + n);
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
