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

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "le_caps.h"
#include "le_dispatch.h"
#include "le_internal.h"
#include "le_simd.h"

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

/* ---- kernel tiers -----------------------------------------------------------------
 * The selected integer kernels live in g_vec_dot / g_act, chosen per type from the
 * per-ISA tables of cpu_simd/ (le_simd.h): the requested tier, or the best lower tier
 * that has a kernel for the type. Selected once at first use with the best tier the
 * CPU supports, or the one $LE_FORCE_ISA names (ref|ssse3|avx2|avx512vnni, if the CPU
 * has it); le_set_isa changes it (tests run every path that way). */

static le_vec_dot_fn g_vec_dot[LE_TYPE_COUNT];
static le_vec_dot_n_fn g_vec_dot_n[LE_TYPE_COUNT]; /* the tier of g_vec_dot_isa[t]'s, or NULL */
static signed char g_vec_dot_isa[LE_TYPE_COUNT];
static le_quantize_row_fn g_act[LE_TYPE_COUNT];
static int g_isa = LE_ISA_REF;
static le_f32_kernels g_f32;
static int g_f32_isa = LE_ISA_REF;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

static const char *const k_isa_names[LE_ISA_COUNT] = {"ref", "ssse3", "avx2", "avx512vnni"};

int le_isa_supported(int isa) {
    le_cpu_info c;
    le_cpu_detect(&c);
    switch (isa) {
    case LE_ISA_REF: return 1;
    case LE_ISA_SSSE3: return c.ssse3;
    case LE_ISA_AVX2: return c.avx2 && c.fma;
    case LE_ISA_AVX512VNNI: return c.avx512f && c.avx512bw && c.avx512vl && c.avx512vnni;
    default: return 0;
    }
}

static void select_isa(int isa) {
    for (int t = 0; t < LE_TYPE_COUNT; t++) {
        g_vec_dot[t] = NULL;
        g_vec_dot_isa[t] = -1;
        g_act[t] = k_traits[t].name && (t == LE_TYPE_Q8_0 || t == LE_TYPE_Q8_1 || t == LE_TYPE_Q8_K)
                       ? k_traits[t].quantize_row : NULL;
        for (int i = isa; i >= 0; i--)
            if (le_vec_dot_table[i][t]) {
                g_vec_dot[t] = le_vec_dot_table[i][t];
                g_vec_dot_isa[t] = (signed char)i;
                break;
            }
        g_vec_dot_n[t] = g_vec_dot_isa[t] >= 0 ? le_vec_dot_n_table[(int)g_vec_dot_isa[t]][t] : NULL;
        for (int i = isa; i >= 0; i--)
            if (le_quantize_act_table[i][t]) {
                g_act[t] = le_quantize_act_table[i][t];
                break;
            }
    }
    for (int i = isa; i >= 0; i--)
        if (le_f32_table[i].gdn_step) {
            g_f32 = le_f32_table[i];
            g_f32_isa = i;
            break;
        }
    g_isa = isa;
}

static void init_once(void) {
    int best = LE_ISA_REF;
    for (int i = LE_ISA_COUNT - 1; i > 0; i--)
        if (le_isa_supported(i)) {
            best = i;
            break;
        }
    const char *force = getenv("LE_FORCE_ISA");
    if (force)
        for (int i = 0; i < LE_ISA_COUNT; i++)
            if (strcmp(force, k_isa_names[i]) == 0 && le_isa_supported(i)) best = i;
    select_isa(best);
}

int le_set_isa(int isa) {
    pthread_once(&g_once, init_once);
    if (isa < 0 || isa >= LE_ISA_COUNT) return LE_FAIL(LE_ERR_INVALID_ARG, "ISA tier %d out of range", isa);
    if (!le_isa_supported(isa))
        return LE_FAIL(LE_ERR_UNAVAILABLE, "this CPU cannot run %s kernels", k_isa_names[isa]);
    pthread_mutex_lock(&g_mu);
    select_isa(isa);
    pthread_mutex_unlock(&g_mu);
    return LE_OK;
}

int le_get_isa(void) {
    pthread_once(&g_once, init_once);
    return g_isa;
}

int le_kernel_isa(int type) {
    pthread_once(&g_once, init_once);
    return type >= 0 && type < LE_TYPE_COUNT ? g_vec_dot_isa[type] : -1;
}

le_vec_dot_fn le_get_vec_dot(int type) {
    pthread_once(&g_once, init_once);
    return type >= 0 && type < LE_TYPE_COUNT ? g_vec_dot[type] : NULL;
}

le_vec_dot_n_fn le_get_vec_dot_n(int type) {
    pthread_once(&g_once, init_once);
    return type >= 0 && type < LE_TYPE_COUNT ? g_vec_dot_n[type] : NULL;
}

int le_vec_dot_n(int type, int64_t n, const void *x, const void *y, int64_t ly, int nt, float *out) {
    const le_type_traits_t *t;
    int rc = check_row("le_vec_dot_n", type, x, y, n, &t);
    if (rc != LE_OK) return rc;
    if (out == NULL || nt < 0) return LE_FAIL(LE_ERR_INVALID_ARG, "le_vec_dot_n: out is NULL or nt < 0");
    le_vec_dot_fn f = le_get_vec_dot(type);
    if (f == NULL) return LE_FAIL(LE_ERR_UNSUPPORTED, "le_vec_dot_n: no integer dot product for %s", t->name);
    le_vec_dot_rows(f, le_get_vec_dot_n(type), n, out, 1, x, y, ly, nt);
    return LE_OK;
}

void le_vec_dot_rows(le_vec_dot_fn vd, le_vec_dot_n_fn vdn, int64_t n, float *s, int64_t ls, const void *x,
                     const void *y, int64_t ly, int nt) {
    if (vdn && nt > 1) {
        vdn(n, s, ls, x, y, ly, nt);
        return;
    }
    for (int t = 0; t < nt; t++) vd(n, s + t * ls, x, (const uint8_t *)y + t * ly);
}

int le_has_vec_dot_n(int type) {
    return le_get_vec_dot_n(type) != NULL;
}

le_quantize_row_fn le_get_act_quantizer(int act_type) {
    pthread_once(&g_once, init_once);
    return act_type >= 0 && act_type < LE_TYPE_COUNT ? g_act[act_type] : NULL;
}

int le_vec_dot(int type, int64_t n, const void *x, const void *y, float *out) {
    const le_type_traits_t *t;
    int rc = check_row("le_vec_dot", type, x, y, n, &t);
    if (rc != LE_OK) return rc;
    if (out == NULL) return LE_FAIL(LE_ERR_INVALID_ARG, "le_vec_dot: out is NULL");
    le_vec_dot_fn f = le_get_vec_dot(type);
    if (f == NULL) return LE_FAIL(LE_ERR_UNSUPPORTED, "le_vec_dot: no integer dot product for %s", t->name);
    f(n, out, x, y);
    return LE_OK;
}

int le_quantize_act(int act_type, const float *src, void *dst, int64_t n) {
    const le_type_traits_t *t;
    int rc = check_row("le_quantize_act", act_type, src, dst, n, &t);
    if (rc != LE_OK) return rc;
    le_quantize_row_fn f = le_get_act_quantizer(act_type);
    if (f == NULL) return LE_FAIL(LE_ERR_UNSUPPORTED, "le_quantize_act: %s is not an activation type", t->name);
    f(src, dst, n);
    return LE_OK;
}

const le_f32_kernels *le_get_f32_kernels(void) {
    pthread_once(&g_once, init_once);
    return &g_f32;
}

int le_f32_isa(void) {
    pthread_once(&g_once, init_once);
    return g_f32_isa;
}

int le_gdn_step(float *S, const float *q, const float *k, const float *v, float decay, float beta, int dk, int dv,
                float *o) {
    if (!S || !q || !k || !v || !o) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gdn_step: NULL argument");
    if (dk < 1 || dv < 1 || dv > LE_GDN_MAX_DV)
        return LE_FAIL(LE_ERR_INVALID_ARG, "le_gdn_step: dk = %d, dv = %d (dv <= %d)", dk, dv, LE_GDN_MAX_DV);
    le_get_f32_kernels()->gdn_step(S, q, k, v, decay, beta, dk, dv, o);
    return LE_OK;
}

int le_dot_f32_k(const float *a, const float *b, int64_t n, float *out) {
    if (!a || !b || !out || n < 0) return LE_FAIL(LE_ERR_INVALID_ARG, "le_dot_f32_k: bad argument");
    *out = le_get_f32_kernels()->dot(a, b, n);
    return LE_OK;
}

int le_gemm_f32_k(const float *a, const float *b, int m, int n, int k, float *c) {
    if (!a || !b || !c || m < 0 || n < 0 || k < 0) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gemm_f32_k: bad argument");
    le_get_f32_kernels()->gemm_tile(a, k, b, k, c, n, m, n, k);
    return LE_OK;
}

int le_gemm_nn_f32_k(const float *a, const float *b, int m, int n, int k, float *c) {
    if (!a || !b || !c || m < 0 || n < 0 || k < 0) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gemm_nn_f32_k: bad argument");
    le_get_f32_kernels()->gemm_nn(a, k, b, n, c, n, m, n, k);
    return LE_OK;
}

int le_exp_sub_sum_f32_k(const float *x, float *y, int64_t n, float scale, double *sum) {
    if (!x || !y || !sum || n < 0 || !(scale > 0.0f))
        return LE_FAIL(LE_ERR_INVALID_ARG, "le_exp_sub_sum_f32_k: bad argument (scale %g)", scale);
    *sum = le_get_f32_kernels()->exp_sub_sum(x, y, n, scale);
    return LE_OK;
}

int le_gelu_tanh_f32_k(const float *x, int64_t n, float *out) {
    if (!x || !out || n < 0) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gelu_tanh_f32_k: bad argument");
    le_get_f32_kernels()->gelu_tanh(x, n, out);
    return LE_OK;
}

int le_silu_f32_k(const float *x, int64_t n, float *out) {
    if (!x || !out || n < 0) return LE_FAIL(LE_ERR_INVALID_ARG, "le_silu_f32_k: bad argument");
    le_get_f32_kernels()->silu(x, n, out);
    return LE_OK;
}
