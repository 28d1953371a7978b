/* matmul.c — y = W x for any weight type, one product or a batch of them as one parallel job.
 *
 * Integer path (W4A8 …, the default where the weight type has an integer dot product):
 * each distinct input is quantised once to the weight type's activation type (Q8_0 /
 * Q8_1 / Q8_K) and every output row goes through the selected tier's vec_dot.
 * Reference path (fp32 activations; int8 off or F32/F16/BF16 weights): each weight row is
 * dequantised once into its thread's rows of the scratch (or read in place when f32) and dotted
 * with every token, so a prefill batch reads the weights once.
 * Scratch (the caller's arena, given back on return; le_matmul_scratch): the products' table, the quantised
 * inputs, and two f32 rows per thread.
 *
 * A batch (le_matmul_batch) is what makes decode fast on many cores: the products of one
 * step that do not depend on each other (the 4 GDN input projections; q, k, v; the gate and
 * up matrices of all routed experts and the shared expert; then all their down matrices)
 * run as ONE job over their concatenated output rows, so a token costs a few jobs per
 * layer instead of one per matrix, and no thread idles while a small matrix finishes.
 * Test: tests/test_model.py, tests/test_quantized.py (every weight type, every CPU tier). */
#include <string.h>

#include "le_internal.h"
#include "le_ops.h"
#include "le_simd.h"

typedef struct {
    const le_mm *mm;
    int n_mm;
    const int64_t *first;        /* [n_mm + 1]: first global row of each product */
    le_vec_dot_fn *vec_dot;      /* [n_mm]: NULL = reference path */
    const uint8_t **xq;          /* [n_mm]: quantised activations of the integer path */
    const int64_t *act_row_bytes;
    float *rows;                 /* [n_threads][row_floats]: each thread's dequantised rows (reference path) */
    int64_t row_floats;
    int n_threads;               /* le_matmul_batch_split: the pool's */
} batch_job;

/* Activation rows a weight row meets per pass (the token tile): 16 Q8_K rows of a 2048-wide input are 37 KiB, so
 * a tile stays in L1 while the task's weight rows stream past it once per tile. */
#define TOK_TILE 16
#define SWIGLU_ROWS 16 /* weight rows whose gates go through one silu call (a SwiGLU pair's rows_int8) */

static void rows_int8(const le_mm *mm, le_vec_dot_fn vd, const uint8_t *xq, int64_t rb, int64_t r0, int64_t r1) {
    const le_weight *w = mm->w;
    const uint8_t *base = w->data + mm->expert * w->nb2;
    le_vec_dot_n_fn vdn = le_get_vec_dot_n(w->type);
    if (mm->w_up) { /* SwiGLU pair: both rows share the input (same activation type, checked by the caller) */
        const uint8_t *base_up = mm->w_up->data + mm->expert * mm->w_up->nb2;
        le_vec_dot_fn vd_up = le_get_vec_dot(mm->w_up->type);
        le_vec_dot_n_fn vdn_up = le_get_vec_dot_n(mm->w_up->type);
        float g[SWIGLU_ROWS * TOK_TILE], u[SWIGLU_ROWS * TOK_TILE];
        le_silu_f32_fn silu = le_get_f32_kernels()->silu;
        for (int64_t t0 = 0; t0 < mm->n_tok; t0 += TOK_TILE) {
            int nt = (int)(mm->n_tok - t0 < TOK_TILE ? mm->n_tok - t0 : TOK_TILE);
            for (int64_t rs = r0; rs < r1; rs += SWIGLU_ROWS) {
                int nr = (int)(r1 - rs < SWIGLU_ROWS ? r1 - rs : SWIGLU_ROWS);
                for (int i = 0; i < nr; i++) {
                    le_vec_dot_rows(vd, vdn, w->ne0, g + i * nt, 1, base + (rs + i) * w->nb1, xq + t0 * rb, rb, nt);
                    le_vec_dot_rows(vd_up, vdn_up, w->ne0, u + i * nt, 1, base_up + (rs + i) * mm->w_up->nb1,
                                    xq + t0 * rb, rb, nt);
                }
                silu(g, (int64_t)nr * nt, g); /* one call for the rows' gates: whole vectors even at one token */
                for (int i = 0; i < nr; i++)
                    for (int t = 0; t < nt; t++) mm->y[(t0 + t) * mm->ldy + rs + i] = g[i * nt + t] * u[i * nt + t];
            }
        }
        return;
    }
    for (int64_t t0 = 0; t0 < mm->n_tok; t0 += TOK_TILE) {
        int nt = (int)(mm->n_tok - t0 < TOK_TILE ? mm->n_tok - t0 : TOK_TILE);
        for (int64_t r = r0; r < r1; r++)
            le_vec_dot_rows(vd, vdn, w->ne0, &mm->y[t0 * mm->ldy + r], mm->ldy, base + r * w->nb1, xq + t0 * rb, rb,
                            nt);
    }
}

/* A row of w as f32: in place when w is f32, else dequantised into buf. */
static const float *row_f32(const le_weight *w, int64_t expert, int64_t r, float *buf) {
    const uint8_t *row = w->data + expert * w->nb2 + r * w->nb1;
    if (w->type == LE_TYPE_F32) return (const float *)row;
    w->tr->dequantize_row(row, buf, w->ne0);
    return buf;
}

/* buf: [2, ne0] the calling thread's rows */
static void rows_f32(const le_mm *mm, int64_t r0, int64_t r1, float *buf) {
    int64_t ne0 = mm->w->ne0;
    le_dot_f32_fn dot = le_get_f32_kernels()->dot;
    le_silu_f32_fn silu = le_get_f32_kernels()->silu;
    for (int64_t r = r0; r < r1; r++) {
        const float *wr = row_f32(mm->w, mm->expert, r, buf);
        const float *ur = mm->w_up ? row_f32(mm->w_up, mm->expert, r, buf + ne0) : NULL;
        for (int64_t t = 0; t < mm->n_tok; t++) {
            const float *x = mm->x + t * mm->ldx;
            float g = dot(wr, x, ne0);
            if (ur) silu(&g, 1, &g); /* the kernel's bits, as the int8 rows' */
            mm->y[t * mm->ldy + r] = ur ? g * dot(ur, x, ne0) : g;
        }
    }
}

/* Global rows [g0, g1) may span several products. */
static void batch_rows(void *ctx, int64_t g0, int64_t g1, int thread) {
    batch_job *j = ctx;
    for (int i = le_piece_of(j->first, j->n_mm, g0); i < j->n_mm && j->first[i] < g1; i++) {
        int64_t r0, r1;
        le_piece_rows(j->first, i, g0, g1, &r0, &r1);
        if (r0 >= r1) continue;
        if (j->vec_dot[i])
            rows_int8(&j->mm[i], j->vec_dot[i], j->xq[i], j->act_row_bytes[i], r0, r1);
        else
            rows_f32(&j->mm[i], r0, r1, j->rows + (int64_t)thread * j->row_floats);
    }
}

/* le_parallel_each's task: thread t runs its share (le_split) of every product's rows. */
static void split_rows(void *ctx, int64_t t, int64_t t1, int thread) {
    (void)t1;
    batch_job *j = ctx;
    for (int i = 0; i < j->n_mm; i++) {
        int64_t r0, r1;
        le_split(j->first[i + 1] - j->first[i], (int)t, j->n_threads, &r0, &r1);
        if (r0 < r1) batch_rows(ctx, j->first[i] + r0, j->first[i] + r1, thread);
    }
}

le_vec_dot_fn le_int_kernel(int int8, const le_weight *w) {
    if (!int8 || w->type == LE_TYPE_F32 || w->type == LE_TYPE_F16 || w->type == LE_TYPE_BF16) return NULL;
    return le_get_vec_dot(w->type);
}

int64_t le_act_row_bytes(const le_weight *w) {
    const le_type_traits_t *at = le_get_type_traits(w->tr->vec_dot_type);
    return w->ne0 / at->block_size * at->type_size;
}

/* A batch's distinct inputs quantised as one job over all their rows: a grouped MoE pass has hundreds of products of a
 * few rows each, too few for a job apiece (le_parallel_rows runs those inline), thousands together */
typedef struct {
    const le_mm *mm;
    const int64_t *own, *qfirst; /* [n_own]: owner products; [n_own + 1]: their first rows among all inputs' */
    int n_own;
    uint8_t *const *xq;          /* per product */
    const int64_t *rb;
} quant_batch_job;

static void quant_batch_rows(void *ctx, int64_t g0, int64_t g1, int thread) {
    (void)thread;
    const quant_batch_job *j = ctx;
    for (int k = le_piece_of(j->qfirst, j->n_own, g0); k < j->n_own && j->qfirst[k] < g1; k++) {
        const int i = (int)j->own[k];
        const le_mm *m = &j->mm[i];
        le_quantize_row_fn quant = le_get_act_quantizer(m->w->tr->vec_dot_type);
        int64_t r0, r1;
        le_piece_rows(j->qfirst, k, g0, g1, &r0, &r1);
        for (int64_t r = r0; r < r1; r++) quant(m->x + r * m->ldx, j->xq[i] + r * j->rb[i], m->w->ne0);
    }
}

/* Rows are quantised independently (same bits on any thread): a prefill's as pool jobs (serial, they were ~2 % of a
 * 2-thread pass, ~13 % at 16 threads), a decode step's inline (le_parallel_rows): one input as a batch of one */
void le_quantize_acts(le_pool *pool, const le_weight *w, const float *x, int64_t rows, int64_t ldx, uint8_t *out) {
    const le_mm mm = {w, 0, x, rows, ldx, NULL, 0, NULL};
    const int64_t own = 0, qfirst[2] = {0, rows}, rb = le_act_row_bytes(w);
    quant_batch_job j = {&mm, &own, qfirst, 1, &out, &rb};
    le_parallel_rows(pool, rows, quant_batch_rows, &j);
}

/* The table of a batch: kernels, quantised-input pointers [n_mm]; first rows [n_mm + 1]; row bytes [n_mm]; the
 * products that quantise an input [n_mm] and their first input rows [n_mm + 1] */
static size_t table_bytes(int n_mm) {
    return (size_t)n_mm * (sizeof(le_vec_dot_fn) + sizeof(uint8_t *) + 4 * sizeof(int64_t)) + 2 * sizeof(int64_t);
}

/* Floats of one thread's rows on the reference path (a SwiGLU pair dequantises two). */
static int64_t row_floats(int64_t f32_ne0) { return le_floats64(2 * f32_ne0); }

size_t le_matmul_scratch(int n_threads, int n_mm, size_t q_bytes, int64_t f32_ne0) {
    return le_align64(table_bytes(n_mm)) + le_align64(q_bytes) +
           (f32_ne0 > 0 ? (size_t)n_threads * (size_t)row_floats(f32_ne0) * sizeof(float) : 0);
}

/* Product mm's integer kernel, NULL for the reference path or no rows; a pair runs on the integer path only if
 * both halves do, on one activation type. */
static le_vec_dot_fn kernel_of(int int8, const le_mm *mm) {
    const le_weight *w = mm->w, *wu = mm->w_up;
    le_vec_dot_fn vd = mm->n_tok > 0 ? le_int_kernel(int8, w) : NULL;
    if (vd && wu && (!le_int_kernel(int8, wu) || wu->tr->vec_dot_type != w->tr->vec_dot_type)) vd = NULL;
    return vd;
}

/* The first earlier product on the integer path with product i's input (same x, n_tok, ldx, activation type),
 * whose quantised rows i reads; i when none. vd: the earlier products' kernels. */
static int input_owner(const le_mm *mm, int i, const le_vec_dot_fn *vd) {
    const le_weight *w = mm[i].w;
    for (int p = 0; p < i; p++)
        if (vd[p] && mm[p].x == mm[i].x && mm[p].n_tok == mm[i].n_tok && mm[p].ldx == mm[i].ldx &&
            mm[p].w->ne0 == w->ne0 && mm[p].w->tr->vec_dot_type == w->tr->vec_dot_type)
            return p;
    return i;
}

/* Each product's kernel into vd; returns the bytes of the quantised inputs (each distinct one's rows rounded up
 * to 64) and the widest reference-path row in *f32_ne0 (0: none). */
static size_t survey(int int8, const le_mm *mm, int n_mm, le_vec_dot_fn *vd, int64_t *f32_ne0) {
    size_t q = 0;
    *f32_ne0 = 0;
    for (int i = 0; i < n_mm; i++) {
        vd[i] = kernel_of(int8, &mm[i]);
        if (!vd[i]) {
            if (mm[i].n_tok > 0 && mm[i].w->ne0 > *f32_ne0) *f32_ne0 = mm[i].w->ne0;
        } else if (input_owner(mm, i, vd) == i) {
            q += le_align64((size_t)(le_act_row_bytes(mm[i].w) * mm[i].n_tok));
        }
    }
    return q;
}

/* The plan's lists are short (at most 4 products); a longer one is planned in pieces of PLAN_MM. */
#define PLAN_MM 16

size_t le_matmul_batch_plan(int n_threads, int int8, const le_mm *mm, int n_mm) {
    le_vec_dot_fn vd[PLAN_MM];
    if (n_mm > PLAN_MM) /* no input shared across pieces: an upper bound */
        return le_matmul_batch_plan(n_threads, int8, mm, PLAN_MM) +
               le_matmul_batch_plan(n_threads, int8, mm + PLAN_MM, n_mm - PLAN_MM);
    int64_t f32_ne0;
    size_t q = n_mm > 0 ? survey(int8, mm, n_mm, vd, &f32_ne0) : 0;
    return n_mm > 0 ? le_matmul_scratch(n_threads, n_mm, q, f32_ne0) : 0;
}

static int matmul_batch(le_pool *pool, le_arena *a, int int8, const le_mm *mm, int n_mm, int split);

int le_matmul_batch(le_pool *pool, le_arena *a, int int8, const le_mm *mm, int n_mm) {
    return matmul_batch(pool, a, int8, mm, n_mm, 0);
}

int le_matmul_batch_split(le_pool *pool, le_arena *a, int int8, const le_mm *mm, int n_mm) {
    return matmul_batch(pool, a, int8, mm, n_mm, 1);
}

static int matmul_batch(le_pool *pool, le_arena *a, int int8, const le_mm *mm, int n_mm, int split) {
    if (n_mm <= 0) return LE_OK;
    for (int i = 0; i < n_mm; i++) {
        const le_weight *w = mm[i].w, *wu = mm[i].w_up;
        if (wu && (wu->ne0 != w->ne0 || wu->ne1 != w->ne1))
            return LE_FAIL(LE_ERR_INVALID_ARG, "SwiGLU pair: gate [%lld, %lld] and up [%lld, %lld] differ",
                           (long long)w->ne0, (long long)w->ne1, (long long)wu->ne0, (long long)wu->ne1);
    }
    int T = le_pool_threads(pool);
    size_t mark = a->used;
    /* per product: kernel, quantised input, first row, activation row bytes */
    uint8_t *table = le_arena_take(a, table_bytes(n_mm));
    if (!table) return LE_FAIL(LE_ERR_NO_MEMORY, "matmul batch of %d: scratch beyond the plan", n_mm);
    le_vec_dot_fn *vd = (le_vec_dot_fn *)table;
    const uint8_t **xq = (const uint8_t **)(vd + n_mm);
    int64_t *first = (int64_t *)(xq + n_mm), *rb = first + n_mm + 1, *own = rb + n_mm, *qfirst = own + n_mm;
    int64_t f32_ne0;
    size_t q_bytes = survey(int8, mm, n_mm, vd, &f32_ne0);
    uint8_t *q = le_arena_take(a, q_bytes);
    float *rows = f32_ne0 ? le_arena_take(a, (size_t)T * (size_t)row_floats(f32_ne0) * sizeof(float)) : NULL;
    if (!q || (f32_ne0 && !rows)) {
        a->used = mark;
        return LE_FAIL(LE_ERR_NO_MEMORY, "matmul batch of %d: scratch beyond the plan", n_mm);
    }
    /* activations quantised once per distinct input, all inputs' rows as one job */
    first[0] = qfirst[0] = 0;
    int n_own = 0;
    for (int i = 0; i < n_mm; i++) {
        const le_weight *w = mm[i].w;
        first[i + 1] = first[i] + (mm[i].n_tok > 0 ? w->ne1 : 0);
        xq[i] = NULL;
        rb[i] = 0;
        if (!vd[i]) continue;
        rb[i] = le_act_row_bytes(w);
        int p = input_owner(mm, i, vd);
        if (p < i) {
            xq[i] = xq[p];
            continue;
        }
        xq[i] = q;
        q += le_align64((size_t)(rb[i] * mm[i].n_tok));
        own[n_own] = i;
        qfirst[n_own + 1] = qfirst[n_own] + mm[i].n_tok;
        n_own++;
    }
    quant_batch_job qj = {mm, own, qfirst, n_own, (uint8_t *const *)xq, rb};
    if (n_own) le_parallel_rows(pool, qfirst[n_own], quant_batch_rows, &qj);
    batch_job j = {mm, n_mm, first, vd, xq, rb, rows, f32_ne0 ? row_floats(f32_ne0) : 0, T};
    int64_t total = first[n_mm];
    if (split) {
        le_parallel_each(pool, split_rows, &j);
    } else {
        /* grain: 4 tasks per thread: few enough that claiming them (one contended atomic each)
         * stays cheap, enough that a thread that started late or runs slow can be covered */
        int64_t grain = total / (4 * T) + 1;
        le_parallel_for(pool, total, grain, batch_rows, &j);
    }
    a->used = mark;
    return LE_OK;
}

int le_matmul(le_pool *pool, le_arena *a, int int8, const le_weight *w, int64_t expert, const float *x,
              int64_t n_tok, int64_t ldx, float *y, int64_t ldy) {
    le_mm mm = {w, expert, x, n_tok, ldx, y, ldy, NULL};
    return le_matmul_batch(pool, a, int8, &mm, 1);
}

void le_weight_row(const le_weight *w, int64_t row, float *out) {
    const uint8_t *src = w->data + row * w->nb1;
    if (w->type == LE_TYPE_F32)
        memcpy(out, src, (size_t)w->ne0 * sizeof(float));
    else
        w->tr->dequantize_row(src, out, w->ne0);
}
