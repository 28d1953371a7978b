/* le_schema.h — the tensor schema of each architecture: every GGUF tensor the engine reads, the weight slot it
 * fills, the layers that hold it and its shape as a rule over the hyperparameters (spec §3.3).
 *
 * One table (native/schema.c), in llama.cpp's llama-arch.cpp spirit: the C loader checks le_model_set_weight
 * against it, and through cffi the Python side reads it for the file check (format/schema.py), the CPU loader, the
 * planner's expert bytes and the GPU upload. A tensor fused from several slots (attention's attn_qkv, the experts'
 * ffn_gate_up_exps) is one row per slot, each taking a row range of ne1 (inside every expert for 3-D tensors).
 * Rows of one group are alternative layouts: alt 0 the standard one, a file holds one alternative per group.
 * This header is fed to cffi's cdef: declarations only, no macros. */
#ifndef LE_SCHEMA_H
#define LE_SCHEMA_H

#include <stdint.h>

#include "le_model.h"

/* Architectures (GGUF general.architecture), as bits of le_tensor_spec.archs. */
enum { LE_ARCH_QWEN35 = 1, LE_ARCH_QWEN35MOE = 2, LE_ARCH_QWEN3NEXT = 4, LE_ARCH_COUNT = 3 };

/* Which layers hold a tensor: le_schema_layer_kinds(hp, layer) has the row's kind bit. */
enum {
    LE_K_GLOBAL = 1,  /* layer -1: embedding, output norm, head */
    LE_K_LAYER = 2,   /* every layer */
    LE_K_GDN = 4,     /* Gated DeltaNet layers (hp.recurrent) */
    LE_K_ATTN = 8,    /* gated full-attention layers */
    LE_K_DENSE = 16,  /* dense SwiGLU FFN (n_expert == 0) */
    LE_K_MOE = 32,    /* routed experts */
    LE_K_SHEXP = 64   /* the gated shared expert (MoE with n_ff_shexp > 0) */
};

/* Dimensions a shape is written in; le_schema_dims resolves them for a model. */
enum {
    LE_D_ZERO = 0, LE_D_ONE = 1,
    LE_D_EMBD = 2, LE_D_VOCAB = 3,
    LE_D_CONV = 4,        /* GDN conv channels: 2 H_k d_k + H_v d_v */
    LE_D_INNER = 5,       /* H_v d_v */
    LE_D_CONV_INNER = 6,  /* CONV + INNER (qwen3next's fused ssm_in) */
    LE_D_HV = 7, LE_D_HV2 = 8, LE_D_DV = 9, LE_D_KERNEL = 10,
    LE_D_HD = 11,         /* attention head_dim */
    LE_D_QG = 12,         /* Q and its gate: 2 n_head head_dim */
    LE_D_KV = 13,         /* n_head_kv head_dim */
    LE_D_QG_KV = 14,      /* QG + KV */
    LE_D_QKV = 15,        /* QG + 2 KV */
    LE_D_ATTN_OUT = 16,   /* n_head head_dim */
    LE_D_FF = 17, LE_D_NEXP = 18, LE_D_FFEXP = 19, LE_D_FFEXP2 = 20, LE_D_SHFF = 21,
    LE_D_COUNT = 22
};

/* Row flags. */
enum {
    LE_T_F32 = 1,       /* read as an f32 array by the ops (norms, conv taps, gates): must be F32 in the file */
    LE_T_EXPERT = 2,    /* routed experts [n_expert, rows, cols]: what streams from host memory */
    LE_T_OPTIONAL = 4   /* its group may be absent (output.weight: the head tied to token_embd) */
};

typedef struct {
    const char *name;   /* GGUF name; for layer rows the part after "blk.N." */
    int archs;          /* LE_ARCH_* bits of the architectures that hold it */
    int kind;           /* one LE_K_* bit */
    const char *group;  /* the group whose alternatives it belongs to */
    int alt;            /* 0: the standard layout */
    int slot;           /* the le_weight_slot it fills; -1: a tensor this engine does not run */
    int ne[3];          /* LE_D_* of ne0, ne1, ne2 (LE_D_ONE where unused) */
    int rows[2];        /* LE_D_* of the ne1 range the slot takes of a fused tensor; both LE_D_ZERO: all */
    int flags;          /* LE_T_* */
} le_tensor_spec;

/* The table: *n rows, in the order of the groups, each group's alternatives in order. */
const le_tensor_spec *le_schema(int *n);
/* Architecture i (0 <= i < LE_ARCH_COUNT): its GGUF name ("qwen35"); its bit is 1 << i. NULL out of range. */
const char *le_schema_arch_name(int i);
/* dims[LE_D_COUNT] of a model (dims[LE_D_ZERO] = 0, dims[LE_D_ONE] = 1). */
int le_schema_dims(const le_hparams *hp, int64_t *dims);
/* The LE_K_* bits of layer `layer` (-1: LE_K_GLOBAL). */
int le_schema_layer_kinds(const le_hparams *hp, int layer);
/* The shape slot `slot` must have in layer `layer`: ne[3]. Returns 1, or 0 where the layer has no such slot. */
int le_schema_slot_shape(const le_hparams *hp, int layer, int slot, int64_t *ne);
/* The slot's standard tensor (its first row): NULL for a slot out of range. */
const le_tensor_spec *le_schema_slot(int slot);

#endif
