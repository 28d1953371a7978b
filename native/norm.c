/* norm.c — RMSNorm and L2 norm, scalar reference.
 * RMSNorm: GGUF norm weights of Qwen3.5 already hold (1 + w) (the converter adds 1),
 * so this is the plain form; ssm_norm (gated norm) is stored as-is and also plain. */
#include <math.h>

#include "le_ops.h"

void le_rmsnorm(const float *x, const float *w, int n, float eps, float *out) {
    double ss = 0.0; /* double: the sum of n squares must not lose the small terms */
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float scale = (float)(1.0 / sqrt(ss / n + eps));
    if (w)
        for (int i = 0; i < n; i++) out[i] = x[i] * scale * w[i];
    else
        for (int i = 0; i < n; i++) out[i] = x[i] * scale;
}

void le_l2norm(float *x, int n, float eps) {
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float scale = (float)(1.0 / sqrt(ss + eps));
    for (int i = 0; i < n; i++) x[i] *= scale;
}
