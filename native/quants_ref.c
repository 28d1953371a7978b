/* quants_ref.c — scalar reference kernels of every GGML quant format.
 *
 * What: fp16/bf16 <-> f32, dequantize_row_<type>_ref for every block of
 * le_blocks.h, and quantize_row_<type>_ref for the activation types
 * (Q8_0, Q8_1, Q8_K) and F16/BF16/F32. Block formats: spec qwen35.md §4.
 * Why: these are the oracle every SIMD / CUDA path is tested against and the
 * fallback when none applies; they follow ggml-quants.c operation by operation
 * (same products, same order, same rounding) so the results are bit-identical
 * to ggml and to gguf-py's numpy transcription.
 * Test: python -m pytest tests/test_quants.py (bit-exact against gguf-py).
 *
 * Every row is n elements, n a multiple of the block size (dispatch.c checks).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "le_dispatch.h"

/* why: a fused multiply-add rounds once where ggml rounds twice (d*q - m,
 * iscale*x + 2^23*1.5), which would break bit-exactness if this file were ever
 * built for an FMA target. Baseline x86-64 has no FMA; this keeps it so. */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

/* ---- scalar conversions --------------------------------------------------------- */

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* IEEE binary16 -> binary32, exact. NaN payloads are kept as they are (no quiet
 * bit added), as numpy's float16 -> float32 cast does. */
float le_fp16_to_fp32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;

    if (exp == 0x1f)                                  /* inf / NaN: copy the payload */
        return bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp != 0)                                     /* normal: rebias 15 -> 127 */
        return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
    if (man == 0)                                     /* signed zero */
        return bits_f32(sign);

    /* subnormal: value = man * 2^-24; normalise so the leading 1 is implicit */
    uint32_t e = 113;                                 /* biased exponent of 2^-14 */
    while (!(man & 0x400u)) {
        man <<= 1;
        e--;
    }
    return bits_f32(sign | (e << 23) | ((man & 0x3ffu) << 13));
}

/* IEEE binary32 -> binary16, round to nearest even; overflow -> inf; NaN -> NaN
 * keeping the top 10 payload bits (forced non-zero), as numpy's cast does. */
uint16_t le_fp32_to_fp16(float f) {
    const uint32_t x = f32_bits(f);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7fffffffu;

    if (ax >= 0x7f800000u) {                          /* inf or NaN */
        if (ax == 0x7f800000u) return sign | 0x7c00u;
        uint16_t payload = (uint16_t)((ax & 0x7fffffu) >> 13);
        return sign | 0x7c00u | (payload ? payload : 1u);
    }
    if (ax >= 0x477ff000u)                            /* >= 65520 rounds past 65504 */
        return sign | 0x7c00u;
    if (ax >= 0x38800000u) {                          /* result is a normal half */
        /* round the 13 dropped mantissa bits to nearest even; a carry ripples into
         * the exponent, which is the right answer (65504 < |f| < 65520 excluded above) */
        const uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);
        return sign | (uint16_t)((r - 0x38000000u) >> 13);
    }
    if (ax <= 0x33000000u)                            /* <= 2^-25: ties to even give 0 */
        return sign;

    /* subnormal half: value / 2^-24 = m * 2^(e - 126) with m the 24-bit significand */
    const uint32_t e = ax >> 23;                      /* 102..112 here */
    const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;                   /* 14..24 */
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    uint32_t q = m >> shift;
    if (rem > half || (rem == half && (q & 1u))) q++; /* may carry into 0x400: min normal */
    return sign | (uint16_t)q;
}

float le_bf16_to_fp32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

/* ggml_compute_fp32_to_bf16: NaN -> top bits with the quiet bit forced; else RNE. */
uint16_t le_fp32_to_bf16(float f) {
    const uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64u);
    return (uint16_t)((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
}

/* E8M0 exponent byte -> 2^(e-128) (half the MX scale, since the grid is doubled);
 * e = 0 and 1 give the subnormals 2^-128, 2^-127 (ggml_e8m0_to_fp32_half). */
static inline float e8m0_to_fp32_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    return bits_f32(bits);
}

/* float -> int8 as ggml's implicit conversion, for every value a finite input gives
 * (already integral, within [-127, 127]); defines what C leaves undefined for
 * NaN/inf inputs (NaN -> 0, out of range -> saturate), so bad data cannot trap. */
static inline int8_t to_i8(float r) {
    if (r >= 127.f) return 127;
    if (r <= -128.f) return -128;
    return r == r ? (int8_t)r : 0;
}

/* ggml's nearest_int: round half to even via the 1.5*2^23 trick; |f| <= 2^22. */
static inline int nearest_int(float f) {
    const float v = f + 12582912.f;
    int32_t i;
    memcpy(&i, &v, sizeof i);
    return (i & 0x007fffff) - 0x00400000;
}

/* ---- grids ------------------------------------------------------------------------ */

static const int8_t kvalues_iq4nl[16] = {
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
};

/* E2M1 values doubled, so the scale is 2^(e-128) rather than 2^(e-127). */
static const int8_t kvalues_mxfp4[16] = {
    0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
};

/* ---- plain floats ----------------------------------------------------------------- */

void dequantize_row_f32_ref(const float *x, float *y, int64_t n) {
    memcpy(y, x, (size_t)n * sizeof *y);              /* bits kept, NaN payloads too */
}

void dequantize_row_f16_ref(const uint16_t *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = le_fp16_to_fp32(x[i]);
}

void dequantize_row_bf16_ref(const uint16_t *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = le_bf16_to_fp32(x[i]);
}

void quantize_row_f32_ref(const float *x, float *y, int64_t n) {
    memcpy(y, x, (size_t)n * sizeof *y);
}

void quantize_row_f16_ref(const float *x, uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = le_fp32_to_fp16(x[i]);
}

void quantize_row_bf16_ref(const float *x, uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = le_fp32_to_bf16(x[i]);
}

/* ---- 32-element blocks -------------------------------------------------------------
 * Each block: byte j of qs holds element j (low nibble) and element j+16 (high). */

void dequantize_row_q4_0_ref(const block_q4_0 *x, float *y, int64_t n) {
    const int64_t nb = n / QK4_0;
    for (int64_t i = 0; i < nb; i++, y += QK4_0) {
        const float d = le_fp16_to_fp32(x[i].d);
        for (int j = 0; j < QK4_0 / 2; j++) {
            const int x0 = (x[i].qs[j] & 0x0f) - 8;
            const int x1 = (x[i].qs[j] >> 4) - 8;
            y[j] = x0 * d;
            y[j + QK4_0 / 2] = x1 * d;
        }
    }
}

void dequantize_row_q4_1_ref(const block_q4_1 *x, float *y, int64_t n) {
    const int64_t nb = n / QK4_1;
    for (int64_t i = 0; i < nb; i++, y += QK4_1) {
        const float d = le_fp16_to_fp32(x[i].d);
        const float m = le_fp16_to_fp32(x[i].m);
        for (int j = 0; j < QK4_1 / 2; j++) {
            const int x0 = x[i].qs[j] & 0x0f;
            const int x1 = x[i].qs[j] >> 4;
            y[j] = x0 * d + m;                        /* two roundings, as ggml */
            y[j + QK4_1 / 2] = x1 * d + m;
        }
    }
}

/* qh as a little-endian u32: bit j is the 5th bit of element j (j < 32). */
static inline uint32_t load_u32_le(const uint8_t b[4]) {
    return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}

void dequantize_row_q5_0_ref(const block_q5_0 *x, float *y, int64_t n) {
    const int64_t nb = n / QK5_0;
    for (int64_t i = 0; i < nb; i++, y += QK5_0) {
        const float d = le_fp16_to_fp32(x[i].d);
        const uint32_t qh = load_u32_le(x[i].qh);
        for (int j = 0; j < QK5_0 / 2; j++) {
            const int h0 = ((qh >> j) << 4) & 0x10;          /* bit j      -> 16 */
            const int h1 = (qh >> (j + 12)) & 0x10;          /* bit j + 16 -> 16 */
            const int x0 = ((x[i].qs[j] & 0x0f) | h0) - 16;
            const int x1 = ((x[i].qs[j] >> 4) | h1) - 16;
            y[j] = x0 * d;
            y[j + QK5_0 / 2] = x1 * d;
        }
    }
}

void dequantize_row_q5_1_ref(const block_q5_1 *x, float *y, int64_t n) {
    const int64_t nb = n / QK5_1;
    for (int64_t i = 0; i < nb; i++, y += QK5_1) {
        const float d = le_fp16_to_fp32(x[i].d);
        const float m = le_fp16_to_fp32(x[i].m);
        const uint32_t qh = load_u32_le(x[i].qh);
        for (int j = 0; j < QK5_1 / 2; j++) {
            const int h0 = ((qh >> j) << 4) & 0x10;
            const int h1 = (qh >> (j + 12)) & 0x10;
            const int x0 = (x[i].qs[j] & 0x0f) | h0;
            const int x1 = (x[i].qs[j] >> 4) | h1;
            y[j] = x0 * d + m;
            y[j + QK5_1 / 2] = x1 * d + m;
        }
    }
}

void dequantize_row_q8_0_ref(const block_q8_0 *x, float *y, int64_t n) {
    const int64_t nb = n / QK8_0;
    for (int64_t i = 0; i < nb; i++, y += QK8_0) {
        const float d = le_fp16_to_fp32(x[i].d);
        for (int j = 0; j < QK8_0; j++) y[j] = x[i].qs[j] * d;
    }
}

/* ggml has no Q8_1 dequantiser (it is an activation type); s is redundant here. */
void dequantize_row_q8_1_ref(const block_q8_1 *x, float *y, int64_t n) {
    const int64_t nb = n / QK8_1;
    for (int64_t i = 0; i < nb; i++, y += QK8_1) {
        const float d = le_fp16_to_fp32(x[i].d);
        for (int j = 0; j < QK8_1; j++) y[j] = x[i].qs[j] * d;
    }
}

void dequantize_row_iq4_nl_ref(const block_iq4_nl *x, float *y, int64_t n) {
    const int64_t nb = n / QK4_NL;
    for (int64_t i = 0; i < nb; i++, y += QK4_NL) {
        const float d = le_fp16_to_fp32(x[i].d);
        for (int j = 0; j < QK4_NL / 2; j++) {
            y[j] = d * kvalues_iq4nl[x[i].qs[j] & 0x0f];
            y[j + QK4_NL / 2] = d * kvalues_iq4nl[x[i].qs[j] >> 4];
        }
    }
}

void dequantize_row_mxfp4_ref(const block_mxfp4 *x, float *y, int64_t n) {
    const int64_t nb = n / QK_MXFP4;
    for (int64_t i = 0; i < nb; i++, y += QK_MXFP4) {
        const float d = e8m0_to_fp32_half(x[i].e);
        for (int j = 0; j < QK_MXFP4 / 2; j++) {
            y[j] = kvalues_mxfp4[x[i].qs[j] & 0x0f] * d;
            y[j + QK_MXFP4 / 2] = kvalues_mxfp4[x[i].qs[j] >> 4] * d;
        }
    }
}

/* ---- K-quants (256-element super-blocks) --------------------------------------------- */

/* Q2_K: per 128 elements (qs + 32h), shift s = 0,2,4,6 selects two 16-groups:
 * y[128h + 32(s/2) + l]      from qs[32h + l]      (l < 16),
 * y[128h + 32(s/2) + 16 + l] from qs[32h + 16 + l]; each group has its own scale byte. */
void dequantize_row_q2_K_ref(const block_q2_K *x, float *y, int64_t n) {
    const int64_t nb = n / QK_K;
    for (int64_t i = 0; i < nb; i++) {
        const float d = le_fp16_to_fp32(x[i].d);
        const float dmin = le_fp16_to_fp32(x[i].dmin);
        const uint8_t *q = x[i].qs;
        int is = 0;
        for (int h = 0; h < QK_K / 128; h++, q += 32) {
            for (int shift = 0; shift < 8; shift += 2) {
                for (int g = 0; g < 2; g++) {          /* g: first / second 16 of q */
                    const uint8_t sc = x[i].scales[is++];
                    const float dl = d * (sc & 0x0f);
                    const float ml = dmin * (sc >> 4);
                    for (int l = 0; l < 16; l++)
                        *y++ = dl * ((q[16 * g + l] >> shift) & 3) - ml;
                }
            }
        }
    }
}

/* Q3_K scale j (0..15), 6 bits: low 4 from byte j (j < 8) or the high nibble of
 * byte j-8; high 2 from byte 8 + j%4 at bit 2*(j/4). Stored biased by 32. */
static inline int q3_k_scale(const uint8_t s[12], int j) {
    const int lo = j < 8 ? s[j] & 0x0f : s[j - 8] >> 4;
    const int hi = (s[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
    return (lo | (hi << 4)) - 32;
}

/* Q3_K: as Q2_K's walk; the high bit of element (h, shift s, l) is hmask[l] bit
 * (4h + s/2), and a clear bit subtracts 4. */
void dequantize_row_q3_K_ref(const block_q3_K *x, float *y, int64_t n) {
    const int64_t nb = n / QK_K;
    for (int64_t i = 0; i < nb; i++) {
        const float d_all = le_fp16_to_fp32(x[i].d);
        const uint8_t *q = x[i].qs;
        const uint8_t *hm = x[i].hmask;
        uint8_t m = 1;                                  /* hmask bit of this shift */
        int is = 0;
        for (int h = 0; h < QK_K / 128; h++, q += 32) {
            for (int shift = 0; shift < 8; shift += 2, m <<= 1) {
                for (int g = 0; g < 2; g++) {
                    const float dl = d_all * q3_k_scale(x[i].scales, is++);
                    for (int l = 16 * g; l < 16 * g + 16; l++)
                        *y++ = dl * (((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4));
                }
            }
        }
    }
}

/* Q4_K / Q5_K (scale, min) pair j (0..7) from the 12 packed bytes
 * (ggml get_scale_min_k4): j < 4 in the low 6 bits of bytes j and j+4; j >= 4 in
 * the nibbles of byte j+4 plus the top 2 bits of bytes j-4 and j. */
static inline void get_scale_min_k4(int j, const uint8_t *s, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Q4_K: chunk c = 0..3 of 32 bytes gives 64 elements: low nibbles with pair 2c,
 * then high nibbles with pair 2c+1. */
void dequantize_row_q4_K_ref(const block_q4_K *x, float *y, int64_t n) {
    const int64_t nb = n / QK_K;
    for (int64_t i = 0; i < nb; i++) {
        const float d = le_fp16_to_fp32(x[i].d);
        const float min = le_fp16_to_fp32(x[i].dmin);
        const uint8_t *q = x[i].qs;
        for (int c = 0; c < QK_K / 64; c++, q += 32) {
            uint8_t sc, m;
            get_scale_min_k4(2 * c, x[i].scales, &sc, &m);
            const float d1 = d * sc, m1 = min * m;
            get_scale_min_k4(2 * c + 1, x[i].scales, &sc, &m);
            const float d2 = d * sc, m2 = min * m;
            for (int l = 0; l < 32; l++) *y++ = d1 * (q[l] & 0x0f) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * (q[l] >> 4) - m2;
        }
    }
}

/* Q5_K: Q4_K plus qh[l] bit 2c (low half) / 2c+1 (high half) adding 16. */
void dequantize_row_q5_K_ref(const block_q5_K *x, float *y, int64_t n) {
    const int64_t nb = n / QK_K;
    for (int64_t i = 0; i < nb; i++) {
        const float d = le_fp16_to_fp32(x[i].d);
        const float min = le_fp16_to_fp32(x[i].dmin);
        const uint8_t *ql = x[i].qs;
        const uint8_t *qh = x[i].qh;
        uint8_t u1 = 1, u2 = 2;
        for (int c = 0; c < QK_K / 64; c++, ql += 32, u1 <<= 2, u2 <<= 2) {
            uint8_t sc, m;
            get_scale_min_k4(2 * c, x[i].scales, &sc, &m);
            const float d1 = d * sc, m1 = min * m;
            get_scale_min_k4(2 * c + 1, x[i].scales, &sc, &m);
            const float d2 = d * sc, m2 = min * m;
            for (int l = 0; l < 32; l++) *y++ = d1 * ((ql[l] & 0x0f) + ((qh[l] & u1) ? 16 : 0)) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * ((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - m2;
        }
    }
}

/* Q6_K: per 128 elements (ql + 64h, qh + 32h, scales + 8h), l = 0..31 fills
 * y[l], y[l+32], y[l+64], y[l+96] from ql nibbles and qh bit pairs 0,2,4,6. */
void dequantize_row_q6_K_ref(const block_q6_K *x, float *y, int64_t n) {
    const int64_t nb = n / QK_K;
    for (int64_t i = 0; i < nb; i++) {
        const float d = le_fp16_to_fp32(x[i].d);
        const uint8_t *ql = x[i].ql;
        const uint8_t *qh = x[i].qh;
        const int8_t *sc = x[i].scales;
        for (int h = 0; h < QK_K / 128; h++, y += 128, ql += 64, qh += 32, sc += 8) {
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                const int q1 = ((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = d * sc[is] * q1;               /* (d * sc) * q, as ggml */
                y[l + 32] = d * sc[is + 2] * q2;
                y[l + 64] = d * sc[is + 4] * q3;
                y[l + 96] = d * sc[is + 6] * q4;
            }
        }
    }
}

void dequantize_row_q8_K_ref(const block_q8_K *x, float *y, int64_t n) {
    const int64_t nb = n / QK_K;
    for (int64_t i = 0; i < nb; i++, y += QK_K)
        for (int j = 0; j < QK_K; j++) y[j] = x[i].d * x[i].qs[j];
}

/* IQ4_XS: sub-block ib = 0..7 of 32: 6-bit scale from scales_l nibble ib and
 * scales_h bits 2ib..2ib+1, biased by 32; values on the IQ4_NL grid. */
void dequantize_row_iq4_xs_ref(const block_iq4_xs *x, float *y, int64_t n) {
    const int64_t nb = n / QK_K;
    for (int64_t i = 0; i < nb; i++) {
        const float d = le_fp16_to_fp32(x[i].d);
        const uint8_t *qs = x[i].qs;
        for (int ib = 0; ib < QK_K / 32; ib++, y += 32, qs += 16) {
            const int ls = ((x[i].scales_l[ib / 2] >> 4 * (ib % 2)) & 0x0f) |
                           (((x[i].scales_h >> 2 * ib) & 3) << 4);
            const float dl = d * (ls - 32);
            for (int j = 0; j < 16; j++) {
                y[j] = dl * kvalues_iq4nl[qs[j] & 0x0f];
                y[j + 16] = dl * kvalues_iq4nl[qs[j] >> 4];
            }
        }
    }
}

/* ---- activation quantisers (ggml quantize_row_q8_{0,1,K}_ref) -------------------------- */

/* ggml's MAX(a, b) macro: a > b ? a : b (differs from fmaxf only for NaN). */
static inline float max_as_ggml(float a, float b) { return a > b ? a : b; }

/* Q8_0: per 32, d = amax/127, q = roundf(x/d) (half away from zero), d stored as half. */
void quantize_row_q8_0_ref(const float *x, block_q8_0 *y, int64_t n) {
    const int64_t nb = n / QK8_0;
    for (int64_t i = 0; i < nb; i++, x += QK8_0) {
        float amax = 0.0f;
        for (int j = 0; j < QK8_0; j++) amax = max_as_ggml(amax, fabsf(x[j]));
        const float d = amax / 127;
        const float id = d ? 1.0f / d : 0.0f;
        y[i].d = le_fp32_to_fp16(d);
        for (int j = 0; j < QK8_0; j++) y[i].qs[j] = to_i8(roundf(x[j] * id));
    }
}

/* Q8_1: Q8_0 plus s = d * sum(q), with the f32 d (not the rounded half). */
void quantize_row_q8_1_ref(const float *x, block_q8_1 *y, int64_t n) {
    const int64_t nb = n / QK8_1;
    for (int64_t i = 0; i < nb; i++, x += QK8_1) {
        float amax = 0.0f;
        for (int j = 0; j < QK8_1; j++) amax = max_as_ggml(amax, fabsf(x[j]));
        const float d = amax / 127;
        const float id = d ? 1.0f / d : 0.0f;
        y[i].d = le_fp32_to_fp16(d);
        int sum = 0;
        for (int j = 0; j < QK8_1; j++) {
            y[i].qs[j] = to_i8(roundf(x[j] * id));
            sum += y[i].qs[j];
        }
        y[i].s = le_fp32_to_fp16(sum * d);
    }
}

/* Q8_K: per 256, max = the first element of largest |x| (signed), iscale = -127/max,
 * q = min(127, nearest_int(iscale*x)) so max maps to -127 and d = 1/iscale may be
 * negative; bsums[k] = sum of q over elements 16k..16k+15.
 * An all-zero block gets d = 0, q = 0 and bsums = 0 (ggml leaves bsums unwritten). */
void quantize_row_q8_K_ref(const float *x, block_q8_K *y, int64_t n) {
    const int64_t nb = n / QK_K;
    for (int64_t i = 0; i < nb; i++, x += QK_K) {
        float max = 0.0f, amax = 0.0f;
        for (int j = 0; j < QK_K; j++) {
            const float ax = fabsf(x[j]);
            if (ax > amax) {
                amax = ax;
                max = x[j];
            }
        }
        if (!amax) {
            memset(&y[i], 0, sizeof y[i]);
            continue;
        }
        const float iscale = -127.f / max;
        for (int j = 0; j < QK_K; j++) {
            const int v = nearest_int(iscale * x[j]);
            y[i].qs[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int k = 0; k < QK_K / 16; k++) {
            int sum = 0;
            for (int j = 0; j < 16; j++) sum += y[i].qs[16 * k + j];
            y[i].bsums[k] = (int16_t)sum;
        }
        y[i].d = 1 / iscale;
    }
}
