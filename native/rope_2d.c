/* rope_2d.c — the vision tower's 2-D axial RoPE (transformers Qwen3_5VisionRotaryEmbedding +
 * apply_rotary_pos_emb_vision), scalar reference.
 *   inv_freq[j] = 1 / theta^(2j / (hd/2)),  j < hd/4      (f32, as torch computes it)
 *   pair i (of hd/2; NeoX rotate_half pairs (i, i + hd/2)) turns by row * inv_freq[i] for i < hd/4 and by
 *   col * inv_freq[i - hd/4] after: the first quarter of the dims sees the patch's row, the second its column.
 *   x1' = x1 cos - x2 sin,  x2' = x2 cos + x1 sin
 * Test: tests/test_vision_tower.py (against a numpy transcription of transformers). */
#include <math.h>
#include <stdlib.h>

#include "le_internal.h"
#include "le_vision_ops.h"

/* pos: [n, 2] (row, col); cos_t, sin_t: [n, hd/2] */
void le_rope2d_table(const int32_t *pos, int64_t n, int head_dim, float theta, int faults, float *cos_t,
                     float *sin_t) {
    int half = head_dim / 2, quarter = head_dim / 4;
    int swap = (faults & LE_VFAULT_ROPE_SWAP) != 0; /* negative control: rows and columns exchanged */
    for (int64_t r = 0; r < n; r++) {
        float row = (float)pos[2 * r + swap], col = (float)pos[2 * r + 1 - swap];
        for (int i = 0; i < half; i++) {
            int j = i < quarter ? i : i - quarter;
            float inv_freq = 1.0f / powf(theta, (float)(2 * j) / (float)half);
            float angle = (i < quarter ? row : col) * inv_freq;
            cos_t[r * half + i] = cosf(angle);
            sin_t[r * half + i] = sinf(angle);
        }
    }
}

/* x: [n_head, hd] one row of q (or k), rotated in place; cos_r, sin_r: [hd/2] */
void le_rope2d_row_ref(float *x, int n_head, int head_dim, const float *cos_r, const float *sin_r) {
    int half = head_dim / 2;
    for (int h = 0; h < n_head; h++) {
        float *xh = x + (int64_t)h * head_dim;
        for (int i = 0; i < half; i++) {
            float x1 = xh[i], x2 = xh[i + half];
            xh[i] = x1 * cos_r[i] - x2 * sin_r[i];
            xh[i + half] = x2 * cos_r[i] + x1 * sin_r[i];
        }
    }
}

int le_vision_op_rope(float *x, int64_t n, int n_head, int head_dim, int64_t row_stride, const int32_t *pos,
                      float theta, int faults) {
    if (!x || !pos || n < 0 || n_head < 1 || head_dim < 4 || head_dim % 4 || row_stride < (int64_t)n_head * head_dim)
        return LE_FAIL(LE_ERR_INVALID_ARG, "rope: n %lld, %d heads of %d, row stride %lld", (long long)n, n_head,
                       head_dim, (long long)row_stride);
    int half = head_dim / 2;
    float *tab = malloc(sizeof(float) * (size_t)(2 * (n > 0 ? n : 1) * half));
    if (!tab) return LE_FAIL(LE_ERR_NO_MEMORY, "rope table of %lld rows", (long long)n);
    le_rope2d_table(pos, n, head_dim, theta, faults, tab, tab + n * half);
    for (int64_t r = 0; r < n; r++)
        le_rope2d_row_ref(x + r * row_stride, n_head, head_dim, tab + r * half, tab + n * half + r * half);
    free(tab);
    return LE_OK;
}
