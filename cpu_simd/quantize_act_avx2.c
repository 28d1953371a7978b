/* quantize_act_avx2.c — the activation quantisers Q8_0, Q8_1, Q8_K with AVX2, bit for bit
 * the bytes of the references (native/quants_ref.c: ggml's quantize_row_q8_{0,1,K}_ref).
 *
 * Why bit-exact: the dot products are tested against their refs on the same activation
 * bytes, and a model run must not depend on which tier quantised its activations.
 * How each rule is kept:
 *  - amax: vmaxps is exact and order-free for non-NaN data. ggml's sequential
 *    MAX(amax, |x|) keeps a NaN only when it is the last element, which no tree of vmaxps
 *    reproduces, so a Q8_0/Q8_1 block holding a NaN goes to the scalar reference.
 *  - Q8_0's roundf (half away from zero): t = trunc(p); r = t + sign(p) where |p - t| >= 0.5
 *    (p - t is exact); NaN -> 0 and clamping to [-128, 127] as the ref's conversion does.
 *  - d, 1/d and the fp16 store are the ref's scalar expressions (le_fp32_to_fp16).
 *  - Q8_K's nearest_int is the same float add of 1.5 * 2^23 and mantissa read, lane-wise;
 *    its max search skips NaN as the ref's `ax > amax` does (vmaxps returns its second
 *    operand when one is NaN), and the signed max is the first element of largest |x|.
 * Build: part of the cffi extension (`pip install -e .`); the pragma below compiles this
 * file for AVX2 whatever the baseline is.
 * Test: python -m pytest tests/test_vec_dot.py -k quantize_act (random rows and the
 * rounding edge cases: ties, -0, NaN, inf, subnormal and huge blocks).
 */
#pragma GCC target("avx2,fma,f16c")

#include "simd_x86.h"

/* why: the ref multiplies and adds separately; keep this file from fusing them. */
#pragma GCC optimize("fp-contract=off")

static inline float hmax_ps_256(__m256 v) {
    __m128 r = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_max_ps(r, _mm_movehl_ps(r, r));
    r = _mm_max_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

/* C roundf then the ref's float -> int8 conversion (NaN -> 0, saturate), as int32 lanes. */
static inline __m256i roundf_to_i8_range(__m256 p) {
    const __m256 sign = _mm256_and_ps(p, _mm256_set1_ps(-0.0f));
    const __m256 t = _mm256_round_ps(p, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 frac = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_sub_ps(p, t));
    const __m256 up = _mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    __m256 r = _mm256_add_ps(t, _mm256_and_ps(up, _mm256_or_ps(sign, _mm256_set1_ps(1.0f))));
    r = _mm256_and_ps(r, _mm256_cmp_ps(r, r, _CMP_ORD_Q));                 /* NaN -> 0 */
    r = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-128.0f)), _mm256_set1_ps(127.0f));
    return _mm256_cvtps_epi32(r);                                          /* exact: integral */
}

/* 4 x 8 int32 lanes, each in [-128, 127] -> 32 int8 in element order. */
static inline __m256i pack_i32x4_i8(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i ab = _mm256_packs_epi32(a, b);       /* lane-interleaved: a0 b0 | a1 b1 */
    const __m256i cd = _mm256_packs_epi32(c, d);
    const __m256i abcd = _mm256_packs_epi16(ab, cd);   /* a0 b0 c0 d0 | a1 b1 c1 d1 (4 bytes each) */
    return _mm256_permutevar8x32_epi32(abcd, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* 4 x 8 int32 lanes, each in [0, 255] -> 32 bytes in element order. */
static inline __m256i pack_i32x4_i8_unsigned(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i abcd = _mm256_packus_epi16(_mm256_packus_epi32(a, b), _mm256_packus_epi32(c, d));
    return _mm256_permutevar8x32_epi32(abcd, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* One 32-element block of Q8_0 codes and its f32 d; returns 0 if the block holds a NaN
 * (the caller then takes the scalar reference). sum: the sum of the codes (Q8_1). */
static inline int q8_block(const float *x, int8_t qs[32], float *d_out, int *sum) {
    const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
    const __m256 v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
    const __m256 nan = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(v0, v0, _CMP_UNORD_Q), _mm256_cmp_ps(v1, v1, _CMP_UNORD_Q)),
                                    _mm256_or_ps(_mm256_cmp_ps(v2, v2, _CMP_UNORD_Q), _mm256_cmp_ps(v3, v3, _CMP_UNORD_Q)));
    if (_mm256_movemask_ps(nan)) return 0;
    const __m256 abs = _mm256_set1_ps(-0.0f);
    const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(abs, v0), _mm256_andnot_ps(abs, v1)),
                                   _mm256_max_ps(_mm256_andnot_ps(abs, v2), _mm256_andnot_ps(abs, v3)));
    const float amax = hmax_ps_256(m);
    const float d = amax / 127;
    const float id = d ? 1.0f / d : 0.0f;
    const __m256 vid = _mm256_set1_ps(id);
    const __m256i i0 = roundf_to_i8_range(_mm256_mul_ps(v0, vid));
    const __m256i i1 = roundf_to_i8_range(_mm256_mul_ps(v1, vid));
    const __m256i i2 = roundf_to_i8_range(_mm256_mul_ps(v2, vid));
    const __m256i i3 = roundf_to_i8_range(_mm256_mul_ps(v3, vid));
    _mm256_storeu_si256((__m256i *)qs, pack_i32x4_i8(i0, i1, i2, i3));
    *d_out = d;
    *sum = le_hsum_epi32_256(_mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3)));
    return 1;
}

void quantize_row_q8_0_avx2(const float *x, void *vy, int64_t n) {
    block_q8_0 *y = vy;
    const int64_t nb = n / QK8_0;
    for (int64_t i = 0; i < nb; i++, x += QK8_0) {
        float d;
        int sum;
        if (q8_block(x, y[i].qs, &d, &sum))
            y[i].d = le_fp32_to_fp16(d);
        else
            quantize_row_q8_0_ref(x, &y[i], QK8_0);            /* a NaN: scalar, ggml's order */
    }
}

void quantize_row_q8_1_avx2(const float *x, void *vy, int64_t n) {
    block_q8_1 *y = vy;
    const int64_t nb = n / QK8_1;
    for (int64_t i = 0; i < nb; i++, x += QK8_1) {
        float d;
        int sum;
        if (q8_block(x, y[i].qs, &d, &sum)) {
            y[i].d = le_fp32_to_fp16(d);
            y[i].s = le_fp32_to_fp16(sum * d);
        } else {
            quantize_row_q8_1_ref(x, &y[i], QK8_1);
        }
    }
}

/* 4 x 8 int32 lanes -> 32 int8 in element order, keeping the low byte of each lane (C's (int8_t)
 * conversion, which the Q8_K ref applies: a subnormal max overflows iscale to inf and nearest_int
 * then yields -2^22, whose low byte is 0, not the -128 a saturating pack would give). */
static inline __m256i pack_i32x4_low_bytes(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i ff = _mm256_set1_epi32(0xff);
    return pack_i32x4_i8_unsigned(_mm256_and_si256(a, ff), _mm256_and_si256(b, ff),
                                  _mm256_and_si256(c, ff), _mm256_and_si256(d, ff));
}

/* Q8_K: per 256, iscale = -127 / (first element of largest |x|), q = (int8_t)min(127,
 * nearest_int(iscale * x)), d = 1 / iscale, bsums per 16. */
void quantize_row_q8_K_avx2(const float *x, void *vy, int64_t n) {
    block_q8_K *y = vy;
    const int64_t nb = n / QK_K;
    const __m256 abs = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < nb; i++, x += QK_K) {
        __m256 m = _mm256_setzero_ps();
        for (int j = 0; j < QK_K; j += 8)                       /* NaN lanes keep m (2nd operand) */
            m = _mm256_max_ps(_mm256_andnot_ps(abs, _mm256_loadu_ps(x + j)), m);
        const float amax = hmax_ps_256(m);
        if (!amax) {
            memset(&y[i], 0, sizeof y[i]);
            continue;
        }
        int first = 0;                                           /* first j with |x[j]| == amax */
        const __m256 vamax = _mm256_set1_ps(amax);
        for (int j = 0; j < QK_K; j += 8) {
            const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(abs, _mm256_loadu_ps(x + j)), vamax, _CMP_EQ_OQ));
            if (mask) {
                first = j + __builtin_ctz((unsigned)mask);
                break;
            }
        }
        const float iscale = -127.f / x[first];
        const __m256 vis = _mm256_set1_ps(iscale);
        const __m256 magic = _mm256_set1_ps(12582912.f);         /* 1.5 * 2^23 */
        for (int j = 0; j < QK_K; j += 32) {
            __m256i q[4];
            for (int k = 0; k < 4; k++) {
                const __m256 v = _mm256_add_ps(_mm256_mul_ps(vis, _mm256_loadu_ps(x + j + 8 * k)), magic);
                __m256i t = _mm256_sub_epi32(_mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x007fffff)),
                                             _mm256_set1_epi32(0x00400000));
                q[k] = _mm256_min_epi32(t, _mm256_set1_epi32(127));
            }
            const __m256i q8 = pack_i32x4_low_bytes(q[0], q[1], q[2], q[3]);
            _mm256_storeu_si256((__m256i *)(y[i].qs + j), q8);
            /* bsums of the two 16-groups of these 32 codes */
            const __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q8), _mm256_set1_epi16(1));
            const __m256i s2 = _mm256_hadd_epi32(s32, s32);
            const __m256i s4 = _mm256_hadd_epi32(s2, s2);          /* [g0 x4 | g1 x4] */
            y[i].bsums[j / 16] = (int16_t)_mm256_extract_epi32(s4, 0);
            y[i].bsums[j / 16 + 1] = (int16_t)_mm256_extract_epi32(s4, 4);
        }
        y[i].d = 1 / iscale;
    }
}
