/* vec_dot_ref.c — scalar reference integer dot products of every weight type.
 *
 * What: vec_dot_<type>_<act>_ref(n, s, x, y): *s = dot of one weight row x (n elements
 * of <type>) with one activation row y (n elements already quantised to <act>, the
 * type's vec_dot_type: Q8_0, Q8_1 or Q8_K; spec qwen35.md §4).
 * How: integer products summed exactly inside a block, the block scales applied in
 * f32. Every function follows ggml-cpu's ggml_vec_dot_<type>_<act>_generic operation by
 * operation (same integer sums, same f32 products in the same order, the same 8 partial
 * f32 sums for Q3_K..Q6_K), so a result equals ggml's scalar path bit for bit.
 * Why: these are the oracle of every SIMD variant in cpu_simd/ and the last fallback of
 * the kernel table (cpu_simd/kernels.c, row LE_ISA_REF).
 * Build: part of the cffi extension (`pip install -e .`).
 * Test: python -m pytest tests/test_vec_dot.py (against f64 math on the dequantised
 * rows, against llama.cpp's own generic kernels when llama-cpp-python is installed, and
 * as the oracle of every tier).
 *
 * n is a multiple of the block size (dispatch.c checks); x and y hold n/block blocks.
 */
#include <stdint.h>
#include <string.h>

#include "le_dispatch.h"
#include "le_simd.h"

/* why: ggml rounds every product and sum separately; a fused multiply-add would round
 * once and break bit-equality with ggml if this file were ever built for an FMA target. */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#define FP16(h) le_fp16_to_fp32(h)

const int8_t le_kvalues_iq4nl[16] = {
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
};

/* E2M1 doubled: the scale of an MXFP4 block is 2^(e-128), half the OCP one. */
const int8_t le_kvalues_mxfp4[16] = {
    0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
};

/* ---- 32-element blocks against Q8_0 / Q8_1 ------------------------------------------
 * Byte j of a 4-bit block holds element j (low nibble) and element j+16 (high). */

void vec_dot_q4_0_q8_0_ref(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q4_0 *x = vx;
    const block_q8_0 *y = vy;
    const int64_t nb = n / QK8_0;
    float sumf = 0;
    for (int64_t ib = 0; ib < nb; ib++) {
        int sumi0 = 0, sumi1 = 0;
        for (int j = 0; j < QK8_0 / 2; j++) {
            const int v0 = (x[ib].qs[j] & 0x0f) - 8;
            const int v1 = (x[ib].qs[j] >> 4) - 8;
            sumi0 += v0 * y[ib].qs[j];
            sumi1 += v1 * y[ib].qs[j + QK8_0 / 2];
        }
        const int sumi = sumi0 + sumi1;
        sumf += sumi * FP16(x[ib].d) * FP16(y[ib].d);       /* (sumi * dx) * dy, as ggml */
    }
    *s = sumf;
}

/* Q4_1 . Q8_1: sum (q*dx + m) * qy*dy = dx*dy * sum(q*qy) + m * (dy * sum(qy)), and the
 * last factor is Q8_1's s field. */
void vec_dot_q4_1_q8_1_ref(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q4_1 *x = vx;
    const block_q8_1 *y = vy;
    const int64_t nb = n / QK8_1;
    float sumf = 0;
    for (int64_t ib = 0; ib < nb; ib++) {
        int sumi0 = 0, sumi1 = 0;
        for (int j = 0; j < QK8_1 / 2; j++) {
            sumi0 += (x[ib].qs[j] & 0x0f) * y[ib].qs[j];
            sumi1 += (x[ib].qs[j] >> 4) * y[ib].qs[j + QK8_1 / 2];
        }
        const int sumi = sumi0 + sumi1;
        sumf += (FP16(x[ib].d) * FP16(y[ib].d)) * sumi + FP16(x[ib].m) * FP16(y[ib].s);
    }
    *s = sumf;
}

/* qh as a little-endian u32: bit j is the 5th bit of element j. */
static inline uint32_t load_u32_le(const uint8_t b[4]) {
    return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}

void vec_dot_q5_0_q8_0_ref(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q5_0 *x = vx;
    const block_q8_0 *y = vy;
    const int64_t nb = n / QK8_0;
    float sumf = 0;
    for (int64_t ib = 0; ib < nb; ib++) {
        const uint32_t qh = load_u32_le(x[ib].qh);
        int sumi0 = 0, sumi1 = 0;
        for (int j = 0; j < QK8_0 / 2; j++) {
            const int h0 = ((qh >> j) << 4) & 0x10;          /* bit j      -> 16 */
            const int h1 = (qh >> (j + 12)) & 0x10;          /* bit j + 16 -> 16 */
            const int x0 = ((x[ib].qs[j] & 0x0f) | h0) - 16;
            const int x1 = ((x[ib].qs[j] >> 4) | h1) - 16;
            sumi0 += x0 * y[ib].qs[j];
            sumi1 += x1 * y[ib].qs[j + QK8_0 / 2];
        }
        const int sumi = sumi0 + sumi1;
        sumf += (FP16(x[ib].d) * FP16(y[ib].d)) * sumi;
    }
    *s = sumf;
}

void vec_dot_q5_1_q8_1_ref(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q5_1 *x = vx;
    const block_q8_1 *y = vy;
    const int64_t nb = n / QK8_1;
    float sumf = 0;
    for (int64_t ib = 0; ib < nb; ib++) {
        const uint32_t qh = load_u32_le(x[ib].qh);
        int sumi0 = 0, sumi1 = 0;
        for (int j = 0; j < QK8_1 / 2; j++) {
            const int h0 = ((qh >> j) << 4) & 0x10;
            const int h1 = (qh >> (j + 12)) & 0x10;
            sumi0 += ((x[ib].qs[j] & 0x0f) | h0) * y[ib].qs[j];
            sumi1 += ((x[ib].qs[j] >> 4) | h1) * y[ib].qs[j + QK8_1 / 2];
        }
        const int sumi = sumi0 + sumi1;
        sumf += (FP16(x[ib].d) * FP16(y[ib].d)) * sumi + FP16(x[ib].m) * FP16(y[ib].s);
    }
    *s = sumf;
}

void vec_dot_q8_0_q8_0_ref(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q8_0 *x = vx;
    const block_q8_0 *y = vy;
    const int64_t nb = n / QK8_0;
    float sumf = 0;
    for (int64_t ib = 0; ib < nb; ib++) {
        int sumi = 0;
        for (int j = 0; j < QK8_0; j++) sumi += x[ib].qs[j] * y[ib].qs[j];
        sumf += sumi * (FP16(x[ib].d) * FP16(y[ib].d));
    }
    *s = sumf;
}

void vec_dot_iq4_nl_q8_0_ref(int64_t n, float *s, const void *vx, const void *vy) {
    const block_iq4_nl *x = vx;
    const block_q8_0 *y = vy;
    const int64_t nb = n / QK4_NL;
    float sumf = 0;
    for (int64_t ib = 0; ib < nb; ib++) {
        const float d = FP16(y[ib].d) * FP16(x[ib].d);
        int sumi1 = 0, sumi2 = 0;
        for (int j = 0; j < QK4_NL / 2; j++) {
            sumi1 += y[ib].qs[j] * le_kvalues_iq4nl[x[ib].qs[j] & 0x0f];
            sumi2 += y[ib].qs[j + QK4_NL / 2] * le_kvalues_iq4nl[x[ib].qs[j] >> 4];
        }
        sumf += d * (sumi1 + sumi2);
    }
    *s = sumf;
}

/* E8M0 byte -> 2^(e-128); e = 0, 1 give the subnormals 2^-128, 2^-127
 * (ggml_e8m0_to_fp32_half; quants_ref.c has the same). */
static inline float e8m0_to_fp32_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

void vec_dot_mxfp4_q8_0_ref(int64_t n, float *s, const void *vx, const void *vy) {
    const block_mxfp4 *x = vx;
    const block_q8_0 *y = vy;
    const int64_t nb = n / QK_MXFP4;
    float sumf = 0;
    for (int64_t ib = 0; ib < nb; ib++) {
        const float d = FP16(y[ib].d) * e8m0_to_fp32_half(x[ib].e);
        int sumi1 = 0, sumi2 = 0;
        for (int j = 0; j < QK_MXFP4 / 2; j++) {
            sumi1 += y[ib].qs[j] * le_kvalues_mxfp4[x[ib].qs[j] & 0x0f];
            sumi2 += y[ib].qs[j + QK_MXFP4 / 2] * le_kvalues_mxfp4[x[ib].qs[j] >> 4];
        }
        sumf += d * (sumi1 + sumi2);
    }
    *s = sumf;
}

/* ---- K-quants and IQ4_XS against Q8_K ------------------------------------------------
 * Q8_K's d is f32 (may be negative); bsums[k] = sum of qs[16k .. 16k+15] carries the
 * min terms: sum_i m_g(i) * qy_i = sum_g m_g * bsum_g. */

/* Q2_K: per 128 elements (qs + 32h), shift 0,2,4,6 selects 32 elements in two groups of
 * 16 (qs[l] and qs[16 + l]), each with a scale byte: low nibble scale, high nibble min. */
void vec_dot_q2_K_q8_K_ref(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q2_K *x = vx;
    const block_q8_K *y = vy;
    const int64_t nb = n / QK_K;
    float sumf = 0;
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *q2 = x[i].qs;
        const int8_t *q8 = y[i].qs;
        const uint8_t *sc = x[i].scales;
        int summs = 0;                                  /* sum_g min_g * bsum_g */
        for (int j = 0; j < 16; j++) summs += y[i].bsums[j] * (sc[j] >> 4);
        const float dall = y[i].d * FP16(x[i].d);
        const float dmin = y[i].d * FP16(x[i].dmin);
        int isum = 0, is = 0;
        for (int k = 0; k < QK_K / 128; k++, q2 += 32) {
            for (int shift = 0; shift < 8; shift += 2, q8 += 32) {
                int isuml = 0;
                for (int l = 0; l < 16; l++) isuml += q8[l] * ((q2[l] >> shift) & 3);
                isum += (sc[is++] & 0x0f) * isuml;
                isuml = 0;
                for (int l = 16; l < 32; l++) isuml += q8[l] * ((q2[l] >> shift) & 3);
                isum += (sc[is++] & 0x0f) * isuml;
            }
        }
        sumf += dall * isum - dmin * summs;
    }
    *s = sumf;
}

/* Q3_K's 16 six-bit scales (biased by 32) from the 12 packed bytes, as ggml unpacks
 * them (cpu_simd/simd_x86.h has the vector form): scale j has its low 4 bits in byte j%8 (low nibble for j < 8, high for j >= 8)
 * and its high 2 bits in byte 8 + j%4 at bit 2*(j/4). */
static void q3_K_unpack_scales(const uint8_t packed[12], int8_t out[16]) {
    const uint32_t kmask1 = 0x03030303u, kmask2 = 0x0f0f0f0fu;
    uint32_t a[4];
    memcpy(a, packed, 12);
    const uint32_t tmp = a[2];
    a[2] = ((a[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
    a[3] = ((a[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
    a[0] = (a[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
    a[1] = (a[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
    memcpy(out, a, 16);                                 /* 0..63, little-endian bytes */
}

/* Q3_K: q = ((qs >> shift) & 3) - (hmask bit ? 0 : 4); y = d * (scale - 32) * q per 16.
 * The sum keeps ggml's 8 partial f32 sums: aux32[l] gathers the elements with index
 * l (mod 8) of a block, and each block adds d * aux32[l] to sums[l]. */
void vec_dot_q3_K_q8_K_ref(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q3_K *x = vx;
    const block_q8_K *y = vy;
    const int64_t nb = n / QK_K;
    float sums[8] = {0};
    for (int64_t i = 0; i < nb; i++) {
        int8_t a[QK_K];                                 /* the 256 weights, -4..3 */
        const uint8_t *q3 = x[i].qs;
        uint8_t m = 1;                                  /* hmask bit of this 32-row */
        for (int c = 0; c < QK_K / 32; c++, m <<= 1) {
            const int shift = 2 * (c % 4);
            if (c == 4) q3 += 32;
            for (int l = 0; l < 32; l++)
                a[32 * c + l] = (int8_t)(((q3[l] >> shift) & 3) - ((x[i].hmask[l] & m) ? 0 : 4));
        }
        int8_t sc[16];
        q3_K_unpack_scales(x[i].scales, sc);
        int32_t aux32[8] = {0};
        const int8_t *q8 = y[i].qs;
        for (int g = 0; g < QK_K / 16; g++)
            for (int l = 0; l < 16; l++) aux32[l % 8] += (sc[g] - 32) * (q8[16 * g + l] * a[16 * g + l]);
        const float d = FP16(x[i].d) * y[i].d;
        for (int l = 0; l < 8; l++) sums[l] += d * aux32[l];
    }
    float sumf = 0;
    for (int l = 0; l < 8; l++) sumf += sums[l];
    *s = sumf;
}

/* Q4_K / Q5_K (scale, min) pairs: 8 six-bit scales and 8 six-bit mins from 12 bytes
 * (ggml get_scale_min_k4, unpacked all at once; cpu_simd/simd_x86.h has the vector
 * form): pair j < 4 in the low 6 bits of bytes
 * j and j+4; j >= 4 in the nibbles of byte j+4 plus the top 2 bits of bytes j-4, j. */
static void q4_K_unpack_scales(const uint8_t packed[12], uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            sc[j] = packed[j] & 63;
            mn[j] = packed[j + 4] & 63;
        } else {
            sc[j] = (packed[j + 4] & 0x0f) | ((packed[j - 4] >> 6) << 4);
            mn[j] = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
        }
    }
}

/* The shared tail of Q4_K and Q5_K: a[256] the unsigned weights (0..15 / 0..31) of block
 * i, 32 per scale; adds d * aux32[l] to sums[l] and returns dmin * sum(min_g * bsum). */
static inline float k4_block(const int8_t *a, const uint8_t *packed_scales, uint16_t xd, uint16_t xdmin,
                             const block_q8_K *y, float sums[8]) {
    uint8_t sc[8], mn[8];
    q4_K_unpack_scales(packed_scales, sc, mn);
    int sumi = 0;
    for (int j = 0; j < QK_K / 16; j++) sumi += y->bsums[j] * mn[j / 2];
    int32_t aux32[8] = {0};
    for (int g = 0; g < QK_K / 32; g++)
        for (int l = 0; l < 32; l++) aux32[l % 8] += sc[g] * (y->qs[32 * g + l] * a[32 * g + l]);
    const float d = FP16(xd) * y->d;
    for (int l = 0; l < 8; l++) sums[l] += d * aux32[l];
    const float dmin = FP16(xdmin) * y->d;
    return dmin * sumi;
}

/* Q4_K: chunk c = 0..3 of 32 bytes: low nibbles are elements 64c..64c+31 (pair 2c),
 * high nibbles 64c+32..64c+63 (pair 2c+1). As ggml: sumf collects -dmin*summs per
 * block, then the 8 partial sums at the end. */
void vec_dot_q4_K_q8_K_ref(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q4_K *x = vx;
    const block_q8_K *y = vy;
    const int64_t nb = n / QK_K;
    float sums[8] = {0}, sumf = 0;
    for (int64_t i = 0; i < nb; i++) {
        int8_t a[QK_K];
        for (int c = 0; c < QK_K / 64; c++)
            for (int l = 0; l < 32; l++) {
                a[64 * c + l] = (int8_t)(x[i].qs[32 * c + l] & 0x0f);
                a[64 * c + 32 + l] = (int8_t)(x[i].qs[32 * c + l] >> 4);
            }
        sumf -= k4_block(a, x[i].scales, x[i].d, x[i].dmin, &y[i], sums);
    }
    for (int l = 0; l < 8; l++) sumf += sums[l];
    *s = sumf;
}

/* Q5_K: Q4_K plus qh[l] bit 2c (low half of chunk c) / 2c+1 (high half) adding 16. */
void vec_dot_q5_K_q8_K_ref(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q5_K *x = vx;
    const block_q8_K *y = vy;
    const int64_t nb = n / QK_K;
    float sums[8] = {0}, sumf = 0;
    for (int64_t i = 0; i < nb; i++) {
        int8_t a[QK_K];
        for (int c = 0; c < QK_K / 64; c++)
            for (int l = 0; l < 32; l++) {
                const uint8_t q = x[i].qs[32 * c + l], h = x[i].qh[l];
                a[64 * c + l] = (int8_t)((q & 0x0f) + ((h >> (2 * c)) & 1) * 16);
                a[64 * c + 32 + l] = (int8_t)((q >> 4) + ((h >> (2 * c + 1)) & 1) * 16);
            }
        sumf -= k4_block(a, x[i].scales, x[i].d, x[i].dmin, &y[i], sums);
    }
    for (int l = 0; l < 8; l++) sumf += sums[l];
    *s = sumf;
}

/* Q6_K: per 128 elements (ql + 64h, qh + 32h), l = 0..31 gives elements l, l+32, l+64,
 * l+96 from ql nibbles and qh bit pairs 0,2,4,6, biased by 32; int8 scale per 16. */
void vec_dot_q6_K_q8_K_ref(int64_t n, float *s, const void *vx, const void *vy) {
    const block_q6_K *x = vx;
    const block_q8_K *y = vy;
    const int64_t nb = n / QK_K;
    float sums[8] = {0};
    for (int64_t i = 0; i < nb; i++) {
        int8_t a[QK_K];
        for (int h = 0; h < QK_K / 128; h++) {
            const uint8_t *ql = x[i].ql + 64 * h, *qh = x[i].qh + 32 * h;
            int8_t *ah = a + 128 * h;
            for (int l = 0; l < 32; l++) {
                ah[l] = (int8_t)(((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32);
                ah[l + 32] = (int8_t)(((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32);
                ah[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                ah[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
        int32_t aux32[8] = {0};
        for (int g = 0; g < QK_K / 16; g++)
            for (int l = 0; l < 16; l++)
                aux32[l % 8] += x[i].scales[g] * (y[i].qs[16 * g + l] * a[16 * g + l]);
        const float d = FP16(x[i].d) * y[i].d;
        for (int l = 0; l < 8; l++) sums[l] += d * aux32[l];
    }
    float sumf = 0;
    for (int l = 0; l < 8; l++) sumf += sums[l];
    *s = sumf;
}

/* IQ4_XS: sub-block ib of 32 on the IQ4_NL grid, 6-bit scale ls (low 4 bits in
 * scales_l nibble ib, high 2 in scales_h bits 2ib..2ib+1), biased by 32. */
void vec_dot_iq4_xs_q8_K_ref(int64_t n, float *s, const void *vx, const void *vy) {
    const block_iq4_xs *x = vx;
    const block_q8_K *y = vy;
    const int64_t nb = n / QK_K;
    float sumf = 0;
    for (int64_t i = 0; i < nb; i++) {
        const float d4d8 = FP16(x[i].d) * y[i].d;
        const uint8_t *qs = x[i].qs;
        const int8_t *q8 = y[i].qs;
        for (int ib = 0; ib < QK_K / 32; ib++, qs += 16, q8 += 32) {
            const int ls = ((x[i].scales_l[ib / 2] >> 4 * (ib % 2)) & 0x0f) |
                           (((x[i].scales_h >> 2 * ib) & 3) << 4);
            const float dl = d4d8 * (ls - 32);
            int sumi1 = 0, sumi2 = 0;
            for (int j = 0; j < 16; j++) {
                sumi1 += q8[j] * le_kvalues_iq4nl[qs[j] & 0x0f];
                sumi2 += q8[j + 16] * le_kvalues_iq4nl[qs[j] >> 4];
            }
            sumf += dl * (sumi1 + sumi2);
        }
    }
    *s = sumf;
}
