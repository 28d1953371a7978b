/* rope.c — rotary position embedding, NeoX style, partial (first n_rot dims), IMRoPE.
 *
 * Frequency slot i (0 <= i < n_rot/2) rotates the pair (x[i], x[i + n_rot/2]) by
 * angle p_i * theta^(-2i/n_rot). IMRoPE (spec §2.4, ggml's is_imrope branch) picks
 * p_i from the position's components interleaved: slot i%3==0 -> t (if i < 3*s0),
 * i%3==1 -> h (if i < 3*s1), i%3==2 -> w (if i < 3*s2), otherwise e. Text tokens
 * have t = h = w = pos and e = 0; an image's merged patches (M-RoPE) have their own (t, row, col). Sections all 0
 * means plain NeoX (every slot t). */
#include <math.h>

#include "le_ops.h"

void le_rope_neox(float *x, int n_heads, int head_stride, int n_rot, const int sections[4], float theta,
                  const int32_t pos[3], int faults) {
    int half = n_rot / 2;
    /* pair (a, b) of slot i: NeoX (i, i + half); the injected fault uses GPT-J's (2i, 2i + 1) */
    int interleaved = faults & LE_FAULT_ROPE_INTERLEAVED;
    int imrope = sections[0] + sections[1] + sections[2] + sections[3] > 0;
    for (int i = 0; i < half; i++) {
        int p = pos[0];
        if (imrope) {
            int s = i % 3;
            int covered = (s == 0 && i < 3 * sections[0]) || (s == 1 && i < 3 * sections[1]) ||
                          (s == 2 && i < 3 * sections[2]);
            p = covered ? pos[s] : 0; /* the e component is 0 */
        }
        /* angle in double: positions up to 262144 times frequencies near 1 */
        double inv_freq = pow((double)theta, -2.0 * i / n_rot);
        double ang = (double)p * inv_freq;
        float c = (float)cos(ang), s = (float)sin(ang);
        for (int h = 0; h < n_heads; h++) {
            float *v = x + (int64_t)h * head_stride;
            int ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + half;
            float a = v[ia], b = v[ib];
            v[ia] = a * c - b * s;
            v[ib] = a * s + b * c;
        }
    }
}
