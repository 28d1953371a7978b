/* kernels.c — the per-ISA kernel tables of le_simd.h.
 *
 * Row LE_ISA_REF holds the scalar references (native/vec_dot_ref.c); each SIMD tier
 * lists the kernels its files in cpu_simd/ provide. A NULL entry falls back to the
 * next lower tier (native/dispatch.c). */
#include <stddef.h>

#include "le_simd.h"
#include "le_vision.h" /* le_gelu_tanh_ref */

/* ggml's vec_dot_type pairs (spec §4): Q4_0/Q5_0/Q8_0/IQ4_NL/MXFP4 . Q8_0,
 * Q4_1/Q5_1 . Q8_1, the K-quants and IQ4_XS . Q8_K. */
#define LE_VEC_DOT_ROW(isa)                                \
    {                                                      \
        [LE_TYPE_Q4_0] = vec_dot_q4_0_q8_0_##isa,          \
        [LE_TYPE_Q4_1] = vec_dot_q4_1_q8_1_##isa,          \
        [LE_TYPE_Q5_0] = vec_dot_q5_0_q8_0_##isa,          \
        [LE_TYPE_Q5_1] = vec_dot_q5_1_q8_1_##isa,          \
        [LE_TYPE_Q8_0] = vec_dot_q8_0_q8_0_##isa,          \
        [LE_TYPE_Q2_K] = vec_dot_q2_K_q8_K_##isa,          \
        [LE_TYPE_Q3_K] = vec_dot_q3_K_q8_K_##isa,          \
        [LE_TYPE_Q4_K] = vec_dot_q4_K_q8_K_##isa,          \
        [LE_TYPE_Q5_K] = vec_dot_q5_K_q8_K_##isa,          \
        [LE_TYPE_Q6_K] = vec_dot_q6_K_q8_K_##isa,          \
        [LE_TYPE_IQ4_NL] = vec_dot_iq4_nl_q8_0_##isa,      \
        [LE_TYPE_IQ4_XS] = vec_dot_iq4_xs_q8_K_##isa,      \
        [LE_TYPE_MXFP4] = vec_dot_mxfp4_q8_0_##isa,        \
    }

const le_vec_dot_fn le_vec_dot_table[LE_ISA_COUNT][LE_TYPE_COUNT] = {
    [LE_ISA_REF] = LE_VEC_DOT_ROW(ref),
    [LE_ISA_SSSE3] = LE_VEC_DOT_ROW(ssse3),
    [LE_ISA_AVX2] = LE_VEC_DOT_ROW(avx2),
    [LE_ISA_AVX512VNNI] = LE_VEC_DOT_ROW(avx512vnni),
};

const le_vec_dot_n_fn le_vec_dot_n_table[LE_ISA_COUNT][LE_TYPE_COUNT] = {
    [LE_ISA_SSSE3] = {[LE_TYPE_Q4_K] = vec_dot_n_q4_K_q8_K_ssse3},
    [LE_ISA_AVX2] = {[LE_TYPE_Q4_K] = vec_dot_n_q4_K_q8_K_avx2, [LE_TYPE_Q6_K] = vec_dot_n_q6_K_q8_K_avx2},
    [LE_ISA_AVX512VNNI] = {[LE_TYPE_Q4_K] = vec_dot_n_q4_K_q8_K_avx512vnni,
                           [LE_TYPE_Q6_K] = vec_dot_n_q6_K_q8_K_avx512vnni},
};

/* Activation quantisers: the refs (typed block pointers, hence the adapters) and AVX2
 * (cpu_simd/quantize_act_avx2.c, bit-exact); SSSE3 falls back to the ref, AVX-512 to AVX2. */
static void q8_0_ref(const float *x, void *y, int64_t n) { quantize_row_q8_0_ref(x, (block_q8_0 *)y, n); }
static void q8_1_ref(const float *x, void *y, int64_t n) { quantize_row_q8_1_ref(x, (block_q8_1 *)y, n); }
static void q8_K_ref(const float *x, void *y, int64_t n) { quantize_row_q8_K_ref(x, (block_q8_K *)y, n); }

const le_quantize_row_fn le_quantize_act_table[LE_ISA_COUNT][LE_TYPE_COUNT] = {
    [LE_ISA_REF] = {
        [LE_TYPE_Q8_0] = q8_0_ref,
        [LE_TYPE_Q8_1] = q8_1_ref,
        [LE_TYPE_Q8_K] = q8_K_ref,
    },
    [LE_ISA_AVX2] = {
        [LE_TYPE_Q8_0] = quantize_row_q8_0_avx2,
        [LE_TYPE_Q8_1] = quantize_row_q8_1_avx2,
        [LE_TYPE_Q8_K] = quantize_row_q8_K_avx2,
    },
};

/* f32 kernels: SSSE3 the references (compiled for the baseline, SSE2) but gemm_nn on 128-bit vectors (the
 * reference's bits), the AVX-512 VNNI tier the AVX-512F kernels. */
const le_f32_kernels le_f32_table[LE_ISA_COUNT] = {
    [LE_ISA_REF] = {le_gdn_step_ref, le_dot_f32_ref, le_gemm_tile_f32_ref, le_gemm_nn_f32_ref,
                    le_exp_sub_sum_f32_ref, le_gelu_tanh_ref, le_silu_f32_ref},
    [LE_ISA_SSSE3] = {le_gdn_step_ref, le_dot_f32_ref, le_gemm_tile_f32_ref, le_gemm_nn_f32_ssse3,
                      le_exp_sub_sum_f32_ref, le_gelu_tanh_ref, le_silu_f32_ref},
    [LE_ISA_AVX2] = {le_gdn_step_avx2, le_dot_f32_avx2, le_gemm_tile_f32_avx2, le_gemm_nn_f32_avx2,
                     le_exp_sub_sum_f32_avx2, le_gelu_tanh_f32_avx2, le_silu_f32_avx2},
    [LE_ISA_AVX512VNNI] = {le_gdn_step_avx512, le_dot_f32_avx512, le_gemm_tile_f32_avx512, le_gemm_nn_f32_avx512,
                           le_exp_sub_sum_f32_avx512, le_gelu_tanh_f32_avx512,
                           le_silu_f32_avx512},
};
