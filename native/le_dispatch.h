/* le_dispatch.h — the capability table of quant types (internal; not fed to cffi).
 *
 * One row per supported ggml type: sizes, the activation type its dot product
 * quantises to, and the row kernels. dispatch.c holds the table and the public
 * entry points of le_quants.h; quants_ref.c holds the scalar `_ref` kernels
 * declared below, which are the fallback every faster path is tested against.
 * Later SIMD paths (cpu_simd/) plug in by pointing a row's kernels elsewhere.
 */
#ifndef LE_DISPATCH_H
#define LE_DISPATCH_H

#include <stdint.h>

#include "le_blocks.h"
#include "le_quants.h"

/* x: n/block_size blocks of the row's type -> y: n f32. n is a multiple of the block size. */
typedef void (*le_dequantize_row_fn)(const void *x, float *y, int64_t n);
/* x: n f32 -> y: n/block_size blocks of the row's type. */
typedef void (*le_quantize_row_fn)(const float *x, void *y, int64_t n);

/* *s = dot(x: a weight row of n elements, y: the activations in the type's vec_dot_type). */
typedef void (*le_vec_dot_fn)(int64_t n, float *s, const void *x, const void *y);
/* s[t * ls] = dot(x, y + t * ly) for t < nt: one weight row against nt activation rows, each block of x unpacked
 * once for all of them; every s[t * ls] bit-equal to the same tier's le_vec_dot_fn on (x, y + t * ly). */
typedef void (*le_vec_dot_n_fn)(int64_t n, float *s, int64_t ls, const void *x, const void *y, int64_t ly, int nt);

typedef struct {
    const char *name;                    /* ggml's spelling: "q4_K"; NULL marks an unsupported id */
    int block_size;                      /* elements per block */
    int type_size;                       /* bytes per block: sizeof(block_x) */
    int vec_dot_type;                    /* le_type the activations are quantised to */
    le_dequantize_row_fn dequantize_row; /* NULL where none */
    le_quantize_row_fn quantize_row;     /* NULL where none */
} le_type_traits_t;

/* The row of a type id, or NULL when the id is unknown or unsupported. */
const le_type_traits_t *le_get_type_traits(int type);

/* The selected tier's integer dot product of a weight type (NULL: none, use dequantise + f32),
 * and the selected activation quantiser of an activation type (never NULL for Q8_0/Q8_1/Q8_K). */
le_vec_dot_fn le_get_vec_dot(int type);
le_quantize_row_fn le_get_act_quantizer(int act_type);
/* The selected tier's several-row dot product of a weight type, from the tier that serves le_get_vec_dot(type);
 * NULL where that tier has none (the caller loops le_get_vec_dot's kernel: the same bits). */
le_vec_dot_n_fn le_get_vec_dot_n(int type);
/* s[t * ls] = vd(x, y + t * ly) for t < nt: through vdn where given (and nt > 1), else vd row by row (same bits). */
void le_vec_dot_rows(le_vec_dot_fn vd, le_vec_dot_n_fn vdn, int64_t n, float *s, int64_t ls, const void *x,
                     const void *y, int64_t ly, int nt);

/* ---- scalar references (quants_ref.c) --------------------------------------- */

/* bf16 bits -> f32 (exact: the bits are the top half of an f32). */
float le_bf16_to_fp32(uint16_t h);
/* f32 -> bf16 bits, ggml's rounding: nearest-even on the top 16 bits, NaN kept quiet. */
uint16_t le_fp32_to_bf16(float f);

void dequantize_row_f32_ref(const float *x, float *y, int64_t n);
void dequantize_row_f16_ref(const uint16_t *x, float *y, int64_t n);
void dequantize_row_bf16_ref(const uint16_t *x, float *y, int64_t n);
void dequantize_row_q4_0_ref(const block_q4_0 *x, float *y, int64_t n);
void dequantize_row_q4_1_ref(const block_q4_1 *x, float *y, int64_t n);
void dequantize_row_q5_0_ref(const block_q5_0 *x, float *y, int64_t n);
void dequantize_row_q5_1_ref(const block_q5_1 *x, float *y, int64_t n);
void dequantize_row_q8_0_ref(const block_q8_0 *x, float *y, int64_t n);
void dequantize_row_q8_1_ref(const block_q8_1 *x, float *y, int64_t n);
void dequantize_row_q2_K_ref(const block_q2_K *x, float *y, int64_t n);
void dequantize_row_q3_K_ref(const block_q3_K *x, float *y, int64_t n);
void dequantize_row_q4_K_ref(const block_q4_K *x, float *y, int64_t n);
void dequantize_row_q5_K_ref(const block_q5_K *x, float *y, int64_t n);
void dequantize_row_q6_K_ref(const block_q6_K *x, float *y, int64_t n);
void dequantize_row_q8_K_ref(const block_q8_K *x, float *y, int64_t n);
void dequantize_row_iq4_nl_ref(const block_iq4_nl *x, float *y, int64_t n);
void dequantize_row_iq4_xs_ref(const block_iq4_xs *x, float *y, int64_t n);
void dequantize_row_mxfp4_ref(const block_mxfp4 *x, float *y, int64_t n);

void quantize_row_f32_ref(const float *x, float *y, int64_t n);
void quantize_row_f16_ref(const float *x, uint16_t *y, int64_t n);
void quantize_row_bf16_ref(const float *x, uint16_t *y, int64_t n);
void quantize_row_q8_0_ref(const float *x, block_q8_0 *y, int64_t n);
void quantize_row_q8_1_ref(const float *x, block_q8_1 *y, int64_t n);
void quantize_row_q8_K_ref(const float *x, block_q8_K *y, int64_t n);

#endif
