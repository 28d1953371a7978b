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

/* ---- scalar references (native/vec_dot_ref.c): the oracle and the last fallback ---- */
void vec_dot_q4_0_q8_0_ref(int64_t n, float *s, const void *x, const void *y);
void vec_dot_q4_1_q8_1_ref(int64_t n, float *s, const void *x, const void *y);
void vec_dot_q5_0_q8_0_ref(int64_t n, float *s, const void *x, const void *y);
void vec_dot_q5_1_q8_1_ref(int64_t n, float *s, const void *x, const void *y);
void vec_dot_q8_0_q8_0_ref(int64_t n, float *s, const void *x, const void *y);
void vec_dot_iq4_nl_q8_0_ref(int64_t n, float *s, const void *x, const void *y);
void vec_dot_mxfp4_q8_0_ref(int64_t n, float *s, const void *x, const void *y);
void vec_dot_q2_K_q8_K_ref(int64_t n, float *s, const void *x, const void *y);
void vec_dot_q3_K_q8_K_ref(int64_t n, float *s, const void *x, const void *y);
void vec_dot_q4_K_q8_K_ref(int64_t n, float *s, const void *x, const void *y);
void vec_dot_q5_K_q8_K_ref(int64_t n, float *s, const void *x, const void *y);
void vec_dot_q6_K_q8_K_ref(int64_t n, float *s, const void *x, const void *y);
void vec_dot_iq4_xs_q8_K_ref(int64_t n, float *s, const void *x, const void *y);

/* The 16-value grids of IQ4_NL/IQ4_XS and MXFP4 (E2M1 doubled), as ggml-common.h. */
extern const int8_t le_kvalues_iq4nl[16];
extern const int8_t le_kvalues_mxfp4[16];

/* ---- SIMD kernels (cpu_simd/vec_dot_<family>_<isa>.c); same contract as the refs ----
 * Activation bytes must come from the Q8 quantisers (values -127..127, never -128):
 * the sign trick of pmaddubsw/vpdpbusd negates them. */
#define LE_DECLARE_VEC_DOTS(isa)                                                        \
    void vec_dot_q4_0_q8_0_##isa(int64_t n, float *s, const void *x, const void *y);   \
    void vec_dot_q4_1_q8_1_##isa(int64_t n, float *s, const void *x, const void *y);   \
    void vec_dot_q5_0_q8_0_##isa(int64_t n, float *s, const void *x, const void *y);   \
    void vec_dot_q5_1_q8_1_##isa(int64_t n, float *s, const void *x, const void *y);   \
    void vec_dot_q8_0_q8_0_##isa(int64_t n, float *s, const void *x, const void *y);   \
    void vec_dot_iq4_nl_q8_0_##isa(int64_t n, float *s, const void *x, const void *y); \
    void vec_dot_mxfp4_q8_0_##isa(int64_t n, float *s, const void *x, const void *y);  \
    void vec_dot_q2_K_q8_K_##isa(int64_t n, float *s, const void *x, const void *y);   \
    void vec_dot_q3_K_q8_K_##isa(int64_t n, float *s, const void *x, const void *y);   \
    void vec_dot_q4_K_q8_K_##isa(int64_t n, float *s, const void *x, const void *y);   \
    void vec_dot_q5_K_q8_K_##isa(int64_t n, float *s, const void *x, const void *y);   \
    void vec_dot_q6_K_q8_K_##isa(int64_t n, float *s, const void *x, const void *y);   \
    void vec_dot_iq4_xs_q8_K_##isa(int64_t n, float *s, const void *x, const void *y);
LE_DECLARE_VEC_DOTS(ssse3)
LE_DECLARE_VEC_DOTS(avx2)
LE_DECLARE_VEC_DOTS(avx512vnni)

/* Activation quantisers (cpu_simd/quantize_act_<isa>.c): the same bytes as the refs of
 * native/quants_ref.c, bit for bit. */
void quantize_row_q8_0_avx2(const float *x, void *y, int64_t n);
void quantize_row_q8_1_avx2(const float *x, void *y, int64_t n);
void quantize_row_q8_K_avx2(const float *x, void *y, int64_t n);

/* ---- f32 kernels: the decode step's and the vision tower's (native/f32_ref.c, cpu_simd/f32_<isa>.c) ----------
 * gdn_step: one Gated DeltaNet v-head, one token; S [dk, dv] f32 updated in place:
 *   S <- decay S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q   (dv <= LE_GDN_MAX_DV)
 * dot: sum a[i] b[i] (the f32 matmul path: router, shared-expert gate, attention scores).
 * gemm_tile: C[i, j] = sum_k A[i, k] B[j, k] for i < M, j < N (C = A B^T, C overwritten): A [M, K] (activations,
 *   queries) and B [N, K] (weight rows, keys), both row-major with K contiguous, row strides lda / ldb / ldc in
 *   floats. Each C element's sum is in an order fixed by K alone (not by i, j, M or N), so how a product is cut
 *   into tiles never changes a bit. (The vision tower's matmuls and attention ran on it until gemm_nn: outer products
 *   need no horizontal sums, ~2x on the tower's shapes; benchmarks/results/vision_encode_cpu_2026-11-28.md.)
 * gemm_nn: C[i, j] = sum_k A[i, k] B[k, j] (C = A B, overwritten): A [M, K] row-major K-contiguous, B [K, N]
 *   row-major N-contiguous (keys transposed, values as they are). K goes in blocks of LE_GEMM_NN_KB: each block's
 *   products summed in k order from 0, the block sums added to C in order; so again an element's bits depend on K
 *   alone. The vision tower's matmuls (weights packed transposed, vision.c) and attention (QK^T, P V).
 * exp_sub_sum: y[j] = exp(fl(x[j] scale) - fl(m scale)) with m = max_k x[k], for j < n (scale > 0: the softmax's
 *   numerators of the scaled row, y may be x); returns sum_j y[j], summed in double. The reference calls expf; the
 *   SIMD tiers a vector expf (simd_x86.h) within tests/tolerances.py's EXP_SUB_SUM_ULP of it.
 * gelu_tanh: out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) for n floats (in place allowed): the vision
 *   blocks' MLP activation. Reference le_gelu_tanh_ref (libm tanhf); the SIMD tiers the same function as
 *   x / (1 + exp(-2u)) with the vector expf (cpu_simd/gelu_tanh_x86.h).
 * silu: out = x / (1 + exp(-x)) for n floats (in place allowed): the SwiGLU gate and the GDN's activations.
 *   Reference le_silu_f32_ref (libm expf); the SIMD tiers the vector expf, the tail padded through the same code
 *   (cpu_simd/silu_x86.h): an element's bits do not depend on its neighbours. */
#define LE_GDN_MAX_DV 1024
#define LE_GDN_MAX_CONV_K 8 /* GDN conv taps (Qwen3.5: 4; cuda8/conv1d.cu's CONV_MAX_K): a stack tile in gdn.c */
#define LE_GEMM_NN_KB 128 /* why: a B panel of 128 k x 64 columns (32 KiB: value rows, packed weights) stays in L1 */
typedef void (*le_gdn_step_fn)(float *S, const float *q, const float *k, const float *v, float decay, float beta,
                               int dk, int dv, float *o);
typedef float (*le_dot_f32_fn)(const float *a, const float *b, int64_t n);
typedef void (*le_gemm_tile_f32_fn)(const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc,
                                    int M, int N, int K);
typedef void (*le_gemm_nn_f32_fn)(const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc,
                                  int M, int N, int K);
typedef double (*le_exp_sub_sum_f32_fn)(const float *x, float *y, int64_t n, float scale);
typedef void (*le_gelu_tanh_f32_fn)(const float *x, int64_t n, float *out);
typedef void (*le_silu_f32_fn)(const float *x, int64_t n, float *out);
typedef struct {
    le_gdn_step_fn gdn_step;
    le_dot_f32_fn dot;
    le_gemm_tile_f32_fn gemm_tile;
    le_gemm_nn_f32_fn gemm_nn;
    le_exp_sub_sum_f32_fn exp_sub_sum;
    le_gelu_tanh_f32_fn gelu_tanh;
    le_silu_f32_fn silu;
} le_f32_kernels;

/* 8 independent partial sums in a fixed order (gcc vectorises it without -ffast-math). */
static inline float le_dot_f32_plain(const float *a, const float *b, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) acc[k] += a[i + k] * b[i + k];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

void le_gdn_step_ref(float *S, const float *q, const float *k, const float *v, float decay, float beta, int dk,
                     int dv, float *o);
float le_dot_f32_ref(const float *a, const float *b, int64_t n);
void le_gdn_step_avx2(float *S, const float *q, const float *k, const float *v, float decay, float beta, int dk,
                      int dv, float *o);
float le_dot_f32_avx2(const float *a, const float *b, int64_t n);
void le_gdn_step_avx512(float *S, const float *q, const float *k, const float *v, float decay, float beta, int dk,
                        int dv, float *o);
float le_dot_f32_avx512(const float *a, const float *b, int64_t n);
#define LE_DECLARE_GEMM_TILE(isa)                                                                                   \
    void le_gemm_tile_f32_##isa(const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc,    \
                                int M, int N, int K);
LE_DECLARE_GEMM_TILE(ref)
LE_DECLARE_GEMM_TILE(avx2)
LE_DECLARE_GEMM_TILE(avx512)
#define LE_DECLARE_SOFTMAX_KERNELS(isa)                                                                             \
    void le_gemm_nn_f32_##isa(const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc,      \
                              int M, int N, int K);                                                                 \
    double le_exp_sub_sum_f32_##isa(const float *x, float *y, int64_t n, float scale);
LE_DECLARE_SOFTMAX_KERNELS(ref)
LE_DECLARE_SOFTMAX_KERNELS(avx2)
LE_DECLARE_SOFTMAX_KERNELS(avx512)
/* the SSSE3 tier's own: gemm_nn (cpu_simd/f32_ssse3.c); its other f32 kernels are the references */
void le_gemm_nn_f32_ssse3(const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc, int M, int N,
                          int K);
/* the reference is le_gelu_tanh_ref (native/gelu.c, le_vision.h) */
void le_gelu_tanh_f32_avx2(const float *x, int64_t n, float *out);
void le_gelu_tanh_f32_avx512(const float *x, int64_t n, float *out);
void le_silu_f32_ref(const float *x, int64_t n, float *out);
void le_silu_f32_avx2(const float *x, int64_t n, float *out);
void le_silu_f32_avx512(const float *x, int64_t n, float *out);

/* [LE_ISA_*]; NULL members fall back to the next lower tier */
extern const le_f32_kernels le_f32_table[LE_ISA_COUNT];
/* The selected tier's f32 kernels (native/dispatch.c); never NULL. */
const le_f32_kernels *le_get_f32_kernels(void);

/* [LE_ISA_*][ggml type id] */
extern const le_vec_dot_fn le_vec_dot_table[LE_ISA_COUNT][LE_TYPE_COUNT];
/* Several activation rows per weight row (le_dispatch.h le_vec_dot_n_fn): [LE_ISA_*][type], NULL: none at that tier
 * (no fallback to another tier's: the bits must be those of the tier's le_vec_dot_table entry). The reference is
 * the loop of the tier's one-row kernel. */
extern const le_vec_dot_n_fn le_vec_dot_n_table[LE_ISA_COUNT][LE_TYPE_COUNT];
#define LE_DECLARE_VEC_DOT_NS(isa)                                                                                 \
    void vec_dot_n_q4_K_q8_K_##isa(int64_t n, float *s, int64_t ls, const void *x, const void *y, int64_t ly, int nt); \
    void vec_dot_n_q6_K_q8_K_##isa(int64_t n, float *s, int64_t ls, const void *x, const void *y, int64_t ly, int nt);
void vec_dot_n_q4_K_q8_K_ssse3(int64_t n, float *s, int64_t ls, const void *x, const void *y, int64_t ly, int nt);
LE_DECLARE_VEC_DOT_NS(avx2)
LE_DECLARE_VEC_DOT_NS(avx512vnni)
/* Activation quantisers per ISA for the vec_dot types (Q8_0, Q8_1, Q8_K); NULL: fall back. */
extern const le_quantize_row_fn le_quantize_act_table[LE_ISA_COUNT][LE_TYPE_COUNT];

#endif
