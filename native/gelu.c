/* gelu.c — the two GELUs of the vision tower, scalar reference (spec §2.7: they differ, and both matter):
 *   tanh form (gelu_pytorch_tanh, the ViT blocks' MLP): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
 *   erf form  (nn.GELU(), the merger):                  0.5 x (1 + erf(x / sqrt(2)))
 * Computed in f32 with libm's tanhf / erff (within an ulp or two of torch's vectorised ones); llama.cpp's f16
 * lookup table is what left ~1e-2 of noise (spec §2.7), so no table here.
 * Test: tests/test_vision_tower.py (against numpy in float64). */
#include <math.h>

#include "le_vision.h"

/* x, out: [n] (in place allowed) */
void le_gelu_tanh_ref(const float *x, int64_t n, float *out) {
    const float beta = 0.7978845608028654f; /* sqrt(2/pi), as torch's kBeta = M_SQRT2 * M_2_SQRTPI * 0.5 */
    const float kappa = 0.044715f;
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        float inner = beta * (v + kappa * v * v * v);
        out[i] = 0.5f * v * (1.0f + tanhf(inner));
    }
}

/* x, out: [n] (in place allowed) */
void le_gelu_erf_ref(const float *x, int64_t n, float *out) {
    const float inv_sqrt2 = 0.7071067811865476f;
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        out[i] = 0.5f * v * (1.0f + erff(v * inv_sqrt2));
    }
}
