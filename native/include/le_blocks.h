/* le_blocks.h — the byte layout of every GGML quant block the engine reads.
 *
 * One definition for native/ (C11), cpu_simd/ (C11) and cuda8/ (CUDA 8, C++11):
 * plain structs of fixed-width integers, no unions, no anonymous members, so the
 * same text is valid C and C++11. Layouts follow ggml-common.h field for field
 * (spec qwen35.md §4); every multi-byte field is little-endian, as on the hosts
 * and GPUs we run on. Half-precision fields are raw IEEE binary16 bits in a
 * uint16_t (le_fp16_to_fp32 / le_fp32_to_fp16 convert); MXFP4's `e` is an E8M0
 * exponent byte.
 *
 * Every size is checked at compile time below; tests/test_quants.py checks the
 * same numbers against gguf-py's GGML_QUANT_SIZES.
 * Not fed to cffi's cdef (it has macros and static asserts).
 */
#ifndef LE_BLOCKS_H
#define LE_BLOCKS_H

#include <stdint.h>

/* why: C11 spells it _Static_assert, C++11 (nvcc 8 included) static_assert. */
#if defined(__cplusplus)
#define LE_STATIC_ASSERT(cond, msg) static_assert(cond, msg)
#else
#define LE_STATIC_ASSERT(cond, msg) _Static_assert(cond, msg)
#endif

/* Elements per block. */
#define QK4_0 32
#define QK4_1 32
#define QK5_0 32
#define QK5_1 32
#define QK8_0 32
#define QK8_1 32
#define QK_K 256          /* K-quant super-block */
#define K_SCALE_SIZE 12   /* Q4_K/Q5_K: 8 (scale, min) pairs of 6 bits */
#define QK4_NL 32
#define QK_MXFP4 32

/* ---- 32-element blocks ------------------------------------------------------- */

/* Q4_0: y = (q - 8) * d; qs[j] holds element j (low nibble) and j+16 (high nibble). */
typedef struct {
    uint16_t d;              /* half: scale */
    uint8_t qs[QK4_0 / 2];   /* 4-bit quants */
} block_q4_0;
LE_STATIC_ASSERT(sizeof(block_q4_0) == 2 + QK4_0 / 2, "block_q4_0 is 18 bytes");

/* Q4_1: y = q * d + m. */
typedef struct {
    uint16_t d;              /* half: scale */
    uint16_t m;              /* half: min */
    uint8_t qs[QK4_1 / 2];   /* 4-bit quants */
} block_q4_1;
LE_STATIC_ASSERT(sizeof(block_q4_1) == 4 + QK4_1 / 2, "block_q4_1 is 20 bytes");

/* Q5_0: y = (q - 16) * d; bit 4 of element j is bit j of qh (a u32 LE). */
typedef struct {
    uint16_t d;              /* half: scale */
    uint8_t qh[4];           /* 5th bits, one per element */
    uint8_t qs[QK5_0 / 2];   /* low 4 bits */
} block_q5_0;
LE_STATIC_ASSERT(sizeof(block_q5_0) == 2 + 4 + QK5_0 / 2, "block_q5_0 is 22 bytes");

/* Q5_1: y = q * d + m. */
typedef struct {
    uint16_t d;              /* half: scale */
    uint16_t m;              /* half: min */
    uint8_t qh[4];           /* 5th bits */
    uint8_t qs[QK5_1 / 2];   /* low 4 bits */
} block_q5_1;
LE_STATIC_ASSERT(sizeof(block_q5_1) == 4 + 4 + QK5_1 / 2, "block_q5_1 is 24 bytes");

/* Q8_0: y = q * d. Also the activation type of Q4_0/Q5_0/Q8_0/IQ4_NL/MXFP4 dots. */
typedef struct {
    uint16_t d;              /* half: scale */
    int8_t qs[QK8_0];        /* quants */
} block_q8_0;
LE_STATIC_ASSERT(sizeof(block_q8_0) == 2 + QK8_0, "block_q8_0 is 34 bytes");

/* Q8_1: activation type of Q4_1/Q5_1 dots; s = d * sum(qs) saves the min term. */
typedef struct {
    uint16_t d;              /* half: scale */
    uint16_t s;              /* half: d * sum(qs) */
    int8_t qs[QK8_1];        /* quants */
} block_q8_1;
LE_STATIC_ASSERT(sizeof(block_q8_1) == 4 + QK8_1, "block_q8_1 is 36 bytes");

/* IQ4_NL: y = d * kvalues_iq4nl[q] (a non-linear 16-entry grid). */
typedef struct {
    uint16_t d;              /* half: scale */
    uint8_t qs[QK4_NL / 2];  /* 4-bit grid indices */
} block_iq4_nl;
LE_STATIC_ASSERT(sizeof(block_iq4_nl) == 2 + QK4_NL / 2, "block_iq4_nl is 18 bytes");

/* MXFP4 (OCP microscaling): y = kvalues_mxfp4[q] * 2^(e-128) (grid holds 2x E2M1). */
typedef struct {
    uint8_t e;               /* E8M0 shared exponent */
    uint8_t qs[QK_MXFP4 / 2];/* 4-bit E2M1 codes */
} block_mxfp4;
LE_STATIC_ASSERT(sizeof(block_mxfp4) == 1 + QK_MXFP4 / 2, "block_mxfp4 is 17 bytes");

/* ---- 256-element super-blocks (K-quants) --------------------------------------- */

/* Q2_K: 16 groups of 16; y = d*(sc&15)*q - dmin*(sc>>4). */
typedef struct {
    uint8_t scales[QK_K / 16]; /* 4-bit scale | 4-bit min, per 16 */
    uint8_t qs[QK_K / 4];      /* 2-bit quants */
    uint16_t d;                /* half: super-scale of the scales */
    uint16_t dmin;             /* half: super-scale of the mins */
} block_q2_K;
LE_STATIC_ASSERT(sizeof(block_q2_K) == QK_K / 16 + QK_K / 4 + 4, "block_q2_K is 84 bytes");

/* Q3_K: 16 groups of 16; 6-bit signed scales (s - 32); q = low2 - (hmask ? 0 : 4). */
typedef struct {
    uint8_t hmask[QK_K / 8];   /* high bit, inverted: set means no -4 */
    uint8_t qs[QK_K / 4];      /* low 2 bits */
    uint8_t scales[12];        /* 16 x 6-bit scales */
    uint16_t d;                /* half: super-scale */
} block_q3_K;
LE_STATIC_ASSERT(sizeof(block_q3_K) == QK_K / 8 + QK_K / 4 + 12 + 2, "block_q3_K is 110 bytes");

/* Q4_K: 8 groups of 32; y = d*sc*q - dmin*m with 6-bit (sc, m). */
typedef struct {
    uint16_t d;                   /* half: super-scale of the scales */
    uint16_t dmin;                /* half: super-scale of the mins */
    uint8_t scales[K_SCALE_SIZE]; /* 8 x (6-bit sc, 6-bit m) */
    uint8_t qs[QK_K / 2];         /* 4-bit quants */
} block_q4_K;
LE_STATIC_ASSERT(sizeof(block_q4_K) == 4 + K_SCALE_SIZE + QK_K / 2, "block_q4_K is 144 bytes");

/* Q5_K: Q4_K plus a 5th bit per element in qh. */
typedef struct {
    uint16_t d;                   /* half: super-scale of the scales */
    uint16_t dmin;                /* half: super-scale of the mins */
    uint8_t scales[K_SCALE_SIZE]; /* 8 x (6-bit sc, 6-bit m) */
    uint8_t qh[QK_K / 8];         /* 5th bits */
    uint8_t qs[QK_K / 2];         /* low 4 bits */
} block_q5_K;
LE_STATIC_ASSERT(sizeof(block_q5_K) == 4 + K_SCALE_SIZE + QK_K / 8 + QK_K / 2, "block_q5_K is 176 bytes");

/* Q6_K: 16 groups of 16; y = d * scales[g] * (q - 32), q 6-bit. */
typedef struct {
    uint8_t ql[QK_K / 2];      /* low 4 bits */
    uint8_t qh[QK_K / 4];      /* high 2 bits */
    int8_t scales[QK_K / 16];  /* 8-bit signed scales */
    uint16_t d;                /* half: super-scale */
} block_q6_K;
LE_STATIC_ASSERT(sizeof(block_q6_K) == QK_K / 2 + QK_K / 4 + QK_K / 16 + 2, "block_q6_K is 210 bytes");

/* Q8_K: activation type of K-quant and IQ4_XS dots; d is a full f32 and may be
 * negative (ggml maps the signed max to -127); bsums speed up the min terms. */
typedef struct {
    float d;                   /* f32 scale */
    int8_t qs[QK_K];           /* quants */
    int16_t bsums[QK_K / 16];  /* sum of qs per group of 16 */
} block_q8_K;
LE_STATIC_ASSERT(sizeof(block_q8_K) == 4 + QK_K + QK_K / 16 * 2, "block_q8_K is 292 bytes");

/* IQ4_XS: 8 groups of 32 on the IQ4_NL grid with 6-bit scales (ls - 32). */
typedef struct {
    uint16_t d;                /* half: super-scale */
    uint16_t scales_h;         /* high 2 bits of the 8 scales */
    uint8_t scales_l[QK_K / 64]; /* low 4 bits of the 8 scales */
    uint8_t qs[QK_K / 2];      /* 4-bit grid indices */
} block_iq4_xs;
LE_STATIC_ASSERT(sizeof(block_iq4_xs) == 4 + QK_K / 64 + QK_K / 2, "block_iq4_xs is 136 bytes");

#endif
