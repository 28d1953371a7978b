/* layernorm.c — LayerNorm (the vision tower's norm1 / norm2 / merger.norm), scalar reference.
 *   out = (x - mean) / sqrt(var + eps) * w + b,  var the biased variance (torch.nn.LayerNorm).
 * Mean and variance are accumulated in double (two passes): the f32 rounding of a sum of n terms would be the
 * largest error of the op; the result is then within an ulp or two of torch's.
 * Test: tests/test_vision_tower.py (against numpy in float64). */
#include <math.h>

#include "le_vision.h"

static void layernorm_row(const float *x, const float *w, const float *b, int n, float eps, float *out) {
    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += x[i];
    double mean = sum / n, ss = 0.0;
    for (int i = 0; i < n; i++) {
        double d = x[i] - mean;
        ss += d * d;
    }
    float rstd = (float)(1.0 / sqrt(ss / n + eps)), fmean = (float)mean;
    for (int i = 0; i < n; i++) {
        float y = (x[i] - fmean) * rstd;
        if (w) y *= w[i];
        if (b) y += b[i];
        out[i] = y;
    }
}

/* x, out: [rows, n] (in place allowed); w, b: [n] or NULL */
void le_layernorm_ref(const float *x, const float *w, const float *b, int64_t rows, int n, float eps, float *out) {
    for (int64_t r = 0; r < rows; r++) layernorm_row(x + r * n, w, b, n, eps, out + r * n);
}
