/* model.c — the Qwen3.5/3.6 model: weights, and the forward pass through the layers.
 *
 *   x = token_embd[tokens]                                       [n, E]
 *   per layer:  x += Mixer(RMSNorm(x) * attn_norm)               GDN or gated attention
 *               x += FFN(RMSNorm(x) * post_attention_norm)       dense SwiGLU or MoE
 *   logits = W_out (RMSNorm(x) * output_norm)                    W_out = token_embd when tied
 * GGUF norm weights already hold (1 + w).
 *
 * A pass runs the rows of one or several sequences (le_forward: one; le_forward_seqs: several, each in its own state,
 * rows concatenated: le_seqs), one layer loop for both. Each weight row is read once for all rows of the pass, and
 * a sequence's results are bit for bit those of its tokens run alone, because nothing mixes rows but the mixers,
 * which keep sequences apart:
 *   - RMSNorm, residuals, RoPE: per row.  Matmuls (matmul.c): each activation row is quantised on its own, each
 *     output element is one vec_dot (or f32 dot) of one weight row and one activation row, whatever the other rows.
 *   - MoE (moe.c): routing per token; a token's output sums its own experts in ascending expert order.
 *   - GDN (gdn.c): conv and recurrence per (sequence, channel group / v-head) in the sequence's conv and SSM state;
 *     the chunked form counts its 64-token chunks from the sequence's first row, as a pass of that sequence does.
 *   - attention (attention.c): a row's keys are its own sequence's cache, positions 0 .. its own.
 * Test: tests/test_model.py, tests/test_batch_decode.py (batched vs alone, bit for bit, every path and tier). */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "le_internal.h"
#include "le_ops.h"
#include "le_schema.h"

/* A slot's name in messages: its standard GGUF tensor (schema.c). */
static const char *slot_name(int slot) { return le_schema_slot(slot)->name; }

int le_model_create(const le_hparams *hp, int n_threads, le_model **out) {
    *out = NULL;
    if (hp->n_layer < 1 || hp->n_layer > 512) return LE_FAIL(LE_ERR_INVALID_ARG, "n_layer = %d, expected 1..512", hp->n_layer);
    if (hp->n_embd < 1 || hp->n_vocab < 1 || hp->n_head < 1 || hp->n_head_kv < 1 || hp->n_head % hp->n_head_kv ||
        hp->head_dim < 1 || hp->n_rot < 0 || hp->n_rot > hp->head_dim || hp->n_rot % 2 || hp->ssm_conv_kernel < 1 ||
        hp->ssm_d_state < 1 || hp->ssm_n_group < 1 || hp->ssm_dt_rank % hp->ssm_n_group ||
        hp->ssm_d_inner != hp->ssm_dt_rank * hp->ssm_d_state || hp->n_expert_used > hp->n_expert ||
        (hp->n_expert == 0 && hp->n_ff < 1) || (hp->n_expert > 0 && (hp->n_expert_used < 1 || hp->n_ff_exp < 1)))
        return LE_FAIL(LE_ERR_INVALID_ARG, "inconsistent hyperparameters");
    if (hp->ssm_conv_kernel > LE_GDN_MAX_CONV_K)
        return LE_FAIL(LE_ERR_UNSUPPORTED, "GDN conv kernel of %d taps > %d", hp->ssm_conv_kernel, LE_GDN_MAX_CONV_K);
    le_model *m = calloc(1, sizeof *m);
    if (!m) return LE_FAIL(LE_ERR_NO_MEMORY, "model");
    m->hp = *hp;
    m->int8 = 1;
    m->layer = calloc((size_t)hp->n_layer, sizeof *m->layer);
    m->state_index = calloc((size_t)hp->n_layer, sizeof(int));
    m->prof = calloc(LE_PROF_COUNT, sizeof(double));
    if (!m->layer || !m->state_index || !m->prof) {
        le_model_free(m);
        return LE_FAIL(LE_ERR_NO_MEMORY, "model layers");
    }
    for (int i = 0; i < hp->n_layer; i++) m->state_index[i] = hp->recurrent[i] ? m->n_gdn++ : m->n_attn++;
    int rc = le_pool_create(n_threads, &m->pool);
    if (rc) {
        le_model_free(m);
        return rc;
    }
    *out = m;
    return LE_OK;
}

void le_model_free(le_model *m) {
    if (!m) return;
    le_pool_free(m->pool);
    le_arena_free(&m->scratch);
    le_arena_free(&m->batch);
    free(m->layer);
    free(m->state_index);
    free(m->prof);
    free(m);
}

double le_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int le_model_set_profile(le_model *m, int on) {
    if (!m) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL model");
    m->profile = on != 0;
    if (on) memset(m->prof, 0, LE_PROF_COUNT * sizeof(double));
    return LE_OK;
}

int le_model_profile(const le_model *m, double *seconds, int n) {
    if (!m || !seconds) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL model or output");
    for (int i = 0; i < n && i < LE_PROF_COUNT; i++) seconds[i] = m->prof[i];
    return LE_PROF_COUNT;
}

int le_model_pin_threads(le_model *m, const int *cpus, int n_cpus) {
    if (!m) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL model");
    return le_pool_pin(m->pool, cpus, n_cpus);
}

int le_model_pinned_cpu(const le_model *m, int thread) { return m ? le_pool_pinned_cpu(m->pool, thread) : -1; }

int le_model_set_weight(le_model *m, int layer, int slot, const void *data, int type, int64_t ne0, int64_t ne1,
                        int64_t ne2, int64_t nb2) {
    if (!m || !data) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL model or data");
    if (layer < -1 || layer >= m->hp.n_layer) return LE_FAIL(LE_ERR_INVALID_ARG, "layer %d out of range", layer);
    if (slot < 0 || slot >= LE_W_COUNT) return LE_FAIL(LE_ERR_INVALID_ARG, "weight slot %d out of range", slot);
    int64_t want[3];
    if (!le_schema_slot_shape(&m->hp, layer, slot, want))
        return LE_FAIL(LE_ERR_INVALID_ARG, "layer %d does not use weight %s", layer, slot_name(slot));
    if (ne0 != want[0] || ne1 != want[1] || ne2 != want[2])
        return LE_FAIL(LE_ERR_FORMAT, "layer %d %s: ne = [%lld, %lld, %lld], expected [%lld, %lld, %lld]", layer,
                       slot_name(slot), (long long)ne0, (long long)ne1, (long long)ne2, (long long)want[0],
                       (long long)want[1], (long long)want[2]);
    const le_type_traits_t *tr = le_get_type_traits(type);
    if (!tr || !tr->dequantize_row)
        return LE_FAIL(LE_ERR_UNSUPPORTED, "layer %d %s: ggml type %d has no kernel in this engine", layer,
                       slot_name(slot), type);
    if ((le_schema_slot(slot)->flags & LE_T_F32) && type != LE_TYPE_F32)
        return LE_FAIL(LE_ERR_UNSUPPORTED, "layer %d %s: must be F32 (found %s); llama.cpp's converter writes it as F32",
                       layer, slot_name(slot), tr->name);
    if (ne0 % tr->block_size)
        return LE_FAIL(LE_ERR_FORMAT, "layer %d %s: row of %lld is not a multiple of %s's block %d", layer,
                       slot_name(slot), (long long)ne0, tr->name, tr->block_size);
    le_weight *w = layer < 0 ? &m->global[slot] : &m->layer[layer][slot];
    w->data = data;
    w->tr = tr;
    w->type = type;
    w->ne0 = ne0;
    w->ne1 = ne1;
    w->ne2 = ne2;
    w->nb1 = ne0 / tr->block_size * tr->type_size;
    w->nb2 = nb2 ? nb2 : w->nb1 * ne1;
    return LE_OK;
}

int le_model_set_int8(le_model *m, int on) {
    if (!m) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL model");
    m->int8 = on != 0;
    return LE_OK;
}

int le_model_finalize(le_model *m) {
    int64_t ne[3];
    for (int s = 0; s < LE_W_ATTN_NORM; s++)
        if (!(le_schema_slot(s)->flags & LE_T_OPTIONAL) && !m->global[s].data)
            return LE_FAIL(LE_ERR_FORMAT, "weight %s is not set", slot_name(s));
    for (int l = 0; l < m->hp.n_layer; l++)
        for (int s = LE_W_ATTN_NORM; s < LE_W_COUNT; s++)
            if (le_schema_slot_shape(&m->hp, l, s, ne) && !m->layer[l][s].data)
                return LE_FAIL(LE_ERR_FORMAT, "layer %d: weight %s is not set", l, slot_name(s));
    return LE_OK;
}

/* Ints of a pass's row tables: rope_pos [n][3], then row0 [n_seq + 1] (n_seq <= n). */
static size_t rows_ints(int n) { return 4 * (size_t)n + 1; }

size_t le_forward_plan(const le_model *m, int n, int n_ctx) {
    const le_hparams *hp = &m->hp;
    /* the LM head's batch (all_logits or not: the larger, so a pass's need does not depend on it) */
    static const float h_id;
    const le_weight *head = m->global[LE_W_OUTPUT].data ? &m->global[LE_W_OUTPUT] : &m->global[LE_W_TOKEN_EMBD];
    le_mm mm = {head, 0, &h_id, n, hp->n_embd, NULL, hp->n_vocab, NULL};
    size_t most = le_matmul_batch_plan(le_pool_threads(m->pool), m->int8, &mm, 1);
    for (int l = 0; l < hp->n_layer; l++) {
        const le_weight *w = m->layer[l];
        size_t mixer = hp->recurrent[l] ? le_gdn_plan(m, w, n) : le_attention_plan(m, w, n, n_ctx);
        size_t ffn = le_ffn_plan(m, w, n);
        if (mixer > most) most = mixer;
        if (ffn > most) most = ffn;
    }
    return le_align64(3 * (size_t)n * hp->n_embd * sizeof(float)) + le_align64(rows_ints(n) * sizeof(int32_t)) + most;
}

/* The rows of a pass: token embeddings, or the caller's rows where tokens[t] < 0 (an image's merged patches). */
static int embed_rows(const le_model *m, const int32_t *tokens, const float *embd, int n, float *x) {
    const le_hparams *hp = &m->hp;
    int E = hp->n_embd;
    for (int t = 0; t < n; t++) {
        if (tokens[t] >= hp->n_vocab || (tokens[t] < 0 && !embd))
            return LE_FAIL(LE_ERR_INVALID_ARG, "token %d at index %d is outside the vocabulary [0, %d)", tokens[t], t,
                           hp->n_vocab);
        if (tokens[t] >= 0)
            le_weight_row(&m->global[LE_W_TOKEN_EMBD], tokens[t], x + (size_t)t * E);
        else
            memcpy(x + (size_t)t * E, embd + (size_t)t * E, (size_t)E * sizeof(float));
    }
    return LE_OK;
}

/* rope_pos [n][3] of a pass: pos3's (one sequence), or text positions: row i of sequence s at its sequence position
 * pos + i + its rope_delta in every component. */
static int rope_positions(const le_seqs *sq, const int32_t *pos3, int32_t *out) {
    int n = sq->row0[sq->n_seq];
    for (int i = 0; pos3 && i < 3 * n; i++)
        if (pos3[i] < 0) return LE_FAIL(LE_ERR_INVALID_ARG, "rope position %d of row %d is negative", pos3[i], i / 3);
    for (int s = 0; s < sq->n_seq; s++) {
        const le_state *st = sq->st[s];
        for (int t = sq->row0[s]; t < sq->row0[s + 1]; t++)
            for (int c = 0; c < 3; c++)
                out[3 * t + c] = pos3 ? pos3[3 * t + c] : st->pos + (t - sq->row0[s]) + st->rope_delta;
    }
    return LE_OK;
}

int le_model_set_yield(le_model *m, volatile int32_t *flag, void (*hook)(void *ctx), void *ctx) {
    if (!m) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL model");
    if (flag && !hook) return LE_FAIL(LE_ERR_INVALID_ARG, "a yield flag without a hook");
    if (m->in_yield) return LE_FAIL(LE_ERR_INVALID_ARG, "le_model_set_yield from inside the yield hook");
    m->yield_flag = flag;
    m->yield_hook = hook;
    m->yield_ctx = ctx;
    return LE_OK;
}

int64_t le_model_yields(const le_model *m) { return m ? m->yields : 0; }

#define NO_YIELD (~0u) /* forward_layers' yield_fp: this pass does not yield (a batched one: its arena is the hook's) */

/* Between two layers: the yield hook, when its flag is up, with the caller's float mode (the hook runs Python). */
static void maybe_yield(le_model *m, unsigned yield_fp) {
    if (yield_fp == NO_YIELD || !m->yield_flag || !*m->yield_flag || m->in_yield) return;
    unsigned inside = le_fp_enter();
    le_fp_leave(yield_fp);
    m->in_yield = 1;
    m->yields++;
    m->yield_hook(m->yield_ctx);
    m->in_yield = 0;
    le_fp_leave(inside);
}

/* Rows [t0, t1) of a pass: x += y (y NULL: no add), then h = RMSNorm(x) * w (h NULL: none); a job over the rows
 * (le_parallel_rows: on the calling thread alone they were 7 % of a 0.8B pass at 16 threads). */
typedef struct {
    float *x;
    const float *y, *w;
    float *h;
    int E;
    float eps;
} norm_job;

static void norm_rows(void *ctx, int64_t t0, int64_t t1, int thread) {
    const norm_job *j = ctx;
    for (int64_t t = t0; t < t1; t++) {
        float *xt = j->x + t * j->E;
        if (j->y)
            for (int i = 0; i < j->E; i++) xt[i] += j->y[t * j->E + i];
        if (j->h) le_rmsnorm(xt, j->w, j->E, j->eps, j->h + t * j->E);
    }
}

static void add_norm(const le_model *m, float *x, const float *y, const le_weight *w, float *h, int n) {
    norm_job j = {x, y, w ? (const float *)w->data : NULL, h, m->hp.n_embd, m->hp.rms_eps};
    le_parallel_rows(m->pool, n, norm_rows, &j);
}

/* One pass of n rows over n_seq sequences (checked by the caller): sequence s's n_tok[s] tokens are the next rows of
 * tokens, run in states[s] (pos3, embd: one sequence only), in scratch ar reserved by le_forward_plan(n, its
 * largest n_ctx). Every op but the mixers is per row; the mixers run each sequence in its own state. logits: NULL,
 * or [n_out, n_vocab]: every row's (all_logits, one sequence) or each sequence's last row's. */
static int forward_layers(le_model *m, le_arena *ar, le_state *const *states, int n_seq, const int32_t *n_tok, int n,
                          const int32_t *tokens, const float *embd, const int32_t *pos3, float *logits,
                          int all_logits, int chunked, unsigned yield_fp) {
    const le_hparams *hp = &m->hp;
    int E = hp->n_embd, rc;
    float *buf = le_arena_take(ar, 3 * (size_t)n * E * sizeof(float));
    if (!buf) return LE_FAIL(LE_ERR_NO_MEMORY, "activations for %d tokens: beyond the plan", n);
    float *x = buf, *h = x + (size_t)n * E, *y = h + (size_t)n * E;
    int32_t *rope_pos = le_arena_take(ar, rows_ints(n) * sizeof(int32_t));
    if (!rope_pos) return LE_FAIL(LE_ERR_NO_MEMORY, "positions for %d tokens: beyond the plan", n);
    int *row0 = rope_pos + 3 * (size_t)n; /* [n_seq + 1] */
    row0[0] = 0;
    for (int s = 0; s < n_seq; s++) row0[s + 1] = row0[s] + n_tok[s];
    le_seqs seqs = {n_seq, states, row0}, *sq = &seqs;
    double tp = le_prof_start(m);
    if ((rc = embed_rows(m, tokens, embd, n, x)) || (rc = rope_positions(sq, pos3, rope_pos))) return rc;

    /* the last layer's FFN runs on the rows the head reads only (none without logits; each sequence's last row, or
     * every row with all_logits): the residual stream's other rows end at its mixer */
    const int n_out = !logits ? 0 : all_logits ? n : sq->n_seq;
    for (int l = 0; l < hp->n_layer && !rc; l++) {
        const le_weight *w = m->layer[l];
        add_norm(m, x, NULL, &w[LE_W_ATTN_NORM], h, n);
        le_prof(m, &tp, LE_PROF_EMBED_NORM);
        if (hp->recurrent[l])
            rc = le_gdn_layer(m, ar, w, h, sq, m->state_index[l], chunked, y);
        else
            rc = le_attention_layer(m, ar, w, h, sq, m->state_index[l], rope_pos, y);
        if (rc) break;
        tp = le_prof_start(m);
        int rows = n;
        if (l + 1 == hp->n_layer && n_out < n) { /* those rows of x and y first, in order (row t_i >= i) */
            for (int i = 0; i < n_out; i++) {
                const int t = row0[i + 1] - 1;
                memmove(x + (size_t)i * E, x + (size_t)t * E, (size_t)E * sizeof(float));
                memmove(y + (size_t)i * E, y + (size_t)t * E, (size_t)E * sizeof(float));
            }
            rows = n_out;
        }
        if (!rows) break;
        add_norm(m, x, y, &w[LE_W_POST_NORM], h, rows);
        le_prof(m, &tp, LE_PROF_EMBED_NORM);
        if ((rc = le_ffn_layer(m, ar, w, h, rows, y))) break;
        tp = le_prof_start(m);
        add_norm(m, x, y, NULL, NULL, rows);
        if (l + 1 < hp->n_layer) {
            maybe_yield(m, yield_fp);
            tp = le_prof_start(m);
        }
    }
    if (rc) return rc;
    for (int s = 0; s < sq->n_seq; s++) sq->st[s]->pos += row0[s + 1] - row0[s];
    if (pos3) { /* one sequence: the next text position is one past the largest used (transformers' get_rope_index) */
        int32_t most = INT32_MIN;
        for (int i = 0; i < 3 * n; i++) most = pos3[i] > most ? pos3[i] : most;
        sq->st[0]->rope_delta = most + 1 - sq->st[0]->pos;
    }
    if (!logits) return LE_OK;
    /* the head's rows (every row, or each sequence's last: rows 0 … n_out - 1 of x since the last layer), normed */
    for (int i = 0; i < n_out; i++)
        le_rmsnorm(x + (size_t)i * E, (const float *)m->global[LE_W_OUTPUT_NORM].data, E, hp->rms_eps,
                   h + (size_t)i * E);
    const le_weight *head = m->global[LE_W_OUTPUT].data ? &m->global[LE_W_OUTPUT] : &m->global[LE_W_TOKEN_EMBD];
    le_prof(m, &tp, LE_PROF_EMBED_NORM);
    rc = le_matmul(m->pool, ar, m->int8, head, 0, h, n_out, E, logits, hp->n_vocab);
    le_prof(m, &tp, LE_PROF_HEAD);
    return rc;
}

/* forward_layers with denormals flushed on the calling thread too (le_threads.h), its mode put back after;
 * may_yield: a single-sequence pass in its state's scratch (le_model_set_yield) */
static int forward_pass(le_model *m, le_arena *ar, le_state *const *states, int n_seq, const int32_t *n_tok, int n,
                        const int32_t *tokens, const float *embd, const int32_t *pos3, float *logits, int all_logits,
                        int chunked, int may_yield) {
    unsigned fp = le_fp_enter();
    int rc = forward_layers(m, ar, states, n_seq, n_tok, n, tokens, embd, pos3, logits, all_logits, chunked,
                            may_yield ? fp : NO_YIELD);
    le_fp_leave(fp);
    return rc;
}

int le_forward(le_model *m, le_state *s, const int32_t *tokens, int n, float *logits, int all_logits, int chunked) {
    return le_forward_embd(m, s, tokens, NULL, NULL, n, logits, all_logits, chunked);
}

int le_forward_embd(le_model *m, le_state *s, const int32_t *tokens, const float *embd, const int32_t *pos3, int n,
                    float *logits, int all_logits, int chunked) {
    if (!m || !s) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL model or state");
    if (!tokens || n < 1) return LE_FAIL(LE_ERR_INVALID_ARG, "no tokens");
    if (s->m != m) return LE_FAIL(LE_ERR_INVALID_ARG, "state belongs to another model");
    if (s->pos + n > s->n_ctx)
        return LE_FAIL(LE_ERR_INVALID_ARG, "%d tokens at position %d exceed the context of %d", n, s->pos, s->n_ctx);
    /* the scratch of the whole pass, planned here: the state's arena grows only for a longer pass than before
     * (or another int8 setting), never inside the layers */
    le_arena *ar = &s->scratch;
    int rc = le_arena_reserve(ar, le_forward_plan(m, n, s->n_ctx), "the forward pass");
    if (rc) return rc;
    ar->used = 0;
    int32_t n_tok = n;
    rc = forward_pass(m, ar, &s, 1, &n_tok, n, tokens, embd, pos3, logits, all_logits, chunked, 1);
    ar->used = 0;
    return rc;
}

int64_t le_model_batch_growths(const le_model *m) { return m ? m->batch.growths : 0; }

int le_forward_seqs(le_model *m, le_state *const *states, int n_seq, const int32_t *tokens, const int32_t *n_tok,
                    float *logits, int chunked) {
    if (!m || !states || !tokens || !n_tok) return LE_FAIL(LE_ERR_INVALID_ARG, "le_forward_seqs: a NULL argument");
    if (n_seq < 1) return LE_FAIL(LE_ERR_INVALID_ARG, "le_forward_seqs: %d sequences, expected >= 1", n_seq);
    /* every check before anything runs: on an error no state advances */
    int64_t total = 0;
    int n_ctx = 1;
    for (int s = 0; s < n_seq; s++) {
        const le_state *st = states[s];
        if (!st) return LE_FAIL(LE_ERR_INVALID_ARG, "sequence %d: NULL state", s);
        if (st->m != m) return LE_FAIL(LE_ERR_INVALID_ARG, "sequence %d: its state belongs to another model", s);
        for (int r = 0; r < s; r++)
            if (states[r] == st)
                return LE_FAIL(LE_ERR_INVALID_ARG, "sequences %d and %d share one state (each needs its own)", r, s);
        if (n_tok[s] < 1) return LE_FAIL(LE_ERR_INVALID_ARG, "sequence %d: %d tokens, expected >= 1", s, n_tok[s]);
        if (n_tok[s] > st->n_ctx - st->pos)
            return LE_FAIL(LE_ERR_INVALID_ARG, "sequence %d: %d tokens at position %d exceed its context of %d", s,
                           n_tok[s], st->pos, st->n_ctx);
        total += n_tok[s];
        if (st->n_ctx > n_ctx) n_ctx = st->n_ctx;
    }
    if (total > INT32_MAX / 4) /* rows index ints (rows_ints: 4 per row) */
        return LE_FAIL(LE_ERR_INVALID_ARG, "le_forward_seqs: %lld tokens in one pass", (long long)total);
    int n = (int)total;
    for (int t = 0; t < n; t++)
        if (tokens[t] < 0 || tokens[t] >= m->hp.n_vocab)
            return LE_FAIL(LE_ERR_INVALID_ARG, "token %d at index %d is outside the vocabulary [0, %d)", tokens[t], t,
                           m->hp.n_vocab);
    /* the model's arena: the states' own belong to their single-sequence passes */
    le_arena *ar = &m->batch;
    int rc = le_arena_reserve(ar, le_forward_plan(m, n, n_ctx), "the batched forward pass");
    if (rc) return rc;
    ar->used = 0;
    rc = forward_pass(m, ar, states, n_seq, n_tok, n, tokens, NULL, NULL, logits, 0, chunked, 0);
    ar->used = 0;
    return rc;
}
