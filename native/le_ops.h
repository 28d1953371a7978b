/* le_ops.h — the reference ops of the forward pass and the model's internal structs
 * (internal; not fed to cffi). One op per file: matmul.c, norm.c, rope.c, attention.c,
 * gdn.c, moe.c; model.c strings them into layers, state.c owns the sequence state.
 * All activations are f32; shapes are given as [rows, cols] row-major. */
#ifndef LE_OPS_H
#define LE_OPS_H

#include <stdint.h>

#include "le_dispatch.h"
#include "le_model.h"
#include "le_threads.h"

/* A weight: ne1 rows of ne0 elements of `type`, rows nb1 bytes apart, ne2 matrices
 * (experts) nb2 bytes apart; data points into the GGUF map. */
typedef struct {
    const uint8_t *data;
    const le_type_traits_t *tr;
    int type;
    int64_t ne0, ne1, ne2, nb1, nb2;
} le_weight;

struct le_model {
    le_hparams hp;
    le_pool *pool;
    le_weight global[3];           /* TOKEN_EMBD, OUTPUT_NORM, OUTPUT */
    le_weight (*layer)[LE_W_COUNT]; /* [n_layer][LE_W_COUNT] */
    int n_gdn, n_attn;
    int *state_index;              /* layer -> index among GDN layers or among attention layers */
    int int8;                      /* 1: quantised weights use the integer dot products (W4A8 ...) */
};

struct le_state {
    const le_model *m;
    int n_ctx, pos;
    int64_t conv_floats, ssm_floats, kv_floats; /* per layer */
    float *conv;   /* [n_gdn][K-1][conv_dim]: the last K-1 pre-conv inputs, oldest first */
    float *ssm;    /* [n_gdn][H_v][d_k][d_v] */
    float *k, *v;  /* [n_attn][n_ctx][n_head_kv * head_dim] */
};

/* ---- matmul.c ---------------------------------------------------------------------
 * y[t, o] = sum_i W_e[o, i] * x[t, i] for t < n_tok, o < W.ne1.
 * x: [n_tok, W.ne0] with row stride ldx; y: [n_tok, W.ne1] with row stride ldy.
 * int8 = 1 and a quantised weight type with an integer kernel: x is quantised once to
 * the type's activation type and each row goes through the selected vec_dot (W4A8 ...).
 * Otherwise each weight row is dequantised once and dotted in f32 with every token. */
int le_matmul(le_pool *pool, int int8, const le_weight *w, int64_t expert, const float *x, int64_t n_tok,
              int64_t ldx, float *y, int64_t ldy);
/* One row of a weight as f32 (embedding lookup). out: [W.ne0] */
void le_weight_row(const le_weight *w, int64_t row, float *out);

/* Dot product with 8 independent partial sums: gcc vectorises it without -ffast-math.
 * The summation order is fixed, so results do not depend on the batch or thread split. */
static inline float le_dot_f32(const float *a, const float *b, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) acc[k] += a[i + k] * b[i + k];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* ---- norm.c ------------------------------------------------------------------------ */
/* out[i] = x[i] / sqrt(mean(x^2) + eps) * w[i]  (w NULL: no weight). In-place allowed. */
void le_rmsnorm(const float *x, const float *w, int n, float eps, float *out);
/* x <- x / sqrt(sum(x^2) + eps)  (transformers' l2norm, eps 1e-6) */
void le_l2norm(float *x, int n, float eps);
static inline float le_silu(float x) { return x / (1.0f + __builtin_expf(-x)); }
static inline float le_sigmoid(float x) { return 1.0f / (1.0f + __builtin_expf(-x)); }
static inline float le_softplus(float x) { return x > 20.0f ? x : __builtin_log1pf(__builtin_expf(x)); }

/* ---- rope.c ------------------------------------------------------------------------
 * NeoX rotation of the first n_rot dims of each head (pairs (i, i + n_rot/2)) at text
 * position pos; IMRoPE sections pick each frequency slot's position component as ggml
 * does (text tokens: t = h = w = pos, e = 0). x: [n_heads, head_dim] */
void le_rope_neox(float *x, int n_heads, int head_dim, int n_rot, const int sections[4], float theta, int pos,
                  int faults);

/* ---- gdn.c -------------------------------------------------------------------------
 * The Gated DeltaNet mixer of one layer for n tokens. x: [n, n_embd] normalised input;
 * out: [n, n_embd]; conv: [K-1, conv_dim], ssm: [H_v, d_k, d_v] updated in place. */
int le_gdn_layer(const le_model *m, const le_weight *w, const float *x, int n, float *conv, float *ssm,
                 int chunked, float *out);

/* ---- attention.c -------------------------------------------------------------------
 * The gated attention mixer for n tokens at positions pos..pos+n-1.
 * kc, vc: [n_ctx, n_head_kv * head_dim] caches, written at those positions. */
int le_attention_layer(const le_model *m, const le_weight *w, const float *x, int n, int pos, float *kc,
                       float *vc, float *out);

/* ---- moe.c / ffn -------------------------------------------------------------------
 * Feed-forward of one layer: dense SwiGLU or the MoE block. x: [n, n_embd]; out: [n, n_embd] */
int le_ffn_layer(const le_model *m, const le_weight *w, const float *x, int n, float *out);

#endif
