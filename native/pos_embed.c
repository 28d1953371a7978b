/* pos_embed.c — the learned position grid resampled to an image's patch grid (transformers'
 * get_vision_interpolation_indices_and_weights, mode bilinear, align_corners, border), scalar reference.
 * Per axis, target index i of `size` maps to src = i (side - 1) / max(size - 1, 1) on the side-long grid
 * (torch.linspace's closed form; f32 as torch computes it); taps floor(src) and floor(src) + 1 (clamped to the
 * grid), weights 1 - |src - tap| (>= 0). The 2-D sample sums the 4 taps (h0w0, h0w1, h1w0, h1w1) with the
 * products of the axis weights, in that order.
 * Test: tests/test_vision_tower.py (against transformers' helper). */
#include <math.h>
#include <string.h>

#include "le_internal.h"
#include "le_vision_ops.h"

/* Taps and weights of target index i on an axis of `size` over a grid of `side`. */
static void axis_taps(int i, int size, int side, int nearest, int tap[2], float wt[2]) {
    float src = (float)i * (float)(side - 1) / (float)(size > 1 ? size - 1 : 1);
    float fl = floorf(src);
    if (nearest) { /* negative control: no interpolation */
        int k = (int)lrintf(src);
        tap[0] = tap[1] = k < side - 1 ? k : side - 1;
        wt[0] = 1.0f;
        wt[1] = 0.0f;
        return;
    }
    for (int o = 0; o < 2; o++) {
        int t = (int)fl + o;
        tap[o] = t < side - 1 ? t : side - 1;
        float d = fabsf((src - fl) - (float)o);
        wt[o] = d < 1.0f ? 1.0f - d : 0.0f;
    }
}

/* table: [side^2, hidden]; out: [hidden] */
void le_pos_embed_row_ref(const float *table, int side, int hidden, int row, int col, int h, int w, int faults,
                          float *out) {
    int nearest = (faults & LE_VFAULT_POS_NEAREST) != 0;
    int th[2], tw[2];
    float wh[2], ww[2];
    axis_taps(row, h, side, nearest, th, wh);
    axis_taps(col, w, side, nearest, tw, ww);
    memset(out, 0, sizeof(float) * (size_t)hidden);
    for (int a = 0; a < 2; a++)
        for (int b = 0; b < 2; b++) {
            float wgt = wh[a] * ww[b];
            const float *e = table + ((int64_t)th[a] * side + tw[b]) * hidden;
            for (int k = 0; k < hidden; k++) out[k] += e[k] * wgt;
        }
}

int le_vision_op_pos_embed(const float *table, int side, int hidden, int t, int h, int w, int merge, int faults,
                           float *out) {
    if (!table || !out || side < 1 || hidden < 1 || t < 1 || merge < 1 || h < merge || w < merge || h % merge ||
        w % merge)
        return LE_FAIL(LE_ERR_INVALID_ARG, "pos_embed: side %d, hidden %d, grid %d x %d x %d, merge %d", side,
                       hidden, t, h, w, merge);
    int64_t hw = (int64_t)h * w;
    for (int64_t i = 0; i < (int64_t)t * hw; i++) {
        int row, col;
        le_vision_patch_pos(i % hw, w, merge, &row, &col);
        le_pos_embed_row_ref(table, side, hidden, row, col, h, w, faults, out + i * hidden);
    }
    return LE_OK;
}
