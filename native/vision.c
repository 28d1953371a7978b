/* vision.c — the Qwen3.5/3.6 vision tower (le_vision.h; spec §2.7; transformers Qwen3_5VisionModel), f32.
 *
 *   patches [n, C*T*P*P] --Conv3d as one matmul (+ bias)--> x [n, H]; x += pos_embed(row, col)   (pos_embed.c)
 *   per block: xn = LN1(x); qkv = W_qkv xn + b; q, k <- 2-D RoPE (rope_2d.c);
 *              x += W_o attn(q, k, v) + b   (attention_bidir.c: per frame);
 *              xn = LN2(x); x += W_fc2 gelu_tanh(W_fc1 xn + b1) + b2           (gelu.c; SIMD: le_simd.h)
 *   merger:    xn = LN(x) [n, H] = [n / M^2, M^2 H] (M^2 consecutive patches side by side: the processor's order
 *              puts each M x M group together); out = W_2 gelu_erf(W_1 xn + b1) + b2   [n / M^2, O]
 * Matmuls run as tiles of tokens x weight rows through the f32 table's gemm_nn (a block of weight rows packed
 * transposed, F16/BF16/Q8_0 dequantised on the way; the biases are added by the row jobs after); the row-wise steps
 * (bias, activation (the f32 table's gelu_tanh), RoPE, residual, norm) run as parallel jobs over rows. Every
 * output element is computed by one task whose result does not depend on the thread that runs it: any thread
 * count gives the same bits.
 * Scratch: one arena, planned per encode from the image's size (vision_plan) and grown only when an image needs
 * more than any before.
 * Test: tests/test_vision_tower.py (ops, and the tower against transformers on tiny converted checkpoints). */
#include <stdlib.h>
#include <string.h>

#include "le_internal.h"
#include "le_ops.h"
#include "le_vision_ops.h"

#define N_GLOBAL LE_VW_LN1_W               /* global slots: 0 .. N_GLOBAL-1 */

/* le_vision_profile's phases (le_vision.h gives the order) */
enum { VP_PATCH, VP_LN, VP_QKV, VP_QKV_ROPE, VP_ATTN, VP_PROJ, VP_FC1, VP_GELU, VP_FC2, VP_RESID, VP_MERGER,
       VP_COUNT };
#define N_BLOCK (LE_VW_COUNT - LE_VW_LN1_W) /* per-block slots */

struct le_vision {
    le_vision_hparams hp;
    le_pool *pool;
    le_weight g[N_GLOBAL];
    le_weight (*blk)[N_BLOCK]; /* [depth][N_BLOCK] */
    le_weight patch;           /* the joined Conv3d kernel [H, C*T*P*P] f32 (owned: patch_f32) */
    float *patch_f32;
    const float *pos;          /* [side^2, H] f32: in the map, or pos_f32 (dequantised) */
    float *pos_f32;
    int finalized;
    le_arena scratch;
    int profile;               /* 1: accumulate phase times into prof (le_vision_set_profile) */
    double prof[VP_COUNT];     /* seconds per phase */
};

static int64_t patch_len(const le_vision_hparams *hp) {
    return (int64_t)hp->in_channels * hp->temporal_patch * hp->patch_size * hp->patch_size;
}

/* The ggml ne of a slot (ne0 fastest); returns its n_dims, 0 when the tower does not use it. */
static int slot_shape(const le_vision_hparams *hp, int slot, int64_t ne[4]) {
    int64_t H = hp->hidden, MH = (int64_t)hp->merge * hp->merge * H, P = hp->patch_size;
    ne[0] = ne[1] = ne[2] = ne[3] = 1;
    switch (slot) {
    case LE_VW_PATCH_W1:
        if (hp->temporal_patch != 2) return 0;
        /* fall through */
    case LE_VW_PATCH_W0:
        ne[0] = P, ne[1] = P, ne[2] = hp->in_channels, ne[3] = H;
        return 4;
    case LE_VW_POS_EMBD: ne[0] = H, ne[1] = (int64_t)hp->pos_side * hp->pos_side; return 2;
    case LE_VW_MERGER_FC1_W: ne[0] = MH, ne[1] = MH; return 2;
    case LE_VW_MERGER_FC1_B: ne[0] = MH; return 1;
    case LE_VW_MERGER_FC2_W: ne[0] = MH, ne[1] = hp->out_hidden; return 2;
    case LE_VW_MERGER_FC2_B: ne[0] = hp->out_hidden; return 1;
    case LE_VW_QKV_W: ne[0] = H, ne[1] = 3 * H; return 2;
    case LE_VW_QKV_B: ne[0] = 3 * H; return 1;
    case LE_VW_O_W: ne[0] = H, ne[1] = H; return 2;
    case LE_VW_FC1_W: ne[0] = H, ne[1] = hp->ffn; return 2;
    case LE_VW_FC1_B: ne[0] = hp->ffn; return 1;
    case LE_VW_FC2_W: ne[0] = hp->ffn, ne[1] = H; return 2;
    default: ne[0] = H; return 1; /* the LayerNorms' weights and biases, patch_b, o_b, fc2_b */
    }
}

static int check_hparams(const le_vision_hparams *hp) {
    if (hp->depth < 1 || hp->hidden < 1 || hp->n_head < 1 || hp->ffn < 1 || hp->patch_size < 1 ||
        hp->in_channels < 1 || hp->merge < 1 || hp->pos_side < 1 || hp->out_hidden < 1 ||
        (hp->temporal_patch != 1 && hp->temporal_patch != 2))
        return LE_FAIL(LE_ERR_INVALID_ARG, "vision hparams: depth %d, hidden %d, heads %d, ffn %d, patch %d x %d, "
                       "merge %d, grid %d, out %d", hp->depth, hp->hidden, hp->n_head, hp->ffn, hp->patch_size,
                       hp->temporal_patch, hp->merge, hp->pos_side, hp->out_hidden);
    if (hp->hidden % hp->n_head || (hp->hidden / hp->n_head) % 4)
        return LE_FAIL(LE_ERR_INVALID_ARG, "vision hparams: hidden %d over %d heads is not a multiple of 4 per head "
                       "(the 2-D RoPE rotates pairs in a row half and a column half)", hp->hidden, hp->n_head);
    if (!(hp->eps > 0.0f) || !(hp->rope_theta > 0.0f))
        return LE_FAIL(LE_ERR_INVALID_ARG, "vision hparams: eps %g, rope theta %g", hp->eps, hp->rope_theta);
    return LE_OK;
}

int le_vision_create(const le_vision_hparams *hp, int n_threads, le_vision **out) {
    if (!hp || !out) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL hparams or out");
    *out = NULL;
    int rc = check_hparams(hp);
    if (rc != LE_OK) return rc;
    le_vision *v = calloc(1, sizeof *v);
    if (!v) return LE_FAIL(LE_ERR_NO_MEMORY, "vision tower");
    v->hp = *hp;
    v->blk = calloc((size_t)hp->depth, sizeof *v->blk);
    if (!v->blk) {
        free(v);
        return LE_FAIL(LE_ERR_NO_MEMORY, "vision tower of %d blocks", hp->depth);
    }
    rc = le_pool_create(n_threads, &v->pool);
    if (rc != LE_OK) {
        free(v->blk);
        free(v);
        return rc;
    }
    *out = v;
    return LE_OK;
}

void le_vision_free(le_vision *v) {
    if (!v) return;
    le_pool_free(v->pool);
    le_arena_free(&v->scratch);
    free(v->patch_f32);
    free(v->pos_f32);
    free(v->blk);
    free(v);
}

static le_weight *slot_weight(le_vision *v, int block, int slot) {
    return block < 0 ? &v->g[slot] : &v->blk[block][slot - N_GLOBAL];
}

int le_vision_set_weight(le_vision *v, int block, int slot, const void *data, int type, const int64_t *ne,
                         int n_dims) {
    if (!v || !data || !ne) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL tower, data or ne");
    if (slot < 0 || slot >= LE_VW_COUNT) return LE_FAIL(LE_ERR_INVALID_ARG, "vision slot %d out of range", slot);
    if ((slot < N_GLOBAL) != (block < 0) || block >= v->hp.depth)
        return LE_FAIL(LE_ERR_INVALID_ARG, "vision slot %d with block %d (global slots take -1, block slots "
                       "0..%d)", slot, block, v->hp.depth - 1);
    int64_t want[4];
    int dims = slot_shape(&v->hp, slot, want);
    if (!dims) return LE_FAIL(LE_ERR_INVALID_ARG, "vision slot %d is not used by a tower of these hparams", slot);
    for (int d = 0; d < 4; d++)
        if ((d < n_dims ? ne[d] : 1) != want[d] || (n_dims < 1 || n_dims > 4))
            return LE_FAIL(LE_ERR_FORMAT, "vision block %d slot %d: ne[%d] = %lld, expected [%lld, %lld, %lld, %lld]",
                           block, slot, d, (long long)(d < n_dims ? ne[d] : 1), (long long)want[0],
                           (long long)want[1], (long long)want[2], (long long)want[3]);
    const le_type_traits_t *tr = le_get_type_traits(type);
    if (!tr || !tr->dequantize_row)
        return LE_FAIL(LE_ERR_UNSUPPORTED, "vision block %d slot %d: ggml type %d has no kernel", block, slot, type);
    if (dims == 1 && type != LE_TYPE_F32)
        return LE_FAIL(LE_ERR_UNSUPPORTED, "vision block %d slot %d: a 1-D tensor must be F32 (found %s)", block, slot,
                       tr->name);
    /* the matrix view: rows of ne0 (of ne0*ne1*ne2 for the Conv3d kernel halves: one output channel) */
    int64_t ne0 = dims == 4 ? want[0] * want[1] * want[2] : want[0], ne1 = dims == 4 ? want[3] : want[1];
    if (ne0 % tr->block_size)
        return LE_FAIL(LE_ERR_FORMAT, "vision block %d slot %d: row of %lld is not a multiple of %s's block %d", block,
                       slot, (long long)ne0, tr->name, tr->block_size);
    le_weight *w = slot_weight(v, block, slot);
    *w = (le_weight){data, tr, type, ne0, ne1, 1, ne0 / tr->block_size * tr->type_size, 0};
    w->nb2 = w->nb1 * ne1;
    v->finalized = 0;
    return LE_OK;
}

/* The Conv3d kernel [H, C, T, P, P] (HF) from the file's T halves [H, C, P, P]: row h of the joined [H, C*T*P*P]
 * matrix is (c, t, y, x)-ordered like a patch row. why: the GGUF cuts the kernel along time; joined, the patch
 * embedding is one matmul over the patches as the processor lays them out. */
static int join_patch_kernel(le_vision *v) {
    const le_vision_hparams *hp = &v->hp;
    int64_t PP = (int64_t)hp->patch_size * hp->patch_size, C = hp->in_channels, T = hp->temporal_patch;
    int64_t len = patch_len(hp), half = C * PP;
    free(v->patch_f32);
    v->patch_f32 = malloc(sizeof(float) * (size_t)(hp->hidden * len + half));
    if (!v->patch_f32) return LE_FAIL(LE_ERR_NO_MEMORY, "joined patch kernel [%d, %lld]", hp->hidden, (long long)len);
    float *row = v->patch_f32 + hp->hidden * len; /* one half's row, dequantised */
    for (int t = 0; t < T; t++)
        for (int64_t h = 0; h < hp->hidden; h++) {
            le_weight_row(&v->g[t ? LE_VW_PATCH_W1 : LE_VW_PATCH_W0], h, row);
            for (int64_t c = 0; c < C; c++)
                memcpy(v->patch_f32 + h * len + (c * T + t) * PP, row + c * PP, sizeof(float) * (size_t)PP);
        }
    v->patch = (le_weight){(const uint8_t *)v->patch_f32, le_get_type_traits(LE_TYPE_F32), LE_TYPE_F32, len,
                           hp->hidden, 1, len * (int64_t)sizeof(float), len * hp->hidden * (int64_t)sizeof(float)};
    return LE_OK;
}

/* The position grid as f32: in place when the file has it in f32, else dequantised once (each patch reads 4 rows;
 * the grid is small: 2304 x H). */
static int pos_table(le_vision *v) {
    const le_weight *w = &v->g[LE_VW_POS_EMBD];
    free(v->pos_f32);
    v->pos_f32 = NULL;
    if (w->type == LE_TYPE_F32) {
        v->pos = (const float *)w->data;
        return LE_OK;
    }
    v->pos_f32 = malloc(sizeof(float) * (size_t)(w->ne0 * w->ne1));
    if (!v->pos_f32) return LE_FAIL(LE_ERR_NO_MEMORY, "position grid [%lld, %lld]", (long long)w->ne1,
                                    (long long)w->ne0);
    for (int64_t r = 0; r < w->ne1; r++) le_weight_row(w, r, v->pos_f32 + r * w->ne0);
    v->pos = v->pos_f32;
    return LE_OK;
}

int le_vision_finalize(le_vision *v) {
    if (!v) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL tower");
    int64_t ne[4];
    for (int b = -1; b < v->hp.depth; b++)
        for (int s = b < 0 ? 0 : N_GLOBAL; s < (b < 0 ? N_GLOBAL : LE_VW_COUNT); s++)
            if (slot_shape(&v->hp, s, ne) && !slot_weight(v, b, s)->data)
                return LE_FAIL(LE_ERR_FORMAT, "vision block %d: weight slot %d is not set", b, s);
    int rc = join_patch_kernel(v);
    if (rc == LE_OK) rc = pos_table(v);
    v->finalized = rc == LE_OK;
    return rc;
}

int le_vision_set_profile(le_vision *v, int on) {
    if (!v) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL tower");
    v->profile = on != 0;
    if (on) memset(v->prof, 0, sizeof v->prof);
    return LE_OK;
}

int le_vision_profile(const le_vision *v, double *seconds, int n) {
    if (!v || !seconds) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL tower or output");
    for (int i = 0; i < n && i < VP_COUNT; i++) seconds[i] = v->prof[i];
    return VP_COUNT;
}

/* Profiling marks: *t holds the time of the previous mark; the span since goes to `phase`. */
static void prof_mark(le_vision *v, double *t, int phase) {
    if (!v->profile) return;
    double now = le_now();
    v->prof[phase] += now - *t;
    *t = now;
}

int64_t le_vision_scratch_bytes(const le_vision *v) { return v ? (int64_t)v->scratch.size : 0; }
int64_t le_vision_scratch_growths(const le_vision *v) { return v ? v->scratch.growths : 0; }

/* ---- encode ------------------------------------------------------------------------------------------------- */

/* The matmuls' tiles (mm, below): tokens x weight rows per task. MM_TOK: a multiple of gemm_nn's 6-row register
 * tile (64 left a 4-row tail in every task: 2.5 % of the encode in tail tiles). MM_ROWS: one full gemm_nn column
 * block of the AVX-512 tier (4 zmm; 4 of the AVX2 tier's). */
#define MM_TOK 48
#define MM_ROWS 64

/* The row-wise steps between the matmuls, one parallel job each (rows_task). */
enum { RJ_LN, RJ_EMBED, RJ_QKV, RJ_GELU_TANH, RJ_GELU_ERF, RJ_RESID, RJ_BIAS };

typedef struct {
    const le_vision *v;
    int kind;
    int64_t cols;        /* floats per row of x (and of y) */
    float *x;            /* [rows, cols]: updated (RJ_LN: written) */
    const float *y;      /* RJ_LN: input [rows, cols]; RJ_RESID: the product added [rows, cols] */
    const float *w, *b;  /* RJ_LN: norm weight and bias; others: b = the product's bias [cols] */
    /* RJ_EMBED: grid gh x gw; tmp [n_threads][le_floats64(H)]. RJ_QKV: cos/sin [hw, hd/2]. Both: hw per frame */
    int gh, gw;
    int64_t hw;
    float *tmp;
    const float *cos_t, *sin_t;
} rows_job;

static void rows_task(void *ctx, int64_t r0, int64_t r1, int thread) {
    rows_job *j = ctx;
    const le_vision_hparams *hp = &j->v->hp;
    int64_t C = j->cols;
    for (int64_t r = r0; r < r1; r++) {
        float *x = j->x + r * C;
        const float *y = j->y ? j->y + r * C : NULL;
        switch (j->kind) {
        case RJ_LN: le_layernorm_ref(y, j->w, j->b, 1, (int)C, hp->eps, x); break;
        case RJ_EMBED: { /* x = (conv + bias) + pos: torch's order of the two additions */
            int row, col;
            float *p = j->tmp + (int64_t)thread * le_floats64(C);
            le_vision_patch_pos(r % j->hw, j->gw, hp->merge, &row, &col);
            le_pos_embed_row_ref(j->v->pos, hp->pos_side, (int)C, row, col, j->gh, j->gw, hp->faults, p);
            for (int64_t k = 0; k < C; k++) x[k] = (x[k] + j->b[k]) + p[k];
            break;
        }
        case RJ_QKV: { /* bias, then RoPE on the q and k thirds of the row */
            int64_t H = C / 3, half = hp->hidden / hp->n_head / 2, f = r % j->hw;
            for (int64_t k = 0; k < C; k++) x[k] += j->b[k];
            for (int part = 0; part < 2; part++)
                le_rope2d_row_ref(x + part * H, hp->n_head, hp->hidden / hp->n_head, j->cos_t + f * half,
                                  j->sin_t + f * half);
            break;
        }
        case RJ_GELU_TANH:
        case RJ_GELU_ERF:
            for (int64_t k = 0; k < C; k++) x[k] += j->b[k];
            (j->kind == RJ_GELU_TANH ? le_get_f32_kernels()->gelu_tanh : le_gelu_erf_ref)(x, C, x);
            break;
        case RJ_RESID: /* x + (y + b): the Linear's output (with its bias) added to the residual stream */
            for (int64_t k = 0; k < C; k++) x[k] += y[k] + j->b[k];
            break;
        default: /* RJ_BIAS */
            for (int64_t k = 0; k < C; k++) x[k] += j->b[k];
        }
    }
}

static void run_rows(le_vision *v, rows_job *j, int64_t rows) {
    j->v = v;
    int64_t grain = rows / (4 * le_pool_threads(v->pool)) + 1;
    le_parallel_for(v->pool, rows, grain, rows_task, j);
}

/* Scratch of one encode, in the order encode takes it. */
typedef struct {
    float *x, *xn, *qkv, *att, *ff; /* [n, H] [n, H] [n, 3H] [n, H] [n, F] */
    float *cos_t, *sin_t;           /* [hw, hd/2] each */
    int32_t *pos;                   /* [hw, 2] (row, col) of a frame's patches */
    float *scores;                  /* [n_threads][le_attention_bidir_row_floats(hw, hd)] */
    float *tmp;                     /* [n_threads][le_floats64(H)] */
} vision_bufs;

/* Bytes of each piece (sizes[]) and their sum; the matmuls' own scratch comes after them (mm: a packed block of
 * MM_ROWS weight rows and one dequantised row per thread, of the widest input). */
static size_t vision_plan(const le_vision *v, int64_t n, int64_t hw, size_t sizes[9]) {
    const le_vision_hparams *hp = &v->hp;
    int64_t H = hp->hidden, T = le_pool_threads(v->pool), half = H / hp->n_head / 2;
    int64_t widest = patch_len(hp) > (int64_t)hp->merge * hp->merge * H ? patch_len(hp)
                                                                         : (int64_t)hp->merge * hp->merge * H;
    if (hp->ffn > widest) widest = hp->ffn;
    int64_t floats[9] = {n * H, n * H, 3 * n * H, n * H, n * hp->ffn, hw * half, hw * half, 0,
                         T * le_attention_bidir_row_floats(hw, (int)(H / hp->n_head))};
    size_t total = 0;
    for (int i = 0; i < 9; i++) {
        sizes[i] = sizeof(float) * (size_t)floats[i];
        if (i == 7) sizes[i] = sizeof(int32_t) * (size_t)(2 * hw);
        total += le_align64(sizes[i]);
    }
    total += le_align64(sizeof(float) * (size_t)(T * le_floats64(H)));
    return total + le_align64(sizeof(float) * (size_t)(T * (MM_ROWS + 1) * widest));
}

static int take_bufs(le_vision *v, int64_t n, int64_t hw, vision_bufs *b) {
    size_t sizes[9];
    int rc = le_arena_reserve(&v->scratch, vision_plan(v, n, hw, sizes), "the vision tower");
    if (rc != LE_OK) return rc;
    le_arena *a = &v->scratch;
    a->used = 0;
    void **dst[9] = {(void **)&b->x, (void **)&b->xn, (void **)&b->qkv, (void **)&b->att, (void **)&b->ff,
                     (void **)&b->cos_t, (void **)&b->sin_t, (void **)&b->pos, (void **)&b->scores};
    for (int i = 0; i < 9; i++)
        if (!(*dst[i] = le_arena_take(a, sizes[i]))) return LE_FAIL(LE_ERR_NO_MEMORY, "vision scratch beyond the plan");
    b->tmp = le_arena_take(a, sizeof(float) * (size_t)(le_pool_threads(v->pool) * le_floats64(v->hp.hidden)));
    return b->tmp ? LE_OK : LE_FAIL(LE_ERR_NO_MEMORY, "vision scratch beyond the plan");
}

/* The matmuls: y [n, w.ne1] = x [n, w.ne0] W^T, cut into tasks of MM_TOK tokens x MM_ROWS weight rows, each one
 * call of the f32 table's gemm_nn (outer products in registers, le_simd.h) on the block of weight rows packed
 * transposed, [K, MM_ROWS], into the thread's buffer (F16/BF16/Q8_0 dequantised a row at a time on the way; f32
 * weights copied). Tasks go weight-row block outer, token block inner, so a thread's run of consecutive tasks
 * packs a row block once and reuses it for every token block of the run. The cut is fixed by the shapes and every
 * element's sum is fixed by K alone (gemm_nn's contract): any thread count gives the same bits.
 * Sizes: a packed block of 768 x 64 f32 (192 KiB; 768 KiB at K = 3072) and a token block of 48 x K stay in a core's
 * L2; gemm_nn's panel of 128 k x 64 rows (32 KiB) in L1. */
typedef struct {
    const le_weight *w;
    const float *x; /* [n, ne0] */
    float *y;       /* [n, ne1] */
    float *wbuf;    /* [n_threads][(MM_ROWS + 1) * ne0]: the packed row block [ne0, MM_ROWS], one dequantised row */
    int64_t n, n_tb, n_rb;
    le_gemm_nn_f32_fn gemm;
} mm_job;

/* bt [K, MM_ROWS] = rows r0 .. r0 + rows - 1 of w, transposed (row: scratch for one dequantised row) */
static void pack_rows(const le_weight *w, int64_t r0, int rows, float *bt, float *row) {
    int64_t K = w->ne0;
    for (int r = 0; r < rows; r++) {
        const float *src = (const float *)(w->data + (r0 + r) * w->nb1);
        if (w->type != LE_TYPE_F32) {
            w->tr->dequantize_row(w->data + (r0 + r) * w->nb1, row, K);
            src = row;
        }
        for (int64_t k = 0; k < K; k++) bt[k * MM_ROWS + r] = src[k];
    }
}

static void mm_tiles(void *ctx, int64_t t0, int64_t t1, int thread) {
    mm_job *j = ctx;
    const le_weight *w = j->w;
    int64_t K = w->ne0, have = -1; /* the row block in this thread's buffer */
    float *bt = j->wbuf + (int64_t)thread * (MM_ROWS + 1) * K;
    for (int64_t idx = t0; idx < t1; idx++) {
        int64_t rb = idx / j->n_tb, tb = idx % j->n_tb, r0 = rb * MM_ROWS, m0 = tb * MM_TOK;
        int rows = (int)(w->ne1 - r0 < MM_ROWS ? w->ne1 - r0 : MM_ROWS);
        int toks = (int)(j->n - m0 < MM_TOK ? j->n - m0 : MM_TOK);
        if (have != rb) pack_rows(w, r0, rows, bt, bt + MM_ROWS * K);
        have = rb;
        j->gemm(j->x + m0 * K, K, bt, MM_ROWS, j->y + m0 * w->ne1 + r0, w->ne1, toks, rows, (int)K);
    }
}

static int mm(le_vision *v, const le_weight *w, const float *x, int64_t n, float *y) {
    size_t mark = v->scratch.used;
    float *wbuf = le_arena_take(&v->scratch, sizeof(float) * (size_t)(le_pool_threads(v->pool) * (MM_ROWS + 1) *
                                                                        w->ne0));
    if (!wbuf) return LE_FAIL(LE_ERR_NO_MEMORY, "vision matmul: scratch beyond the plan");
    mm_job j = {w, x, y, wbuf, n, (n + MM_TOK - 1) / MM_TOK, (w->ne1 + MM_ROWS - 1) / MM_ROWS,
                le_get_f32_kernels()->gemm_nn};
    /* grain: one row block per chunk where there are >= 4 per thread (each block packed once, by one thread), else
     * ~4 chunks per thread */
    int64_t tasks = j.n_tb * j.n_rb, T = le_pool_threads(v->pool);
    le_parallel_for(v->pool, tasks, j.n_rb >= 4 * T ? j.n_tb : tasks / (4 * T) + 1, mm_tiles, &j);
    v->scratch.used = mark;
    return LE_OK;
}

/* One pre-LN ViT block on x [n, H]; seg: rows per frame (the attention's segments). */
static int vision_block(le_vision *v, int blk, const vision_bufs *b, int64_t n, int64_t hw) {
    const le_vision_hparams *hp = &v->hp;
    const le_weight *w = v->blk[blk];
#define W(s) (&w[(s) - N_GLOBAL])
#define F32(s) ((const float *)W(s)->data)
    int64_t H = hp->hidden;
    double t = v->profile ? le_now() : 0.0;
    rows_job ln1 = {.kind = RJ_LN, .cols = H, .x = b->xn, .y = b->x, .w = F32(LE_VW_LN1_W), .b = F32(LE_VW_LN1_B)};
    run_rows(v, &ln1, n);
    prof_mark(v, &t, VP_LN);
    int rc = mm(v, W(LE_VW_QKV_W), b->xn, n, b->qkv);
    if (rc != LE_OK) return rc;
    prof_mark(v, &t, VP_QKV);
    rows_job qkv = {.kind = RJ_QKV, .cols = 3 * H, .x = b->qkv, .b = F32(LE_VW_QKV_B), .hw = hw, .cos_t = b->cos_t,
                    .sin_t = b->sin_t};
    run_rows(v, &qkv, n);
    prof_mark(v, &t, VP_QKV_ROPE);
    le_attention_bidir(v->pool, b->qkv, n, hw, hp->n_head, (int)(H / hp->n_head), b->scores, b->att);
    prof_mark(v, &t, VP_ATTN);
    if ((rc = mm(v, W(LE_VW_O_W), b->att, n, b->xn)) != LE_OK) return rc;
    prof_mark(v, &t, VP_PROJ);
    rows_job o = {.kind = RJ_RESID, .cols = H, .x = b->x, .y = b->xn, .b = F32(LE_VW_O_B)};
    run_rows(v, &o, n);
    prof_mark(v, &t, VP_RESID);
    rows_job ln2 = {.kind = RJ_LN, .cols = H, .x = b->xn, .y = b->x, .w = F32(LE_VW_LN2_W), .b = F32(LE_VW_LN2_B)};
    run_rows(v, &ln2, n);
    prof_mark(v, &t, VP_LN);
    if ((rc = mm(v, W(LE_VW_FC1_W), b->xn, n, b->ff)) != LE_OK) return rc;
    prof_mark(v, &t, VP_FC1);
    int act = hp->faults & LE_VFAULT_FFN_GELU_ERF ? RJ_GELU_ERF : RJ_GELU_TANH; /* tanh form: the real one */
    rows_job fc1 = {.kind = act, .cols = hp->ffn, .x = b->ff, .b = F32(LE_VW_FC1_B)};
    run_rows(v, &fc1, n);
    prof_mark(v, &t, VP_GELU);
    if ((rc = mm(v, W(LE_VW_FC2_W), b->ff, n, b->att)) != LE_OK) return rc;
    prof_mark(v, &t, VP_FC2);
    rows_job fc2 = {.kind = RJ_RESID, .cols = H, .x = b->x, .y = b->att, .b = F32(LE_VW_FC2_B)};
    run_rows(v, &fc2, n);
    prof_mark(v, &t, VP_RESID);
    return LE_OK;
#undef W
#undef F32
}

/* The merger: LN per patch, M^2 consecutive patches as one row [M^2 H], fc1, GELU (erf form), fc2 -> out. */
static int vision_merger(le_vision *v, const vision_bufs *b, int64_t n, float *out) {
    const le_vision_hparams *hp = &v->hp;
    const le_weight *g = v->g;
    int64_t H = hp->hidden, m2 = (int64_t)hp->merge * hp->merge, rows = n / m2;
    rows_job ln = {.kind = RJ_LN, .cols = H, .x = b->xn, .y = b->x, .w = (const float *)g[LE_VW_MERGER_NORM_W].data,
                   .b = (const float *)g[LE_VW_MERGER_NORM_B].data};
    run_rows(v, &ln, n);
    int rc = mm(v, &g[LE_VW_MERGER_FC1_W], b->xn, rows, b->qkv); /* xn [n, H] is [n / M^2, M^2 H] */
    if (rc != LE_OK) return rc;
    int act = hp->faults & LE_VFAULT_MERGER_GELU_TANH ? RJ_GELU_TANH : RJ_GELU_ERF; /* erf form: the real one */
    rows_job fc1 = {.kind = act, .cols = m2 * H, .x = b->qkv, .b = (const float *)g[LE_VW_MERGER_FC1_B].data};
    run_rows(v, &fc1, rows);
    if ((rc = mm(v, &g[LE_VW_MERGER_FC2_W], b->qkv, rows, out)) != LE_OK) return rc;
    rows_job fc2 = {.kind = RJ_BIAS, .cols = hp->out_hidden, .x = out, .b = (const float *)g[LE_VW_MERGER_FC2_B].data};
    run_rows(v, &fc2, rows);
    return LE_OK;
}

static int check_image(const le_vision *v, const float *patches, int64_t n_patches, int64_t plen, int t, int h,
                       int w, const float *out, int64_t out_len) {
    const le_vision_hparams *hp = &v->hp;
    if (!v->finalized) return LE_FAIL(LE_ERR_INVALID_ARG, "vision tower not finalized (le_vision_finalize)");
    if (!patches || !out) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL patches or out");
    if (t < 1 || h < 1 || w < 1 || h % hp->merge || w % hp->merge)
        return LE_FAIL(LE_ERR_INVALID_ARG, "grid %d x %d x %d: each side must be a positive multiple of merge %d", t, h,
                       w, hp->merge);
    if (n_patches != (int64_t)t * h * w || plen != patch_len(hp))
        return LE_FAIL(LE_ERR_INVALID_ARG, "patches [%lld, %lld], expected [%lld, %lld] for grid %d x %d x %d",
                       (long long)n_patches, (long long)plen, (long long)t * h * w, (long long)patch_len(hp), t, h, w);
    int64_t want = n_patches / ((int64_t)hp->merge * hp->merge) * hp->out_hidden;
    if (out_len != want)
        return LE_FAIL(LE_ERR_INVALID_ARG, "out holds %lld floats, expected %lld", (long long)out_len, (long long)want);
    return LE_OK;
}

static int encode(le_vision *v, const float *patches, int64_t n_patches, int64_t plen, int t, int h, int w,
                  float *out, int64_t out_len);

/* encode with denormals flushed on the calling thread too, as the forward (le_threads.h) */
int le_vision_encode(le_vision *v, const float *patches, int64_t n_patches, int64_t plen, int t, int h, int w,
                     float *out, int64_t out_len) {
    unsigned fp = le_fp_enter();
    int rc = encode(v, patches, n_patches, plen, t, h, w, out, out_len);
    le_fp_leave(fp);
    return rc;
}

static int encode(le_vision *v, const float *patches, int64_t n_patches, int64_t plen, int t, int h, int w,
                  float *out, int64_t out_len) {
    if (!v) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL tower");
    int rc = check_image(v, patches, n_patches, plen, t, h, w, out, out_len);
    if (rc != LE_OK) return rc;
    const le_vision_hparams *hp = &v->hp;
    int64_t n = n_patches, hw = (int64_t)h * w;
    vision_bufs b;
    if ((rc = take_bufs(v, n, hw, &b)) != LE_OK) return rc;
    /* positions and RoPE angles of one frame (every frame has the same) */
    for (int64_t i = 0; i < hw; i++) le_vision_patch_pos(i, w, hp->merge, &b.pos[2 * i], &b.pos[2 * i + 1]);
    double tp = v->profile ? le_now() : 0.0;
    le_rope2d_table(b.pos, hw, hp->hidden / hp->n_head, hp->rope_theta, hp->faults, b.cos_t, b.sin_t);
    if ((rc = mm(v, &v->patch, patches, n, b.x)) != LE_OK) goto done;
    rows_job embed = {.kind = RJ_EMBED, .cols = hp->hidden, .x = b.x, .b = (const float *)v->g[LE_VW_PATCH_B].data,
                      .gh = h, .gw = w, .hw = hw, .tmp = b.tmp};
    run_rows(v, &embed, n);
    prof_mark(v, &tp, VP_PATCH);
    for (int blk = 0; blk < hp->depth && rc == LE_OK; blk++) rc = vision_block(v, blk, &b, n, hw);
    if (v->profile) tp = le_now();
    if (rc == LE_OK) rc = vision_merger(v, &b, n, out);
    prof_mark(v, &tp, VP_MERGER);
done:
    v->scratch.used = 0;
    return rc;
}
