/* moe.c — the feed-forward of a layer: dense SwiGLU, or the MoE block (spec §2.5).
 *
 *   dense:  out = W_down (SiLU(W_gate x) * W_up x)
 *   MoE:    p = softmax(W_router x) over all experts (f32); top-k; w = p_topk / sum p_topk
 *           out = sum_e w_e down_e(SiLU(gate_e x) * up_e x)
 *               + sigmoid(w_shexp_gate . x) * down_s(SiLU(gate_s x) * up_s x)
 * The batch's tokens are grouped by expert so each expert's weights are read once. A MoE
 * layer is three parallel jobs, whatever the batch:
 *   A  router logits + the shared expert's gate/up pair (it does not depend on the routing)
 *   B  gate/up pairs of every expert the batch routes to (SiLU(g) * u written directly)
 *   C  down + combine: each task owns a range of output rows and, for those rows, runs the
 *      down matrices of every used expert and of the shared expert over their tokens and
 *      accumulates the weighted sums straight into `out` (no per-expert output buffers,
 *      no serial combine; every element sums its experts in ascending order, then the
 *      shared expert, whatever the thread split).
 * Ties in top-k go to the lower expert index. le_moe_routed runs B and C alone for one token and
 * experts chosen elsewhere (the hybrid decode: the GPU routes, the CPU runs the unpinned experts), split statically:
 * each thread computes the same rows of every expert (le_split), the rows the lookahead prefetched into its caches
 * (native/hybrid.c); the sums are the same bits either way.
 * Scratch: the caller's arena (le_forward: the state's; le_moe_routed: the model's), given back on return;
 * le_ffn_plan / le_moe_routed_plan count it, the routed part for the worst routing of n tokens.
 * Test: tests/test_model.py, tests/test_quantized.py (test_moe_routed_*). */
#include <limits.h>
#include <math.h>
#include <string.h>

#include "le_internal.h"
#include "le_ops.h"

/* Minimum of the top-k weight sum before renormalising (llama.cpp clamps the same way). */
#define MOE_WSUM_MIN 6.103515625e-5f

static size_t max2(size_t a, size_t b) { return a > b ? a : b; }

/* The plan's stand-ins for distinct inputs (only their addresses are compared). */
static const float x_id[2];

/* dense scratch: act [n, ff], then the gate/up pair's batch or the down product's */
static size_t dense_plan(const le_model *m, const le_weight *w, int n) {
    int T = le_pool_threads(m->pool), E = m->hp.n_embd;
    int64_t ff = m->hp.n_ff;
    le_mm gu = {&w[LE_W_FFN_GATE], 0, x_id, n, E, NULL, ff, &w[LE_W_FFN_UP]};
    le_mm down = {&w[LE_W_FFN_DOWN], 0, x_id + 1, n, ff, NULL, E, NULL};
    return le_align64((size_t)n * ff * sizeof(float)) +
           max2(le_matmul_batch_plan(T, m->int8, &gu, 1), le_matmul_batch_plan(T, m->int8, &down, 1));
}

static int dense(const le_model *m, le_arena *ar, const le_weight *w, const float *x, int n, float *out) {
    int E = m->hp.n_embd;
    int64_t ff = m->hp.n_ff;
    size_t mark = ar->used;
    float *act = le_arena_take(ar, (size_t)n * ff * sizeof(float));
    if (!act) return LE_FAIL(LE_ERR_NO_MEMORY, "ffn scratch for %d tokens: beyond the plan", n);
    double tp = le_prof_start(m);
    le_mm gu = {&w[LE_W_FFN_GATE], 0, x, n, E, act, ff, &w[LE_W_FFN_UP]};
    int rc = le_matmul_batch(m->pool, ar, m->int8, &gu, 1);
    le_prof(m, &tp, LE_PROF_FFN_GATE_UP);
    if (!rc) {
        rc = le_matmul(m->pool, ar, m->int8, &w[LE_W_FFN_DOWN], 0, act, n, ff, out, E);
        le_prof(m, &tp, LE_PROF_FFN_DOWN);
    }
    ar->used = mark;
    return rc;
}

/* Job C. Activation rows: [0, nk) routed (expert e owns [start[e], start[e] + count[e])), then
 * [nk, nk + n) the shared expert's, one per token. */
typedef struct {
    const le_weight *wd, *wds;       /* routed down [ff_exp -> E] x n_expert, shared down (or NULL) */
    const int *used, *start, *count; /* used experts in ascending order, their row ranges */
    int n_used, n, nk, E;
    const int *tok_of;               /* [nk] token of each routed row */
    const float *wrow;               /* [nk] routing weight of each routed row */
    const float *sgate;              /* [n] shared-expert gate */
    /* integer path: activations quantised (row bytes rb, rbs); f32 path: act rows (ff, ffs floats) */
    le_vec_dot_fn vd, vds;
    le_vec_dot_n_fn vdn, vdns;       /* their several-row kernels, or NULL */
    const uint8_t *aq, *aqs;
    int64_t rb, rbs;
    const float *act, *acts;
    float *out;                      /* [n, E] */
    float *rows;                     /* f32 path: [n_threads][row_floats] each thread's dequantised row */
    int64_t row_floats;
    int n_threads;                   /* down_split: the pool's */
} down_job;

/* Tokens of one expert a down row is dotted with at a time (the several-row kernels take them 4 by 4) */
#define DOWN_TILE 16

/* Passes of at most this many tokens (decode steps, batched up to 16 sequences) run the down as down_batch, longer
 * ones (prefill) as down_rows: the same bits either way; measured on the GPU machine's Xeon, 16 threads, same host
 * (benchmarks/results/denormals_2026-11-28.md): down_batch decodes 5-14 % faster (each expert's rows one stream),
 * down_rows prefills 9-11 % faster (no [nk, E] products written and read back). */
#define DOWN_BATCH_TOKENS 16

/* Floats of one thread's dequantised down row (at most ne0 wide). */
static int64_t down_row_floats(int64_t ne0) { return le_floats64(ne0); }

static void down_rows(void *ctx, int64_t r0, int64_t r1, int thread) {
    down_job *j = ctx;
    const le_weight *wd = j->wd, *wds = j->wds;
    le_dot_f32_fn dot = le_get_f32_kernels()->dot;
    float *buf = j->rows ? j->rows + (int64_t)thread * j->row_floats : NULL; /* a dequantised row for the f32 path */
    for (int t = 0; t < j->n; t++) memset(j->out + (size_t)t * j->E + r0, 0, (size_t)(r1 - r0) * sizeof(float));
    for (int u = 0; u < j->n_used; u++) {
        int e = j->used[u];
        const uint8_t *base = wd->data + (int64_t)e * wd->nb2;
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *row = base + r * wd->nb1;
            const float *rf = (const float *)row;
            if (!j->vd && wd->type != LE_TYPE_F32) {
                wd->tr->dequantize_row(row, buf, wd->ne0);
                rf = buf;
            }
            for (int i0 = j->start[e], end = i0 + j->count[e]; i0 < end; i0 += DOWN_TILE) {
                int nt = end - i0 < DOWN_TILE ? end - i0 : DOWN_TILE;
                float s[DOWN_TILE];
                if (j->vd) le_vec_dot_rows(j->vd, j->vdn, wd->ne0, s, 1, row, j->aq + (int64_t)i0 * j->rb, j->rb, nt);
                else
                    for (int i = 0; i < nt; i++) s[i] = dot(rf, j->act + (int64_t)(i0 + i) * wd->ne0, wd->ne0);
                for (int i = 0; i < nt; i++) j->out[(size_t)j->tok_of[i0 + i] * j->E + r] += j->wrow[i0 + i] * s[i];
            }
        }
    }
    if (wds)
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *row = wds->data + r * wds->nb1;
            const float *rf = (const float *)row;
            if (!j->vds && wds->type != LE_TYPE_F32) {
                wds->tr->dequantize_row(row, buf, wds->ne0);
                rf = buf;
            }
            for (int t0 = 0; t0 < j->n; t0 += DOWN_TILE) {
                int nt = j->n - t0 < DOWN_TILE ? j->n - t0 : DOWN_TILE;
                float s[DOWN_TILE];
                if (j->vds)
                    le_vec_dot_rows(j->vds, j->vdns, wds->ne0, s, 1, row, j->aqs + (int64_t)t0 * j->rbs, j->rbs, nt);
                else
                    for (int t = 0; t < nt; t++) s[t] = dot(rf, j->acts + (int64_t)(t0 + t) * wds->ne0, wds->ne0);
                for (int t = 0; t < nt; t++) j->out[(size_t)(t0 + t) * j->E + r] += j->sgate[t0 + t] * s[t];
            }
        }
}

/* The routed experts (and, given acts/sgate, the shared expert's down) of n tokens with k selected
 * experts each: sel [n*k] expert ids (< 0: skipped, the hybrid decode's GPU-side experts), wsel [n*k]
 * their weights; acts [n, fs] SiLU(g)*u of the shared expert and sgate [n] its gate, or NULL (none);
 * out [n, E] is overwritten. Jobs B and C of the header. */
/* down_rows over each thread's share of the output rows (le_split): le_parallel_each's task */
static void down_split(void *ctx, int64_t t, int64_t t1, int thread) {
    (void)t1;
    down_job *j = ctx;
    int64_t r0, r1;
    le_split(j->E, (int)t, j->n_threads, &r0, &r1);
    if (r0 < r1) down_rows(ctx, r0, r1, thread);
}

/* Token-slots n * k of a batch; they index int arrays, so the product must fit an int. */
static int slots(int n, int k, int *nk) {
    if (n < 0 || k < 0 || (int64_t)n * k > INT_MAX)
        return LE_FAIL(LE_ERR_INVALID_ARG, "%d tokens x %d experts: more token-slots than an int holds", n, k);
    *nk = n * k;
    return LE_OK;
}

/* routed's own scratch: floats wrow [nk], xg [nk, E] (several tokens), act [nk, fe]; ints tok_of [nk], count,
 * start, used [ne]; the batch's products [ne + 1] */
static size_t routed_floats(const le_hparams *hp, int n, int64_t nk) {
    return (size_t)nk + (n > 1 ? (size_t)nk * hp->n_embd : 0) + (size_t)nk * hp->n_ff_exp;
}
static size_t routed_own(const le_hparams *hp, int n, int64_t nk) {
    return le_align64(routed_floats(hp, n, nk) * sizeof(float)) +
           le_align64(((size_t)nk + 3 * (size_t)hp->n_expert) * sizeof(int)) +
           le_align64(((size_t)hp->n_expert + 1) * sizeof(le_mm));
}

/* routed's scratch for the worst routing of n tokens x k experts (shared: with the shared expert's down):
 * its own, then the larger of job B's batch (at most min(n_expert, nk) experts, each expert's quantised rows
 * rounded up to 64 bytes) and job C's quantised inputs and dequantised rows. */
static size_t routed_plan(const le_model *m, const le_weight *w, int n, int k, int shared) {
    const le_hparams *hp = &m->hp;
    int T = le_pool_threads(m->pool), ne = hp->n_expert;
    int64_t nk = (int64_t)n * k, n_mm = nk < ne ? nk : ne;
    const le_weight *g = &w[LE_W_GATE_EXPS], *u = &w[LE_W_UP_EXPS], *wd = &w[LE_W_DOWN_EXPS],
                    *wds = shared ? &w[LE_W_DOWN_SHEXP] : NULL;
    /* B: every product is a gate/up pair of the same two tensors, so all take one path (matmul.c's rule) */
    int b_int = le_int_kernel(m->int8, g) && le_int_kernel(m->int8, u) && u->tr->vec_dot_type == g->tr->vec_dot_type;
    size_t b_q = b_int ? (size_t)le_act_row_bytes(g) * (size_t)nk + (size_t)LE_ARENA_ALIGN * (size_t)n_mm : 0;
    size_t b = le_matmul_scratch(T, (int)n_mm, b_q, b_int ? 0 : g->ne0);
    /* C: the routed rows (at most nk) and the shared expert's n quantised, or a row per thread */
    int c_int = le_int_kernel(m->int8, wd) != NULL, cs_int = wds && le_int_kernel(m->int8, wds);
    size_t c = (c_int ? le_align64((size_t)le_act_row_bytes(wd) * (size_t)nk) : 0) +
               (cs_int ? le_align64((size_t)le_act_row_bytes(wds) * (size_t)n) : 0);
    if (!c_int || (wds && !cs_int)) {
        int64_t ne0 = wds && wds->ne0 > wd->ne0 ? wds->ne0 : wd->ne0;
        c += (size_t)T * (size_t)down_row_floats(ne0) * sizeof(float);
    }
    /* or down_batch's: the products' rows [nk (+ n), E], then its batch (each expert's input aligned apart) */
    int64_t f32_ne0 = !c_int ? wd->ne0 : 0;
    if (wds && !cs_int && wds->ne0 > f32_ne0) f32_ne0 = wds->ne0;
    size_t d_q = (c_int ? (size_t)le_act_row_bytes(wd) * (size_t)nk + (size_t)LE_ARENA_ALIGN * (size_t)n_mm : 0) +
                 (cs_int ? (size_t)le_act_row_bytes(wds) * (size_t)n + LE_ARENA_ALIGN : 0);
    size_t d_rows = le_align64(((size_t)nk + (wds ? (size_t)n : 0)) * (size_t)hp->n_embd * sizeof(float));
    size_t d = n > DOWN_BATCH_TOKENS ? 0 : d_rows + le_matmul_scratch(T, (int)n_mm + 1, d_q, f32_ne0);
    return routed_own(hp, n, nk) + max2(b, max2(c, d));
}

/* The combine of the down products: out[t, r] = sum over t's experts in ascending id of wrow[i] dn[i, r], then
 * + sgate[t] ds[t, r] (the shared expert): per element the order down_rows adds in, so the same bits. Items: rows r. */
typedef struct {
    const int *used, *start, *count, *tok_of;
    int n_used, n, E;
    const float *wrow, *dn, *sgate, *ds; /* dn [nk, E] the routed rows' products, ds [n, E] the shared's or NULL */
    float *out;                          /* [n, E] */
} combine_job;

static void combine_rows(void *ctx, int64_t r0, int64_t r1, int thread) {
    (void)thread;
    const combine_job *c = ctx;
    int64_t E = c->E, w = r1 - r0;
    for (int t = 0; t < c->n; t++) memset(c->out + t * E + r0, 0, (size_t)w * sizeof(float));
    for (int u = 0; u < c->n_used; u++) {
        int e = c->used[u];
        for (int i = c->start[e]; i < c->start[e] + c->count[e]; i++) {
            float *o = c->out + (int64_t)c->tok_of[i] * E + r0;
            const float *d = c->dn + (int64_t)i * E + r0, wi = c->wrow[i];
            for (int64_t r = 0; r < w; r++) o[r] += wi * d[r];
        }
    }
    if (c->ds)
        for (int t = 0; t < c->n; t++) {
            float *o = c->out + t * E + r0;
            const float *d = c->ds + t * E + r0, g = c->sgate[t];
            for (int64_t r = 0; r < w; r++) o[r] += g * d[r];
        }
}

/* Job C as one batch of products (the CPU engine's decode pass): every used expert's down on its rows of act, and
 * the shared expert's on acts, into rows of their own (le_matmul_batch: each expert's 2,048 rows read as one stream,
 * where down_rows reads 17 rows of each of them a task), then the combine. mm: room for n_used + 1 products. */
static int down_batch(const le_model *m, le_arena *ar, const le_weight *w, int n, int rows, const down_job *dj,
                      le_mm *mm) {
    const le_hparams *hp = &m->hp;
    int E = hp->n_embd, T = le_pool_threads(m->pool), n_mm = 0, rc;
    size_t bytes = ((size_t)rows + (dj->wds ? (size_t)n : 0)) * (size_t)E * sizeof(float);
    float *dn = bytes ? le_arena_take(ar, bytes) : NULL;
    if (bytes && !dn) return LE_FAIL(LE_ERR_NO_MEMORY, "moe down rows for %d tokens: beyond the plan", n);
    float *ds = dj->wds ? dn + (size_t)rows * E : NULL;
    for (int u = 0; u < dj->n_used; u++) {
        int e = dj->used[u];
        mm[n_mm++] = (le_mm){&w[LE_W_DOWN_EXPS], e, dj->act + (size_t)dj->start[e] * hp->n_ff_exp, dj->count[e],
                             hp->n_ff_exp, dn + (size_t)dj->start[e] * E, E, NULL};
    }
    if (ds) mm[n_mm++] = (le_mm){&w[LE_W_DOWN_SHEXP], 0, dj->acts, n, hp->n_ff_shexp, ds, E, NULL};
    if (n_mm && (rc = le_matmul_batch(m->pool, ar, m->int8, mm, n_mm))) return rc;
    combine_job c = {dj->used, dj->start, dj->count, dj->tok_of, dj->n_used, n, E, dj->wrow, dn, dj->sgate, ds,
                     dj->out};
    le_parallel_for(m->pool, E, E / (4 * T) + 1, combine_rows, &c);
    return LE_OK;
}

/* xg row r = x row tok_of[r] */
typedef struct {
    const float *x;
    const int *tok_of;
    float *xg;
    int E;
} gather_job;

static void gather_rows(void *ctx, int64_t r0, int64_t r1, int thread) {
    (void)thread;
    const gather_job *j = ctx;
    for (int64_t r = r0; r < r1; r++)
        memcpy(j->xg + (size_t)r * j->E, j->x + (size_t)j->tok_of[r] * j->E, (size_t)j->E * sizeof(float));
}

static int routed(const le_model *m, le_arena *ar, const le_weight *w, const float *x, int n, int k, const int *sel,
                  const float *wsel, const float *acts, const float *sgate, float *out, int split) {
    const le_hparams *hp = &m->hp;
    int E = hp->n_embd, ne = hp->n_expert, shared = acts != NULL, T = le_pool_threads(m->pool);
    int64_t fe = hp->n_ff_exp, fs = hp->n_ff_shexp;
    int nk = 0, rc = slots(n, k, &nk);
    if (rc) return rc;
    size_t mark = ar->used;
    float *buf = le_arena_take(ar, routed_floats(hp, n, nk) * sizeof(float));
    int *ibuf = le_arena_take(ar, ((size_t)nk + 3 * (size_t)ne) * sizeof(int));
    le_mm *mm = le_arena_take(ar, ((size_t)ne + 1) * sizeof(le_mm));
    if (!buf || !ibuf || !mm) {
        rc = LE_FAIL(LE_ERR_NO_MEMORY, "moe scratch for %d tokens: beyond the plan", n);
        goto done;
    }
    float *wrow = buf, *xg = wrow + nk, *act = xg + (n > 1 ? (size_t)nk * E : 0);
    int *tok_of = ibuf, *count = tok_of + nk, *start = count + ne, *used = start + ne;
    double tp = le_prof_start(m);
    /* group token-slots by expert: expert e owns rows [start[e], start[e] + count[e]) of xg and act
     * (one token: every expert reads x itself, nothing is gathered) */
    memset(count, 0, (size_t)ne * sizeof(int));
    for (int ts = 0; ts < nk; ts++) {
        if (sel[ts] >= ne) {
            rc = LE_FAIL(LE_ERR_INVALID_ARG, "expert id %d outside [0, %d)", sel[ts], ne);
            goto done;
        }
        if (sel[ts] >= 0) count[sel[ts]]++;
    }
    int n_used = 0, rows = 0;
    for (int e = 0; e < ne; e++) {
        start[e] = rows;
        rows += count[e];
        if (count[e]) used[n_used++] = e;
        count[e] = 0;
    }
    for (int ts = 0; ts < nk; ts++) {
        int e = sel[ts];
        if (e < 0) continue;
        int r = start[e] + count[e]++;
        tok_of[r] = ts / k;
        wrow[r] = wsel[ts];
    }
    if (n > 1) { /* the rows gathered as pool jobs (a 35B pass: 8 x 2,048 floats a token, serial a layer before) */
        gather_job gj = {x, tok_of, xg, E};
        le_parallel_rows(m->pool, rows, gather_rows, &gj);
    }
    le_prof(m, &tp, LE_PROF_MOE_ROUTER);

    /* B: gate/up pairs of every used expert */
    int n_mm = 0;
    for (int u = 0; u < n_used; u++) {
        int e = used[u];
        mm[n_mm++] = (le_mm){&w[LE_W_GATE_EXPS], e, n > 1 ? xg + (size_t)start[e] * E : x, count[e], E,
                             act + (size_t)start[e] * fe, fe, &w[LE_W_UP_EXPS]};
    }
    if (n_mm && (rc = (split ? le_matmul_batch_split : le_matmul_batch)(m->pool, ar, m->int8, mm, n_mm))) goto done;
    le_prof(m, &tp, LE_PROF_FFN_GATE_UP);

    /* C: down + combine */
    down_job dj = {&w[LE_W_DOWN_EXPS], shared ? &w[LE_W_DOWN_SHEXP] : NULL, used, start, count, n_used, n, rows, E,
                   tok_of, wrow, sgate, NULL, NULL, NULL, NULL, NULL, NULL, 0, 0, act, acts, out, NULL, 0, T};
    if (!split && n <= DOWN_BATCH_TOKENS) { /* a decode step's pass: one batch of products, then the combine */
        rc = down_batch(m, ar, w, n, rows, &dj, mm);
        le_prof(m, &tp, LE_PROF_FFN_DOWN);
        goto done;
    }
    /* the down inputs quantised for their integer kernels (none: the f32 path) */
    uint8_t *aq = NULL, *aqs = NULL;
    if (rows && (dj.vd = le_int_kernel(m->int8, dj.wd))) {
        dj.rb = le_act_row_bytes(dj.wd);
        dj.vdn = le_get_vec_dot_n(dj.wd->type);
        if (!(aq = le_arena_take(ar, (size_t)(dj.rb * rows)))) goto short_plan;
        le_quantize_acts(m->pool, dj.wd, act, rows, fe, aq);
    }
    if (shared && (dj.vds = le_int_kernel(m->int8, dj.wds))) {
        dj.rbs = le_act_row_bytes(dj.wds);
        dj.vdns = le_get_vec_dot_n(dj.wds->type);
        if (!(aqs = le_arena_take(ar, (size_t)(dj.rbs * n)))) goto short_plan;
        le_quantize_acts(m->pool, dj.wds, acts, n, fs, aqs);
    }
    dj.aq = aq;
    dj.aqs = aqs;
    /* a dequantised row per thread where a down matrix runs on the f32 path */
    if ((rows && !dj.vd) || (shared && !dj.vds)) {
        int64_t ne0 = shared && dj.wds->ne0 > dj.wd->ne0 ? dj.wds->ne0 : dj.wd->ne0;
        dj.row_floats = down_row_floats(ne0);
        if (!(dj.rows = le_arena_take(ar, (size_t)T * (size_t)dj.row_floats * sizeof(float)))) goto short_plan;
    }
    le_prof(m, &tp, LE_PROF_FFN_ACT);
    if (split) le_parallel_each(m->pool, down_split, &dj);
    else le_parallel_for(m->pool, E, E / (8 * T) + 1, down_rows, &dj);
    le_prof(m, &tp, LE_PROF_FFN_DOWN);
    goto done;
short_plan:
    rc = LE_FAIL(LE_ERR_NO_MEMORY, "moe down scratch for %d tokens: beyond the plan", n);
done:
    ar->used = mark;
    return rc;
}

/* Job A: the router's logits and the shared expert's gate/up pair (x read once: one quantised input). */
static int job_a(const le_weight *w, const le_hparams *hp, const float *x, int n, float *logits, float *acts,
                 le_mm mm[2]) {
    int n_mm = 0;
    mm[n_mm++] = (le_mm){&w[LE_W_GATE_INP], 0, x, n, hp->n_embd, logits, hp->n_expert, NULL};
    if (hp->n_ff_shexp > 0)
        mm[n_mm++] = (le_mm){&w[LE_W_GATE_SHEXP], 0, x, n, hp->n_embd, acts, hp->n_ff_shexp, &w[LE_W_UP_SHEXP]};
    return n_mm;
}

/* moe's own scratch: floats logits [n, ne], wsel [n, k], sgate [n], acts [n, fs]; ints sel [nk] */
static size_t moe_floats(const le_hparams *hp, int n, int64_t nk) {
    return (size_t)n * hp->n_expert + (size_t)nk + n + (size_t)n * hp->n_ff_shexp;
}

static size_t moe_plan(const le_model *m, const le_weight *w, int n) {
    const le_hparams *hp = &m->hp;
    int64_t nk = (int64_t)n * hp->n_expert_used;
    le_mm mm[2];
    int n_mm = job_a(w, hp, x_id, n, NULL, NULL, mm);
    return le_align64(moe_floats(hp, n, nk) * sizeof(float)) + le_align64((size_t)nk * sizeof(int)) +
           max2(le_matmul_batch_plan(le_pool_threads(m->pool), m->int8, mm, n_mm),
                routed_plan(m, w, n, hp->n_expert_used, hp->n_ff_shexp > 0));
}

/* Rows [t0, t1) of the routing: softmax of the router's logits (in place), top-k (ties to the lower index),
 * renormalised weights; a job over the rows (le_parallel_rows). */
typedef struct {
    const le_hparams *hp;
    float *logits;
    int *sel;
    float *wsel;
} route_job;

static void route_rows(void *ctx, int64_t t0, int64_t t1, int thread) {
    const route_job *j = ctx;
    const le_hparams *hp = j->hp;
    int ne = hp->n_expert, k = hp->n_expert_used;
    float *logits = j->logits, *wsel = j->wsel;
    int *sel = j->sel;
    for (int64_t t = t0; t < t1; t++) {
        float *l = logits + (size_t)t * ne;
        float mx = -INFINITY;
        for (int e = 0; e < ne; e++) mx = l[e] > mx ? l[e] : mx;
        double sum = 0.0;
        for (int e = 0; e < ne; e++) {
            l[e] = expf(l[e] - mx);
            sum += l[e];
        }
        for (int e = 0; e < ne; e++) l[e] = (float)(l[e] / sum);
        /* top-k by insertion into a list kept in descending order; a later expert must be strictly
         * larger to pass an earlier one, so ties go to the lower index */
        int *top = sel + t * k;
        int kept = 0;
        for (int e = 0; e < ne; e++) {
            if (kept == k && !(l[e] > l[top[k - 1]])) continue;
            int p = kept < k ? kept++ : k - 1;
            while (p > 0 && l[e] > l[top[p - 1]]) {
                top[p] = top[p - 1];
                p--;
            }
            top[p] = e;
        }
        float wsum = 0.0f;
        for (int s = 0; s < k; s++) {
            wsel[t * k + s] = l[top[s]];
            wsum += l[top[s]];
        }
        if (wsum < MOE_WSUM_MIN) wsum = MOE_WSUM_MIN;
        if (hp->faults & LE_FAULT_NO_TOPK_RENORM) wsum = 1.0f;
        for (int s = 0; s < k; s++) wsel[t * k + s] /= wsum;
    }
}

static int moe(const le_model *m, le_arena *ar, const le_weight *w, const float *x, int n, float *out) {
    const le_hparams *hp = &m->hp;
    int E = hp->n_embd, ne = hp->n_expert, k = hp->n_expert_used, shared = hp->n_ff_shexp > 0;
    int nk = 0, rc = slots(n, k, &nk);
    if (rc) return rc;
    size_t mark = ar->used;
    float *buf = le_arena_take(ar, moe_floats(hp, n, nk) * sizeof(float));
    int *sel = le_arena_take(ar, (size_t)nk * sizeof(int));
    if (!buf || !sel) {
        rc = LE_FAIL(LE_ERR_NO_MEMORY, "moe scratch for %d tokens: beyond the plan", n);
        goto done;
    }
    float *logits = buf, *wsel = logits + (size_t)n * ne, *sgate = wsel + nk, *acts = sgate + n;
    double tp = le_prof_start(m);

    /* A: router logits and the shared expert's gate/up pair */
    le_mm mm[2];
    int n_mm = job_a(w, hp, x, n, logits, acts, mm);
    if ((rc = le_matmul_batch(m->pool, ar, m->int8, mm, n_mm))) goto done;
    le_prof(m, &tp, LE_PROF_MOE_ROUTER);

    /* routing: softmax, top-k (ties to the lower index), renormalise */
    route_job rj = {hp, logits, sel, wsel};
    le_parallel_rows(m->pool, n, route_rows, &rj);
    if (shared) {
        const float *sg = (const float *)w[LE_W_GATE_INP_SHEXP].data; /* [E] */
        for (int t = 0; t < n; t++) sgate[t] = le_sigmoid(le_dot_f32(sg, x + (size_t)t * E, E));
    }
    le_prof(m, &tp, LE_PROF_MOE_ROUTER);
    rc = routed(m, ar, w, x, n, k, sel, wsel, shared ? acts : NULL, shared ? sgate : NULL, out, 0);
done:
    ar->used = mark;
    return rc;
}

int le_moe_routed(le_model *m, int layer, const float *x, int n_sel, const int32_t *ids, const float *wts,
                  float *out) {
    if (!m || !x || !ids || !wts || !out) return LE_FAIL(LE_ERR_INVALID_ARG, "le_moe_routed: a NULL argument");
    if (!m->hp.n_expert) return LE_FAIL(LE_ERR_INVALID_ARG, "le_moe_routed: the model has no experts");
    if (layer < 0 || layer >= m->hp.n_layer)
        return LE_FAIL(LE_ERR_INVALID_ARG, "le_moe_routed: layer %d outside [0, %d)", layer, m->hp.n_layer);
    if (n_sel < 1 || n_sel > m->hp.n_expert)
        return LE_FAIL(LE_ERR_INVALID_ARG, "le_moe_routed: %d experts (1..%d)", n_sel, m->hp.n_expert);
    /* the model's arena, sized for n_expert experts of this layer: grows on a layer's first call at most */
    int rc = le_arena_reserve(&m->scratch, le_moe_routed_plan(m, m->layer[layer]), "le_moe_routed");
    if (rc) return rc;
    m->scratch.used = 0;
    return routed(m, &m->scratch, m->layer[layer], x, 1, n_sel, ids, wts, NULL, NULL, out, 1);
}

size_t le_moe_routed_plan(const le_model *m, const le_weight *w) { return routed_plan(m, w, 1, m->hp.n_expert, 0); }

int64_t le_model_scratch_growths(const le_model *m) { return m->scratch.growths; }

size_t le_ffn_plan(const le_model *m, const le_weight *w, int n) {
    return m->hp.n_expert ? moe_plan(m, w, n) : dense_plan(m, w, n);
}

int le_ffn_layer(const le_model *m, le_arena *ar, const le_weight *w, const float *x, int n, float *out) {
    return m->hp.n_expert ? moe(m, ar, w, x, n, out) : dense(m, ar, w, x, n, out);
}
