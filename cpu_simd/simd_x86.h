/* simd_x86.h — small inline helpers the SIMD kernel files share.
 *
 * Include it after the file's `#pragma GCC target(...)`: each section is compiled only
 * when that target enables its ISA (GCC defines __SSSE3__/__AVX2__/... from the pragma),
 * so the helpers take the ISA of the file that includes them.
 * ISA-neutral helpers come first (plain C and SSE2, which every x86-64 has): le_h2f /
 * le_h2f_x4 (exact fp16 -> f32 without F16C, for the SSSE3 tier), le_e8m0_half (MXFP4's
 * scale), and the vector forms of the Q3_K / Q4_K scale unpacking.
 */
#ifndef LE_SIMD_X86_H
#define LE_SIMD_X86_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <immintrin.h>

#include "le_blocks.h"
#include "le_simd.h"

/* Software prefetch of the weights a GEMV streams from DRAM. A dot product's arithmetic fills the out-of-order
 * window, so one thread keeps few misses in flight: the hardware streamer alone gave one thread 7.1 GB/s of Q4_K
 * (AVX-512 VNNI) of the ~16 it can read; fetching the lines LE_PREFETCH_BYTES ahead of each block: 11.4 GB/s
 * (Sapphire Rapids, one thread, 256 MiB; 512 / 1024 / 2048 / 4096 bytes ahead: 10.4 / 10.9 / 11.4 / 10.1).
 * Called once per step of a block loop with the step's bytes (`stride`: one K-quant block of 144-210 bytes, or 2-4
 * small blocks): the 64-byte lines covering [block + LE_PREFETCH_BYTES, + stride rounded up to lines), so the
 * windows of consecutive steps leave no gap. Past a row's end the lines are the next row's (a GEMV's next); a
 * prefetch never faults. SSE1: every tier. */
#define LE_PREFETCH_BYTES 2048

/* A several-row dot product (le_vec_dot_n_fn) from ROWS(n, s, ls, x, y, ly, NT), an always-inline body for NT rows
 * at once (NT a constant the compiler unrolls): passes of 4 rows, then the remainder. */
#define LE_ROWS_BY_4(ROWS, n, s, ls, vx, vy, ly, nt)                                          \
    do {                                                                                     \
        const uint8_t *y_ = (const uint8_t *)(vy);                                           \
        float *s_ = (s);                                                                     \
        int nt_ = (nt);                                                                      \
        for (; nt_ >= 4; nt_ -= 4, s_ += 4 * (ls), y_ += 4 * (ly)) ROWS(n, s_, ls, vx, y_, ly, 4); \
        if (nt_ == 3) ROWS(n, s_, ls, vx, y_, ly, 3);                                        \
        else if (nt_ == 2) ROWS(n, s_, ls, vx, y_, ly, 2);                                   \
        else if (nt_ == 1) ROWS(n, s_, ls, vx, y_, ly, 1);                                   \
    } while (0)

/* LE_ROWS_BY_4 with passes of 8 rows first (a body whose 8 rows' accumulators fit AVX-512VL's 32 vector registers). */
#define LE_ROWS_BY_8(ROWS, n, s, ls, vx, vy, ly, nt)                                          \
    do {                                                                                     \
        const uint8_t *y8_ = (const uint8_t *)(vy);                                          \
        float *s8_ = (s);                                                                    \
        int nt8_ = (nt);                                                                     \
        for (; nt8_ >= 8; nt8_ -= 8, s8_ += 8 * (ls), y8_ += 8 * (ly)) ROWS(n, s8_, ls, vx, y8_, ly, 8); \
        LE_ROWS_BY_4(ROWS, n, s8_, ls, vx, y8_, ly, nt8_);                                  \
    } while (0)

static inline void le_prefetch_ahead(const void *block, size_t stride) {
    const char *p = (const char *)block + LE_PREFETCH_BYTES;
    for (size_t l = 0; l < (stride + 63) / 64; l++) _mm_prefetch(p + 64 * l, _MM_HINT_T0);
}

/* IEEE half -> float, exact for every input, without F16C (the SSSE3 tier): exponent and mantissa move to their
 * f32 places and the exponent is rebiased by an integer add; a subnormal half (exponent 0) gets the exponent of
 * 2^-14 and 2^-14 is subtracted (float arithmetic on normal numbers, so exact under the core's DAZ: a multiply of
 * the raw bits, a denormal float, read as zero there, le_threads.h); inf/NaN get the all-ones exponent (payload kept,
 * as le_fp16_to_fp32 does) and the sign is or-ed in. No data-dependent branch on the sign: block scales have
 * random signs, and a branch there costs more than the dot product. */
static inline float le_h2f(uint16_t h) {
    const uint32_t em = (uint32_t)(h & 0x7fffu) << 13;
    uint32_t o = em + (112u << 23);
    float f;
    if ((h & 0x7c00u) == 0) { /* zero or subnormal (rare) */
        o = em + (113u << 23);
        memcpy(&f, &o, 4);
        f -= 0x1p-14f;
        memcpy(&o, &f, 4);
    }
    if ((h & 0x7c00u) == 0x7c00u) o |= 0x7f800000u;     /* inf / NaN (rare) */
    o |= (uint32_t)(h & 0x8000u) << 16;
    memcpy(&f, &o, 4);
    return f;
}

/* le_h2f on 4 halves at once: h holds one half in the low 16 bits of each int32 lane. SSE2. */
static inline __m128 le_h2f_x4(__m128i h) {
    const __m128i ex = _mm_and_si128(h, _mm_set1_epi32(0x7c00));
    const __m128i em = _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x7fff)), 13);
    const __m128i normal = _mm_add_epi32(em, _mm_set1_epi32(112 << 23));
    const __m128i sub_bits = _mm_add_epi32(em, _mm_set1_epi32(113 << 23));
    const __m128 sub = _mm_sub_ps(_mm_castsi128_ps(sub_bits), _mm_set1_ps(0x1p-14f));
    const __m128i is_sub = _mm_cmpeq_epi32(ex, _mm_setzero_si128());
    __m128i o = _mm_or_si128(_mm_and_si128(is_sub, _mm_castps_si128(sub)), _mm_andnot_si128(is_sub, normal));
    const __m128i infnan = _mm_cmpeq_epi32(ex, _mm_set1_epi32(0x7c00));
    o = _mm_or_si128(o, _mm_and_si128(infnan, _mm_set1_epi32(0x7f800000)));
    o = _mm_or_si128(o, _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x8000)), 16));
    return _mm_castsi128_ps(o);
}

/* The fp16 field at byte offset `off` of 4 consecutive blocks of `size` bytes, as le_h2f_x4 input. */
static inline __m128i le_halves_x4(const void *blocks, size_t size, size_t off) {
    const uint8_t *b = (const uint8_t *)blocks + off;
    uint16_t h[4];
    for (int k = 0; k < 4; k++) memcpy(&h[k], b + k * size, 2);
    return _mm_setr_epi32(h[0], h[1], h[2], h[3]);
}

/* E8M0 byte -> 2^(e-128), as ggml_e8m0_to_fp32_half. */
static inline float le_e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Q4_K/Q5_K: the 12 packed scale bytes -> bytes 0..7 = the 8 six-bit scales, bytes 8..15 =
 * the 8 six-bit mins (q4_K_unpack_scales of native/vec_dot_ref.c in vector form, as ggml's utmp shuffle: pair
 * j < 4 sits in the low 6 bits of bytes j and j+4; j >= 4 in the nibbles of byte j+4 plus
 * the top 2 bits of bytes j-4 and j). SSE2 only: every x86-64 has it. */
static inline __m128i le_q4_K_scales_mins(const uint8_t packed[12]) {
    const uint32_t k6 = 0x3f3f3f3fu, k4 = 0x0f0f0f0fu, k2 = 0x03030303u;
    uint32_t u[3];
    memcpy(u, packed, 12);
    const uint32_t sc_lo = u[0] & k6;                                   /* scales 0..3 */
    const uint32_t sc_hi = (u[2] & k4) | (((u[0] >> 6) & k2) << 4);     /* scales 4..7 */
    const uint32_t mn_lo = u[1] & k6;                                   /* mins 0..3 */
    const uint32_t mn_hi = ((u[2] >> 4) & k4) | (((u[1] >> 6) & k2) << 4); /* mins 4..7 */
    return _mm_set_epi32((int)mn_hi, (int)mn_lo, (int)sc_hi, (int)sc_lo);
}

/* Q3_K: the 12 packed bytes -> the 16 six-bit scales (0..63, still biased by 32) as bytes
 * (q3_K_unpack_scales of native/vec_dot_ref.c in vector form). SSE2 only. */
static inline __m128i le_q3_K_scales(const uint8_t packed[12]) {
    const uint32_t k4 = 0x0f0f0f0fu, k2 = 0x03030303u;
    uint32_t a[3];
    memcpy(a, packed, 12);
    const uint32_t s0 = (a[0] & k4) | (((a[2] >> 0) & k2) << 4);        /* scales 0..3 */
    const uint32_t s1 = (a[1] & k4) | (((a[2] >> 2) & k2) << 4);        /* 4..7 */
    const uint32_t s2 = ((a[0] >> 4) & k4) | (((a[2] >> 4) & k2) << 4); /* 8..11 */
    const uint32_t s3 = ((a[1] >> 4) & k4) | (((a[2] >> 6) & k2) << 4); /* 12..15 */
    return _mm_set_epi32((int)s3, (int)s2, (int)s1, (int)s0);
}

/* ---- SSSE3 (128-bit) ---------------------------------------------------------------- */
#if defined(__SSSE3__)

static inline float le_hsum_ps_128(__m128 v) {
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_shuffle_ps(v, v, 1));
    return _mm_cvtss_f32(v);
}

/* 4 vectors of 4 int32 partial sums -> [sum(a), sum(b), sum(c), sum(d)]. */
static inline __m128i le_hsum4_epi32(__m128i a, __m128i b, __m128i c, __m128i d) {
    return _mm_hadd_epi32(_mm_hadd_epi32(a, b), _mm_hadd_epi32(c, d));
}

/* 16 bytes -> 16 bytes of low nibbles (lo) and of high nibbles (hi). */
static inline void le_nibbles_128(__m128i q, __m128i *lo, __m128i *hi) {
    const __m128i m4 = _mm_set1_epi8(0x0f);
    *lo = _mm_and_si128(q, m4);
    *hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
}

/* int8 lanes 0..7 -> int16 (SSE2 only: no pmovsxbw before SSE4.1). */
static inline __m128i le_cvtepi8_epi16_lo(__m128i v) {
    return _mm_srai_epi16(_mm_unpacklo_epi8(v, v), 8);
}

/* sum over pairs of (signed x) * (signed y) as 8 int16 -> 4 int32, via pmaddubsw's
 * unsigned x signed product: |x| * (y * sign(x)). y must not be -128. */
static inline __m128i le_dot_i8_128(__m128i x, __m128i y) {
    const __m128i p16 = _mm_maddubs_epi16(_mm_sign_epi8(x, x), _mm_sign_epi8(y, x));
    return _mm_madd_epi16(p16, _mm_set1_epi16(1));
}

#endif /* __SSSE3__ */

/* ---- AVX2 (256-bit) ----------------------------------------------------------------- */
#if defined(__AVX2__)

static inline float le_hsum_ps_256(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

static inline int le_hsum_epi32_256(__m256i v) {
    __m128i r = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    r = _mm_add_epi32(r, _mm_shuffle_epi32(r, _MM_SHUFFLE(1, 0, 3, 2)));
    r = _mm_add_epi32(r, _mm_shuffle_epi32(r, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(r);
}

/* 16 bytes of a 32-element 4-bit block -> 32 bytes: low nibbles (elements 0..15) in the
 * low lane, high nibbles (16..31) in the high lane. */
static inline __m256i le_nibbles_32(const uint8_t *qs) {
    const __m128i q = _mm_loadu_si128((const __m128i *)qs);
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(q, 4), q);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

/* 32 bits -> 32 bytes: byte j is 0xff if bit j is set, else 0 (Q5_0/Q5_1's qh). */
static inline __m256i le_bits_to_bytes_32(const uint8_t qh[4]) {
    uint32_t b;
    memcpy(&b, qh, 4);
    const __m256i shuf = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                            0x0303030303030303LL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)b), shuf); /* byte j <- byte j/8 */
    v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL)); /* all but bit j%8 */
    return _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
}

/* sum over pairs of (signed x) * (signed y) -> 8 int32 (y must not be -128). */
static inline __m256i le_dot_i8_256(__m256i x, __m256i y) {
    const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x));
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

/* sum over pairs of (unsigned x) * (signed y) -> 8 int32. */
static inline __m256i le_dot_u8_256(__m256i x, __m256i y) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), _mm256_set1_epi16(1));
}

/* The 8 group scales ls_g - 32 (-32..31) of an IQ4_XS block as int16 lanes 0..7: the low 4
 * bits are nibble g of scales_l, the high 2 bits are bits 2g, 2g+1 of scales_h. */
static inline __m128i le_iq4_xs_scales(const block_iq4_xs *b) {
    uint32_t sl;
    memcpy(&sl, b->scales_l, 4);
    const __m128i v = _mm_cvtsi32_si128((int)sl);
    const __m128i m4 = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_unpacklo_epi8(_mm_and_si128(v, m4), _mm_and_si128(_mm_srli_epi16(v, 4), m4)); /* byte g */
    const __m128i sh = _mm_set1_epi32(b->scales_h), m3 = _mm_set1_epi32(3);
    const __m128i hi = _mm_and_si128(_mm_srlv_epi32(sh, _mm_setr_epi32(0, 2, 4, 6)), m3);
    const __m128i hi2 = _mm_and_si128(_mm_srlv_epi32(sh, _mm_setr_epi32(8, 10, 12, 14)), m3);
    const __m128i h16 = _mm_packs_epi32(hi, hi2);                                                  /* int16 g */
    return _mm_sub_epi16(_mm_or_si128(_mm_cvtepu8_epi16(lo), _mm_slli_epi16(h16, 4)), _mm_set1_epi16(32));
}

#endif /* __AVX2__ */

/* ---- AVX-512 VNNI (+BW, VL) ------------------------------------------------------------
 * vpdpbusd: acc += sum of 4 (unsigned byte x signed byte) products per int32 lane, no
 * intermediate saturation (unlike pmaddubsw). */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)

/* sum of 4 (signed x) * (signed y) per int32 lane: |x| * (y * sign(x)); y must not be -128. */
static inline __m256i le_dpbssd_256(__m256i acc, __m256i x, __m256i y) {
    return _mm256_dpbusd_epi32(acc, _mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x));
}

/* int16 lane k -> idx[k] = base + k / per: the scale index of each int16 lane of a vpmaddubsw
 * result over 64 elements (32 lanes; `per` lanes per group: 16 for groups of 32, 8 for 16). */
static inline __m512i le_group_index_epi16(int base, int per) {
    const __m512i k = _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                                       15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i g = per == 16 ? _mm512_srli_epi16(k, 4) : _mm512_srli_epi16(k, 3);
    return _mm512_add_epi16(g, _mm512_set1_epi16((short)base));
}

/* The int16 scales of the groups under a 64-element vpmaddubsw result: scales16 holds one
 * int16 scale per group (lanes 0..15), base is the first group, per the lanes per group. */
static inline __m512i le_group_scales_epi16(__m512i scales16, int base, int per) {
    return _mm512_permutexvar_epi16(le_group_index_epi16(base, per), scales16);
}

#endif /* AVX-512 VNNI */

/* ---- expf on a vector (AVX2 + FMA, AVX-512F): the softmax's exp (le_simd.h exp_sub_sum) -----------------
 * Cephes' expf: n = round(x log2 e), r = x - n ln2 (ln2 in two floats, each step one FMA: |r| <= ln2/2 with an
 * error below an ulp of r), exp(r) = 1 + r + r^2 P(r) (P: Cephes' degree-5 minimax, relative error 1.5e-8 on that
 * interval), times 2^n. The scaling underflows gradually like expf: a subnormal result is rounded once (AVX-512:
 * vscalefps; AVX2: 2^n as two normal factors 2^(n/2), the first product exact). x is clamped to
 * [LE_EXP_LO, LE_EXP_HI] first: exp(LE_EXP_LO) is below half the smallest subnormal, so everything from there
 * down to -inf gives 0 exactly; exp(LE_EXP_HI) overflows to inf as expf does. NaN stays NaN (max/min return
 * the second operand on NaN). Measured against glibc's expf over [-104, 0]: tests/test_f32_kernels.py. */
#define LE_EXP_LO -104.0f
#define LE_EXP_HI 89.0f
#define LE_EXP_LOG2E 1.44269504088896341f
#define LE_EXP_LN2_HI 0.693147182464599609375f  /* float(ln 2) */
#define LE_EXP_LN2_LO -1.904654299957768e-09f   /* ln 2 - LE_EXP_LN2_HI */
#define LE_EXP_P0 1.9875691500e-4f
#define LE_EXP_P1 1.3981999507e-3f
#define LE_EXP_P2 8.3334519073e-3f
#define LE_EXP_P3 4.1665795894e-2f
#define LE_EXP_P4 1.6666665459e-1f
#define LE_EXP_P5 5.0000001201e-1f

#if defined(__AVX2__) && defined(__FMA__)
/* ---- Q4_K / Q5_K (same scales and mins) on AVX2 + FMA: the vec_dot kernels' shared pieces ---------------------- */
/* int16 lanes all equal to scale g of `scales` (the 8 scales as int16, in both 128-bit lanes). */
static inline __m256i le_k4_scale_of(__m256i scales, int g) {
    return _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(0x0100 + 0x0202 * g)));
}

/* int16 lanes 2g, 2g + 1 both min g of a block's scales and mins (le_q4_K_scales_mins: mins in bytes 8..15) */
static inline __m256i le_k4_mins_twice(__m128i scales_mins) {
    return _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(scales_mins, scales_mins));
}

/* acc + d * s - dmin * (mins . bsums): a block's float step for one activation row (every Q4_K / Q5_K kernel, in
 * this order: the several-row kernels keep the one-row kernel's bits) */
static inline __m256 le_k4_block_step(__m256 acc, __m256 d, __m256 dmin, __m256i s, __m256i mins2,
                                       const int16_t *bsums) {
    const __m256i m = _mm256_madd_epi16(mins2, _mm256_loadu_si256((const __m256i *)bsums));
    return _mm256_fnmadd_ps(dmin, _mm256_cvtepi32_ps(m), _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), acc));
}

static inline __m256 le_exp_ps_256(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(LE_EXP_HI), _mm256_max_ps(_mm256_set1_ps(LE_EXP_LO), x));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LE_EXP_LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LE_EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LE_EXP_LN2_LO), r);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(LE_EXP_P0), r, _mm256_set1_ps(LE_EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(LE_EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(LE_EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(LE_EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(LE_EXP_P5));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    /* 2^n = 2^n1 2^n2, n1 = floor(n / 2): both in [-75, 65], normal floats */
    __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, _mm256_set1_epi32(127)), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}
#endif

#if defined(__AVX512F__)
static inline __m512 le_exp_ps_512(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(LE_EXP_HI), _mm512_max_ps(_mm512_set1_ps(LE_EXP_LO), x));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LE_EXP_LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LE_EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LE_EXP_LN2_LO), r);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(LE_EXP_P0), r, _mm512_set1_ps(LE_EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(LE_EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(LE_EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(LE_EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(LE_EXP_P5));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

/* ---- AVX2 and AVX-512 VNNI: one kernel body, the dot instruction chosen by the target ----
 * A quant family's AVX2 and AVX-512 VNNI kernels are one body (cpu_simd/vec_dot_<type>_x86.h)
 * compiled by two small files, vec_dot_<type>_avx2.c and vec_dot_<type>_avx512vnni.c, whose
 * pragmas pick the target. What differs sits in the helpers below (as ggml's
 * mul_sum_us8_pairs_float): LE_X86_VNNI is 1 where the file's target has AVX-512 VNNI + VL
 * (vpdpbusd / vpdpwssd on ymm), else 0. Both forms give the same int32 lanes, bit for bit:
 * the pair sums of vpmaddubsw never saturate with Q8 activations (-127..127). */
#if defined(__AVX2__)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LE_X86_VNNI 1
#else
#define LE_X86_VNNI 0
#endif

/* acc + sum of 2 (int16 a) x (int16 b) per int32 lane: vpdpwssd, or vpmaddwd + vpaddd. */
static inline __m256i le_madd_acc_256(__m256i acc, __m256i a, __m256i b) {
#if LE_X86_VNNI
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

/* sum of 4 (signed x) * (signed y) per int32 lane (y must not be -128): the sign trick into
 * vpdpbusd, or into vpmaddubsw + vpmaddwd (le_dot_i8_256). */
static inline __m256i le_mul_sum_i8_256(__m256i x, __m256i y) {
#if LE_X86_VNNI
    return le_dpbssd_256(_mm256_setzero_si256(), x, y);
#else
    return le_dot_i8_256(x, y);
#endif
}

#endif /* AVX2 / AVX-512 VNNI */

#endif
