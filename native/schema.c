/* schema.c — the tensor schema of qwen35 / qwen35moe / qwen3next (le_schema.h; spec §3.3).
 *
 * Every tensor the engine reads from a GGUF, in file-check order: which architectures and layers hold it, the weight
 * slot it fills, its shape as dimension symbols, the row range of a fused tensor a slot takes, and its flags.
 * Test: tests/test_schema.py (the table against gguf-py's tensor names and llama.cpp-converted files). */
#include <string.h>

#include "le_internal.h"
#include "le_schema.h"

#define ALL (LE_ARCH_QWEN35 | LE_ARCH_QWEN35MOE | LE_ARCH_QWEN3NEXT)
#define Q35 (LE_ARCH_QWEN35 | LE_ARCH_QWEN35MOE)
#define NEXT LE_ARCH_QWEN3NEXT
#define MOE (LE_ARCH_QWEN35MOE | LE_ARCH_QWEN3NEXT)
#define DENSE LE_ARCH_QWEN35
#define D(x) LE_D_##x
#define WHOLE {D(ZERO), D(ZERO)}

/* name, archs, kind, group, alt, slot, {ne0, ne1, ne2}, rows, flags */
static const le_tensor_spec TABLE[] = {
    {"token_embd.weight", ALL, LE_K_GLOBAL, "embeddings", 0, LE_W_TOKEN_EMBD, {D(EMBD), D(VOCAB), D(ONE)}, WHOLE, 0},
    {"output_norm.weight", ALL, LE_K_GLOBAL, "embeddings", 0, LE_W_OUTPUT_NORM, {D(EMBD), D(ONE), D(ONE)}, WHOLE,
     LE_T_F32},
    {"output.weight", ALL, LE_K_GLOBAL, "lm head", 0, LE_W_OUTPUT, {D(EMBD), D(VOCAB), D(ONE)}, WHOLE, LE_T_OPTIONAL},

    {"attn_norm.weight", ALL, LE_K_LAYER, "norms", 0, LE_W_ATTN_NORM, {D(EMBD), D(ONE), D(ONE)}, WHOLE, LE_T_F32},
    {"post_attention_norm.weight", ALL, LE_K_LAYER, "norms", 0, LE_W_POST_NORM, {D(EMBD), D(ONE), D(ONE)}, WHOLE,
     LE_T_F32},

    /* Gated DeltaNet */
    {"ssm_conv1d.weight", ALL, LE_K_GDN, "gated deltanet", 0, LE_W_SSM_CONV, {D(KERNEL), D(CONV), D(ONE)}, WHOLE,
     LE_T_F32},
    {"ssm_dt.bias", ALL, LE_K_GDN, "gated deltanet", 0, LE_W_SSM_DT, {D(HV), D(ONE), D(ONE)}, WHOLE, LE_T_F32},
    {"ssm_a", ALL, LE_K_GDN, "gated deltanet", 0, LE_W_SSM_A, {D(HV), D(ONE), D(ONE)}, WHOLE, LE_T_F32},
    {"ssm_norm.weight", ALL, LE_K_GDN, "gated deltanet", 0, LE_W_SSM_NORM, {D(DV), D(ONE), D(ONE)}, WHOLE, LE_T_F32},
    {"ssm_out.weight", ALL, LE_K_GDN, "gated deltanet", 0, LE_W_SSM_OUT, {D(INNER), D(EMBD), D(ONE)}, WHOLE, 0},
    {"attn_qkv.weight", ALL, LE_K_GDN, "gdn input projection", 0, LE_W_GDN_QKV, {D(EMBD), D(CONV), D(ONE)}, WHOLE, 0},
    {"attn_gate.weight", ALL, LE_K_GDN, "gdn input projection", 0, LE_W_GDN_GATE, {D(EMBD), D(INNER), D(ONE)}, WHOLE,
     0},
    /* qwen3next may fuse qkv and the gate (not run here: cpu/model.py says so) */
    {"ssm_in.weight", NEXT, LE_K_GDN, "gdn input projection", 1, -1, {D(EMBD), D(CONV_INNER), D(ONE)}, WHOLE, 0},
    {"ssm_beta.weight", Q35, LE_K_GDN, "gdn beta/alpha", 0, LE_W_SSM_BETA, {D(EMBD), D(HV), D(ONE)}, WHOLE, 0},
    {"ssm_alpha.weight", Q35, LE_K_GDN, "gdn beta/alpha", 0, LE_W_SSM_ALPHA, {D(EMBD), D(HV), D(ONE)}, WHOLE, 0},
    {"ssm_ba.weight", NEXT, LE_K_GDN, "gdn beta/alpha", 0, -1, {D(EMBD), D(HV2), D(ONE)}, WHOLE, 0},

    /* gated attention */
    {"attn_output.weight", ALL, LE_K_ATTN, "attention", 0, LE_W_O, {D(ATTN_OUT), D(EMBD), D(ONE)}, WHOLE, 0},
    {"attn_q_norm.weight", ALL, LE_K_ATTN, "attention", 0, LE_W_Q_NORM, {D(HD), D(ONE), D(ONE)}, WHOLE, LE_T_F32},
    {"attn_k_norm.weight", ALL, LE_K_ATTN, "attention", 0, LE_W_K_NORM, {D(HD), D(ONE), D(ONE)}, WHOLE, LE_T_F32},
    {"attn_q.weight", ALL, LE_K_ATTN, "attention projections", 0, LE_W_Q, {D(EMBD), D(QG), D(ONE)}, WHOLE, 0},
    {"attn_k.weight", ALL, LE_K_ATTN, "attention projections", 0, LE_W_K, {D(EMBD), D(KV), D(ONE)}, WHOLE, 0},
    {"attn_v.weight", ALL, LE_K_ATTN, "attention projections", 0, LE_W_V, {D(EMBD), D(KV), D(ONE)}, WHOLE, 0},
    /* fused Q+gate | K | V */
    {"attn_qkv.weight", ALL, LE_K_ATTN, "attention projections", 1, LE_W_Q, {D(EMBD), D(QKV), D(ONE)},
     {D(ZERO), D(QG)}, 0},
    {"attn_qkv.weight", ALL, LE_K_ATTN, "attention projections", 1, LE_W_K, {D(EMBD), D(QKV), D(ONE)},
     {D(QG), D(QG_KV)}, 0},
    {"attn_qkv.weight", ALL, LE_K_ATTN, "attention projections", 1, LE_W_V, {D(EMBD), D(QKV), D(ONE)},
     {D(QG_KV), D(QKV)}, 0},

    /* MoE: router, routed experts, gated shared expert */
    {"ffn_gate_inp.weight", MOE, LE_K_MOE, "router", 0, LE_W_GATE_INP, {D(EMBD), D(NEXP), D(ONE)}, WHOLE, 0},
    {"ffn_gate_exps.weight", MOE, LE_K_MOE, "experts", 0, LE_W_GATE_EXPS, {D(EMBD), D(FFEXP), D(NEXP)}, WHOLE,
     LE_T_EXPERT},
    {"ffn_up_exps.weight", MOE, LE_K_MOE, "experts", 0, LE_W_UP_EXPS, {D(EMBD), D(FFEXP), D(NEXP)}, WHOLE,
     LE_T_EXPERT},
    {"ffn_down_exps.weight", MOE, LE_K_MOE, "experts", 0, LE_W_DOWN_EXPS, {D(FFEXP), D(EMBD), D(NEXP)}, WHOLE,
     LE_T_EXPERT},
    /* fused gate | up, rows [0, ff) and [ff, 2 ff) of every expert */
    {"ffn_gate_up_exps.weight", MOE, LE_K_MOE, "experts", 1, LE_W_GATE_EXPS, {D(EMBD), D(FFEXP2), D(NEXP)},
     {D(ZERO), D(FFEXP)}, LE_T_EXPERT},
    {"ffn_gate_up_exps.weight", MOE, LE_K_MOE, "experts", 1, LE_W_UP_EXPS, {D(EMBD), D(FFEXP2), D(NEXP)},
     {D(FFEXP), D(FFEXP2)}, LE_T_EXPERT},
    {"ffn_down_exps.weight", MOE, LE_K_MOE, "experts", 1, LE_W_DOWN_EXPS, {D(FFEXP), D(EMBD), D(NEXP)}, WHOLE,
     LE_T_EXPERT},
    {"ffn_gate_inp_shexp.weight", MOE, LE_K_SHEXP, "shared expert", 0, LE_W_GATE_INP_SHEXP, {D(EMBD), D(ONE), D(ONE)},
     WHOLE, LE_T_F32},
    {"ffn_gate_shexp.weight", MOE, LE_K_SHEXP, "shared expert", 0, LE_W_GATE_SHEXP, {D(EMBD), D(SHFF), D(ONE)}, WHOLE,
     0},
    {"ffn_up_shexp.weight", MOE, LE_K_SHEXP, "shared expert", 0, LE_W_UP_SHEXP, {D(EMBD), D(SHFF), D(ONE)}, WHOLE, 0},
    {"ffn_down_shexp.weight", MOE, LE_K_SHEXP, "shared expert", 0, LE_W_DOWN_SHEXP, {D(SHFF), D(EMBD), D(ONE)}, WHOLE,
     0},

    /* dense SwiGLU */
    {"ffn_gate.weight", DENSE, LE_K_DENSE, "feed-forward", 0, LE_W_FFN_GATE, {D(EMBD), D(FF), D(ONE)}, WHOLE, 0},
    {"ffn_up.weight", DENSE, LE_K_DENSE, "feed-forward", 0, LE_W_FFN_UP, {D(EMBD), D(FF), D(ONE)}, WHOLE, 0},
    {"ffn_down.weight", DENSE, LE_K_DENSE, "feed-forward", 0, LE_W_FFN_DOWN, {D(FF), D(EMBD), D(ONE)}, WHOLE, 0},
};
#define N_ROWS ((int)(sizeof TABLE / sizeof TABLE[0]))

static const char *ARCH_NAME[LE_ARCH_COUNT] = {"qwen35", "qwen35moe", "qwen3next"};

const le_tensor_spec *le_schema(int *n) {
    if (n) *n = N_ROWS;
    return TABLE;
}

const char *le_schema_arch_name(int i) { return i >= 0 && i < LE_ARCH_COUNT ? ARCH_NAME[i] : NULL; }

int le_schema_dims(const le_hparams *hp, int64_t *d) {
    if (!hp || !d) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL hparams or dims");
    int64_t conv = 2 * (int64_t)hp->ssm_n_group * hp->ssm_d_state + hp->ssm_d_inner;
    int64_t qg = 2 * (int64_t)hp->n_head * hp->head_dim, kv = (int64_t)hp->n_head_kv * hp->head_dim;
    d[LE_D_ZERO] = 0;
    d[LE_D_ONE] = 1;
    d[LE_D_EMBD] = hp->n_embd;
    d[LE_D_VOCAB] = hp->n_vocab;
    d[LE_D_CONV] = conv;
    d[LE_D_INNER] = hp->ssm_d_inner;
    d[LE_D_CONV_INNER] = conv + hp->ssm_d_inner;
    d[LE_D_HV] = hp->ssm_dt_rank;
    d[LE_D_HV2] = 2 * (int64_t)hp->ssm_dt_rank;
    d[LE_D_DV] = hp->ssm_dt_rank ? hp->ssm_d_inner / hp->ssm_dt_rank : 0;
    d[LE_D_KERNEL] = hp->ssm_conv_kernel;
    d[LE_D_HD] = hp->head_dim;
    d[LE_D_QG] = qg;
    d[LE_D_KV] = kv;
    d[LE_D_QG_KV] = qg + kv;
    d[LE_D_QKV] = qg + 2 * kv;
    d[LE_D_ATTN_OUT] = (int64_t)hp->n_head * hp->head_dim;
    d[LE_D_FF] = hp->n_ff;
    d[LE_D_NEXP] = hp->n_expert;
    d[LE_D_FFEXP] = hp->n_ff_exp;
    d[LE_D_FFEXP2] = 2 * (int64_t)hp->n_ff_exp;
    d[LE_D_SHFF] = hp->n_ff_shexp;
    return LE_OK;
}

int le_schema_layer_kinds(const le_hparams *hp, int layer) {
    if (layer < 0) return LE_K_GLOBAL;
    if (layer >= hp->n_layer || layer >= (int)(sizeof hp->recurrent / sizeof hp->recurrent[0])) return 0;
    int k = LE_K_LAYER | (hp->recurrent[layer] ? LE_K_GDN : LE_K_ATTN);
    if (hp->n_expert == 0) return k | LE_K_DENSE;
    return k | LE_K_MOE | (hp->n_ff_shexp ? LE_K_SHEXP : 0);
}

const le_tensor_spec *le_schema_slot(int slot) {
    for (int i = 0; i < N_ROWS; i++)
        if (TABLE[i].slot == slot) return &TABLE[i];
    return NULL;
}

int le_schema_slot_shape(const le_hparams *hp, int layer, int slot, int64_t *ne) {
    int64_t d[LE_D_COUNT];
    le_schema_dims(hp, d);
    int kinds = le_schema_layer_kinds(hp, layer);
    ne[0] = ne[1] = ne[2] = 1;
    for (int i = 0; i < N_ROWS; i++) {
        const le_tensor_spec *t = &TABLE[i];
        if (t->slot != slot || !(t->kind & kinds)) continue;
        ne[0] = d[t->ne[0]];
        ne[1] = t->rows[1] != LE_D_ZERO ? d[t->rows[1]] - d[t->rows[0]] : d[t->ne[1]];
        ne[2] = d[t->ne[2]];
        return 1;
    }
    return 0;
}
