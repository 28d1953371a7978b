/* moe.c — the feed-forward of a layer: dense SwiGLU, or the MoE block (spec §2.5).
 *
 *   dense:  out = W_down (SiLU(W_gate x) * W_up x)
 *   MoE:    p = softmax(W_router x) over all experts (f32); top-k; w = p_topk / sum p_topk
 *           out = sum_e w_e down_e(SiLU(gate_e x) * up_e x)
 *               + sigmoid(w_shexp_gate . x) * down_s(SiLU(gate_s x) * up_s x)
 * Prefill groups the batch's tokens by expert so each expert's weights are read once.
 * Ties in top-k go to the lower expert index. Test: tests/test_model.py. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "le_internal.h"
#include "le_ops.h"

/* Minimum of the top-k weight sum before renormalising (llama.cpp clamps the same way). */
#define MOE_WSUM_MIN 6.103515625e-5f

/* out[n, E] = W_down(SiLU(W_gate x) * W_up x) for one (expert) matrix set; act: [n, ff] x2 scratch */
static int swiglu(const le_model *m, const le_weight *wg, const le_weight *wu, const le_weight *wd, int64_t e,
                  const float *x, int n, float *act, float *out) {
    int E = m->hp.n_embd;
    int64_t ff = wg->ne1;
    float *up = act + (size_t)n * ff;
    int rc;
    if ((rc = le_matmul(m->pool, m->int8, wg, e, x, n, E, act, ff)) || (rc = le_matmul(m->pool, m->int8, wu, e, x, n, E, up, ff)))
        return rc;
    for (size_t i = 0; i < (size_t)n * ff; i++) act[i] = le_silu(act[i]) * up[i];
    return le_matmul(m->pool, m->int8, wd, e, act, n, ff, out, E);
}

static int moe(const le_model *m, const le_weight *w, const float *x, int n, float *out) {
    const le_hparams *hp = &m->hp;
    int E = hp->n_embd, ne = hp->n_expert, k = hp->n_expert_used;
    int64_t ff = hp->n_ff_exp > hp->n_ff_shexp ? hp->n_ff_exp : hp->n_ff_shexp;
    int rc = LE_OK;
    /* scratch: logits [n, ne], sel [n, k] ids + weights, gathered x [n, E], act [n, 2 ff], y [n, E],
     * per-expert token lists [ne][n] */
    size_t floats = (size_t)n * ne + (size_t)n * k + 2 * (size_t)n * E + 2 * (size_t)n * ff + (size_t)n * E;
    float *buf = malloc(floats * sizeof(float));
    int *ids = malloc(((size_t)n * k + (size_t)ne * n + ne) * sizeof(int));
    if (!buf || !ids) {
        free(buf);
        free(ids);
        return LE_FAIL(LE_ERR_NO_MEMORY, "moe scratch for %d tokens", n);
    }
    float *logits = buf, *wsel = logits + (size_t)n * ne, *xg = wsel + (size_t)n * k;
    float *act = xg + (size_t)n * E, *y = act + 2 * (size_t)n * ff, *acc = y + (size_t)n * E;
    int *sel = ids, *tok_of = sel + (size_t)n * k, *count = tok_of + (size_t)ne * n;

    if ((rc = le_matmul(m->pool, m->int8, &w[LE_W_GATE_INP], 0, x, n, E, logits, ne))) goto done;
    memset(count, 0, (size_t)ne * sizeof(int));
    for (int t = 0; t < n; t++) {
        float *l = logits + (size_t)t * ne;
        float mx = -INFINITY;
        for (int e = 0; e < ne; e++) mx = l[e] > mx ? l[e] : mx;
        double sum = 0.0;
        for (int e = 0; e < ne; e++) {
            l[e] = expf(l[e] - mx);
            sum += l[e];
        }
        for (int e = 0; e < ne; e++) l[e] = (float)(l[e] / sum);
        /* top-k by selection: k is small (8) */
        float wsum = 0.0f;
        for (int s = 0; s < k; s++) {
            int best = -1;
            for (int e = 0; e < ne; e++) {
                int taken = 0;
                for (int r = 0; r < s; r++) taken |= sel[t * k + r] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            sel[t * k + s] = best;
            wsel[t * k + s] = l[best];
            wsum += l[best];
        }
        if (wsum < MOE_WSUM_MIN) wsum = MOE_WSUM_MIN;
        if (hp->faults & LE_FAULT_NO_TOPK_RENORM) wsum = 1.0f;
        for (int s = 0; s < k; s++) {
            wsel[t * k + s] /= wsum;
            int e = sel[t * k + s];
            tok_of[(size_t)e * n + count[e]++] = t * k + s; /* remember token and slot */
        }
    }
    memset(acc, 0, (size_t)n * E * sizeof(float));
    for (int e = 0; e < ne; e++) {
        int c = count[e];
        if (!c) continue;
        for (int i = 0; i < c; i++)
            memcpy(xg + (size_t)i * E, x + (size_t)(tok_of[(size_t)e * n + i] / k) * E, (size_t)E * sizeof(float));
        if ((rc = swiglu(m, &w[LE_W_GATE_EXPS], &w[LE_W_UP_EXPS], &w[LE_W_DOWN_EXPS], e, xg, c, act, y))) goto done;
        for (int i = 0; i < c; i++) {
            int ts = tok_of[(size_t)e * n + i];
            float wt = wsel[ts];
            float *dst = acc + (size_t)(ts / k) * E;
            const float *src = y + (size_t)i * E;
            for (int d = 0; d < E; d++) dst[d] += wt * src[d];
        }
    }
    if (hp->n_ff_shexp) {
        if ((rc = swiglu(m, &w[LE_W_GATE_SHEXP], &w[LE_W_UP_SHEXP], &w[LE_W_DOWN_SHEXP], 0, x, n, act, y))) goto done;
        const float *sg = (const float *)w[LE_W_GATE_INP_SHEXP].data; /* [E] */
        for (int t = 0; t < n; t++) {
            float d = 0.0f;
            for (int i = 0; i < E; i++) d += sg[i] * x[(size_t)t * E + i];
            float gate = le_sigmoid(d);
            for (int i = 0; i < E; i++) acc[(size_t)t * E + i] += gate * y[(size_t)t * E + i];
        }
    }
    memcpy(out, acc, (size_t)n * E * sizeof(float));
done:
    free(buf);
    free(ids);
    return rc;
}

int le_ffn_layer(const le_model *m, const le_weight *w, const float *x, int n, float *out) {
    if (m->hp.n_expert) return moe(m, w, x, n, out);
    float *act = malloc(2 * (size_t)n * m->hp.n_ff * sizeof(float));
    if (!act) return LE_FAIL(LE_ERR_NO_MEMORY, "ffn scratch for %d tokens", n);
    int rc = swiglu(m, &w[LE_W_FFN_GATE], &w[LE_W_FFN_UP], &w[LE_W_FFN_DOWN], 0, x, n, act, out);
    free(act);
    return rc;
}
