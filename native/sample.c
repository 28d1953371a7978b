/* sample.c — the token sampler of le_sample.h: penalties, top-k, top-p, min-p, temperature and one draw in a few
 * O(n_vocab) passes over the logits, instead of sorting the vocabulary (80-90 ms a token at 248k).
 *
 * The kept set is a prefix of the order "logit descending, id ascending". A token's place in that order is its
 * kid = key(x) << 32 | id, key(x) an unsigned that falls as x rises (-0 counted as +0, so equal logits tie on
 * id): a cut is one kid, and kept = kid <= cut. How each cut is found:
 *   top list  one pass (scan) keeps the R best tokens behind a rising threshold: R = top_k when top-k is on and
 *             <= LIST_MAX, else TOP_R (1 when greedy). Its first is the max. With top-k <= LIST_MAX everything
 *             after (top-p on the renormalised top-k, min-p, the draw) runs on that list.
 *   top-p     the cut is where the running mass in kid order first reaches top_p * S, S = sum exp(x - max).
 *             A full histogram of the vocabulary would find it, but scattering 248k tokens into buckets costs
 *             0.5-1 ms here, more than everything else together. So: the exact top list plus a 1/32 subsample
 *             (strided blocks of 8) estimate where the cut is and the standard error of that estimate; one pass
 *             (mass) computes S exactly and collects the tokens of the band estimate +- BAND_Z standard errors;
 *             `resolve` finds the cut among them (a radix select on kid carrying masses, buckets of 1024, then
 *             a sort of <= RES_SORT). When that pass shows the cut outside the band (an estimate off by more than
 *             BAND_Z sigma), the region holding the cut is collected and resolved instead: slower, never wrong.
 *             Below SAMPLE_MIN_N tokens every token is collected (cheaper than estimating).
 *   top-k     above LIST_MAX: every token collected, resolve by count, then top-p by mass among the top-k.
 *   min-p     a threshold: x - max >= log(min_p) in double, as the smallest float logit that passes.
 *   draw      u * W inverted over the kept weights in index order: from the list when the kept set lies in the
 *             top list (weights with a double argument), else one pass of block sums (BLOCK tokens each, float
 *             argument) and a rescan of the block where u * W falls.
 * Threads (le_sample_on): the passes over the vocabulary run in slices on a model's thread pool (le_parallel_for,
 * one slice a chunk: a late worker's slices are taken by the others). The mass pass, its region's exps, the draw's
 * block sums and the weights run over slices fixed by n alone (n_slices: SLICE_MIN tokens or more, BLOCK-aligned),
 * each slice's sums and region in its own place, merged in slice order; no value depends on where a thread
 * starts, so every result is the same bits for any thread count and without a pool. The top list is a set (the R
 * best kids), the same whatever the split: its scan runs one slice per thread, each keeping its R best, merged
 * by one more compaction (only for R <= SCAN_R_MAX: beyond, the merge costs more than the scan).
 * The passes (scan, mass, exps, draw, weights) have a scalar reference (`*_ref`, also the path below AVX2) and
 * an AVX2 + FMA version side by side, chosen by the process's tier (le_set_isa; ref and ssse3 run the ref).
 * exp is Cephes' expf: measured within 1.2e-7 relative (2 half-ulps) of exp() on every float in [-87.3, 0],
 * unbiased (mean signed error 4e-10); below ln(FLT_MIN) it gives 0 (a weight under 1.2e-38 of the max).
 * Test: python -m pytest tests/test_sampling.py (every tier and path against a float64 numpy reference).
 * Bench: python -m pytest benchmarks/bench_sampling.py --benchmark-enable; on a pool as decode runs it:
 *        python benchmarks/bench_sampling.py --threads 1,16 --gap-us 1400 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define LE_SAMPLE_X86 1
#endif

#include "le_internal.h"
#include "le_ops.h"      /* struct le_model: its pool */
#include "le_quants.h"
#include "le_sample.h"
#include "le_threads.h"

enum {
    TOP_R = 64,                    /* the top list without top-k: the heavy tokens a subsample could miss */
    LIST_MAX = 4096,               /* top-k up to this runs on the list */
    TOP_CAP = 2 * LIST_MAX + 80,   /* the scan's buffer: compacted back to R when full */
    SAMPLE_STRIDE = 256,           /* one block of 8 tokens every 256: a 1/32 subsample */
    SAMPLE_MIN_N = 65536,          /* smaller vocabularies collect every token for top-p */
    EST_SCALE = 64,                /* the estimate's buckets of d = max - x: 1/64 nat ... */
    EST_BUCKETS = 32 * EST_SCALE,  /* ... over [0, 32); the last also holds d >= 32 (e < 1.3e-14) */
    RES_BUCKETS = 1024,            /* resolve's histogram */
    RES_SORT = 48,                 /* resolve sorts sets this small */
    BLOCK = 256,                   /* the draw's block of tokens */
    SLICE_MIN = 64 * BLOCK,        /* a slice of a parallel pass: 16,384 tokens or more (~15 us of exp) ... */
    SLICES_MAX = 32,               /* ... and at most this many (larger vocabularies: longer slices) */
    SCAN_R_MAX = 256,              /* the scan runs one slice per thread for top lists this short */
    SCAN_CAP = 2 * SCAN_R_MAX + 80, /* a slice's scan buffer */
    PLACE_MIN = 16384,             /* a collected region this large is placed (copy + exp) in parallel */
};
_Static_assert(SLICES_MAX * SCAN_R_MAX <= TOP_CAP, "the slices' top lists merge in the top buffer");
#define EXP_MIN (-87.33654475f)    /* ln(FLT_MIN): exp below it is flushed to 0 */
#define BAND_Z 5.0                 /* the band: estimate +- BAND_Z standard errors ... */
#define BAND_FLOOR 1e-4            /* ... +- this fraction of the mass, +- one bucket */
#define ALL_KEPT UINT64_MAX        /* the cut that keeps every token */

/* ---- keys ---------------------------------------------------------------------------------------------------- */

/* An unsigned that falls as x rises (IEEE bits made monotone, then inverted); -0 counts as +0. */
static inline uint32_t key_of(float x) {
    x += 0.0f;                                   /* -0 + 0 = +0 */
    uint32_t b;
    memcpy(&b, &x, 4);
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ~b;
}

static inline float logit_of(uint32_t key) {
    uint32_t b = ~key;
    b = (b & 0x80000000u) ? (b & 0x7fffffffu) : ~b;
    float x;
    memcpy(&x, &b, 4);
    return x;
}

static inline uint64_t kid_of(float x, int64_t id) { return (uint64_t)key_of(x) << 32 | (uint32_t)id; }

static inline int32_t id_of(uint64_t kid) { return (int32_t)(kid & 0x7fffffffu); }

/* ---- exp ----------------------------------------------------------------------------------------------------- */

/* e^t for t <= 0: Cephes' expf. t = n ln2 + r, |r| <= ln2/2 (ln2 in two parts, n * 0.693359375 exact),
 * e^r = 1 + r + r^2 P(r), times 2^n built in the exponent bits. t < ln(FLT_MIN) (and -inf): 0. The selects are
 * bit masks, not branches, so gcc vectorises loops of it at -O2 (SSE2 on the baseline build). */
static inline float exp_ref(float t) {
    const uint32_t low = -(uint32_t)!(t >= EXP_MIN);   /* below the range, or -inf: all ones */
    const float emin = EXP_MIN;
    uint32_t tb, eb;
    memcpy(&tb, &t, 4);
    memcpy(&eb, &emin, 4);
    tb = (tb & ~low) | (eb & low);                      /* t clamped to EXP_MIN: 2^n stays a normal float */
    float tc;
    memcpy(&tc, &tb, 4);
    const float n = (tc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;   /* nearest integer, |.| < 2^22 */
    float r = tc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * (r * r) + (r + 1.0f);
    const int32_t bits = ((int32_t)n + 127) << 23;                            /* 2^n, n >= -126 */
    float s;
    memcpy(&s, &bits, 4);
    const float y = p * s;
    uint32_t yb;
    memcpy(&yb, &y, 4);
    yb &= ~low;                                                               /* flushed to 0 */
    float out;
    memcpy(&out, &yb, 4);
    return out;
}

/* A draw weight exp((x - m) inv_t) with the argument formed in double: the list's weights, and every weight
 * when inv_t exceeds float (T < 2^-64, where a float product would lose the argument). */
static inline float weight_exact(float x, float m, double inv_t) {
    const double arg = ((double)x - (double)m) * inv_t;   /* x - m exact in double; x == m gives 0, never NaN */
    return arg < EXP_MIN ? 0.0f : exp_ref((float)arg);
}

/* ---- the passes: scalar references ------------------------------------------------------------------------- */

typedef struct {
    /* Appends to out the ids i in [i, n) with x_i > thr (>= when incl); stops before the array's end only when
     * fewer than 64 slots of `room` are left (the caller compacts then: its buffer keeps R + 80 free after a
     * compaction, so every call advances); returns where it stopped. *bad |= a NaN or +inf was seen. */
    int64_t (*scan)(const float *x, int64_t i, int64_t n, float thr, int incl, int32_t *out, int64_t room,
                    int64_t *n_out, int *bad);
    /* e_i = exp(x_i - m) over [0, n): *S = sum e, *A = sum e over x > a; the region lo < x <= hi collected in
     * index order: ids[] and their logits xr[] (room for n + 8), *nr of them. */
    void (*mass)(const float *x, int64_t n, float m, float a, float lo, float hi, double *S, double *A, int32_t *ids,
                 float *xr, int64_t *nr);
    /* e_i = exp(x_i - m) */
    void (*exps)(const float *x, int64_t n, float m, float *e);
    /* w_i = exp((x_i - m) inv_t) for the kept positions (x > v, or x == v and i <= id), else 0: the sum of each
     * BLOCK into blocks[]; returns the number kept. x: the logits (i: the token id) or a region (i: its index). */
    int64_t (*draw)(const float *x, int64_t n, float m, float inv_t, float v, int32_t id, double *blocks);
    /* the same w_i of [i0, i0 + len) into w[0, len); returns the number kept */
    int64_t (*weights)(const float *x, int64_t i0, int64_t len, float m, float inv_t, float v, int32_t id,
                       float *w);
} sample_kernels;

/* The references run in blocks of RB tokens, written so that gcc vectorises each block's loops at -O2 (SSE2 on
 * the baseline build, no intrinsics): fixed trip counts, restrict, comparisons as integers, selects as masks,
 * sums over 8 partial sums in a fixed order. Tails run one token at a time. */
enum { RB = 64 };
_Static_assert(BLOCK % RB == 0 && BLOCK % 32 == 0, "a slice (BLOCK-aligned) starts where a whole pass has a block");

static inline float masked(float v, int keep) {
    uint32_t b;
    memcpy(&b, &v, 4);
    b &= -(uint32_t)keep;
    memcpy(&v, &b, 4);
    return v;
}

/* sum of e[0, RB) in double, 8 partial sums in a fixed order */
static double sum_block_ref(const float *restrict e) {
    double acc[8] = {0};
    for (int i = 0; i < RB; i += 8)
        for (int k = 0; k < 8; k++) acc[k] += e[i + k];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

static void exp_block_ref(const float *restrict x, float m, float *restrict e) {
    for (int i = 0; i < RB; i++) e[i] = exp_ref(x[i] - m);
}

static int64_t scan_ref(const float *x, int64_t i, int64_t n, float thr, int incl, int32_t *out, int64_t room,
                        int64_t *n_out, int *bad) {
    int64_t k = 0;
    int b = 0;
    while (i < n) {
        if (i + RB <= n) {                     /* a block: one vectorised test, appends only when it passes */
            if (room - k < RB) break;          /* the caller compacts first */
            int any = 0;
            for (int j = 0; j < RB; j++) {
                const float v = x[i + j];
                any |= (v > thr) | (incl & (v == thr));
                b |= (v != v) | (v == INFINITY);
            }
            if (any)
                for (int j = 0; j < RB; j++) {   /* branch-free; room >= RB */
                    out[k] = (int32_t)(i + j);
                    k += (x[i + j] > thr) | (incl & (x[i + j] == thr));
                }
            i += RB;
        } else {                               /* the tail: one token */
            if (k >= room) break;
            const float v = x[i];
            b |= (v != v) | (v == INFINITY);
            if (incl ? v >= thr : v > thr) out[k++] = (int32_t)i;
            i++;
        }
    }
    *n_out = k;
    *bad |= b;
    return i;
}

static void mass_ref(const float *x, int64_t n, float m, float a, float lo, float hi, double *S, double *A,
                     int32_t *ids, float *xr, int64_t *nr) {
    double s = 0.0, sa = 0.0;
    int64_t k = 0, i = 0;
    float e[RB], ea[RB];
    for (; i + RB <= n; i += RB) {
        exp_block_ref(x + i, m, e);
        int any = 0;
        for (int j = 0; j < RB; j++) {
            ea[j] = masked(e[j], x[i + j] > a);
            any |= (x[i + j] > lo) & (x[i + j] <= hi);
        }
        s += sum_block_ref(e);
        sa += sum_block_ref(ea);
        if (any)
            for (int j = 0; j < RB; j++) {   /* branch-free: a block may hold region tokens at random */
                ids[k] = (int32_t)(i + j);
                xr[k] = x[i + j];
                k += (x[i + j] > lo) & (x[i + j] <= hi);
            }
    }
    for (; i < n; i++) {
        const float ei = exp_ref(x[i] - m);
        s += ei;
        sa += x[i] > a ? ei : 0.0f;
        if (x[i] > lo && x[i] <= hi) {
            ids[k] = (int32_t)i;
            xr[k++] = x[i];
        }
    }
    *S = s;
    *A = sa;
    *nr = k;
}

static void exps_ref(const float *x, int64_t n, float m, float *e) {
    int64_t i = 0;
    for (; i + RB <= n; i += RB) exp_block_ref(x + i, m, e + i);
    for (; i < n; i++) e[i] = exp_ref(x[i] - m);
}

static inline int kept_ref(float x, int64_t i, float v, int32_t id) { return x > v || (x == v && i <= id); }

/* w over [i0, i0 + RB) into w; the number kept */
static int weights_block_ref(const float *restrict x, int64_t i0, float m, float inv_t, float v, int32_t id,
                             float *restrict w) {
    const int last = id - i0 < 0 ? -1 : id - i0 >= RB ? RB : (int)(id - i0);   /* j <= last: i0 + j <= id */
    const float *restrict xb = x + i0;
    int kept = 0;
    for (int j = 0; j < RB; j++) {
        const int k = (xb[j] > v) | ((xb[j] == v) & (j <= last));
        w[j] = masked(exp_ref((xb[j] - m) * inv_t), k);
        kept += k;
    }
    return kept;
}

/* The scalar tail of a block of the draw pass (both tiers): kept tokens in [i, end) counted, their weights added. */
static int64_t draw_tail(const float *x, int64_t i, int64_t end, float m, float inv_t, float v, int32_t id,
                         double *s) {
    int64_t kept = 0;
    for (; i < end; i++)
        if (kept_ref(x[i], i, v, id)) {
            *s += exp_ref((x[i] - m) * inv_t);
            kept++;
        }
    return kept;
}

static int64_t draw_ref(const float *x, int64_t n, float m, float inv_t, float v, int32_t id, double *blocks) {
    int64_t kept = 0;
    float w[RB];
    for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {
        const int64_t end = b0 + BLOCK < n ? b0 + BLOCK : n;
        double s = 0.0;
        int64_t i = b0;
        for (; i + RB <= end; i += RB) {
            const int k = weights_block_ref(x, i, m, inv_t, v, id, w);
            if (k) s += sum_block_ref(w);
            kept += k;
        }
        kept += draw_tail(x, i, end, m, inv_t, v, id, &s);
        blocks[b0 / BLOCK] = s;
    }
    return kept;
}

static int64_t weights_ref(const float *x, int64_t i0, int64_t len, float m, float inv_t, float v, int32_t id,
                           float *w) {
    int64_t kept = 0, j = 0;
    for (; j + RB <= len; j += RB) kept += weights_block_ref(x, i0 + j, m, inv_t, v, id, w + j);
    for (; j < len; j++) {
        const int k = kept_ref(x[i0 + j], i0 + j, v, id);
        w[j] = k ? exp_ref((x[i0 + j] - m) * inv_t) : 0.0f;
        kept += k;
    }
    return kept;
}

static const sample_kernels k_ref = {scan_ref, mass_ref, exps_ref, draw_ref, weights_ref};

/* ---- the passes: AVX2 + FMA ---------------------------------------------------------------------------------
 * The same contracts, 32 tokens (4 vectors) a step where a step can be skipped as a whole (a group test is a
 * branch predicted well both for peaked logits, where nearly every group is skipped, and for flat ones, where
 * nearly none is; a test per vector of 8 mispredicts when a third of the vectors hold something), and the scalar
 * reference for the tail. Float sums run per BLOCK (at most 32 additions a lane) and are added up in double. */
#ifdef LE_SAMPLE_X86

#define LE_AVX2 __attribute__((target("avx2,fma")))

LE_AVX2 static inline __m256 exp_avx2(__m256 t) {
    const __m256 live = _mm256_cmp_ps(t, _mm256_set1_ps(EXP_MIN), _CMP_GE_OQ);   /* else 0 (and -inf) */
    t = _mm256_max_ps(t, _mm256_set1_ps(EXP_MIN));
    const __m256i ni = _mm256_cvtps_epi32(_mm256_mul_ps(t, _mm256_set1_ps(1.44269504088896341f)));  /* nearest */
    const __m256 n = _mm256_cvtepi32_ps(ni);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), t);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(ni, _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(pow2n)), live);
}

/* 8 floats summed in double */
LE_AVX2 static inline double hsum_avx2(__m256 v) {
    const __m256d d = _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)),
                                    _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
    const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(d), _mm256_extractf128_pd(d, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

/* kept = x > v, or x == v and not i > id */
LE_AVX2 static inline __m256 kept_avx2(__m256 vx, __m256i vi, __m256 vv, __m256i vid) {
    const __m256 gt = _mm256_cmp_ps(vx, vv, _CMP_GT_OQ);
    const __m256 eq = _mm256_cmp_ps(vx, vv, _CMP_EQ_OQ);
    return _mm256_or_ps(gt, _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(vi, vid)), eq));
}

/* The lanes of a 4-bit mask, packed to the front (vpermilps indices). */
static const int32_t k_pack4[16][4] = {
    {0, 0, 0, 0}, {0, 0, 0, 0}, {1, 0, 0, 0}, {0, 1, 0, 0}, {2, 0, 0, 0}, {0, 2, 0, 0}, {1, 2, 0, 0}, {0, 1, 2, 0},
    {3, 0, 0, 0}, {0, 3, 0, 0}, {1, 3, 0, 0}, {0, 1, 3, 0}, {2, 3, 0, 0}, {0, 2, 3, 0}, {1, 2, 3, 0}, {0, 1, 2, 3}};

/* Appends the lanes of `mask` of ids vi and logits vx at ids + k, xr + k (writes 8 entries, keeps popcount). */
LE_AVX2 static inline int64_t pack_avx2(unsigned mask, __m256i vi, __m256 vx, int32_t *ids, float *xr, int64_t k) {
    for (int h = 0; h < 2; h++, mask >>= 4) {
        const __m128i sel = _mm_loadu_si128((const __m128i *)k_pack4[mask & 15]);
        const __m128 xh = h ? _mm256_extractf128_ps(vx, 1) : _mm256_castps256_ps128(vx);
        const __m128 ih = _mm_castsi128_ps(h ? _mm256_extracti128_si256(vi, 1) : _mm256_castsi256_si128(vi));
        _mm_storeu_ps(xr + k, _mm_permutevar_ps(xh, sel));
        _mm_storeu_si128((__m128i *)(ids + k), _mm_castps_si128(_mm_permutevar_ps(ih, sel)));
        k += __builtin_popcount(mask & 15);
    }
    return k;
}

LE_AVX2 static int64_t scan_avx2(const float *x, int64_t i, int64_t n, float thr, int incl, int32_t *out,
                                 int64_t room, int64_t *n_out, int *bad) {
    const __m256 vthr = _mm256_set1_ps(thr);
    __m256 unord = _mm256_setzero_ps(), vmax = _mm256_set1_ps(-INFINITY);
    int64_t k = 0;
    for (; i + 32 <= n && room - k >= 32; i += 32) {
        const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        const __m256 v2 = _mm256_loadu_ps(x + i + 16), v3 = _mm256_loadu_ps(x + i + 24);
        /* NaN: an unordered pair; +inf: the running max */
        unord = _mm256_or_ps(unord, _mm256_or_ps(_mm256_cmp_ps(v0, v1, _CMP_UNORD_Q),
                                                 _mm256_cmp_ps(v2, v3, _CMP_UNORD_Q)));
        const __m256 mx = _mm256_max_ps(_mm256_max_ps(v0, v1), _mm256_max_ps(v2, v3));
        vmax = _mm256_max_ps(vmax, mx);
        /* the group's max decides whether any lane passes */
        const __m256 any = incl ? _mm256_cmp_ps(mx, vthr, _CMP_GE_OQ) : _mm256_cmp_ps(mx, vthr, _CMP_GT_OQ);
        if (!_mm256_movemask_ps(any)) continue;
        const __m256 vs[4] = {v0, v1, v2, v3};
        for (int j = 0; j < 4; j++) {
            const __m256 c = incl ? _mm256_cmp_ps(vs[j], vthr, _CMP_GE_OQ) : _mm256_cmp_ps(vs[j], vthr, _CMP_GT_OQ);
            for (unsigned mask = (unsigned)_mm256_movemask_ps(c); mask; mask &= mask - 1)
                out[k++] = (int32_t)(i + 8 * j + __builtin_ctz(mask));
        }
    }
    *bad |= _mm256_movemask_ps(_mm256_or_ps(unord, _mm256_cmp_ps(vmax, _mm256_set1_ps(INFINITY), _CMP_EQ_OQ))) != 0;
    int64_t kt = 0;
    if (i + 32 > n) i = scan_ref(x, i, n, thr, incl, out + k, room - k, &kt, bad);   /* the tail only: else the
                                                                                        * caller compacts first */
    *n_out = k + kt;
    return i;
}

LE_AVX2 static void mass_avx2(const float *x, int64_t n, float m, float a, float lo, float hi, double *S,
                              double *A, int32_t *ids, float *xr, int64_t *nr) {
    const __m256 vm = _mm256_set1_ps(m), va = _mm256_set1_ps(a), vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
    double s = 0.0, sa = 0.0;
    int64_t k = 0, i = 0;
    while (i + 32 <= n) {
        __m256 acc = _mm256_setzero_ps(), acca = _mm256_setzero_ps();
        const int64_t end = i + BLOCK <= n ? i + BLOCK : n;
        for (; i + 32 <= end; i += 32) {
            uint32_t in = 0;   /* the group's region lanes, 8 bits a vector: masks stay out of the 16 registers */
            for (int j = 0; j < 4; j++) {
                const __m256 v = _mm256_loadu_ps(x + i + 8 * j);
                const __m256 e = exp_avx2(_mm256_sub_ps(v, vm));
                acc = _mm256_add_ps(acc, e);
                acca = _mm256_add_ps(acca, _mm256_and_ps(e, _mm256_cmp_ps(v, va, _CMP_GT_OQ)));
                in |= (uint32_t)_mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(v, vlo, _CMP_GT_OQ),
                                                                 _mm256_cmp_ps(v, vhi, _CMP_LE_OQ))) << 8 * j;
            }
            if (!in) continue;
            for (int j = 0; j < 4; j++) {
                const __m256i vi = _mm256_add_epi32(_mm256_set1_epi32((int32_t)(i + 8 * j)),
                                                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                k = pack_avx2(in >> 8 * j & 0xff, vi, _mm256_loadu_ps(x + i + 8 * j), ids, xr, k);
            }
        }
        s += hsum_avx2(acc);
        sa += hsum_avx2(acca);
    }
    double ts = 0.0, ta = 0.0;
    int64_t tk = 0;
    mass_ref(x + i, n - i, m, a, lo, hi, &ts, &ta, ids + k, xr + k, &tk);
    for (int64_t j = 0; j < tk; j++) ids[k + j] += (int32_t)i;   /* the tail's ids are relative to x + i */
    *S = s + ts;
    *A = sa + ta;
    *nr = k + tk;
}

LE_AVX2 static void exps_avx2(const float *x, int64_t n, float m, float *e) {
    const __m256 vm = _mm256_set1_ps(m);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(e + i, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm)));
    exps_ref(x + i, n - i, m, e + i);
}

LE_AVX2 static int64_t draw_avx2(const float *x, int64_t n, float m, float inv_t, float v, int32_t id,
                                 double *blocks) {
    const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(inv_t), vv = _mm256_set1_ps(v);
    const __m256i vid = _mm256_set1_epi32(id), lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int64_t kept = 0;
    for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {
        const int64_t end = b0 + BLOCK < n ? b0 + BLOCK : n;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        int64_t i = b0;
        for (; i + 32 <= end; i += 32) {
            uint32_t in = 0;   /* the group's kept lanes, 8 bits a vector */
            for (int j = 0; j < 4; j++)
                in |= (uint32_t)_mm256_movemask_ps(kept_avx2(_mm256_loadu_ps(x + i + 8 * j),
                                                             _mm256_add_epi32(_mm256_set1_epi32((int32_t)(i + 8 * j)),
                                                                              lanes), vv, vid)) << 8 * j;
            if (!in) continue;
            kept += __builtin_popcount(in);
            for (int j = 0; j < 4; j += 2) {
                const __m256 x0 = _mm256_loadu_ps(x + i + 8 * j), x1 = _mm256_loadu_ps(x + i + 8 * j + 8);
                const __m256 k0 = kept_avx2(x0, _mm256_add_epi32(_mm256_set1_epi32((int32_t)(i + 8 * j)), lanes),
                                            vv, vid);
                const __m256 k1 = kept_avx2(x1, _mm256_add_epi32(_mm256_set1_epi32((int32_t)(i + 8 * j + 8)), lanes),
                                            vv, vid);
                acc0 = _mm256_add_ps(acc0, _mm256_and_ps(exp_avx2(_mm256_mul_ps(_mm256_sub_ps(x0, vm), vt)), k0));
                acc1 = _mm256_add_ps(acc1, _mm256_and_ps(exp_avx2(_mm256_mul_ps(_mm256_sub_ps(x1, vm), vt)), k1));
            }
        }
        double s = hsum_avx2(_mm256_add_ps(acc0, acc1));
        kept += draw_tail(x, i, end, m, inv_t, v, id, &s);
        blocks[b0 / BLOCK] = s;
    }
    return kept;
}

LE_AVX2 static int64_t weights_avx2(const float *x, int64_t i0, int64_t len, float m, float inv_t, float v,
                                    int32_t id, float *w) {
    const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(inv_t), vv = _mm256_set1_ps(v);
    const __m256i vid = _mm256_set1_epi32(id), step = _mm256_set1_epi32(8);
    __m256i vi = _mm256_add_epi32(_mm256_set1_epi32((int32_t)i0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    int64_t kept = 0, j = 0;
    for (; j + 8 <= len; j += 8, vi = _mm256_add_epi32(vi, step)) {
        const __m256 vx = _mm256_loadu_ps(x + i0 + j);
        const __m256 k = kept_avx2(vx, vi, vv, vid);
        kept += __builtin_popcount((unsigned)_mm256_movemask_ps(k));
        _mm256_storeu_ps(w + j, _mm256_and_ps(exp_avx2(_mm256_mul_ps(_mm256_sub_ps(vx, vm), vt)), k));
    }
    return kept + weights_ref(x, i0 + j, len - j, m, inv_t, v, id, w + j);
}

static const sample_kernels k_avx2 = {scan_avx2, mass_avx2, exps_avx2, draw_avx2, weights_avx2};
#endif

int le_sample_isa(void) {
#ifdef LE_SAMPLE_X86
    if (le_get_isa() >= LE_ISA_AVX2) return LE_ISA_AVX2;
#endif
    return LE_ISA_REF;
}

static const sample_kernels *kernels(int isa) {
#ifdef LE_SAMPLE_X86
    if (isa == LE_ISA_AVX2) return &k_avx2;
#endif
    (void)isa;
    return &k_ref;
}

/* ---- slices (file comment) ----------------------------------------------------------------------------------- */

/* The slices of a pass over n tokens: SLICE_MIN tokens or more each, at most SLICES_MAX; 1 below 2 SLICE_MIN. */
static int n_slices(int64_t n) {
    const int64_t ns = n / SLICE_MIN;
    return ns < 1 ? 1 : ns > SLICES_MAX ? SLICES_MAX : (int)ns;
}

/* Slice t of ns over [0, n): [*i0, *i1), both multiples of BLOCK except n (so of RB, 32 and 8: every kernel's
 * blocks and vectors fall where one call over [0, n) has them). */
static void slice_of(int64_t n, int ns, int64_t t, int64_t *i0, int64_t *i1) {
    *i0 = n * t / ns / BLOCK * BLOCK;
    *i1 = t + 1 == ns ? n : n * (t + 1) / ns / BLOCK * BLOCK;
}

/* ---- scratch ------------------------------------------------------------------------------------------------- */

typedef struct {
    float *xp;        /* [n] penalised logits */
    int32_t *ids;     /* [n + 64] a collected region: token ids, ascending ... */
    float *xr;        /* [n + 64] ... their logits ... */
    float *er;        /* [n + 64] ... their e, packed in place to the band's; the weights of le_sample_probs */
    uint64_t *kid;    /* [n + 64] the band's kids (resolve), or the kept ids of a top-list draw */
    int32_t *top;     /* [TOP_CAP] the scan's candidates */
    uint64_t *tkid;   /* [TOP_CAP] the top list, sorted */
    float *xs, *es;   /* [n / SAMPLE_STRIDE * 8 + 16] the subsample and its e */
    double *blocks;   /* [n / BLOCK + 2] the draw's block sums */
    double *est;      /* [EST_BUCKETS] */
    double *hm;       /* [RES_BUCKETS] resolve's masses and counts */
    int64_t *hc;
    /* the parallel passes (n_slices(n) = ns slices) */
    int32_t *tids;    /* [n + 16 ns + 64] each slice's part of a collected region, at its start + 16 t ... */
    float *txr;       /* ... before it is placed in ids / xr */
    int32_t *stop;    /* [ns * SCAN_CAP] each scan slice's candidates ... */
    uint64_t *stkid;  /* [ns * SCAN_CAP] ... their kids while compacting ... */
    double *shm;      /* [ns * RES_BUCKETS] ... and resolve's histograms */
    int64_t *shc;
    le_pool *pool;    /* the threads (NULL: the caller's only); not part of the buffer */
} scratch_t;

/* Carves [base, ...) into scratch_t (s NULL: only measures); the bytes used. */
static int64_t layout(int64_t n, void *base, scratch_t *s) {
    uintptr_t p = (uintptr_t)base;
    const uintptr_t start = p;
#define TAKE(field, type, count)                      \
    p = (p + 63) & ~(uintptr_t)63;                    \
    if (s) s->field = (type *)p;                      \
    p += (uintptr_t)(count) * sizeof(type);
    TAKE(xp, float, n)
    TAKE(ids, int32_t, n + 64)
    TAKE(xr, float, n + 64)
    TAKE(er, float, n + 64)
    TAKE(kid, uint64_t, n + 64)
    TAKE(top, int32_t, TOP_CAP)
    TAKE(tkid, uint64_t, TOP_CAP)
    TAKE(xs, float, n / SAMPLE_STRIDE * 8 + 16)
    TAKE(es, float, n / SAMPLE_STRIDE * 8 + 16)
    TAKE(blocks, double, n / BLOCK + 2)
    TAKE(est, double, EST_BUCKETS)
    TAKE(hm, double, RES_BUCKETS)
    TAKE(hc, int64_t, RES_BUCKETS)
    const int64_t ns = n_slices(n);
    TAKE(tids, int32_t, n + 16 * ns + 64)
    TAKE(txr, float, n + 16 * ns + 64)
    TAKE(stop, int32_t, ns * SCAN_CAP)
    TAKE(stkid, uint64_t, ns * SCAN_CAP)
    TAKE(shm, double, ns * RES_BUCKETS)
    TAKE(shc, int64_t, ns * RES_BUCKETS)
#undef TAKE
    if (s) s->pool = NULL;
    return (int64_t)(p - start);
}

int64_t le_sample_scratch_bytes(int64_t n_vocab) {
    if (n_vocab < 1) return 0;
    return layout(n_vocab, NULL, NULL) + 64;   /* + the base's alignment */
}

/* ---- sorting and selection ----------------------------------------------------------------------------------- */

static void isort_pair(uint64_t *k, float *e, int64_t n) {
    for (int64_t i = 1; i < n; i++) {
        const uint64_t kv = k[i];
        const float ev = e ? e[i] : 0.0f;
        int64_t j = i;
        for (; j > 0 && k[j - 1] > kv; j--) {
            k[j] = k[j - 1];
            if (e) e[j] = e[j - 1];
        }
        k[j] = kv;
        if (e) e[j] = ev;
    }
}

/* Ascending, distinct keys (kids and ids are): quicksort, median of three, the smaller side recursed. */
static void sort_u64(uint64_t *a, int64_t n) {
    while (n > 24) {
        uint64_t *lo = a, *mid = a + n / 2, *hi = a + n - 1, t;
        if (*mid < *lo) t = *mid, *mid = *lo, *lo = t;
        if (*hi < *mid) t = *hi, *hi = *mid, *mid = t;
        if (*mid < *lo) t = *mid, *mid = *lo, *lo = t;
        const uint64_t pivot = *mid;
        int64_t i = -1, j = n;
        for (;;) {
            do i++; while (a[i] < pivot);
            do j--; while (a[j] > pivot);
            if (i >= j) break;
            t = a[i], a[i] = a[j], a[j] = t;
        }
        if (j + 1 < n - j - 1) {
            sort_u64(a, j + 1);
            a += j + 1;
            n -= j + 1;
        } else {
            sort_u64(a + j + 1, n - j - 1);
            n = j + 1;
        }
    }
    isort_pair(a, NULL, n);
}

typedef struct {
    uint64_t kid;   /* the cut */
    int64_t count;  /* members up to and including it (all members when not found) */
    double mass;    /* their e summed */
    int found;
} cut_t;

/* The member of kid[0, n) (any order; e: its mass, may be NULL) at which, walking in kid order, the running count
 * reaches `want` (want > 0), or base + the running mass reaches `target` (want == 0; base < target).
 * A radix select: a histogram of RES_BUCKETS over the members' kid range, the bucket where the walk crosses
 * moved to the front, again until RES_SORT members remain, which are sorted. Kids are distinct, so each round
 * narrows the range 1024-fold: at most 7 rounds. Reorders kid and e. hc, hm: RES_BUCKETS each. */
static cut_t resolve(uint64_t *kid, float *e, int64_t n, int64_t want, double base, double target, int64_t *hc,
                     double *hm) {
    cut_t c = {0, 0, 0.0, 0};
    int narrowed = 0;
    for (;;) {
        if (n <= RES_SORT) {
            isort_pair(kid, e, n);
            for (int64_t j = 0; j < n; j++) {
                c.count++;
                c.mass += e ? e[j] : 0.0;
                if (want ? c.count >= want : base + c.mass >= target) {
                    c.kid = kid[j];
                    c.found = 1;
                    return c;
                }
            }
            if (narrowed && n > 0) {   /* the bucket sums crossed in this bucket, the element sums fell short
                                        * by a rounding: the bucket's last member is the cut */
                c.kid = kid[n - 1];
                c.found = 1;
            }
            return c;
        }
        uint64_t lo = kid[0], hi = kid[0];
        for (int64_t j = 1; j < n; j++) {
            lo = kid[j] < lo ? kid[j] : lo;
            hi = kid[j] > hi ? kid[j] : hi;
        }
        const uint64_t span = hi - lo;
        const int shift = span >> 10 ? 54 - __builtin_clzll(span) : 0;   /* span >> shift < RES_BUCKETS */
        memset(hc, 0, RES_BUCKETS * sizeof *hc);
        memset(hm, 0, RES_BUCKETS * sizeof *hm);
        for (int64_t j = 0; j < n; j++) {
            const uint64_t b = (kid[j] - lo) >> shift;
            hc[b]++;
            hm[b] += e ? e[j] : 0.0;
        }
        uint64_t b = 0;
        for (; b < RES_BUCKETS; b++) {
            if (want ? c.count + hc[b] >= want : base + c.mass + hm[b] >= target) break;
            c.count += hc[b];
            c.mass += hm[b];
        }
        if (b == RES_BUCKETS) return c;
        int64_t k = 0;
        for (int64_t j = 0; j < n; j++)
            if (((kid[j] - lo) >> shift) == b) {
                const uint64_t tk = kid[k];
                kid[k] = kid[j];
                kid[j] = tk;
                if (e) {
                    const float te = e[k];
                    e[k] = e[j];
                    e[j] = te;
                }
                k++;
            }
        n = k;
        narrowed = 1;
    }
}

/* ---- the plan: the max, the cut, where the kept tokens are listed -------------------------------------------- */

typedef struct {
    float m;          /* the max logit */
    int greedy;
    uint64_t cut;     /* the last kept kid (ALL_KEPT: every token) */
    int64_t n_list;   /* > 0: the kept set lies in the top list; its ids, ascending, in s->kid[0, n_list) */
    int64_t n_region; /* > 0: else it lies in the collected region s->ids / s->xr [0, n_region) */
    int path;
    double inv_t;     /* 1 / temperature */
} plan_t;

/* Keeps the R best of top[0, cnt) (cnt > R, ids of x); *thr: the R-th's logit. Returns how many are kept (R). */
static int64_t compact_top(const float *x, int32_t *top, int64_t cnt, int64_t R, uint64_t *tkid, int64_t *hc,
                           double *hm, float *thr) {
    for (int64_t j = 0; j < cnt; j++) tkid[j] = kid_of(x[top[j]], top[j]);
    const cut_t c = resolve(tkid, NULL, cnt, R, 0.0, 0.0, hc, hm);
    int64_t kept = 0;
    for (int64_t j = 0; j < cnt; j++)
        if (kid_of(x[top[j]], top[j]) <= c.kid) top[kept++] = top[j];
    *thr = x[id_of(c.kid)];
    return kept;
}

/* The R best tokens of [i0, i1) (R <= i1 - i0) as ids in top[0, *n_top), any order: one scan behind a rising
 * threshold, compacted to R when the buffer (cap >= R + 80 entries) fills. *bad |= a NaN or +inf seen (the scan
 * stops early then). 0: the scan could not advance (cannot happen with cap >= R + 80). */
static int top_scan(const sample_kernels *k, const float *x, int64_t i0, int64_t i1, int64_t R, int64_t cap,
                    int32_t *top, uint64_t *tkid, int64_t *hc, double *hm, int64_t *n_top, int *bad) {
    float thr = -INFINITY;
    int incl = 1;
    int64_t cnt = 0, pos = i0;
    while (pos < i1 || cnt > R) {
        if (pos < i1) {
            int64_t added = 0;
            const int64_t from = pos;
            pos = k->scan(x, pos, i1, thr, incl, top + cnt, cap - cnt, &added, bad);
            cnt += added;
            if (*bad) break;
            if (pos < i1 && cnt <= R) {
                if (pos == from) return 0;
                continue;
            }
        }
        if (cnt <= R) continue;
        /* later tokens must beat the R-th (an equal logit has a larger id) */
        cnt = compact_top(x, top, cnt, R, tkid, hc, hm, &thr);
        incl = 0;
    }
    *n_top = cnt;
    return 1;
}

/* The scan in slices, one per thread (top_list): slice t's R best into s->stop + t SCAN_CAP. */
typedef struct {
    const sample_kernels *k;
    const float *x;
    int64_t n, R;
    int nsc;
    scratch_t *s;
    int64_t cnt[SLICES_MAX];
    int bad[SLICES_MAX], ok[SLICES_MAX];
} scan_job;

static void scan_slices(void *ctx, int64_t t0, int64_t t1, int thread) {
    scan_job *j = ctx;
    for (int64_t t = t0; t < t1; t++) {
        int64_t i0, i1;
        slice_of(j->n, j->nsc, t, &i0, &i1);
        const int64_t R = j->R < i1 - i0 ? j->R : i1 - i0;
        j->bad[t] = 0;
        j->ok[t] = top_scan(j->k, j->x, i0, i1, R, 2 * R + 80, j->s->stop + t * SCAN_CAP,
                            j->s->stkid + t * SCAN_CAP, j->s->shc + t * RES_BUCKETS, j->s->shm + t * RES_BUCKETS,
                            &j->cnt[t], &j->bad[t]);
    }
}

/* The R best tokens (fewer when n < R), sorted by kid into s->tkid; *nt of them. LE_ERR_FORMAT on NaN / +inf. */
static int top_list(const sample_kernels *k, const float *x, int64_t n, int64_t R, scratch_t *s, int64_t *nt) {
    int bad = 0, ok = 1;
    int64_t cnt = 0;
    const int nth = le_pool_threads(s->pool), ns = n_slices(n);
    const int nsc = R > SCAN_R_MAX ? 1 : nth < ns ? nth : ns;
    if (nsc == 1) {
        const int64_t cap = 2 * R + 80 < TOP_CAP ? 2 * R + 80 : TOP_CAP;   /* >= R + 64 free after a compaction */
        ok = top_scan(k, x, 0, n, R, cap, s->top, s->tkid, s->hc, s->hm, &cnt, &bad);
    } else {   /* each slice's R best, then the R best of their union: the same set */
        scan_job j = {k, x, n, R, nsc, s, {0}, {0}, {0}};
        le_parallel_for(s->pool, nsc, 1, scan_slices, &j);
        for (int t = 0; t < nsc; t++) {
            memcpy(s->top + cnt, s->stop + t * SCAN_CAP, (size_t)j.cnt[t] * sizeof *s->top);
            cnt += j.cnt[t];
            bad |= j.bad[t];
            ok &= j.ok[t];
        }
        float thr;
        if (ok && !bad && cnt > R) cnt = compact_top(x, s->top, cnt, R, s->tkid, s->hc, s->hm, &thr);
    }
    if (!ok)   /* a hang would be worse than an error */
        return LE_FAIL(LE_ERR_INVALID_ARG, "le_sample: the scan stopped early over %lld tokens", (long long)n);
    if (bad) {
        for (int64_t i = 0; i < n; i++)
            if (x[i] != x[i] || x[i] == INFINITY)
                return LE_FAIL(LE_ERR_FORMAT, "le_sample: logit %lld of %lld is %s: the model produced garbage, "
                               "nothing to sample from", (long long)i, (long long)n, x[i] != x[i] ? "NaN" : "+inf");
    }
    for (int64_t j = 0; j < cnt; j++) s->tkid[j] = kid_of(x[s->top[j]], s->top[j]);
    sort_u64(s->tkid, cnt);
    if (cnt == 0 || logit_of((uint32_t)(s->tkid[0] >> 32)) == -INFINITY)
        return LE_FAIL(LE_ERR_FORMAT, "le_sample: no finite logit among %lld", (long long)n);
    *nt = cnt;
    return LE_OK;
}

/* The top-p estimate (file comment): from the exact top list and the subsample, the band of logits (b, a] holding
 * the cut unless the estimate is off by more than BAND_Z sigma; *dense: the region x > b is expected to hold more
 * than a quarter of the vocabulary (then only the band is collected and the draw is a pass). 0: no estimate. */
static int estimate_band(const sample_kernels *k, const float *x, int64_t n, float m, double p, scratch_t *s,
                         int64_t nt, float *a, float *b, int *dense) {
    const uint64_t last = s->tkid[nt - 1];
    int64_t ns = 0, nl = 0;
    for (int64_t i = SAMPLE_STRIDE / 2; i + 8 <= n; i += SAMPLE_STRIDE, ns += 8) memcpy(s->xs + ns, x + i, 32);
    k->exps(s->xs, ns, m, s->es);
    for (int64_t j = 0; j < ns; j++) {   /* tokens of the top list count exactly, below, not as samples */
        const int64_t i = SAMPLE_STRIDE / 2 + j / 8 * SAMPLE_STRIDE + j % 8;
        if (kid_of(s->xs[j], i) <= last) s->es[j] = -1.0f;
        else nl++;
    }
    if (nl == 0) return 0;
    double *h = s->est, total = 0.0;
    memset(h, 0, EST_BUCKETS * sizeof *h);
    const double ratio = (double)(n - nt) / (double)nl;   /* tokens each sample stands for */
#define EST_BUCKET(d) ((d) * EST_SCALE < EST_BUCKETS - 1 ? (int64_t)((d) * EST_SCALE) : EST_BUCKETS - 1)
    for (int64_t j = 0; j < nt; j++) {
        const float xj = logit_of((uint32_t)(s->tkid[j] >> 32));
        h[EST_BUCKET(m - xj)] += exp_ref(xj - m);
    }
    for (int64_t j = 0; j < ns; j++)
        if (s->es[j] >= 0.0f) h[EST_BUCKET(m - s->xs[j])] += ratio * s->es[j];
#undef EST_BUCKET
    for (int64_t j = 0; j < EST_BUCKETS; j++) total += h[j];
    int64_t bh = 0;
    double cum = h[0];
    while (bh < EST_BUCKETS - 1 && cum < p * total) cum += h[++bh];
    /* the standard error of the estimated mass fraction below the estimated cut, from the samples' spread */
    const float tau = (float)(bh + 1) / EST_SCALE;
    const double f = cum / total;
    double sy = 0.0, syy = 0.0;
    for (int64_t j = 0; j < ns; j++)
        if (s->es[j] >= 0.0f) {
            const double y = s->es[j] * ((m - s->xs[j] < tau) - f);
            sy += y;
            syy += y * y;
        }
    const double sigma = ratio * sqrt(fmax(syy - sy * sy / (double)nl, 0.0)) / total;
    const double f_lo = p - BAND_Z * sigma - BAND_FLOOR, f_hi = p + BAND_Z * sigma + BAND_FLOOR;
    int64_t b_lo = 0, b_hi = 0;   /* d < b_lo / 64: surely kept; d >= b_hi / 64: surely not */
    for (cum = 0.0; b_lo < EST_BUCKETS && cum + h[b_lo] <= f_lo * total; b_lo++) cum += h[b_lo];
    for (cum = 0.0; b_hi < EST_BUCKETS && cum < f_hi * total; b_hi++) cum += h[b_hi];
    b_lo -= 1;   /* one bucket of slack each side: d is bucketed in float */
    b_hi += 1;
    *a = b_lo > 0 ? m - (float)b_lo / EST_SCALE : m;
    *b = b_hi < EST_BUCKETS - 1 ? m - (float)b_hi / EST_SCALE : -INFINITY;
    int64_t above = nt;   /* expected tokens with x > b */
    for (int64_t j = 0; j < ns; j++) above += s->es[j] >= 0.0f && s->xs[j] > *b ? 1 : 0;
    *dense = (double)(above - nt) * ratio + nt > 0.25 * (double)n;
    return 1;
}

/* The mass pass in slices (collect): slice t's sums, and its part of the region, nr[t] tokens placed at off[t]. */
typedef struct {
    const sample_kernels *k;
    const float *x;
    int64_t n;
    int ns;
    float m, a, lo, hi;
    scratch_t *s;
    double S[SLICES_MAX], A[SLICES_MAX];
    int64_t nr[SLICES_MAX], off[SLICES_MAX];
} mass_job;

/* Slice t's mass pass, its region's ids and logits to ids / xr (room for its length + 8). */
static void mass_slice(mass_job *j, int64_t t, int32_t *ids, float *xr) {
    int64_t i0, i1;
    slice_of(j->n, j->ns, t, &i0, &i1);
    j->k->mass(j->x + i0, i1 - i0, j->m, j->a, j->lo, j->hi, &j->S[t], &j->A[t], ids, xr, &j->nr[t]);
    for (int64_t r = 0; r < j->nr[t]; r++) ids[r] += (int32_t)i0;   /* the kernel's ids are relative to x + i0 */
}

static void mass_slices(void *ctx, int64_t t0, int64_t t1, int thread) {   /* to tids / txr at i0 + 16 t */
    mass_job *j = ctx;
    for (int64_t t = t0; t < t1; t++) {
        int64_t i0, i1;
        slice_of(j->n, j->ns, t, &i0, &i1);
        mass_slice(j, t, j->s->tids + i0 + 16 * t, j->s->txr + i0 + 16 * t);
    }
}

/* Slice t's part of the region from tids / txr to its place in ids / xr, and its e. */
static void place_slices(void *ctx, int64_t t0, int64_t t1, int thread) {
    mass_job *j = ctx;
    scratch_t *s = j->s;
    for (int64_t t = t0; t < t1; t++) {
        int64_t i0, i1;
        slice_of(j->n, j->ns, t, &i0, &i1);
        memcpy(s->ids + j->off[t], s->tids + i0 + 16 * t, (size_t)j->nr[t] * sizeof *s->ids);
        memcpy(s->xr + j->off[t], s->txr + i0 + 16 * t, (size_t)j->nr[t] * sizeof *s->xr);
        j->k->exps(s->xr + j->off[t], j->nr[t], j->m, s->er + j->off[t]);
    }
}

/* Collects the region lo < x <= hi (ids, logits, e in s->ids, s->xr, s->er); *S, *A: the mass pass's sums (of the
 * slices' sums, in slice order). The region's e: exps per slice part, the same bits with and without threads. */
static int64_t collect(const sample_kernels *k, const float *x, int64_t n, float m, float a, float lo, float hi,
                       scratch_t *s, double *S, double *A) {
    mass_job j = {k, x, n, n_slices(n), m, a, lo, hi, s, {0}, {0}, {0}, {0}};
    int64_t nr = 0;
    if (j.ns > 1 && le_pool_threads(s->pool) > 1) {   /* each slice's region apart, then placed */
        le_parallel_for(s->pool, j.ns, 1, mass_slices, &j);
        for (int t = 0; t < j.ns; t++) {
            j.off[t] = nr;
            nr += j.nr[t];
        }
        if (nr >= PLACE_MIN) le_parallel_for(s->pool, j.ns, 1, place_slices, &j);
        else place_slices(&j, 0, j.ns, 0);
    } else {   /* the slices in order, each region straight to its place */
        for (int t = 0; t < j.ns; t++) {
            j.off[t] = nr;
            mass_slice(&j, t, s->ids + nr, s->xr + nr);
            k->exps(s->xr + nr, j.nr[t], m, s->er + nr);   /* the same exp of the same x - m as the pass's sums */
            nr += j.nr[t];
        }
    }
    *S = *A = 0.0;
    for (int t = 0; t < j.ns; t++) {
        *S += j.S[t];
        *A += j.A[t];
    }
    return nr;
}

/* The region's tokens with x <= hi (all: INFINITY) as kid (s->kid) and e (packed in place in s->er). */
static int64_t band_of(scratch_t *s, int64_t nr, float hi) {
    int64_t nb = 0;
    for (int64_t j = 0; j < nr; j++) {   /* branch-free: a third of the region may be band, at random */
        s->kid[nb] = kid_of(s->xr[j], s->ids[j]);
        s->er[nb] = s->er[j];
        nb += s->xr[j] <= hi;
    }
    return nb;
}

/* Where the top-p walk over the whole vocabulary stops (file comment). *n_region > 0: the kept set lies in the
 * region left collected in s->ids / s->xr. total > 0: the mass the target is a fraction of, when x[0, n) is only
 * the head of a longer row (le_sample_cand); else x's own. */
static uint64_t top_p_cut(const sample_kernels *k, const float *x, int64_t n, float m, double p, double total,
                          int flags, scratch_t *s, int64_t nt, int *path, int64_t *n_region) {
    float a = INFINITY, b = -INFINITY;   /* kept surely: x > a; the band: b < x <= a */
    int dense = 0;
    if (n >= SAMPLE_MIN_N && !(flags & LE_SAMPLE_FORCE_ALL) && estimate_band(k, x, n, m, p, s, nt, &a, &b, &dense))
        *path |= LE_SAMPLE_PATH_BAND;
    else
        *path |= LE_SAMPLE_PATH_ALL;
    if (flags & LE_SAMPLE_FORCE_MISS_HIGH) a = b = m;         /* nothing surely kept, an empty band */
    if (flags & LE_SAMPLE_FORCE_MISS_LOW) a = b = -FLT_MAX;   /* every finite token "surely kept" */
    double S, A;
    int64_t nr = collect(k, x, n, m, a, b, dense ? a : INFINITY, s, &S, &A);   /* b < x (<= a when dense) */
    const double target = p * (total > S ? total : S);
    cut_t c;
    *n_region = 0;
    if (A >= target) {   /* the cut lies above the band: in x > a */
        *path |= LE_SAMPLE_PATH_FALLBACK;
        if (dense) nr = collect(k, x, n, m, a, a, INFINITY, s, &S, &A);
        int64_t nb = 0;   /* the region's x > a, packed to the front */
        for (int64_t j = 0; j < nr; j++)
            if (s->xr[j] > a) {
                s->ids[nb] = s->ids[j];
                s->xr[nb] = s->xr[j];
                s->er[nb++] = s->er[j];
            }
        nr = nb;
        const int64_t nk = band_of(s, nr, INFINITY);
        c = resolve(s->kid, s->er, nk, 0, 0.0, target, s->hc, s->hm);
        if (!c.found) {   /* the pass's sums reached the target, the elements' fell short: keep all of x > a */
            c.kid = 0;
            for (int64_t j = 0; j < nk; j++) c.kid = s->kid[j] > c.kid ? s->kid[j] : c.kid;
            c.found = nk > 0;
        }
        *n_region = nr;
    } else {
        const int64_t nb = band_of(s, nr, a);
        c = resolve(s->kid, s->er, nb, 0, A, target, s->hc, s->hm);
        *n_region = dense ? 0 : nr;
        if (!c.found && b > -INFINITY) {   /* the cut lies below the band: collect x <= b */
            *path |= LE_SAMPLE_PATH_FALLBACK;
            const double base = A + c.mass;
            nr = collect(k, x, n, m, INFINITY, -INFINITY, b, s, &S, &A);
            c = resolve(s->kid, s->er, band_of(s, nr, INFINITY), 0, base, target, s->hc, s->hm);
            *n_region = 0;
        }
    }
    return c.found ? c.kid : ALL_KEPT;
}

/* The smallest float t with (double)t - m >= log(min_p): min-p keeps x >= t (probabilities >= min_p * p_max). */
static float min_p_threshold(float m, double min_p) {
    const double lmp = log(min_p);
    float t = (float)((double)m + lmp);
    while ((double)t - (double)m < lmp) t = nextafterf(t, INFINITY);
    for (float d = nextafterf(t, -INFINITY); (double)d - (double)m >= lmp; d = nextafterf(t, -INFINITY)) t = d;
    return t;
}

/* The kept set of x[0, n) under p (top-p's mass: total when > 0, see top_p_cut). */
static int plan_sample(const sample_kernels *k, const float *x, int64_t n, const le_sample_params *p, double total,
                       scratch_t *s, plan_t *pl) {
    memset(pl, 0, sizeof *pl);
    pl->inv_t = p->temperature > 0 ? 1.0 / p->temperature : INFINITY;
    pl->greedy = p->temperature == 0 || !isfinite(pl->inv_t);
    const int64_t kk = p->top_k > 0 && p->top_k < n ? p->top_k : n;   /* top-k on: kk < n */
    int64_t R = pl->greedy ? 1 : kk < n && kk <= LIST_MAX ? kk : TOP_R, nt = 0;
    R = R < n ? R : n;
    int rc = top_list(k, x, n, R, s, &nt);
    if (rc != LE_OK) return rc;
    pl->m = logit_of((uint32_t)(s->tkid[0] >> 32));
    if (pl->greedy) {
        pl->path = LE_SAMPLE_PATH_GREEDY;
        pl->cut = s->tkid[0];
        s->kid[0] = (uint64_t)id_of(s->tkid[0]);
        pl->n_list = 1;
        return LE_OK;
    }
    uint64_t cut = ALL_KEPT;
    if (kk < n && kk <= LIST_MAX) {   /* top-k on the list, then top-p on its renormalised mass */
        cut = s->tkid[kk - 1];
        if (p->top_p < 1.0) {
            double S = 0.0, C = 0.0;
            for (int64_t j = 0; j < kk; j++) S += exp_ref(logit_of((uint32_t)(s->tkid[j] >> 32)) - pl->m);
            for (int64_t j = 0; j < kk; j++) {
                C += exp_ref(logit_of((uint32_t)(s->tkid[j] >> 32)) - pl->m);
                if (C >= p->top_p * S) {
                    cut = s->tkid[j];
                    break;
                }
            }
        }
    } else if (kk < n) {   /* top-k above the list: every token, by count, then top-p among the top-k */
        pl->path |= LE_SAMPLE_PATH_ALL;
        double S, A;
        const int64_t nr = collect(k, x, n, pl->m, INFINITY, -INFINITY, INFINITY, s, &S, &A);
        int64_t nb = band_of(s, nr, INFINITY);
        const cut_t ck = resolve(s->kid, s->er, nb, kk, 0.0, 0.0, s->hc, s->hm);
        cut = ck.found ? ck.kid : ALL_KEPT;
        for (int64_t i = 0, need = kk - ck.count; !ck.found && i < n; i++)   /* fewer than kk finite logits: the
                                                                               * -inf ones follow by id */
            if (x[i] == -INFINITY && --need == 0) cut = kid_of(x[i], i);
        if (p->top_p < 1.0) {
            int64_t j2 = 0;
            double S_kk = 0.0;
            for (int64_t j = 0; j < nb; j++)
                if (s->kid[j] <= cut) {
                    s->kid[j2] = s->kid[j];
                    s->er[j2++] = s->er[j];
                    S_kk += s->er[j];
                }
            const cut_t cp = resolve(s->kid, s->er, j2, 0, 0.0, p->top_p * S_kk, s->hc, s->hm);
            if (cp.found && cp.kid < cut) cut = cp.kid;
        }
    } else if (p->top_p < 1.0) {
        cut = top_p_cut(k, x, n, pl->m, p->top_p, total, p->flags, s, nt, &pl->path, &pl->n_region);
    }
    if (p->min_p > 0.0) {
        const uint64_t cm = (uint64_t)key_of(min_p_threshold(pl->m, p->min_p)) << 32 | 0xffffffffu;
        cut = cm < cut ? cm : cut;
    }
    pl->cut = cut;
    if (cut <= s->tkid[nt - 1] || nt == n) {   /* the kept set lies in the top list: its ids, in index order */
        int64_t K = 0;
        while (K < nt && s->tkid[K] <= cut) K++;
        for (int64_t j = 0; j < K; j++) s->kid[j] = (uint64_t)id_of(s->tkid[j]);
        sort_u64(s->kid, K);
        pl->n_list = K;
        pl->n_region = 0;
        pl->path |= LE_SAMPLE_PATH_LIST;
    } else {
        pl->path |= pl->n_region > 0 ? LE_SAMPLE_PATH_REGION : LE_SAMPLE_PATH_PASS;
    }
    return LE_OK;
}

/* The kept predicate from the cut: x > v, or x == v and id <= *id (over the logits), or index <= *id (over the
 * region, whose ids ascend). */
static void cut_predicate(const plan_t *pl, const scratch_t *s, float *v, int32_t *id) {
    if (pl->cut == ALL_KEPT) {
        *v = -INFINITY;
        *id = INT32_MAX;
        return;
    }
    *v = logit_of((uint32_t)(pl->cut >> 32));
    const uint64_t cid = pl->cut & 0xffffffffu;
    *id = cid > INT32_MAX ? INT32_MAX : (int32_t)cid;
    if (pl->n_region > 0) {   /* the region's last index with an id <= cid */
        int64_t lo = 0, hi = pl->n_region;
        while (lo < hi) {
            const int64_t mid = (lo + hi) / 2;
            if ((uint64_t)s->ids[mid] <= cid) lo = mid + 1;
            else hi = mid;
        }
        *id = (int32_t)(lo - 1);
    }
}

/* ---- entry points -------------------------------------------------------------------------------------------- */

static int check_args(const char *what, const float *logits, int64_t n, const int32_t *pen_ids,
                      const int32_t *pen_counts, int32_t n_pen, const le_sample_params *p, void *scratch,
                      int64_t scratch_bytes) {
    if (!logits || !p || !scratch) return LE_FAIL(LE_ERR_INVALID_ARG, "%s: NULL logits, params or scratch", what);
    if (n < 1 || n > INT32_MAX) return LE_FAIL(LE_ERR_INVALID_ARG, "%s: n_vocab = %lld", what, (long long)n);
    if (scratch_bytes < le_sample_scratch_bytes(n))
        return LE_FAIL(LE_ERR_INVALID_ARG, "%s: scratch of %lld bytes, le_sample_scratch_bytes says %lld", what,
                       (long long)scratch_bytes, (long long)le_sample_scratch_bytes(n));
    if (n_pen < 0 || (n_pen > 0 && (!pen_ids || !pen_counts)))
        return LE_FAIL(LE_ERR_INVALID_ARG, "%s: %d penalty ids without arrays", what, n_pen);
    if (!(p->temperature >= 0) || p->top_k < 0 || !(p->top_p > 0 && p->top_p <= 1) ||
        !(p->min_p >= 0 && p->min_p <= 1) || !(p->repetition_penalty > 0) || !isfinite(p->presence_penalty) ||
        !isfinite(p->frequency_penalty))
        return LE_FAIL(LE_ERR_INVALID_ARG, "%s: temperature %g, top_k %d, top_p %g, min_p %g, penalties %g %g %g",
                       what, p->temperature, p->top_k, p->top_p, p->min_p, p->repetition_penalty,
                       p->presence_penalty, p->frequency_penalty);
    for (int32_t j = 0; j < n_pen; j++)
        if (pen_ids[j] < 0 || pen_ids[j] >= n || pen_counts[j] < 1)
            return LE_FAIL(LE_ERR_INVALID_ARG, "%s: penalty entry %d: id %d (vocabulary %lld), count %d", what, j,
                           pen_ids[j], (long long)n, pen_counts[j]);
    return LE_OK;
}

/* The penalised logits (sampling.py's arithmetic: the repetition penalty in float, then x - count * frequency -
 * presence in double, rounded to float); the caller's when no penalty applies. */
static const float *penalise(const float *logits, int64_t n, const int32_t *ids, const int32_t *counts, int32_t np,
                             const le_sample_params *p, float *xp) {
    if (np == 0 || (p->repetition_penalty == 1.0 && p->presence_penalty == 0.0 && p->frequency_penalty == 0.0))
        return logits;
    memcpy(xp, logits, (size_t)n * sizeof *xp);
    const float rp = (float)p->repetition_penalty;
    for (int32_t j = 0; j < np; j++) {
        float v = xp[ids[j]];
        if (p->repetition_penalty != 1.0) v = v > 0 ? v / rp : v * rp;
        xp[ids[j]] = (float)((double)v - (double)counts[j] * p->frequency_penalty - p->presence_penalty);
    }
    return xp;
}

static void fill_info(le_sample_info *info, const plan_t *pl, int32_t token, int64_t n_kept, int isa) {
    if (!info) return;
    info->token = token;
    info->path = pl->path;
    info->n_kept = n_kept;
    if (pl->cut == ALL_KEPT) {
        info->cut_logit = -INFINITY;
        info->cut_id = INT32_MAX;
    } else {
        info->cut_logit = logit_of((uint32_t)(pl->cut >> 32));
        info->cut_id = (pl->cut & 0xffffffffu) > INT32_MAX ? INT32_MAX : (int32_t)(pl->cut & 0xffffffffu);
    }
    info->max_logit = pl->m;
    info->isa = isa;
}

/* The weights of [i0, i0 + len) of the pass's array (the logits or the region); the extreme temperatures
 * (1/T beyond 2^64, where a float product would lose the argument) take the double argument. */
static int64_t pass_weights(const sample_kernels *k, const float *xa, int64_t i0, int64_t len, const plan_t *pl,
                            float v, int32_t id, float *w) {
    if (pl->inv_t <= 0x1p64) return k->weights(xa, i0, len, pl->m, (float)pl->inv_t, v, id, w);
    int64_t kept = 0;
    for (int64_t j = 0; j < len; j++) {
        const int kp = kept_ref(xa[i0 + j], i0 + j, v, id);
        w[j] = kp ? weight_exact(xa[i0 + j], pl->m, pl->inv_t) : 0.0f;
        kept += kp;
    }
    return kept;
}

/* The draw's and the weights' passes in slices (pass_draw, le_sample_probs_on): slice t of xa[0, n). */
typedef struct {
    const sample_kernels *k;
    const float *xa;
    int64_t n;
    int ns;
    const plan_t *pl;
    float v;
    int32_t id;
    double *blocks;   /* the draw's block sums, or NULL: the weights into w */
    float *w;
    int64_t kept[SLICES_MAX];
} pass_job;

static void pass_slices(void *ctx, int64_t t0, int64_t t1, int thread) {
    pass_job *j = ctx;
    for (int64_t t = t0; t < t1; t++) {
        int64_t i0, i1;
        slice_of(j->n, j->ns, t, &i0, &i1);
        if (j->blocks) {   /* the kernel counts from x + i0: the cut's id made relative (-1: no tie kept) */
            const int32_t id = j->id < i0 ? -1 : (int32_t)(j->id - i0);
            j->kept[t] = j->k->draw(j->xa + i0, i1 - i0, j->pl->m, (float)j->pl->inv_t, j->v, id,
                                    j->blocks + i0 / BLOCK);
        } else {
            j->kept[t] = pass_weights(j->k, j->xa, i0, i1 - i0, j->pl, j->v, j->id, j->w + i0);
        }
    }
}

/* The pass over xa[0, n) in slices on the pool; the number kept. Per-token and per-block values: the same bits as
 * one call (slices start at block boundaries). */
static int64_t pass_run(const sample_kernels *k, const float *xa, int64_t n, const plan_t *pl, float v, int32_t id,
                        double *blocks, float *w, le_pool *pool) {
    pass_job j = {k, xa, n, n_slices(n), pl, v, id, blocks, w, {0}};
    le_parallel_for(pool, j.ns, 1, pass_slices, &j);
    int64_t kept = 0;
    for (int t = 0; t < j.ns; t++) kept += j.kept[t];
    return kept;
}

/* The draw over a pass: u * W inverted over the block sums, then inside the block; the index in xa. */
static int64_t pass_draw(const sample_kernels *k, const float *xa, int64_t n, const plan_t *pl, const scratch_t *s,
                         double u, int64_t *n_kept) {
    float v;
    int32_t id;
    cut_predicate(pl, s, &v, &id);
    const int64_t nblk = (n + BLOCK - 1) / BLOCK;
    if (pl->inv_t <= 0x1p64) {
        *n_kept = pass_run(k, xa, n, pl, v, id, s->blocks, NULL, s->pool);
    } else {
        *n_kept = 0;
        for (int64_t b = 0; b < nblk; b++) {
            const int64_t len = b * BLOCK + BLOCK < n ? BLOCK : n - b * BLOCK;
            *n_kept += pass_weights(k, xa, b * BLOCK, len, pl, v, id, s->er);
            double sb = 0.0;
            for (int64_t j = 0; j < len; j++) sb += s->er[j];
            s->blocks[b] = sb;
        }
    }
    double W = 0.0, cum = 0.0;
    for (int64_t b = 0; b < nblk; b++) W += s->blocks[b];
    const double target = u * W;
    int64_t b = 0, last = -1;
    for (; b < nblk; b++) {
        if (s->blocks[b] > 0) last = b;
        if (cum + s->blocks[b] > target) break;
        cum += s->blocks[b];
    }
    const int past = b == nblk;   /* u * W rounded up to W: the last token with weight */
    if (past) b = last;
    const int64_t len = b * BLOCK + BLOCK < n ? BLOCK : n - b * BLOCK;
    pass_weights(k, xa, b * BLOCK, len, pl, v, id, s->er);
    for (int64_t j = 0; j < len && !past; j++) {
        cum += s->er[j];
        if (cum > target && s->er[j] > 0) return b * BLOCK + j;
    }
    for (int64_t j = len - 1; j >= 0; j--)   /* (or the block's own sum fell short by a rounding) */
        if (s->er[j] > 0) return b * BLOCK + j;
    return b * BLOCK;
}

/* The draw from a planned kept set of x[0, n): u inverted over the kept weights in index order; the index. */
static int32_t draw_planned(const sample_kernels *k, const float *x, int64_t n, plan_t *pl, scratch_t *s, double u,
                            int64_t *n_kept) {
    int32_t tok = -1;
    if (pl->greedy) {
        *n_kept = 1;
        return (int32_t)s->kid[0];
    }
    if (pl->n_list > 0) {   /* the kept ids, ascending, in s->kid */
        *n_kept = pl->n_list;
        double W = 0.0, cum = 0.0;
        for (int64_t j = 0; j < *n_kept; j++) W += weight_exact(x[s->kid[j]], pl->m, pl->inv_t);
        const double target = u * W;
        for (int64_t j = 0; j < *n_kept && tok < 0; j++) {
            const float w = weight_exact(x[s->kid[j]], pl->m, pl->inv_t);
            cum += w;
            if (cum > target && w > 0) tok = (int32_t)s->kid[j];
        }
        for (int64_t j = *n_kept - 1; j >= 0 && tok < 0; j--)   /* u * W rounded up to W */
            if (weight_exact(x[s->kid[j]], pl->m, pl->inv_t) > 0) tok = (int32_t)s->kid[j];
        return tok;
    }
    if (pl->n_region > 0)   /* a pass over the collected region (LE_SAMPLE_PATH_REGION) */
        return s->ids[pass_draw(k, s->xr, pl->n_region, pl, s, u, n_kept)];
    return (int32_t)pass_draw(k, x, n, pl, s, u, n_kept);
}

static int prepare(const char *what, le_model *model, const float *logits, int64_t n, const int32_t *pen_ids,
                   const int32_t *pen_counts, int32_t n_pen, const le_sample_params *params, void *scratch,
                   int64_t scratch_bytes, scratch_t *s, const sample_kernels **k, int *isa, const float **x,
                   plan_t *pl) {
    int rc = check_args(what, logits, n, pen_ids, pen_counts, n_pen, params, scratch, scratch_bytes);
    if (rc != LE_OK) return rc;
    layout(n, scratch, s);
    s->pool = model ? model->pool : NULL;
    *isa = le_sample_isa();
    *k = kernels(*isa);
    *x = penalise(logits, n, pen_ids, pen_counts, n_pen, params, s->xp);
    return plan_sample(*k, *x, n, params, 0.0, s, pl);
}

int le_sample(const float *logits, int64_t n, const int32_t *pen_ids, const int32_t *pen_counts, int32_t n_pen,
              const le_sample_params *params, double u, void *scratch, int64_t scratch_bytes, int32_t *token,
              le_sample_info *info) {
    return le_sample_on(NULL, logits, n, pen_ids, pen_counts, n_pen, params, u, scratch, scratch_bytes, token, info);
}

int le_sample_on(le_model *model, const float *logits, int64_t n, const int32_t *pen_ids, const int32_t *pen_counts,
                 int32_t n_pen, const le_sample_params *params, double u, void *scratch, int64_t scratch_bytes,
                 int32_t *token, le_sample_info *info) {
    if (!token) return LE_FAIL(LE_ERR_INVALID_ARG, "le_sample: NULL token");
    if (!(u >= 0.0 && u < 1.0)) return LE_FAIL(LE_ERR_INVALID_ARG, "le_sample: u = %g is not in [0, 1)", u);
    scratch_t s;
    const sample_kernels *k;
    const float *x;
    plan_t pl;
    int isa;
    int rc = prepare("le_sample", model, logits, n, pen_ids, pen_counts, n_pen, params, scratch, scratch_bytes, &s,
                     &k, &isa, &x, &pl);
    if (rc != LE_OK) return rc;
    int64_t n_kept;
    const int32_t tok = draw_planned(k, x, n, &pl, &s, u, &n_kept);
    *token = tok;
    fill_info(info, &pl, tok, n_kept, isa);
    return LE_OK;
}

int le_sample_probs(const float *logits, int64_t n, const int32_t *pen_ids, const int32_t *pen_counts,
                    int32_t n_pen, const le_sample_params *params, void *scratch, int64_t scratch_bytes,
                    double *probs, le_sample_info *info) {
    return le_sample_probs_on(NULL, logits, n, pen_ids, pen_counts, n_pen, params, scratch, scratch_bytes, probs,
                              info);
}

int le_sample_probs_on(le_model *model, const float *logits, int64_t n, const int32_t *pen_ids,
                       const int32_t *pen_counts, int32_t n_pen, const le_sample_params *params, void *scratch,
                       int64_t scratch_bytes, double *probs, le_sample_info *info) {
    if (!probs) return LE_FAIL(LE_ERR_INVALID_ARG, "le_sample_probs: NULL probs");
    scratch_t s;
    const sample_kernels *k;
    const float *x;
    plan_t pl;
    int isa;
    int rc = prepare("le_sample_probs", model, logits, n, pen_ids, pen_counts, n_pen, params, scratch,
                     scratch_bytes, &s, &k, &isa, &x, &pl);
    if (rc != LE_OK) return rc;
    memset(probs, 0, (size_t)n * sizeof *probs);
    int64_t n_kept;
    if (pl.greedy) {
        n_kept = 1;
        probs[s.kid[0]] = 1.0;
    } else if (pl.n_list > 0) {
        n_kept = pl.n_list;
        double W = 0.0;
        for (int64_t j = 0; j < n_kept; j++) W += probs[s.kid[j]] = weight_exact(x[s.kid[j]], pl.m, pl.inv_t);
        for (int64_t j = 0; j < n_kept; j++) probs[s.kid[j]] /= W;
    } else {
        float v;
        int32_t id;
        cut_predicate(&pl, &s, &v, &id);
        const int64_t nw = pl.n_region > 0 ? pl.n_region : n;
        n_kept = pass_run(k, pl.n_region > 0 ? s.xr : x, nw, &pl, v, id, NULL, s.er, s.pool);
        double W = 0.0;
        for (int64_t i = 0; i < nw; i++) W += s.er[i];
        for (int64_t i = 0; i < nw; i++) probs[pl.n_region > 0 ? s.ids[i] : i] = s.er[i] / W;
    }
    fill_info(info, &pl, id_of(s.tkid[0]), n_kept, isa);
    return LE_OK;
}

/* ---- candidates chosen where the logits are (a GPU: cuda8/sample_cut.cu) ------------------------------------ */

int64_t le_sample_cand_scratch_bytes(int64_t n_cand) {
    if (n_cand < 1) return 0;
    return (int64_t)(sizeof(uint64_t) + sizeof(float) + sizeof(int32_t)) * n_cand + 128 +
           le_sample_scratch_bytes(n_cand);
}

int le_sample_cand(const int32_t *ids, const float *x, int64_t n_cand, int64_t n_vocab, double total, float rest_max,
                   const le_sample_params *params, double u, void *scratch, int64_t scratch_bytes, int32_t *token,
                   le_sample_info *info) {
    if (!ids || !x || !token || !scratch || !params)
        return LE_FAIL(LE_ERR_INVALID_ARG, "le_sample_cand: NULL ids, x, token, scratch or params");
    if (n_cand < 1 || n_vocab < n_cand || n_vocab > INT32_MAX)
        return LE_FAIL(LE_ERR_INVALID_ARG, "le_sample_cand: %lld candidates of a vocabulary of %lld",
                       (long long)n_cand, (long long)n_vocab);
    if (!(u >= 0.0 && u < 1.0)) return LE_FAIL(LE_ERR_INVALID_ARG, "le_sample_cand: u = %g is not in [0, 1)", u);
    if (!(total >= 0.0 && total < INFINITY) || rest_max != rest_max || rest_max == INFINITY)
        return LE_FAIL(LE_ERR_INVALID_ARG, "le_sample_cand: total %g, rest_max %g", total, (double)rest_max);
    if (scratch_bytes < le_sample_cand_scratch_bytes(n_cand))
        return LE_FAIL(LE_ERR_INVALID_ARG, "le_sample_cand: scratch of %lld bytes, %lld needed",
                       (long long)scratch_bytes, (long long)le_sample_cand_scratch_bytes(n_cand));
    /* the candidates in id order: (id, x bits) sorted as one key, then apart */
    uint64_t *pk = (uint64_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    float *xs = (float *)(pk + n_cand);
    int32_t *is = (int32_t *)(xs + n_cand);
    void *rest = (void *)(((uintptr_t)(is + n_cand) + 63) & ~(uintptr_t)63);
    const int64_t rest_bytes = scratch_bytes - (int64_t)((char *)rest - (char *)scratch);
    for (int64_t j = 0; j < n_cand; j++) {
        if (ids[j] < 0 || ids[j] >= n_vocab)
            return LE_FAIL(LE_ERR_INVALID_ARG, "le_sample_cand: id %d outside the vocabulary of %lld", ids[j],
                           (long long)n_vocab);
        uint32_t b;
        memcpy(&b, x + j, 4);
        pk[j] = (uint64_t)(uint32_t)ids[j] << 32 | b;
    }
    sort_u64(pk, n_cand);
    for (int64_t j = 0; j < n_cand; j++) {
        if (j > 0 && pk[j] >> 32 == pk[j - 1] >> 32)
            return LE_FAIL(LE_ERR_INVALID_ARG, "le_sample_cand: id %u twice", (unsigned)(pk[j] >> 32));
        is[j] = (int32_t)(pk[j] >> 32);
        const uint32_t b = (uint32_t)pk[j];
        memcpy(xs + j, &b, 4);
    }
    /* top-k over the row: the candidates hold its set, and top-p is then a fraction of that set's mass */
    le_sample_params p = *params;
    const int top_k = p.top_k > 0 && p.top_k < n_vocab;
    int rc = check_args("le_sample_cand", xs, n_cand, NULL, NULL, 0, &p, rest, rest_bytes);
    if (rc != LE_OK) return rc;
    *token = -1;
    if (!top_k) p.top_k = 0;
    if (!top_k && n_cand >= SAMPLE_MIN_N) p.flags |= LE_SAMPLE_FORCE_ALL;   /* the estimate assumes a whole row */
    scratch_t s;
    layout(n_cand, rest, &s);
    const int isa = le_sample_isa();
    const sample_kernels *k = kernels(isa);
    plan_t pl;
    rc = plan_sample(k, xs, n_cand, &p, top_k ? 0.0 : total, &s, &pl);
    if (rc != LE_OK) return rc;
    if (!pl.greedy && top_k && p.top_k > n_cand) return LE_OK;   /* the top-k set reaches past them */
    /* with top-k the kept set lies in the top-k set, which they hold; else no token left behind may be kept */
    if (!pl.greedy && !top_k && n_cand < n_vocab && rest_max > -INFINITY && kid_of(rest_max, 0) <= pl.cut)
        return LE_OK;   /* the caller samples the whole row */
    int64_t n_kept;
    const int32_t tok = is[draw_planned(k, xs, n_cand, &pl, &s, u, &n_kept)];
    *token = tok;
    fill_info(info, &pl, tok, n_kept, isa);
    if (info && pl.cut != ALL_KEPT && (pl.cut & 0xffffffffu) < (uint64_t)n_cand)
        info->cut_id = is[pl.cut & 0xffffffffu];   /* a position: the token's id (min-p's cut names none) */
    return LE_OK;
}

int le_sample_window_cut(const int32_t *ids, const float *x, int64_t n_win, double base, double total, float max,
                         const le_sample_params *params, void *scratch, int64_t scratch_bytes, float *cut_logit,
                         int32_t *cut_id, int32_t *found) {
    if (!ids || !x || !params || !scratch || !cut_logit || !cut_id || !found)
        return LE_FAIL(LE_ERR_INVALID_ARG, "le_sample_window_cut: NULL argument");
    if (n_win < 1 || n_win > INT32_MAX || scratch_bytes < (int64_t)sizeof(uint64_t) * n_win + 64)
        return LE_FAIL(LE_ERR_INVALID_ARG, "le_sample_window_cut: %lld tokens, scratch of %lld bytes",
                       (long long)n_win, (long long)scratch_bytes);
    if (!(base >= 0.0 && total > 0.0 && total < INFINITY && base <= total) || !isfinite(max))
        return LE_FAIL(LE_ERR_INVALID_ARG, "le_sample_window_cut: base %g, total %g, max %g", base, total,
                       (double)max);
    if (!(params->top_p > 0 && params->top_p < 1) || !(params->min_p >= 0 && params->min_p <= 1))
        return LE_FAIL(LE_ERR_INVALID_ARG, "le_sample_window_cut: top_p %g, min_p %g (top-p must be on)",
                       params->top_p, params->min_p);
    uint64_t *kid = (uint64_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    for (int64_t j = 0; j < n_win; j++) {
        if (ids[j] < 0 || !(x[j] <= max) || x[j] != x[j])
            return LE_FAIL(LE_ERR_INVALID_ARG, "le_sample_window_cut: token %d, logit %g (max %g)", ids[j],
                           (double)x[j], (double)max);
        kid[j] = kid_of(x[j], ids[j]);
    }
    sort_u64(kid, n_win);
    /* top-p's walk from the mass before the window: the first token where the running mass reaches the target */
    const double target = params->top_p * total;
    uint64_t cut = ALL_KEPT;
    double c = base;
    for (int64_t j = 0; j < n_win && base < target; j++) {
        c += exp_ref(logit_of((uint32_t)(kid[j] >> 32)) - max);
        if (c >= target) {
            cut = kid[j];
            break;
        }
    }
    *found = cut != ALL_KEPT;
    if (!*found) return LE_OK;   /* crossed before the window, or not in it: the caller samples the whole row */
    if (params->min_p > 0.0) {
        const uint64_t cm = (uint64_t)key_of(min_p_threshold(max, params->min_p)) << 32 | 0xffffffffu;
        cut = cm < cut ? cm : cut;
    }
    *cut_logit = logit_of((uint32_t)(cut >> 32));
    *cut_id = (cut & 0xffffffffu) > INT32_MAX ? INT32_MAX : (int32_t)(cut & 0xffffffffu);
    return LE_OK;
}
