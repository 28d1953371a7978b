/* le_vision_ops.h — the vision tower's ops (internal; not fed to cffi; the test entry points are in
 * include/le_vision.h). One op per file: layernorm.c, gelu.c, rope_2d.c, attention_bidir.c, pos_embed.c;
 * vision.c strings them into the tower. All f32, shapes [rows, cols] row-major. */
#ifndef LE_VISION_OPS_H
#define LE_VISION_OPS_H

#include <stdint.h>

#include "le_threads.h"
#include "le_vision.h"

/* (row, col) in patches of patch `within` (0 .. h*w-1) of a frame in the processor's order: (h/M blocks,
 * w/M blocks, M x M group row-major) — transformers' get_vision_position_ids / the interpolation's decode. */
static inline void le_vision_patch_pos(int64_t within, int w, int merge, int *row, int *col) {
    int64_t mm = (int64_t)merge * merge, blocks_w = w / merge;
    int64_t in_col = within % merge, in_row = (within / merge) % merge;
    int64_t block_col = (within / mm) % blocks_w, block_row = within / (mm * blocks_w);
    *row = (int)(block_row * merge + in_row);
    *col = (int)(block_col * merge + in_col);
}

/* ---- rope_2d.c ----------------------------------------------------------------------
 * cos, sin: [n, hd/2] the angles of each row's pairs (pos [n, 2] = (row, col)); computed once per image and
 * shared by every head and block. */
void le_rope2d_table(const int32_t *pos, int64_t n, int head_dim, float theta, int faults, float *cos_t,
                     float *sin_t);
/* One row: n_head heads of head_dim at x (contiguous), rotated by the row's cos/sin [hd/2]. */
void le_rope2d_row_ref(float *x, int n_head, int head_dim, const float *cos_r, const float *sin_r);

/* ---- attention_bidir.c ---------------------------------------------------------------
 * qkv [n, 3 H] (H = n_head * head_dim; q | k | v head-major), out [n, H]; every row attends to every row of its
 * segment of seg_len rows (a frame). scores: [n_threads][le_attention_bidir_row_floats(seg_len, head_dim)] per-thread
 * scratch (a tile's scores, the packed keys and values). */
void le_attention_bidir(le_pool *pool, const float *qkv, int64_t n, int64_t seg_len, int n_head, int head_dim,
                        float *scores, float *out);
/* Floats of one thread's scratch for segments of seg_len. */
int64_t le_attention_bidir_row_floats(int64_t seg_len, int head_dim);

/* ---- pos_embed.c ---------------------------------------------------------------------
 * The position embedding of the patch at (row, col) of an h x w grid: table [side^2, hidden] f32 sampled
 * bilinearly with align_corners (faults: LE_VFAULT_POS_NEAREST: the nearest grid point); out [hidden]. */
void le_pos_embed_row_ref(const float *table, int side, int hidden, int row, int col, int h, int w, int faults,
                          float *out);

#endif
