/* le_ops.h — the reference ops of the forward pass and the model's internal structs
 * (internal; not fed to cffi). One op per file: matmul.c, norm.c, rope.c, attention.c,
 * gdn.c, moe.c; model.c strings them into layers, state.c owns the sequence state.
 * All activations are f32; shapes are given as [rows, cols] row-major. */
#ifndef LE_OPS_H
#define LE_OPS_H

#include <stdint.h>

#include "le_dispatch.h"
#include "le_simd.h"
#include "le_model.h"
#include "le_threads.h"

/* ---- arena.c -----------------------------------------------------------------------
 * The scratch memory of a forward pass, planned and sized before the pass (as ggml plans its work buffer) and
 * reused: an op takes 64-byte-aligned pieces by bumping `used` and gives them back by restoring it, so a pass whose
 * plan fits calls no allocator (a decode step after the first). Owners: each state (le_forward) and the model
 * (le_moe_routed). Each op's plan counts what it takes, in le_align64 units (the MoE's: for its worst routing);
 * a take beyond the plan fails, never writes past the block. */
typedef struct {
    uint8_t *base;   /* 64-byte aligned */
    size_t size;     /* bytes at base */
    size_t used;     /* bytes taken by the ops now running */
    int64_t growths; /* times base was (re)allocated (le_state_scratch_growths) */
} le_arena;

#define LE_ARENA_ALIGN 64
static inline size_t le_align64(size_t bytes) { return (bytes + LE_ARENA_ALIGN - 1) & ~(size_t)(LE_ARENA_ALIGN - 1); }
/* n floats rounded up to whole 64-byte lines: the stride of per-thread slices, so no two threads share a line. */
static inline int64_t le_floats64(int64_t n) { return (n + 15) & ~(int64_t)15; }
/* Makes room for a plan of `bytes` (nothing is kept: only between passes); the old block stays if this fails. */
int le_arena_reserve(le_arena *a, size_t bytes, const char *what);
void le_arena_free(le_arena *a);
/* le_align64(bytes) from the arena, or NULL when the plan left too little: a plan that missed a piece
 * (the op fails with LE_ERR_NO_MEMORY; never past the end). */
static inline void *le_arena_take(le_arena *a, size_t bytes) {
    size_t b = le_align64(bytes);
    if (b > a->size - a->used) return NULL;
    void *p = a->base + a->used;
    a->used += b;
    return p;
}

/* A weight: ne1 rows of ne0 elements of `type`, rows nb1 bytes apart, ne2 matrices
 * (experts) nb2 bytes apart; data points into the GGUF map. */
typedef struct {
    const uint8_t *data;
    const le_type_traits_t *tr;
    int type;
    int64_t ne0, ne1, ne2, nb1, nb2;
} le_weight;

/* Where the time of a forward pass goes (le_model_profile): wall time on the calling thread
 * per phase, parallel jobs included. */
enum {
    LE_PROF_EMBED_NORM, LE_PROF_GDN_PROJ, LE_PROF_GDN_CORE, LE_PROF_GDN_OUT, LE_PROF_ATTN_PROJ,
    LE_PROF_ATTN_CORE, LE_PROF_ATTN_OUT, LE_PROF_MOE_ROUTER, LE_PROF_FFN_GATE_UP, LE_PROF_FFN_ACT,
    LE_PROF_FFN_DOWN, LE_PROF_FFN_COMBINE, LE_PROF_HEAD, LE_PROF_COUNT
};

struct le_model {
    le_hparams hp;
    le_pool *pool;
    le_weight global[3];           /* TOKEN_EMBD, OUTPUT_NORM, OUTPUT */
    le_weight (*layer)[LE_W_COUNT]; /* [n_layer][LE_W_COUNT] */
    int n_gdn, n_attn;
    int *state_index;              /* layer -> index among GDN layers or among attention layers */
    int int8;                      /* 1: quantised weights use the integer dot products (W4A8 ...) */
    int profile;                   /* 1: accumulate phase times into prof */
    double *prof;                  /* [LE_PROF_COUNT] seconds */
    le_arena scratch;              /* le_moe_routed's (the forward pass uses its state's) */
    le_arena batch;                /* le_forward_seqs': several states, so none of theirs */
    volatile int32_t *yield_flag;  /* le_model_set_yield: a single-sequence pass calls yield_hook between layers */
    void (*yield_hook)(void *ctx); /* when *yield_flag != 0; never inside the hook's own passes (in_yield) */
    void *yield_ctx;
    int in_yield;
    int64_t yields;                /* hook calls so far */
};

/* Profiling marks: t holds the time of the previous mark; the span since goes to `phase`. */
double le_now(void);
static inline void le_prof(const le_model *m, double *t, int phase) {
    if (!m->profile) return;
    double now = le_now();
    m->prof[phase] += now - *t;
    *t = now;
}
static inline double le_prof_start(const le_model *m) { return m->profile ? le_now() : 0.0; }

struct le_state {
    const le_model *m;
    int n_ctx, pos;
    int rope_delta; /* M-RoPE: a text token at sequence position i rotates at i + rope_delta (le_forward_embd) */
    int64_t conv_floats, ssm_floats, kv_floats; /* per layer */
    float *conv;   /* [n_gdn][K-1][conv_dim]: the last K-1 pre-conv inputs, oldest first */
    float *ssm;    /* [n_gdn][H_v][d_k][d_v] */
    float *k, *v;  /* [n_attn][n_ctx][n_head_kv * head_dim] */
    le_arena scratch; /* le_forward's: grown to le_forward_plan of the longest pass so far */
};

/* The sequences of a pass (le_forward_seqs; le_forward: one). Sequence s owns the contiguous rows
 * row0[s] .. row0[s+1]-1 of the pass's activations: its tokens at positions st[s]->pos onward, in its own state
 * (conv + SSM states, KV cache). The mixers run each sequence's recurrence and attention in its state; every other
 * op is per row, so a row's result does not depend on the other rows of the pass. */
typedef struct {
    int n_seq;
    le_state *const *st; /* [n_seq], distinct */
    const int *row0;     /* [n_seq + 1]; row0[n_seq] = the pass's rows */
} le_seqs;

/* ---- matmul.c ---------------------------------------------------------------------
 * y[t, o] = sum_i W_e[o, i] * x[t, i] for t < n_tok, o < W.ne1.
 * x: [n_tok, W.ne0] with row stride ldx; y: [n_tok, W.ne1] with row stride ldy.
 * int8 = 1 and a quantised weight type with an integer kernel: x is quantised once to
 * the type's activation type and each row goes through the selected vec_dot (W4A8 ...).
 * Otherwise each weight row is dequantised once and dotted in f32 with every token. */
int le_matmul(le_pool *pool, le_arena *a, int int8, const le_weight *w, int64_t expert, const float *x,
              int64_t n_tok, int64_t ldx, float *y, int64_t ldy);
/* One product of a batch: y[t, o] = sum_i W_e[o, i] * x[t, i], t < n_tok (0: skipped), o < W.ne1.
 * With w_up set it is a SwiGLU pair (gate W, up W_up, same shape): y[t, o] = SiLU((W x)[o]) * (W_up x)[o],
 * both rows computed by the same task, so the activation needs no pass of its own. */
typedef struct {
    const le_weight *w;
    int64_t expert;
    const float *x;
    int64_t n_tok, ldx;
    float *y;
    int64_t ldy;
    const le_weight *w_up;
} le_mm;
/* Runs independent products as one parallel job over their concatenated output rows;
 * inputs shared by several products (same x, n_tok, ldx, activation type) are quantised once.
 * Scratch from a, given back before returning (le_matmul_batch_plan). */
int le_matmul_batch(le_pool *pool, le_arena *a, int int8, const le_mm *mm, int n_mm);
/* The same products, each thread computing its share of every product's rows (le_split): the same results;
 * a thread reads the same rows of an expert whatever else the batch holds (the lookahead prefetches them). */
int le_matmul_batch_split(le_pool *pool, le_arena *a, int int8, const le_mm *mm, int n_mm);
/* The scratch a batch takes: its n_mm products' table, q_bytes of quantised inputs (each distinct input's
 * rows rounded up to 64 bytes) and, when f32_ne0 > 0 (a product on the f32 path, rows of at most f32_ne0),
 * two dequantised rows for each of n_threads threads. */
size_t le_matmul_scratch(int n_threads, int n_mm, size_t q_bytes, int64_t f32_ne0);
/* le_matmul_scratch of these products (only shapes, types and x's address, which tells shared inputs, are read). */
size_t le_matmul_batch_plan(int n_threads, int int8, const le_mm *mm, int n_mm);
/* The selected tier's integer dot product for w's rows; NULL when w runs on the f32 path (int8 off,
 * F32/F16/BF16 weights, or no kernel for the type). */
le_vec_dot_fn le_int_kernel(int int8, const le_weight *w);
/* The last i < n with first[i] <= g (first ascending, first[0] <= g): the piece of a job's global index g (a batch's
 * product holding row g, a pass's sequence holding row tile g). */
static inline int le_piece_of(const int64_t *first, int n, int64_t g) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (first[mid] <= g) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Piece i's share of the global range [g0, g1), as rows local to the piece: [*r0, *r1) (empty when *r0 >= *r1). */
static inline void le_piece_rows(const int64_t *first, int i, int64_t g0, int64_t g1, int64_t *r0, int64_t *r1) {
    *r0 = (g0 > first[i] ? g0 : first[i]) - first[i];
    *r1 = (g1 < first[i + 1] ? g1 : first[i + 1]) - first[i];
}

/* Bytes of one activation row quantised for w (w.ne0 values in w's vec_dot type). */
int64_t le_act_row_bytes(const le_weight *w);
/* rows activation rows of w.ne0 floats (ldx apart) quantised for w's integer kernel into out
 * (rows * le_act_row_bytes(w) bytes), on the pool's threads from LE_ROWS_PAR_MIN rows. */
void le_quantize_acts(le_pool *pool, const le_weight *w, const float *x, int64_t rows, int64_t ldx, uint8_t *out);
/* One row of a weight as f32 (embedding lookup). out: [W.ne0] */
void le_weight_row(const le_weight *w, int64_t row, float *out);

/* The plain f32 dot product (fixed summation order; le_simd.h). Hot decode paths use the
 * selected tier's le_get_f32_kernels()->dot instead. */
static inline float le_dot_f32(const float *a, const float *b, int64_t n) { return le_dot_f32_plain(a, b, n); }

/* ---- norm.c ------------------------------------------------------------------------ */
/* out[i] = x[i] / sqrt(mean(x^2) + eps) * w[i]  (w NULL: no weight). In-place allowed. */
void le_rmsnorm(const float *x, const float *w, int n, float eps, float *out);
/* x <- x / sqrt(sum(x^2) + eps)  (transformers' l2norm, eps 1e-6) */
void le_l2norm(float *x, int n, float eps);
static inline float le_sigmoid(float x) { return 1.0f / (1.0f + __builtin_expf(-x)); }
static inline float le_softplus(float x) { return x > 20.0f ? x : __builtin_log1pf(__builtin_expf(x)); }

/* ---- rope.c ------------------------------------------------------------------------
 * NeoX rotation of the first n_rot dims of each head (pairs (i, i + n_rot/2)) at rope
 * position pos = (t, h, w); IMRoPE sections pick each frequency slot's component as ggml
 * does (text tokens: t = h = w, e = 0); without sections every slot takes t. x: n_heads heads,
 * head_stride floats apart (the q heads of [q | gate] rows: 2 * head_dim); each angle is
 * computed once for all heads. */
void le_rope_neox(float *x, int n_heads, int head_stride, int n_rot, const int sections[4], float theta,
                  const int32_t pos[3], int faults);

/* ---- gdn.c -------------------------------------------------------------------------
 * The Gated DeltaNet mixer of one layer (GDN layer gi among the model's) for the rows of sq. x: [n, n_embd]
 * normalised input; out: [n, n_embd]; each sequence's conv [K-1, conv_dim] and ssm [H_v, d_k, d_v] of layer gi
 * updated in place. chunked: the chunked form for each sequence of more than one token. */
int le_gdn_layer(const le_model *m, le_arena *a, const le_weight *w, const float *x, const le_seqs *sq, int gi,
                 int chunked, float *out);
/* Scratch bytes le_gdn_layer takes for n tokens (either form). */
size_t le_gdn_plan(const le_model *m, const le_weight *w, int n);

/* ---- attention.c -------------------------------------------------------------------
 * The gated attention mixer (attention layer ai among the model's) for the rows of sq: sequence s's rows at its
 * positions st[s]->pos onward, rotated at rope positions rope_pos [n][3] (t, h, w), reading and writing its
 * caches of layer ai ([n_ctx, n_head_kv * head_dim] K and V) at those positions. x, out: [n, n_embd]. */
int le_attention_layer(const le_model *m, le_arena *a, const le_weight *w, const float *x, const le_seqs *sq,
                       int ai, const int32_t *rope_pos, float *out);
/* Scratch bytes le_attention_layer takes for n rows in contexts of at most n_ctx (scores: n_ctx per thread, so that
 * a decode step's need does not grow with its position). */
size_t le_attention_plan(const le_model *m, const le_weight *w, int n, int n_ctx);

/* ---- moe.c / ffn -------------------------------------------------------------------
 * Feed-forward of one layer: dense SwiGLU or the MoE block. x: [n, n_embd]; out: [n, n_embd] */
int le_ffn_layer(const le_model *m, le_arena *a, const le_weight *w, const float *x, int n, float *out);
/* Scratch bytes le_ffn_layer takes for n tokens; le_moe_routed_plan: le_moe_routed's for up to n_expert experts. */
size_t le_ffn_plan(const le_model *m, const le_weight *w, int n);
size_t le_moe_routed_plan(const le_model *m, const le_weight *w);

/* ---- model.c -----------------------------------------------------------------------
 * Scratch bytes a pass of n rows takes on states of at most n_ctx positions (le_forward: one state; le_forward_seqs:
 * up to n): the activations x, h, y, the rows' rope positions and sequence table, then the largest of any layer's
 * mixer and FFN and the LM head (each gives its scratch back before the next). */
size_t le_forward_plan(const le_model *m, int n, int n_ctx);

#endif
