/* compat.cuh — every GPU capability, and everything CUDA-version dependent, named once.
 *
 * Kernel files include this and never test __CUDA_ARCH__ or __CUDACC_VER_MAJOR__ themselves
 * (tests/lint_cuda8.py checks). It builds with nvcc 8 … 13 and NVRTC 11.x / 12.x as C++11.
 *
 * Tiers (the code path a kernel takes), lowest first:
 *   fermi   sm_20+  no warp shuffles (shared memory + __syncthreads), no __ldg, no __dp4a
 *   kepler  sm_30+  warp shuffles; __ldg from sm_35 (LE_CC_LDG)
 *   dp4a    sm_61+  __dp4a (4 int8 products per instruction) for the W4A8/W8A8 kernels;
 *                   from sm_75 also the int8 tensor-core mma (gemm_mma.cu), where the toolchain knows it
 * The tier is the PTX target's compute capability, lowered at compile time by
 * -DLE_FORCE_TIER=<tier>: LE_CC_FERMI (200), LE_CC_KEPLER (300), LE_CC_LDG (350) or LE_CC_DP4A
 * (610). That is how the Fermi path (which no toolkit we can run targets any more) is compiled
 * for compute_35 … compute_90 and run, JIT-compiled by the driver, on a Hopper.
 *
 * Why the fermi tier synchronises the whole block even inside a warp: from sm_70 on, threads
 * of a warp are scheduled independently, so the warp-synchronous shared-memory idiom of the
 * Fermi era is a race there. __syncthreads() is correct on every chip; the cost only matters
 * on real Fermi cards, which do not run this code faster than it runs here anyway.
 *
 * No __launch_bounds__ on the kernels: with one (and no minimum of blocks) ptxas 11.8 squeezes the
 * sm_35 code into 32 registers and spills; without, nothing spills on sm_35/61/70
 * (python -m legacy_engine.gpu ptxas). Block sizes are fixed per kernel (the *_THREADS macros).
 *
 * Rules for the helpers with a `scratch` argument (le_shfl_xor, le_warp_*, le_block_*):
 *   1-D blocks whose size is a multiple of 32 (a power of two for le_block_*),
 *   scratch = a __shared__ float[blockDim.x] (LE_SCRATCH(n) declares one),
 *   every thread of the block calls them (uniform control flow): on the fermi tier they
 *   contain __syncthreads(); on the others scratch is unused except by le_block_*.
 */
#ifndef LE_COMPAT_CUH
#define LE_COMPAT_CUH

#include "le_blocks.h"

/* ---- tiers: compute capability x 100, as __CUDA_ARCH__ counts ------------------------- */
#define LE_CC_FERMI 200  /* sm_20: the floor of CUDA 8 */
#define LE_CC_KEPLER 300 /* sm_30: __shfl_xor */
#define LE_CC_LDG 350    /* sm_35: __ldg (read-only data cache) */
#define LE_CC_FP16 530   /* sm_53: __half arithmetic (not used: fp16 is converted from raw bits) */
#define LE_CC_DP4A 610   /* sm_61: __dp4a */
#define LE_CC_VOLTA 700  /* sm_70: independent thread scheduling */
#define LE_CC_TURING 750 /* sm_75: int8 tensor cores (mma.sync m8n8k16 .s8) */
#define LE_CC_AMPERE 800 /* sm_80: mma.sync m16n8k16 .s8 (two m8n8k16 in one instruction) */

#ifdef __CUDA_ARCH__
#define LE_ARCH __CUDA_ARCH__
#else
#define LE_ARCH 0 /* host pass of nvcc: no device code is emitted from it */
#endif

/* The effective tier: the target's, or LE_FORCE_TIER when that is lower. */
#if defined(LE_FORCE_TIER) && (LE_FORCE_TIER) < LE_ARCH
#define LE_CC (LE_FORCE_TIER)
#else
#define LE_CC LE_ARCH
#endif

#define LE_HAS_SHFL (LE_CC >= LE_CC_KEPLER)
#define LE_HAS_LDG (LE_CC >= LE_CC_LDG)
#define LE_HAS_DP4A (LE_CC >= LE_CC_DP4A)
/* 255 registers per thread from sm_35; sm_20/sm_30 have 63 (kernels that keep a second set of values in
 * flight, e.g. gemm_f32's prefetched step, do so only here) */
#define LE_HAS_MANY_REGS (LE_CC >= LE_CC_LDG)

/* why on the compiler version and not CUDART_VERSION: NVRTC does not define the latter.
 * CUDA 9 added the *_sync shuffles and made them mandatory for sm_70+. */
#if defined(__CUDACC_VER_MAJOR__) && __CUDACC_VER_MAJOR__ >= 9
#define LE_HAS_SYNC_INTRINSICS 1
#else
#define LE_HAS_SYNC_INTRINSICS 0
#endif
#ifdef __CUDACC_VER_MINOR__
#define LE_CUDACC_VERSION (__CUDACC_VER_MAJOR__ * 100 + __CUDACC_VER_MINOR__)
#elif defined(__CUDACC_VER_MAJOR__)
#define LE_CUDACC_VERSION (__CUDACC_VER_MAJOR__ * 100)
#else
#define LE_CUDACC_VERSION 0
#endif

/* int8 mma.sync: PTX ISA 6.4 (CUDA 10.1) for m8n8k16 on sm_75, 7.0 (CUDA 11.0) for m16n8k16 on sm_80 */
#define LE_HAS_MMA_INT8 (LE_CC >= LE_CC_TURING && LE_CUDACC_VERSION >= 1001)
#define LE_HAS_MMA_16816 (LE_CC >= LE_CC_AMPERE && LE_CUDACC_VERSION >= 1100)
/* f16 mma.sync with f32 accumulators: m16n8k8 from PTX ISA 6.5 (CUDA 10.2) on sm_75, m16n8k16 from sm_80 */
#define LE_HAS_MMA_F16 (LE_CC >= LE_CC_TURING && LE_CUDACC_VERSION >= 1002)
/* tf32 mma.sync m16n8k8 with f32 accumulators: PTX ISA 7.0 (CUDA 11.0) on sm_80 */
#define LE_HAS_MMA_TF32 LE_HAS_MMA_16816

#define LE_WARP 32
/* A block-sized scratch array for the reduction helpers. */
#define LE_SCRATCH(name, n) __shared__ float name[(n)]

/* ---- loads ------------------------------------------------------------------------------ */

/* why not plain __restrict__: on const pointers it lets nvcc emit ld.global.nc (the sm_35
 * read-only cache) by itself, which the fermi/kepler-sm_30 path must not use. */
#if LE_HAS_LDG
#define LE_RESTRICT __restrict__
#else
#define LE_RESTRICT
#endif

/* A read-only global load: through the texture/read-only cache (__ldg) from sm_35, plain below. */
template <typename T>
__device__ __forceinline__ T le_ldg(const T *p) {
#if LE_HAS_LDG
    return __ldg(p);
#else
    return *p;
#endif
}

/* The two 16-bit halves of le_load_i32_a2 as loaded (x: bytes 0-1, y: bytes 2-3), and their join: a load
 * issued a step before its use (gemm_q8.cuh's pipelined staging) keeps the halves until then. */
__device__ __forceinline__ int2 le_raw_i32_a2(const uint8_t *p) {
    const uint16_t *h = (const uint16_t *)p;
    return make_int2(le_ldg(h), le_ldg(h + 1));
}
__device__ __forceinline__ int le_join_i32_a2(int2 r) { return (int)((unsigned)r.x | ((unsigned)r.y << 16)); }

/* 4 bytes at p as an int; p only 2-byte aligned (blocks of 18, 34, 210 bytes). */
__device__ __forceinline__ int le_load_i32_a2(const uint8_t *p) { return le_join_i32_a2(le_raw_i32_a2(p)); }

/* 4 bytes at p as an int; p 4-byte aligned. */
__device__ __forceinline__ int le_load_i32_a4(const uint8_t *p) { return le_ldg((const int *)p); }

/* ---- fp16 from raw bits: no __half type, no half arithmetic (cuda_fp16.h differs between
 * CUDA 8 and 9+, and NVRTC has no headers); cvt.f32.f16 / cvt.rn.f16.f32 exist on every
 * PTX target. Exact (f16 -> f32) and round-to-nearest-even (f32 -> f16), like numpy. */
__device__ __forceinline__ float le_half_to_float(uint16_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ uint16_t le_float_to_half(float f) {
    uint16_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

/* A fp16 field of a block, through the read-only cache. */
__device__ __forceinline__ float le_ldg_half(const uint16_t *p) { return le_half_to_float(le_ldg(p)); }

/* ---- integer dot product -------------------------------------------------------------------- */

/* c + sum of the four products of the signed bytes of a and b (__dp4a from sm_61). */
__device__ __forceinline__ int le_dp4a(int a, int b, int c) {
#if LE_HAS_DP4A
    return __dp4a(a, b, c);
#else
#pragma unroll
    for (int i = 0; i < 4; i++) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
#endif
}

/* One warp's int8 tensor-core product D[16 x 8] = c + A[16 x 16] B[16 x 8] (s8 x s8 -> s32, c in every element), with
 * g = lane / 4, t = lane % 4:  a0 = A[g][4t .. 4t+3], a1 = A[g+8][4t .. 4t+3] (4 bytes each, k ascending),
 * b = B[4t .. 4t+3][g];  d[0], d[1] = D[g][2t], D[g][2t+1];  d[2], d[3] = D[g+8][2t], D[g+8][2t+1].
 * sm_80+: one m16n8k16; sm_75: two m8n8k16 (rows g and g+8). Integer sums: exact, the same as le_dp4a's.
 * Only where LE_HAS_MMA_INT8 (every lane of the warp must call it). */
#if LE_HAS_MMA_INT8
__device__ __forceinline__ void le_mma_s8_16x8x16(int *d, int a0, int a1, int b, int c) {
#if LE_HAS_MMA_16816
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %7, %7, %7};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(b), "r"(c));
#else
    asm("mma.sync.aligned.m8n8k16.row.col.s32.s8.s8.s32 {%0, %1}, {%2}, {%3}, {%4, %4};"
        : "=r"(d[0]), "=r"(d[1])
        : "r"(a0), "r"(b), "r"(c));
    asm("mma.sync.aligned.m8n8k16.row.col.s32.s8.s8.s32 {%0, %1}, {%2}, {%3}, {%4, %4};"
        : "=r"(d[2]), "=r"(d[3])
        : "r"(a1), "r"(b), "r"(c));
#endif
}

/* The same over K = 32: D[16 x 8] = c + A[16 x 32] B[32 x 8] with a0, a1 as above for columns 0-15 and a2, a3 for
 * columns 16-31 (A[g][16 + 4t ..], A[g+8][16 + 4t ..]), b0 = B[4t ..][g], b1 = B[16 + 4t ..][g]; d as above.
 * sm_80+: one m16n8k32; sm_75: the second half accumulated onto the first (exact). */
__device__ __forceinline__ void le_mma_s8_16x8x32(int *d, int a0, int a1, int a2, int a3, int b0, int b1, int c) {
#if LE_HAS_MMA_16816
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %10, %10, %10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(c));
#else
    int lo[4];
    le_mma_s8_16x8x16(lo, a0, a1, b0, c);
    asm("mma.sync.aligned.m8n8k16.row.col.s32.s8.s8.s32 {%0, %1}, {%2}, {%3}, {%4, %5};"
        : "=r"(d[0]), "=r"(d[1])
        : "r"(a2), "r"(b1), "r"(lo[0]), "r"(lo[1]));
    asm("mma.sync.aligned.m8n8k16.row.col.s32.s8.s8.s32 {%0, %1}, {%2}, {%3}, {%4, %5};"
        : "=r"(d[2]), "=r"(d[3])
        : "r"(a3), "r"(b1), "r"(lo[2]), "r"(lo[3]));
#endif
}
#endif

/* One warp's f16 tensor-core product D[16 x 8] += A[16 x 16] B[16 x 8] in f32 (g = lane / 4, t = lane % 4; a word
 * holds two f16, the lower column / row in its low half): a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8,
 * 2t+9], a3 = A[g+8][2t+8, 2t+9]; b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g]; d[0], d[1] = D[g][2t, 2t+1], d[2],
 * d[3] = D[g+8][2t, 2t+1]. sm_80+: one m16n8k16; sm_75: two m16n8k8 (columns 0-7, then 8-15). Only where
 * LE_HAS_MMA_F16 (every lane of the warp must call it). */
#if LE_HAS_MMA_F16
__device__ __forceinline__ void le_mma_f16_16x8x16(float *d, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                                   unsigned b0, unsigned b1) {
#if LE_HAS_MMA_16816
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(b0));
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a2), "r"(a3), "r"(b1));
#endif
}

/* (x, y) as two f16 pairs: hi = (f16(x), f16(y)), lo = the remainders (f16(x - hi.x), f16(y - hi.y)); hi + lo holds
 * 22 of f32's 24 significant bits (where x is a normal f16's magnitude), so hi.hi + hi.lo + lo.hi is an f32-grade
 * product */
__device__ __forceinline__ void le_split_f16x2(float x, float y, unsigned &hi, unsigned &lo) {
    const uint16_t hx = le_float_to_half(x), hy = le_float_to_half(y);
    const uint16_t lx = le_float_to_half(x - le_half_to_float(hx)), ly = le_float_to_half(y - le_half_to_float(hy));
    hi = (unsigned)hx | ((unsigned)hy << 16);
    lo = (unsigned)lx | ((unsigned)ly << 16);
}
#endif

/* One warp's tf32 tensor-core product D[16 x 8] += A[16 x 8] B[8 x 8] in f32 (g = lane / 4, t = lane % 4; operands
 * are f32 words rounded to tf32: le_split_tf32): a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4], a3 = A[g+8][t+4];
 * b0 = B[t][g], b1 = B[t+4][g]; d[0], d[1] = D[g][2t, 2t+1], d[2], d[3] = D[g+8][2t, 2t+1]. Only where
 * LE_HAS_MMA_TF32 (every lane of the warp must call it). */
#if LE_HAS_MMA_TF32
__device__ __forceinline__ void le_mma_tf32_16x8x8(float *d, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                                   unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* x (finite) as hi = x rounded to tf32's 11 significant bits (half an ulp up in magnitude, then the 13 low bits
 * cleared: two integer instructions; cvt.rna.tf32.f32 is a dozen on sm_90) and lo = x - hi (exact in f32; the mma
 * reads its top 11 bits): hi + lo holds 21 of x's 24 bits at any magnitude, so hi.hi + hi.lo + lo.hi is an f32-grade
 * product where f16 halves (le_split_f16x2) would flush small decays and states */
__device__ __forceinline__ void le_split_tf32(float x, unsigned &hi, unsigned &lo) {
    hi = (__float_as_uint(x) + 0x1000u) & 0xFFFFE000u;
    lo = __float_as_uint(x - __uint_as_float(hi));
}
#endif

/* ---- warp exchange --------------------------------------------------------------------------- */

/* The value of lane (lane ^ mask), mask < 32. See the rules at the top for `scratch`. */
__device__ __forceinline__ float le_shfl_xor(float v, int mask, volatile float *scratch) {
#if LE_HAS_SHFL && LE_HAS_SYNC_INTRINSICS
    return __shfl_xor_sync(0xffffffffu, v, mask);
#elif LE_HAS_SHFL
    return __shfl_xor(v, mask); /* CUDA 8 */
#else
    const int t = threadIdx.x;
    scratch[t] = v;
    __syncthreads();
    const float r = scratch[t ^ mask];
    __syncthreads();
    return r;
#endif
}

#if LE_HAS_SHFL
/* The int v of lane src of this lane's group of `width` lanes (a power of 2); every lane of the warp calls it.
 * Only where LE_HAS_SHFL (sm_30+; no scratch form: its callers run only there). */
__device__ __forceinline__ int le_shfl_idx(int v, int src, int width) {
#if LE_HAS_SYNC_INTRINSICS
    return __shfl_sync(0xffffffffu, v, src, width);
#else
    return __shfl(v, src, width); /* CUDA 8 */
#endif
}
#endif

/* The same for an int (argmax indices): native int shuffles, or the scratch read as ints. */
__device__ __forceinline__ int le_shfl_xor(int v, int mask, volatile float *scratch) {
#if LE_HAS_SHFL && LE_HAS_SYNC_INTRINSICS
    return __shfl_xor_sync(0xffffffffu, v, mask);
#elif LE_HAS_SHFL
    return __shfl_xor(v, mask); /* CUDA 8 */
#else
    volatile int *s = (volatile int *)scratch;
    const int t = threadIdx.x;
    s[t] = v;
    __syncthreads();
    const int r = s[t ^ mask];
    __syncthreads();
    return r;
#endif
}

/* -infinity without math.h (NVRTC has no headers), and the largest int (an argmax's "no index"). */
__device__ __forceinline__ float le_neg_inf() { return __int_as_float((int)0xff800000u); }
#define LE_INT_MAX 0x7fffffff

/* Sum / max over the 32 lanes of each warp; every lane gets the result. */
__device__ __forceinline__ float le_warp_sum(float v, float *scratch) {
#pragma unroll
    for (int m = LE_WARP / 2; m > 0; m >>= 1) v += le_shfl_xor(v, m, scratch);
    return v;
}

__device__ __forceinline__ float le_warp_max(float v, float *scratch) {
#pragma unroll
    for (int m = LE_WARP / 2; m > 0; m >>= 1) v = fmaxf(v, le_shfl_xor(v, m, scratch));
    return v;
}

/* Sum over the block; every thread gets the result. blockDim.x: a power of two, >= 32. */
__device__ __forceinline__ float le_block_sum(float v, float *scratch) {
#if LE_HAS_SHFL
    const int lane = threadIdx.x % LE_WARP, warp = threadIdx.x / LE_WARP, n_warps = blockDim.x / LE_WARP;
    v = le_warp_sum(v, scratch);
    __syncthreads(); /* scratch may still be read by the previous call */
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < n_warps ? scratch[lane] : 0.0f;
    return le_warp_sum(v, scratch);
#else
    /* tree in shared memory */
    const int t = threadIdx.x;
    __syncthreads();
    scratch[t] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) scratch[t] += scratch[t + s];
        __syncthreads();
    }
    return scratch[0];
#endif
}

/* Max over the block; every thread gets the result. blockDim.x: a power of two, >= 32. */
__device__ __forceinline__ float le_block_max(float v, float *scratch) {
#if LE_HAS_SHFL
    const int lane = threadIdx.x % LE_WARP, warp = threadIdx.x / LE_WARP, n_warps = blockDim.x / LE_WARP;
    v = le_warp_max(v, scratch);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < n_warps ? scratch[lane] : le_neg_inf();
    return le_warp_max(v, scratch);
#else
    const int t = threadIdx.x;
    __syncthreads();
    scratch[t] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) scratch[t] = fmaxf(scratch[t], scratch[t + s]);
        __syncthreads();
    }
    return scratch[0];
#endif
}

/* ---- argmax: (value, index) pairs; the larger value wins, an equal value the lower index ------------------------- */

/* why the index tie-break: every lane of a butterfly then keeps the same winner, and the result
 * is the first maximum, as np.argmax and the C references pick it. NaN must not enter (it
 * compares false both ways, so lanes would disagree): callers skip NaN when they scan. */
__device__ __forceinline__ bool le_argmax_better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

__device__ __forceinline__ void le_warp_argmax(float &v, int &i, float *scratch) {
#pragma unroll
    for (int m = LE_WARP / 2; m > 0; m >>= 1) {
        const float ov = le_shfl_xor(v, m, scratch);
        const int oi = le_shfl_xor(i, m, scratch);
        if (le_argmax_better(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
}

/* Argmax over the block; every thread gets (v, i). blockDim.x: a multiple of 32, >= 64 (the
 * warp winners take scratch[0, 32) for values and [32, 64) for indices). */
__device__ __forceinline__ void le_block_argmax(float &v, int &i, float *scratch) {
    const int lane = threadIdx.x % LE_WARP, warp = threadIdx.x / LE_WARP, n_warps = blockDim.x / LE_WARP;
    __syncthreads(); /* fermi: scratch may still be read by the previous call (le_block_sum's result) */
    le_warp_argmax(v, i, scratch);
    __syncthreads();
    if (lane == 0) {
        scratch[warp] = v;
        ((volatile int *)scratch)[LE_WARP + warp] = i;
    }
    __syncthreads();
    v = lane < n_warps ? scratch[lane] : le_neg_inf();
    i = lane < n_warps ? ((volatile int *)scratch)[LE_WARP + lane] : LE_INT_MAX;
    __syncthreads(); /* fermi: the next butterfly writes scratch, which others may still be reading */
    le_warp_argmax(v, i, scratch);
}

/* ---- what a module was compiled as ------------------------------------------------------------------ */

#define LE_FEATURE_SHFL 1
#define LE_FEATURE_LDG 2
#define LE_FEATURE_DP4A 4
#define LE_FEATURE_SYNC 8
#define LE_FEATURE_MMA 16

/* The MoE GEMVs' skipped pairs: a negative expert id (the hybrid decode runs that expert on the CPU) makes the
 * pair's output row zero and its block do nothing else. e is uniform over the block, so the whole block returns
 * (no barrier is left waiting). -> 1 when the caller returns. */
/* Q8_1 block ib of the lanes' values xi (x[ib * QK8_1 + lane]; 0 where ib >= nb) by one warp into y[ib] when ib < nb,
 * else only the warp's reductions (fermi's need every thread): d = amax / 127, q = round(x / d), s = sum of x. One set
 * of expressions for quantize_q8_1, swiglu_q8_1 (which computes x rather than loads it), add_rmsnorm_f32 and
 * gdn_gated_rmsnorm_f32, so their blocks are the same bits. */
__device__ __forceinline__ void le_q8_1_value(float xi, block_q8_1 *y, int ib, int nb, float *scratch) {
    const int lane = threadIdx.x % LE_WARP;
    const float amax = le_warp_max(fabsf(xi), scratch);
    const float sum = le_warp_sum(xi, scratch);
    const float d = amax / 127;
    const int q = amax == 0.0f ? 0 : (int)roundf(xi / d);
    if (ib < nb) {
        y[ib].qs[lane] = (int8_t)q;
        if (lane == 0) {
            y[ib].d = le_float_to_half(d);
            y[ib].s = le_float_to_half(sum);
        }
    }
}
/* le_q8_1_value of the 32 floats at x + ib * QK8_1 */
__device__ __forceinline__ void le_q8_1_block(const float *x, block_q8_1 *y, int ib, int nb, float *scratch) {
    const int lane = threadIdx.x % LE_WARP;
    le_q8_1_value(ib < nb ? x[(size_t)ib * QK8_1 + lane] : 0.0f, y, ib, nb, scratch);
}

__device__ __forceinline__ int le_zero_skipped_pair(int e, float *y, int nrows) {
    if (e >= 0) return 0;
    for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < nrows; r += gridDim.x * blockDim.x) y[r] = 0.0f;
    return 1;
}

/* out[0] = __CUDA_ARCH__ of the PTX target, out[1] = the effective tier (LE_CC),
 * out[2] = compiler version (major*100+minor), out[3] = LE_FEATURE_* bits in use (SYNC: the
 * shuffles are the *_sync ones).
 * Every module carries it, so a test can prove which path the loaded code takes. */
extern "C" __global__ void le_tier_probe(int *out) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        out[0] = LE_ARCH;
        out[1] = LE_CC;
        out[2] = LE_CUDACC_VERSION;
        out[3] = (LE_HAS_SHFL ? LE_FEATURE_SHFL : 0) | (LE_HAS_LDG ? LE_FEATURE_LDG : 0) |
                 (LE_HAS_DP4A ? LE_FEATURE_DP4A : 0) |
                 (LE_HAS_SHFL && LE_HAS_SYNC_INTRINSICS ? LE_FEATURE_SYNC : 0) |
                 (LE_HAS_MMA_INT8 ? LE_FEATURE_MMA : 0);
    }
}

#endif
