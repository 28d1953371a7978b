/* le_quants.h — the quant types of GGUF files and their scalar reference kernels.
 * Type ids are ggml's (gguf-py GGMLQuantizationType). Rows hold n elements, n a
 * multiple of the type's block size; a row of a quantised type is n/block_size
 * consecutive blocks (block structs: le_blocks.h).
 * This header is fed to cffi's cdef: declarations only, no macros. */
#ifndef LE_QUANTS_H
#define LE_QUANTS_H

#include <stdint.h>
#include <stddef.h>

typedef enum {
    LE_TYPE_F32 = 0, LE_TYPE_F16 = 1, LE_TYPE_Q4_0 = 2, LE_TYPE_Q4_1 = 3,
    LE_TYPE_Q5_0 = 6, LE_TYPE_Q5_1 = 7, LE_TYPE_Q8_0 = 8, LE_TYPE_Q8_1 = 9,
    LE_TYPE_Q2_K = 10, LE_TYPE_Q3_K = 11, LE_TYPE_Q4_K = 12, LE_TYPE_Q5_K = 13,
    LE_TYPE_Q6_K = 14, LE_TYPE_Q8_K = 15, LE_TYPE_IQ4_NL = 20, LE_TYPE_IQ4_XS = 23,
    LE_TYPE_BF16 = 30, LE_TYPE_MXFP4 = 39,
    LE_TYPE_COUNT = 42
} le_type;

/* What the engine knows of one type: the capability table row. */
typedef struct {
    int type;             /* le_type id; -1 when the id is not supported */
    const char *name;     /* "q4_K" etc, as ggml names it */
    int block_size;       /* elements per block */
    int type_size;        /* bytes per block */
    int vec_dot_type;     /* activation type the dot product quantises to (Q8_0/Q8_1/Q8_K/F32) */
    int can_dequantize;   /* 1 if a dequantise kernel exists */
    int can_quantize;     /* 1 if a quantise kernel exists */
} le_type_info;

/* Fills *out for a type id; LE_ERR_UNSUPPORTED for ids the engine does not handle. */
int le_type_traits(int type, le_type_info *out);

/* src: n elements of `type`, dst: n f32. n must be a multiple of the block size. */
int le_dequantize_row(int type, const void *src, float *dst, int64_t n);

/* src: n f32, dst: n elements of `type` (the activation types Q8_0/Q8_1/Q8_K, and F16, BF16, F32). */
int le_quantize_row(int type, const float *src, void *dst, int64_t n);

/* Instruction-set tiers of the CPU kernels, lowest first. */
typedef enum {
    LE_ISA_REF = 0,          /* scalar C: the reference and the fallback */
    LE_ISA_SSSE3 = 1,        /* pmaddubsw: any x86-64 since 2006 (the legacy-host baseline) */
    LE_ISA_AVX2 = 2,         /* 256-bit integer + FMA */
    LE_ISA_AVX512VNNI = 3,   /* vpdpbusd on 512-bit registers */
    LE_ISA_COUNT = 4
} le_isa;

/* 1 if this CPU (CPUID + XGETBV) can run kernels of `isa`. */
int le_isa_supported(int isa);
/* Selects the kernels of `isa` (or the best lower tier per type); LE_ERR_UNAVAILABLE if the CPU lacks it.
 * Called once at load with the best supported tier (or $LE_FORCE_ISA); tests call it to run every path. */
int le_set_isa(int isa);
int le_get_isa(void);
/* The tier that serves `type`'s dot product now (after fallbacks); -1 if the type has none. */
int le_kernel_isa(int type);
/* *out = dot(x: n weights of `type`, y: n activations quantised to type's vec_dot_type). */
int le_vec_dot(int type, int64_t n, const void *x, const void *y, float *out);
/* out[t] = dot(x, y + t * ly) for t < nt (activation rows ly bytes apart) through the tier's several-row kernel
 * where it has one (le_has_vec_dot_n), else the one-row kernel per row: the same bits either way. */
int le_vec_dot_n(int type, int64_t n, const void *x, const void *y, int64_t ly, int nt, float *out);
int le_has_vec_dot_n(int type);
/* Quantises activations to an activation type (Q8_0/Q8_1/Q8_K) with the selected tier's kernel. */
int le_quantize_act(int act_type, const float *src, void *dst, int64_t n);

/* The f32 kernels of the decode step (Gated DeltaNet recurrent step, f32 dot product),
 * chosen with the same tier (ref and ssse3: the scalar reference); le_f32_isa: the tier
 * serving them. le_gdn_step: one head, one token; S [dk, dv] f32 updated in place:
 * S <- decay S; delta = beta (v - S^T k); S <- S + k delta^T; o = S^T q. */
int le_f32_isa(void);
/* 1 where the C core's work runs with denormal floats flushed to zero (MXCSR FTZ | DAZ, x86 builds; the caller's
 * own mode is put back after each call), else 0. */
int le_fp_flushes(void);
int le_gdn_step(float *S, const float *q, const float *k, const float *v, float decay, float beta, int dk, int dv,
                float *o);
int le_dot_f32_k(const float *a, const float *b, int64_t n, float *out);
/* c [m, n] = a [m, k] b [n, k]^T (all row-major, contiguous) with the selected tier's gemm tile kernel. */
int le_gemm_f32_k(const float *a, const float *b, int m, int n, int k, float *c);
/* c [m, n] = a [m, k] b [k, n] (all row-major, contiguous) with the selected tier's gemm_nn kernel. */
int le_gemm_nn_f32_k(const float *a, const float *b, int m, int n, int k, float *c);
/* y [n] = exp(x scale - max(x) scale) with the selected tier's exp_sub_sum (scale > 0); *sum = sum of y. */
int le_exp_sub_sum_f32_k(const float *x, float *y, int64_t n, float scale, double *sum);
/* out [n] = gelu_tanh(x) (the vision MLP's activation) with the selected tier's kernel; in place allowed. */
int le_gelu_tanh_f32_k(const float *x, int64_t n, float *out);
/* out [n] = silu(x) = x / (1 + exp(-x)) with the selected tier's kernel; in place allowed. */
int le_silu_f32_k(const float *x, int64_t n, float *out);

/* IEEE half <-> float, round to nearest even (numpy's conversion). */
float le_fp16_to_fp32(uint16_t h);
uint16_t le_fp32_to_fp16(float f);

#endif
