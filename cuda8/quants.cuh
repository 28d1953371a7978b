/* quants.cuh — weight blocks decoded 32 elements at a time, for every GEMV/GEMM file.
 *
 * A weight row of n elements (n a multiple of the type's block size) is n/32 "sub-blocks"
 * of 32 consecutive elements; sub-block s covers elements [32s, 32s+32). Every type decodes
 * a sub-block to an le_q32: 32 small integers packed 4 per int (element 4k+i in byte i of
 * q[k], signed bytes) and the affine map
 *     y[j] = d[j / 16] * q[j] - m
 * which is exactly the dequantisation of native/quants_ref.c (same products in the same
 * order), so the f32 kernels see the reference's weights bit for bit and the int8 kernels
 * can feed q[] to le_dp4a. Two scales because Q6_K has one per 16 elements.
 *
 * Types (layouts: native/include/le_blocks.h, spec qwen35.md §4), with the alignment of a
 * block in a row, which decides the load width (row starts are 4-byte aligned):
 *   Q4_0   32 el, 18 B, 2-aligned   q = nibble - 8 (signed), m = 0
 *   Q8_0   32 el, 34 B, 2-aligned   q = int8, m = 0
 *   Q4_K  256 el, 144 B, 4-aligned  q = nibble, d = d*sc, m = dmin*mn (6-bit sc, mn)
 *   Q5_K  256 el, 176 B, 4-aligned  q = nibble | qh bit << 4, as Q4_K
 *   Q6_K  256 el, 210 B, 2-aligned  q = 6 bits - 32 (signed), d[h] = d*scales[g], m = 0
 *   IQ4_XS 256 el, 136 B, 4-aligned q = kvalues_iq4nl[nibble] (int8), d = d*(ls-32), m = 0
 * Only Q4_K and Q5_K have a min term (HAS_MIN); the int8 kernels take it from Q8_1's sum of x.
 *
 * decode(row, s, b) fills all of sub-block s; qword(row, s, k) returns only its int k (elements
 * 4k..4k+3) and scale(row, s, h, d, m) the scale of its half h (elements 16h..16h+15; TWO_SCALES: only
 * Q6_K's halves differ) and the min: for kernels whose consecutive lanes take consecutive words, so that
 * weight and activation loads coalesce (gemv_f32.cu), and that decode a sub-block's scales once for all
 * its words (gemm_q8.cuh). le_word<T> is the two together. HDR: the type's scales of a sub-block come from its
 * block's first 16 bytes (4-aligned), scale_hdr(h, s, d, m) decodes them from those as 4 words (Q4_K, Q5_K).
 * qword = qfin(qraw) and (types without HDR) scale = sfin(sraw): qraw / sraw only load (the raw words, qraw_t / int2),
 * qfin / sfin only compute, so that a kernel can issue a step's loads a step before it decodes them.
 */
#ifndef LE_QUANTS_CUH
#define LE_QUANTS_CUH

#include "compat.cuh"

struct le_q32 {
    int q[8];   /* 32 signed bytes: element 4k+i is byte i of q[k] */
    float d[2]; /* scale of elements 0..15 and 16..31 */
    float m;    /* subtracted from every element */
};

/* Bytewise b - c for bytes b < 128 and c <= b's range, without borrows between bytes:
 * ((b | 0x80) - c) ^ 0x80 per byte (the set top bit absorbs the borrow). */
__device__ __forceinline__ int le_sub_bytes(int b, int c) {
    return (int)((((unsigned)b | 0x80808080u) - (unsigned)c) ^ 0x80808080u);
}

/* Q4_K / Q5_K: the 6-bit (scale, min) pair of sub-block j of 8 (ggml get_scale_min_k4). */
__device__ __forceinline__ void le_scale_min_k4(int j, const uint8_t *s, int *sc, int *mn) {
    if (j < 4) {
        *sc = le_ldg(s + j) & 63;
        *mn = le_ldg(s + j + 4) & 63;
    } else {
        const int a = le_ldg(s + j + 4), lo = le_ldg(s + j - 4), hi = le_ldg(s + j);
        *sc = (a & 0xF) | ((lo >> 6) << 4);
        *mn = (a >> 4) | ((hi >> 6) << 4);
    }
}

/* Q4_K / Q5_K (same header: d, dmin, 12 bytes of scales): d = d * sc, m = dmin * mn of sub-block j of block blk */
__device__ __forceinline__ void le_scale_k4(const uint8_t *blk, int j, float &d, float &m) {
    int sc, mn;
    le_scale_min_k4(j, blk + 4, &sc, &mn);
    d = le_ldg_half((const uint16_t *)blk) * sc;
    m = le_ldg_half((const uint16_t *)blk + 1) * mn;
}

/* Q4_K / Q5_K from the block's 16-byte header as 4 words h (d | dmin << 16, then the 12 scale bytes): what
 * le_scale_k4 gives for sub-block j, the same products */
__device__ __forceinline__ void le_scale_k4_hdr(const int *h, int j, float &d, float &m) {
    /* byte b of the scales, b < 12: word 1 + b / 4 chosen by compares (an indexed register array would go to
     * local memory) */
#define LE_K4_BYTE(b) ((((b) < 4 ? h[1] : (b) < 8 ? h[2] : h[3]) >> (8 * ((b) % 4))) & 0xFF)
    int sc, mn;
    if (j < 4) {
        sc = LE_K4_BYTE(j) & 63;
        mn = LE_K4_BYTE(j + 4) & 63;
    } else {
        const int a = LE_K4_BYTE(j + 4), lo = LE_K4_BYTE(j - 4), hi = LE_K4_BYTE(j);
        sc = (a & 0xF) | ((lo >> 6) << 4);
        mn = (a >> 4) | ((hi >> 6) << 4);
    }
#undef LE_K4_BYTE
    d = le_half_to_float((uint16_t)(h[0] & 0xFFFF)) * sc;
    m = le_half_to_float((uint16_t)((unsigned)h[0] >> 16)) * mn;
}

/* IQ4_NL/IQ4_XS grid: four 4-bit indices (one per byte of v, each < 16) -> four int8 values,
 * with two byte permutes (prmt, every chip) instead of four table loads. */
__device__ __forceinline__ int le_iq4_lookup(int v) {
    /* kvalues_iq4nl = {-127,-104,-83,-65,-49,-35,-22,-10, 1,13,25,38,53,69,89,113} as bytes */
    const unsigned t0 = 0xBFAD9881u, t1 = 0xF6EADDCFu, t2 = 0x26190D01u, t3 = 0x71594535u;
    const unsigned t = (unsigned)v | ((unsigned)v >> 4);            /* nibbles of bytes 0,1 / 2,3 side by side */
    const unsigned sel = ((t & 0xFFu) | ((t >> 8) & 0xFF00u)) & 0x7777u; /* byte i <- index & 7 */
    const unsigned lo = __byte_perm(t0, t1, sel), hi = __byte_perm(t2, t3, sel);
    const unsigned upper = (((unsigned)v >> 3) & 0x01010101u) * 0xFFu;  /* bytes whose index >= 8 */
    return (int)((lo & ~upper) | (hi & upper));
}

/* The f16 bits at p (2-aligned) as a raw scale word (x; y unused): Q4_0's and Q8_0's block header */
__device__ __forceinline__ int2 le_raw_f16(const uint8_t *p) { return make_int2(le_ldg((const uint16_t *)p), 0); }

/* ---- one struct per type: BLOCK elements, BYTES per block, decode(row, s, out) ---------------- */

struct le_t_q4_0 {
    enum { BLOCK = QK4_0, BYTES = sizeof(block_q4_0), TWO_SCALES = 0, HAS_MIN = 0, HDR = 0 };
    static __device__ __forceinline__ void decode(const uint8_t *row, int s, le_q32 &b) {
        const uint8_t *blk = row + (size_t)s * BYTES;
        const float d = le_ldg_half((const uint16_t *)blk);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int v = le_load_i32_a2(blk + 2 + 4 * k);
            b.q[k] = le_sub_bytes(v & 0x0F0F0F0F, 0x08080808);            /* elements 4k.. */
            b.q[k + 4] = le_sub_bytes((v >> 4) & 0x0F0F0F0F, 0x08080808); /* elements 16+4k.. */
        }
        b.d[0] = b.d[1] = d;
        b.m = 0.0f;
    }
    typedef int2 qraw_t;
    static __device__ __forceinline__ int2 sraw(const uint8_t *row, int s) {
        return le_raw_f16(row + (size_t)s * BYTES);
    }
    static __device__ __forceinline__ void sfin(int2 r, int, int, float &d, float &m) {
        d = le_half_to_float((uint16_t)r.x);
        m = 0.0f;
    }
    static __device__ __forceinline__ void scale(const uint8_t *row, int s, int h, float &d, float &m) {
        sfin(sraw(row, s), s, h, d, m);
    }
    static __device__ __forceinline__ int2 qraw(const uint8_t *row, int s, int k) {
        return le_raw_i32_a2(row + (size_t)s * BYTES + 2 + 4 * (k & 3));
    }
    static __device__ __forceinline__ int qfin(int2 r, int, int k) {
        const int v = le_join_i32_a2(r);
        return le_sub_bytes((k < 4 ? v : v >> 4) & 0x0F0F0F0F, 0x08080808);
    }
    static __device__ __forceinline__ int qword(const uint8_t *row, int s, int k) {
        return qfin(qraw(row, s, k), s, k);
    }
};

struct le_t_q8_0 {
    enum { BLOCK = QK8_0, BYTES = sizeof(block_q8_0), TWO_SCALES = 0, HAS_MIN = 0, HDR = 0 };
    static __device__ __forceinline__ void decode(const uint8_t *row, int s, le_q32 &b) {
        const uint8_t *blk = row + (size_t)s * BYTES;
        b.d[0] = b.d[1] = le_ldg_half((const uint16_t *)blk);
#pragma unroll
        for (int k = 0; k < 8; k++) b.q[k] = le_load_i32_a2(blk + 2 + 4 * k);
        b.m = 0.0f;
    }
    typedef int2 qraw_t;
    static __device__ __forceinline__ int2 sraw(const uint8_t *row, int s) {
        return le_raw_f16(row + (size_t)s * BYTES);
    }
    static __device__ __forceinline__ void sfin(int2 r, int s, int h, float &d, float &m) {
        le_t_q4_0::sfin(r, s, h, d, m); /* the same header: d as f16, no min */
    }
    static __device__ __forceinline__ void scale(const uint8_t *row, int s, int h, float &d, float &m) {
        sfin(sraw(row, s), s, h, d, m);
    }
    static __device__ __forceinline__ int2 qraw(const uint8_t *row, int s, int k) {
        return le_raw_i32_a2(row + (size_t)s * BYTES + 2 + 4 * k);
    }
    static __device__ __forceinline__ int qfin(int2 r, int, int) { return le_join_i32_a2(r); }
    static __device__ __forceinline__ int qword(const uint8_t *row, int s, int k) {
        return qfin(qraw(row, s, k), s, k);
    }
};

struct le_t_q4_K {
    enum { BLOCK = QK_K, BYTES = sizeof(block_q4_K), TWO_SCALES = 0, HAS_MIN = 1, HDR = 1 };
    static __device__ __forceinline__ void decode(const uint8_t *row, int s, le_q32 &b) {
        const uint8_t *blk = row + (size_t)(s / 8) * BYTES;
        const int j = s % 8; /* sub-block of the super-block */
        const float d = le_ldg_half((const uint16_t *)blk), dmin = le_ldg_half((const uint16_t *)blk + 1);
        int sc, mn;
        le_scale_min_k4(j, blk + 4, &sc, &mn);
        const uint8_t *qs = blk + 16 + 32 * (j / 2); /* even j: low nibbles, odd j: high nibbles */
        const int shift = 4 * (j & 1);
#pragma unroll
        for (int k = 0; k < 8; k++) b.q[k] = (le_load_i32_a4(qs + 4 * k) >> shift) & 0x0F0F0F0F;
        b.d[0] = b.d[1] = d * sc;
        b.m = dmin * mn;
    }
    static __device__ __forceinline__ void scale(const uint8_t *row, int s, int, float &d, float &m) {
        le_scale_k4(row + (size_t)(s / 8) * BYTES, s % 8, d, m);
    }
    static __device__ __forceinline__ void scale_hdr(const int *h, int s, float &d, float &m) {
        le_scale_k4_hdr(h, s % 8, d, m);
    }
    typedef int2 qraw_t;
    static __device__ __forceinline__ int2 qraw(const uint8_t *row, int s, int k) {
        const int j = s % 8;
        return make_int2(le_load_i32_a4(row + (size_t)(s / 8) * BYTES + 16 + 32 * (j / 2) + 4 * k), 0);
    }
    static __device__ __forceinline__ int qfin(int2 r, int s, int) { return (r.x >> (4 * (s % 8 & 1))) & 0x0F0F0F0F; }
    static __device__ __forceinline__ int qword(const uint8_t *row, int s, int k) {
        return qfin(qraw(row, s, k), s, k);
    }
};

struct le_t_q5_K {
    enum { BLOCK = QK_K, BYTES = sizeof(block_q5_K), TWO_SCALES = 0, HAS_MIN = 1, HDR = 1 };
    static __device__ __forceinline__ void decode(const uint8_t *row, int s, le_q32 &b) {
        const uint8_t *blk = row + (size_t)(s / 8) * BYTES;
        const int j = s % 8;
        const float d = le_ldg_half((const uint16_t *)blk), dmin = le_ldg_half((const uint16_t *)blk + 1);
        int sc, mn;
        le_scale_min_k4(j, blk + 4, &sc, &mn);
        const uint8_t *qh = blk + 16;                 /* bit j of qh[l]: 5th bit of element l */
        const uint8_t *qs = blk + 48 + 32 * (j / 2);
        const int shift = 4 * (j & 1);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const int lo = (le_load_i32_a4(qs + 4 * k) >> shift) & 0x0F0F0F0F;
            const int hi = ((le_load_i32_a4(qh + 4 * k) >> j) & 0x01010101) << 4;
            b.q[k] = lo | hi;
        }
        b.d[0] = b.d[1] = d * sc;
        b.m = dmin * mn;
    }
    static __device__ __forceinline__ void scale(const uint8_t *row, int s, int, float &d, float &m) {
        le_scale_k4(row + (size_t)(s / 8) * BYTES, s % 8, d, m);
    }
    static __device__ __forceinline__ void scale_hdr(const int *h, int s, float &d, float &m) {
        le_scale_k4_hdr(h, s % 8, d, m);
    }
    typedef int2 qraw_t; /* x: the nibbles' word, y: the fifth bits' word */
    static __device__ __forceinline__ int2 qraw(const uint8_t *row, int s, int k) {
        const uint8_t *blk = row + (size_t)(s / 8) * BYTES;
        const int j = s % 8;
        return make_int2(le_load_i32_a4(blk + 48 + 32 * (j / 2) + 4 * k), le_load_i32_a4(blk + 16 + 4 * k));
    }
    static __device__ __forceinline__ int qfin(int2 r, int s, int) {
        const int j = s % 8;
        return ((r.x >> (4 * (j & 1))) & 0x0F0F0F0F) | (((r.y >> j) & 0x01010101) << 4);
    }
    static __device__ __forceinline__ int qword(const uint8_t *row, int s, int k) {
        return qfin(qraw(row, s, k), s, k);
    }
};

struct le_t_q6_K {
    enum { BLOCK = QK_K, BYTES = sizeof(block_q6_K), TWO_SCALES = 1, HAS_MIN = 0, HDR = 0 };
    static __device__ __forceinline__ void decode(const uint8_t *row, int s, le_q32 &b) {
        const uint8_t *blk = row + (size_t)(s / 8) * BYTES;
        const int j = s % 8, n = j / 4, t = j % 4; /* half n of 128 elements, quarter t of it */
        const uint8_t *ql = blk + 64 * n + 32 * (t & 1);
        const uint8_t *qh = blk + 128 + 32 * n;
        const int8_t *scales = (const int8_t *)(blk + 192) + 8 * n + 2 * t;
        const float d = le_ldg_half((const uint16_t *)(blk + 208));
        const int lshift = 4 * (t >> 1), hshift = 2 * t;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const int lo = (le_load_i32_a2(ql + 4 * k) >> lshift) & 0x0F0F0F0F;
            const int hi = ((le_load_i32_a2(qh + 4 * k) >> hshift) & 0x03030303) << 4;
            b.q[k] = le_sub_bytes(lo | hi, 0x20202020); /* q - 32 */
        }
        b.d[0] = d * le_ldg(scales);     /* elements 0..15 */
        b.d[1] = d * le_ldg(scales + 1); /* elements 16..31 */
        b.m = 0.0f;
    }
    /* x: d's f16 bits, y: the sub-block's two int8 scales (elements 0-15, 16-31) */
    static __device__ __forceinline__ int2 sraw(const uint8_t *row, int s) {
        const uint8_t *blk = row + (size_t)(s / 8) * BYTES;
        return make_int2(le_ldg((const uint16_t *)(blk + 208)),
                         le_ldg((const uint16_t *)(blk + 192 + 2 * (s % 8))));
    }
    static __device__ __forceinline__ void sfin(int2 r, int, int h, float &d, float &m) {
        d = le_half_to_float((uint16_t)r.x) * (int)(signed char)(r.y >> (8 * h));
        m = 0.0f;
    }
    static __device__ __forceinline__ void scale(const uint8_t *row, int s, int h, float &d, float &m) {
        sfin(sraw(row, s), s, h, d, m);
    }
    typedef int4 qraw_t; /* the low nibbles' halves (x, y), the high bits' (z, w) */
    static __device__ __forceinline__ int4 qraw(const uint8_t *row, int s, int k) {
        const uint8_t *blk = row + (size_t)(s / 8) * BYTES;
        const int j = s % 8, n = j / 4, t = j % 4;
        const int2 lo = le_raw_i32_a2(blk + 64 * n + 32 * (t & 1) + 4 * k);
        const int2 hi = le_raw_i32_a2(blk + 128 + 32 * n + 4 * k);
        return make_int4(lo.x, lo.y, hi.x, hi.y);
    }
    static __device__ __forceinline__ int qfin(int4 r, int s, int) {
        const int t = s % 8 % 4;
        const int lo = (le_join_i32_a2(make_int2(r.x, r.y)) >> (4 * (t >> 1))) & 0x0F0F0F0F;
        const int hi = ((le_join_i32_a2(make_int2(r.z, r.w)) >> (2 * t)) & 0x03030303) << 4;
        return le_sub_bytes(lo | hi, 0x20202020);
    }
    static __device__ __forceinline__ int qword(const uint8_t *row, int s, int k) {
        return qfin(qraw(row, s, k), s, k);
    }
};

struct le_t_iq4_xs {
    enum { BLOCK = QK_K, BYTES = sizeof(block_iq4_xs), TWO_SCALES = 0, HAS_MIN = 0, HDR = 0 };
    static __device__ __forceinline__ void decode(const uint8_t *row, int s, le_q32 &b) {
        const uint8_t *blk = row + (size_t)(s / 8) * BYTES;
        const int j = s % 8;
        const float d = le_ldg_half((const uint16_t *)blk);
        const int scales_h = le_ldg((const uint16_t *)blk + 1);
        const int ls = ((le_ldg(blk + 4 + j / 2) >> (4 * (j % 2))) & 0xF) | (((scales_h >> (2 * j)) & 3) << 4);
        const uint8_t *qs = blk + 8 + 16 * j;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int v = le_load_i32_a4(qs + 4 * k);
            b.q[k] = le_iq4_lookup(v & 0x0F0F0F0F);
            b.q[k + 4] = le_iq4_lookup((v >> 4) & 0x0F0F0F0F);
        }
        b.d[0] = b.d[1] = d * (ls - 32);
        b.m = 0.0f;
    }
    /* x: the block's first word (d's f16 bits | scales_h << 16), y: the byte of the sub-block's low scale bits */
    static __device__ __forceinline__ int2 sraw(const uint8_t *row, int s) {
        const uint8_t *blk = row + (size_t)(s / 8) * BYTES;
        return make_int2(le_ldg((const int *)blk), le_ldg(blk + 4 + s % 8 / 2));
    }
    static __device__ __forceinline__ void sfin(int2 r, int s, int, float &d, float &m) {
        const int j = s % 8, scales_h = (int)((unsigned)r.x >> 16);
        const int ls = ((r.y >> (4 * (j % 2))) & 0xF) | (((scales_h >> (2 * j)) & 3) << 4);
        d = le_half_to_float((uint16_t)(r.x & 0xFFFF)) * (ls - 32);
        m = 0.0f;
    }
    static __device__ __forceinline__ void scale(const uint8_t *row, int s, int h, float &d, float &m) {
        sfin(sraw(row, s), s, h, d, m);
    }
    typedef int2 qraw_t;
    static __device__ __forceinline__ int2 qraw(const uint8_t *row, int s, int k) {
        return make_int2(le_load_i32_a4(row + (size_t)(s / 8) * BYTES + 8 + 16 * (s % 8) + 4 * (k & 3)), 0);
    }
    static __device__ __forceinline__ int qfin(int2 r, int, int k) {
        return le_iq4_lookup((k < 4 ? r.x : r.x >> 4) & 0x0F0F0F0F);
    }
    static __device__ __forceinline__ int qword(const uint8_t *row, int s, int k) {
        return qfin(qraw(row, s, k), s, k);
    }
};

/* Int k of sub-block s (elements 4k..4k+3) with that int's scale and min (elements 0-15 take scale h = 0, 16-31
 * h = 1; only Q6_K has two): for kernels whose consecutive lanes take consecutive words. */
template <class T>
__device__ __forceinline__ int le_word(const uint8_t *row, int s, int k, float &d, float &m) {
    T::scale(row, s, k / 4, d, m);
    return T::qword(row, s, k);
}

/* The byte i of q as a signed value. */
__device__ __forceinline__ int le_byte(int q, int i) { return (int)(signed char)(q >> (8 * i)); }

/* Row bytes of n elements of type T. */
template <class T>
__device__ __forceinline__ size_t le_row_bytes(int n) {
    return (size_t)(n / T::BLOCK) * T::BYTES;
}

/* The dense GEMVs' matrices of one launch (gemv_f32.cu, gemv_dp4a.cu): up to GEMV_MAX_MATS of one type and width on
 * the same input (GDN's qkv, z, beta and alpha; a SwiGLU's gate and up; attention's q, k and v): matrix 0 is nrows
 * rows of W into y, matrix m > 0 n_m rows at W + w_m bytes (may be negative) into y + y_m floats (n_m = 0: none).
 * The grid is the matrices' blocks one after another (ceil(rows / warps) each, no empty block: a decode token is a
 * chain of dependent launches, each mostly latency); with one matrix, the grid as launched, grid-strided. */
#define GEMV_MAX_MATS 4
#define LE_GEMV_MATS \
    long long w_1, long long y_1, int n_1, long long w_2, long long y_2, int n_2, long long w_3, long long y_3, int n_3
#define LE_GEMV_PICK(m, v0, v1, v2, v3) ((m) == 0 ? (v0) : (m) == 1 ? (v1) : (m) == 2 ? (v2) : (v3))

struct le_gemv_mat {
    int m, blk, nblk; /* the block's matrix, its index among that matrix's blocks, their count */
};

__device__ __forceinline__ le_gemv_mat le_gemv_mat_of(int nrows, int n_1, int n_2, int n_3, int warps) {
    le_gemv_mat g;
    g.m = 0;
    g.blk = blockIdx.x;
    g.nblk = gridDim.x;
    if (n_1 == 0) return g;
    const int nb[GEMV_MAX_MATS] = {(nrows + warps - 1) / warps, (n_1 + warps - 1) / warps,
                                   (n_2 + warps - 1) / warps, (n_3 + warps - 1) / warps};
    int b = blockIdx.x;
    while (g.m < GEMV_MAX_MATS - 1 && b >= nb[g.m]) b -= nb[g.m++];
    g.blk = b;
    g.nblk = nb[g.m];
    return g;
}

#endif
