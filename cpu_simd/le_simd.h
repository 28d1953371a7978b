/* le_simd.h — the integer-SIMD kernel tables (internal; not fed to cffi).
 *
 * vec_dot: *s = sum_i w[i] * a[i] for one weight row `x` (n elements of the weight
 * type, n/block_size blocks) and one activation row `y` already quantised to the
 * type's vec_dot_type (Q8_0 / Q8_1 / Q8_K): integer products inside a block, block
 * scales applied in f32 (W4A8, W5A8, W6A8, W8A8). n is a multiple of the block size.
 *
 * One table per ISA; a NULL entry means "this ISA has no kernel for that type" and
 * dispatch (native/dispatch.c) falls back to the next lower ISA, ending at the scalar
 * reference (`*_ref`, native/vec_dot_ref.c), which every type has and which is the
 * oracle of the SIMD variants (tests/test_vec_dot.py).
 * Each SIMD source compiles for its ISA inside the file (#pragma GCC target), so one
 * build carries every path and still runs on a baseline x86-64 CPU. */
#ifndef LE_SIMD_H
#define LE_SIMD_H

#include <stdint.h>

#include "le_dispatch.h"

/* [LE_ISA_*][ggml type id] */
extern const le_vec_dot_fn le_vec_dot_table[LE_ISA_COUNT][LE_TYPE_COUNT];
/* Activation quantisers per ISA for the vec_dot types (Q8_0, Q8_1, Q8_K); NULL: fall back. */
extern const le_quantize_row_fn le_quantize_act_table[LE_ISA_COUNT][LE_TYPE_COUNT];

#endif
