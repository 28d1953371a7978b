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

/* Dot product with 8 independent partial sums (lets gcc vectorise without -ffast-math). */
static float dot_f32(const float *a, const float *b, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) acc[k] += a[i + k] * b[i + k];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

typedef struct {
    const le_weight *w;
    const uint8_t *base; /* the expert's first row */
    const float *x;
    int64_t n_tok, ldx, ldy;
    float *y;
    int failed;
} matmul_job;

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
        for (int64_t t = 0; t < j->n_tok; t++) j->y[t * j->ldy + r] = dot_f32(wr, j->x + t * j->ldx, ne0);
    }
    free(buf);
}

int le_matmul(le_pool *pool, const le_weight *w, int64_t expert, const float *x, int64_t n_tok, int64_t ldx,
              float *y, int64_t ldy) {
    matmul_job j = {w, w->data + expert * w->nb2, x, n_tok, ldx, ldy, y, 0};
    /* grain: enough rows per task to amortise the dispatch, few enough to balance */
    int64_t grain = w->ne1 / (8 * le_pool_threads(pool)) + 1;
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
