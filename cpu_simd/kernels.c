/* kernels.c — the per-ISA kernel tables of le_simd.h.
 *
 * Row LE_ISA_REF holds the scalar references (native/vec_dot_ref.c); each SIMD tier
 * lists the kernels its files in cpu_simd/ provide. A NULL entry falls back to the
 * next lower tier (native/dispatch.c). */
#include <stddef.h>

#include "le_simd.h"

const le_vec_dot_fn le_vec_dot_table[LE_ISA_COUNT][LE_TYPE_COUNT] = {
    [LE_ISA_REF] = {0},
};

const le_quantize_row_fn le_quantize_act_table[LE_ISA_COUNT][LE_TYPE_COUNT] = {
    [LE_ISA_REF] = {0},
};
