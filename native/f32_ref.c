/* f32_ref.c — scalar references of the f32 kernels of the decode step (le_simd.h
 * "f32 kernels"): the Gated DeltaNet recurrent step of one head and the f32 dot product.
 * These are the oracle of cpu_simd/f32_<isa>.c and the kernels of the ref and ssse3 tiers.
 *
 * gdn_step, one v-head, one token (spec §2.3), S: [dk, dv] row-major f32, in place:
 *   S <- decay S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q
 * gemm_tile: C [M, N] = A [M, K] B [N, K]^T, each element one le_dot_f32_plain (8 partial sums).
 * gemm_nn: C [M, N] = A [M, K] B [K, N], each element summed in k order within blocks of LE_GEMM_NN_KB, the
 *   blocks' sums added in order (the SIMD tiers' order; they fuse each multiply-add).
 * exp_sub_sum: the softmax's numerators of a scaled row with libm's expf and their sum in double (the vision
 *   attention's softmax as it was before the vector exp).
 * silu: x / (1 + expf(-x)) with libm's expf, element by element.
 * Test: tests/test_f32_kernels.py. */
#include <math.h>

#include "le_simd.h"

void le_gdn_step_ref(float *S, const float *q, const float *k, const float *v, float decay, float beta, int dk,
                     int dv, float *o) {
    float delta[LE_GDN_MAX_DV];
    for (int c = 0; c < dv; c++) delta[c] = 0.0f;
    for (int i = 0; i < dk; i++) {
        float *Si = S + (int64_t)i * dv;
        for (int c = 0; c < dv; c++) {
            Si[c] *= decay;
            delta[c] += Si[c] * k[i];
        }
    }
    for (int c = 0; c < dv; c++) delta[c] = beta * (v[c] - delta[c]);
    for (int c = 0; c < dv; c++) o[c] = 0.0f;
    for (int i = 0; i < dk; i++) {
        float *Si = S + (int64_t)i * dv;
        for (int c = 0; c < dv; c++) {
            Si[c] += k[i] * delta[c];
            o[c] += Si[c] * q[i];
        }
    }
}

float le_dot_f32_ref(const float *a, const float *b, int64_t n) { return le_dot_f32_plain(a, b, n); }

void le_gemm_tile_f32_ref(const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc, int M,
                          int N, int K) {
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) C[i * ldc + j] = le_dot_f32_plain(A + i * lda, B + j * ldb, K);
}

void le_gemm_nn_f32_ref(const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc, int M, int N,
                        int K) {
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            float c = 0.0f;
            for (int k0 = 0; k0 < K; k0 += LE_GEMM_NN_KB) {
                float s = 0.0f;
                for (int k = k0; k < K && k < k0 + LE_GEMM_NN_KB; k++) s += A[i * lda + k] * B[k * ldb + j];
                c = k0 ? c + s : s;
            }
            C[i * ldc + j] = c;
        }
}

double le_exp_sub_sum_f32_ref(const float *x, float *y, int64_t n, float scale) {
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; j++)
        if (x[j] > mx) mx = x[j];
    const float sub = mx * scale; /* = max_j fl(x[j] scale): rounding is monotonic and scale > 0 */
    double sum = 0.0;
    for (int64_t j = 0; j < n; j++) {
        y[j] = expf(x[j] * scale - sub);
        sum += y[j];
    }
    return sum;
}

void le_silu_f32_ref(const float *x, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = x[i] / (1.0f + expf(-x[i]));
}
