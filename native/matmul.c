/* matmul.c — y = W x for any weight type: dequantise a row, dot it with every token.
 *
 * Reference path (fp32 activations): each task takes a range of output rows; a row is
 * dequantised once into a per-task buffer (or read in place when the weight is f32)
 * and dotted with all n_tok inputs, so a prefill batch reads the weights once.
 * The integer SIMD GEMV kernels (W4A8) of cpu_simd/ will plug in beside this through
 * the capability table; this stays their oracle.
 * Test: tests/test_model.py (oracle comparisons exercise every weight type). */
#include <stdlib.h>
#include <string.h>

#include "le_internal.h"
#include "le_ops.h"

typedef struct {
    const le_weight *w;
    const uint8_t *base; /* the expert's first row */
    const float *x;
    int64_t n_tok, ldx, ldy;
    float *y;
    int failed;
    /* integer path */
    le_vec_dot_fn vec_dot;
    const uint8_t *xq;   /* [n_tok, act_row_bytes] activations in the vec_dot type */
    int64_t act_row_bytes;
} matmul_job;

static void matmul_rows_int8(void *ctx, int64_t r0, int64_t r1, int thread) {
    matmul_job *j = ctx;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = j->base + r * j->w->nb1;
        for (int64_t t = 0; t < j->n_tok; t++) j->vec_dot(j->w->ne0, &j->y[t * j->ldy + r], row, j->xq + t * j->act_row_bytes);
    }
}

static void matmul_rows(void *ctx, int64_t r0, int64_t r1, int thread) {
    matmul_job *j = ctx;
    const le_weight *w = j->w;
    int64_t ne0 = w->ne0;
    float *buf = NULL;
    if (w->type != LE_TYPE_F32) {
        buf = malloc((size_t)ne0 * sizeof(float));
        if (!buf) {
            __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
            return;
        }
    }
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = j->base + r * w->nb1;
        const float *wr;
        if (buf) {
            w->tr->dequantize_row(row, buf, ne0);
            wr = buf;
        } else {
            wr = (const float *)row;
        }
        for (int64_t t = 0; t < j->n_tok; t++) j->y[t * j->ldy + r] = le_dot_f32(wr, j->x + t * j->ldx, ne0);
    }
    free(buf);
}

int le_matmul(le_pool *pool, int int8, const le_weight *w, int64_t expert, const float *x, int64_t n_tok,
              int64_t ldx, float *y, int64_t ldy) {
    matmul_job j = {w, w->data + expert * w->nb2, x, n_tok, ldx, ldy, y, 0, NULL, NULL, 0};
    /* grain: enough rows per task to amortise the dispatch, few enough to balance */
    int64_t grain = w->ne1 / (8 * le_pool_threads(pool)) + 1;
    le_vec_dot_fn vd = int8 && w->type != LE_TYPE_F32 && w->type != LE_TYPE_F16 && w->type != LE_TYPE_BF16
                           ? le_get_vec_dot(w->type) : NULL;
    if (vd) {
        /* quantise every activation row once to the weight type's activation type */
        const le_type_traits_t *at = le_get_type_traits(w->tr->vec_dot_type);
        le_quantize_row_fn q = le_get_act_quantizer(w->tr->vec_dot_type);
        int64_t rb = w->ne0 / at->block_size * at->type_size;
        uint8_t *xq = malloc((size_t)(rb * n_tok));
        if (!xq) return LE_FAIL(LE_ERR_NO_MEMORY, "quantised activations (%lld bytes)", (long long)(rb * n_tok));
        for (int64_t t = 0; t < n_tok; t++) q(x + t * ldx, xq + t * rb, w->ne0);
        j.vec_dot = vd;
        j.xq = xq;
        j.act_row_bytes = rb;
        le_parallel_for(pool, w->ne1, grain, matmul_rows_int8, &j);
        free(xq);
        return LE_OK;
    }
    le_parallel_for(pool, w->ne1, grain, matmul_rows, &j);
    if (j.failed) return LE_FAIL(LE_ERR_NO_MEMORY, "matmul row buffer (%lld floats)", (long long)w->ne0);
    return LE_OK;
}

void le_weight_row(const le_weight *w, int64_t row, float *out) {
    const uint8_t *src = w->data + row * w->nb1;
    if (w->type == LE_TYPE_F32)
        memcpy(out, src, (size_t)w->ne0 * sizeof(float));
    else
        w->tr->dequantize_row(src, out, w->ne0);
}
