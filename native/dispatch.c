/* dispatch.c — the capability table of quant types and the public row entry points.
 *
 * One row per ggml type id the engine supports (le_dispatch.h: sizes, activation
 * type of the dot product, row kernels). Today every kernel is the scalar
 * reference of quants_ref.c; SIMD paths (cpu_simd/) will replace a row's pointers
 * with the best the CPU has, the reference staying the test oracle.
 *
 * The entry points of le_quants.h validate everything the caller controls (type
 * id, NULL pointers, n < 0, n not a multiple of the block) and return a status
 * with a message (le_last_error) instead of crashing. They cannot check buffer
 * lengths: the Python wrappers (legacy_engine/_native.py) do.
 * Test: python -m pytest tests/test_quants.py
 */
#include <stddef.h>
#include <stdint.h>

#include "le_dispatch.h"
#include "le_internal.h"

/* Adapters from the typed reference kernels to the table's void-pointer
 * signatures (calling through a cast function pointer would be undefined). */
#define LE_DEQUANT_ADAPTER(name, block_t)                                          \
    static void dequant_##name(const void *x, float *y, int64_t n) {              \
        dequantize_row_##name##_ref((const block_t *)x, y, n);                     \
    }
#define LE_QUANT_ADAPTER(name, block_t)                                            \
    static void quant_##name(const float *x, void *y, int64_t n) {                \
        quantize_row_##name##_ref(x, (block_t *)y, n);                             \
    }

LE_DEQUANT_ADAPTER(f32, float)
LE_DEQUANT_ADAPTER(f16, uint16_t)
LE_DEQUANT_ADAPTER(bf16, uint16_t)
LE_DEQUANT_ADAPTER(q4_0, block_q4_0)
LE_DEQUANT_ADAPTER(q4_1, block_q4_1)
LE_DEQUANT_ADAPTER(q5_0, block_q5_0)
LE_DEQUANT_ADAPTER(q5_1, block_q5_1)
LE_DEQUANT_ADAPTER(q8_0, block_q8_0)
LE_DEQUANT_ADAPTER(q8_1, block_q8_1)
LE_DEQUANT_ADAPTER(q2_K, block_q2_K)
LE_DEQUANT_ADAPTER(q3_K, block_q3_K)
LE_DEQUANT_ADAPTER(q4_K, block_q4_K)
LE_DEQUANT_ADAPTER(q5_K, block_q5_K)
LE_DEQUANT_ADAPTER(q6_K, block_q6_K)
LE_DEQUANT_ADAPTER(q8_K, block_q8_K)
LE_DEQUANT_ADAPTER(iq4_nl, block_iq4_nl)
LE_DEQUANT_ADAPTER(iq4_xs, block_iq4_xs)
LE_DEQUANT_ADAPTER(mxfp4, block_mxfp4)

LE_QUANT_ADAPTER(f32, float)
LE_QUANT_ADAPTER(f16, uint16_t)
LE_QUANT_ADAPTER(bf16, uint16_t)
LE_QUANT_ADAPTER(q8_0, block_q8_0)
LE_QUANT_ADAPTER(q8_1, block_q8_1)
LE_QUANT_ADAPTER(q8_K, block_q8_K)

/* name, elements per block, bytes per block, dequantiser, quantiser (or NULL) */
#define ROW(name_str, bs, block_t, vdt, deq, q) \
    { name_str, bs, (int)sizeof(block_t), vdt, deq, q }

/* Indexed by ggml type id; rows left zero (name NULL) are unsupported ids
 * (IQ2/IQ3/IQ1, TQ, I8..F64, NVFP4, ...).
 * vec_dot_type is ggml-cpu's type_traits_cpu[].vec_dot_type (spec §4). */
static const le_type_traits_t k_traits[LE_TYPE_COUNT] = {
    [LE_TYPE_F32]    = ROW("f32",    1,        float,        LE_TYPE_F32,  dequant_f32,    quant_f32),
    [LE_TYPE_F16]    = ROW("f16",    1,        uint16_t,     LE_TYPE_F16,  dequant_f16,    quant_f16),
    [LE_TYPE_BF16]   = ROW("bf16",   1,        uint16_t,     LE_TYPE_BF16, dequant_bf16,   quant_bf16),
    [LE_TYPE_Q4_0]   = ROW("q4_0",   QK4_0,    block_q4_0,   LE_TYPE_Q8_0, dequant_q4_0,   NULL),
    [LE_TYPE_Q4_1]   = ROW("q4_1",   QK4_1,    block_q4_1,   LE_TYPE_Q8_1, dequant_q4_1,   NULL),
    [LE_TYPE_Q5_0]   = ROW("q5_0",   QK5_0,    block_q5_0,   LE_TYPE_Q8_0, dequant_q5_0,   NULL),
    [LE_TYPE_Q5_1]   = ROW("q5_1",   QK5_1,    block_q5_1,   LE_TYPE_Q8_1, dequant_q5_1,   NULL),
    [LE_TYPE_Q8_0]   = ROW("q8_0",   QK8_0,    block_q8_0,   LE_TYPE_Q8_0, dequant_q8_0,   quant_q8_0),
    [LE_TYPE_Q8_1]   = ROW("q8_1",   QK8_1,    block_q8_1,   LE_TYPE_Q8_1, dequant_q8_1,   quant_q8_1),
    [LE_TYPE_Q2_K]   = ROW("q2_K",   QK_K,     block_q2_K,   LE_TYPE_Q8_K, dequant_q2_K,   NULL),
    [LE_TYPE_Q3_K]   = ROW("q3_K",   QK_K,     block_q3_K,   LE_TYPE_Q8_K, dequant_q3_K,   NULL),
    [LE_TYPE_Q4_K]   = ROW("q4_K",   QK_K,     block_q4_K,   LE_TYPE_Q8_K, dequant_q4_K,   NULL),
    [LE_TYPE_Q5_K]   = ROW("q5_K",   QK_K,     block_q5_K,   LE_TYPE_Q8_K, dequant_q5_K,   NULL),
    [LE_TYPE_Q6_K]   = ROW("q6_K",   QK_K,     block_q6_K,   LE_TYPE_Q8_K, dequant_q6_K,   NULL),
    [LE_TYPE_Q8_K]   = ROW("q8_K",   QK_K,     block_q8_K,   LE_TYPE_Q8_K, dequant_q8_K,   quant_q8_K),
    [LE_TYPE_IQ4_NL] = ROW("iq4_nl", QK4_NL,   block_iq4_nl, LE_TYPE_Q8_0, dequant_iq4_nl, NULL),
    [LE_TYPE_IQ4_XS] = ROW("iq4_xs", QK_K,     block_iq4_xs, LE_TYPE_Q8_K, dequant_iq4_xs, NULL),
    [LE_TYPE_MXFP4]  = ROW("mxfp4",  QK_MXFP4, block_mxfp4,  LE_TYPE_Q8_0, dequant_mxfp4,  NULL),
};

const le_type_traits_t *le_get_type_traits(int type) {
    if (type < 0 || type >= LE_TYPE_COUNT || k_traits[type].name == NULL) return NULL;
    return &k_traits[type];
}

int le_type_traits(int type, le_type_info *out) {
    if (out == NULL) return LE_FAIL(LE_ERR_INVALID_ARG, "le_type_traits: out is NULL");
    const le_type_traits_t *t = le_get_type_traits(type);
    if (t == NULL) {
        out->type = -1;
        out->name = "";
        out->block_size = out->type_size = 0;
        out->vec_dot_type = -1;
        out->can_dequantize = out->can_quantize = 0;
        return LE_FAIL(LE_ERR_UNSUPPORTED, "ggml type id %d is not supported", type);
    }
    out->type = type;
    out->name = t->name;
    out->block_size = t->block_size;
    out->type_size = t->type_size;
    out->vec_dot_type = t->vec_dot_type;
    out->can_dequantize = t->dequantize_row != NULL;
    out->can_quantize = t->quantize_row != NULL;
    return LE_OK;
}

/* The checks both row entry points share; *t is set on LE_OK. */
static int check_row(const char *fn, int type, const void *src, const void *dst, int64_t n,
                     const le_type_traits_t **t) {
    *t = le_get_type_traits(type);
    if (*t == NULL)
        return LE_FAIL(LE_ERR_UNSUPPORTED, "%s: ggml type id %d is not supported", fn, type);
    if (src == NULL || dst == NULL)
        return LE_FAIL(LE_ERR_INVALID_ARG, "%s(%s): %s is NULL", fn, (*t)->name,
                       src == NULL ? "src" : "dst");
    if (n < 0)
        return LE_FAIL(LE_ERR_INVALID_ARG, "%s(%s): n = %lld is negative", fn, (*t)->name,
                       (long long)n);
    if (n % (*t)->block_size != 0)
        return LE_FAIL(LE_ERR_INVALID_ARG,
                       "%s(%s): n = %lld is not a multiple of the block size %d; pad the row",
                       fn, (*t)->name, (long long)n, (*t)->block_size);
    return LE_OK;
}

int le_dequantize_row(int type, const void *src, float *dst, int64_t n) {
    const le_type_traits_t *t;
    int rc = check_row("le_dequantize_row", type, src, dst, n, &t);
    if (rc != LE_OK) return rc;
    if (t->dequantize_row == NULL)
        return LE_FAIL(LE_ERR_UNSUPPORTED, "le_dequantize_row: no dequantiser for %s", t->name);
    t->dequantize_row(src, dst, n);
    return LE_OK;
}

int le_quantize_row(int type, const float *src, void *dst, int64_t n) {
    const le_type_traits_t *t;
    int rc = check_row("le_quantize_row", type, src, dst, n, &t);
    if (rc != LE_OK) return rc;
    if (t->quantize_row == NULL)
        return LE_FAIL(LE_ERR_UNSUPPORTED,
                       "le_quantize_row: no quantiser for %s (only f32, f16, bf16, q8_0, q8_1, q8_K)",
                       t->name);
    t->quantize_row(src, dst, n);
    return LE_OK;
}
