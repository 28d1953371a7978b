/* get_rows.cu — the token embedding: rows of a (quantised) matrix picked by id, dequantised to f32.
 *
 * Reference: native/model.c le_forward (le_weight_row: le_dequantize_row of row tokens[t]).
 *   get_rows_<type>(W, ids, y, n, ncols)      type: q4_0 q8_0 q4_K q5_K q6_K iq4_xs
 *   get_rows_f32(W, ids, y, n, ncols)
 *   get_rows_raw16(W, ids, y, n, row_words)   rows of row_words 16-byte words copied as they are (no decoding)
 *     W: [nrows, ncols] rows of quant blocks (as gemv_f32.cu) or f32;  ids: [n] int32 (checked by the host);
 *     y: [n, ncols] f32
 *     launch: block GET_ROWS_THREADS (128) x 1 x 1, grid min(n, 65535) x 1 x 1 (rows grid-strided)
 * Each thread decodes 32-element sub-blocks (quants.cuh) to y = d * q - m with the product and the
 * difference rounded separately (__fmul_rn / __fsub_rn: no FMA contraction), which is the
 * reference's dequantisation bit for bit.
 * Tiers: all (no shuffles, no shared memory).
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k get_rows
 */
#include "quants.cuh"

#define GET_ROWS_THREADS 128

template <class T>
__device__ __forceinline__ void get_rows(const uint8_t *LE_RESTRICT W, const int *LE_RESTRICT ids,
                                         float *LE_RESTRICT y, int n, int ncols) {
    const size_t row_bytes = le_row_bytes<T>(ncols);
    for (int t = blockIdx.x; t < n; t += gridDim.x) {
        const uint8_t *w = W + (size_t)ids[t] * row_bytes;
        float *yr = y + (size_t)t * ncols;
        for (int s = threadIdx.x; s < ncols / 32; s += GET_ROWS_THREADS) {
            le_q32 b;
            T::decode(w, s, b);
#pragma unroll
            for (int j = 0; j < 32; j++)
                yr[32 * s + j] = __fsub_rn(__fmul_rn(b.d[j / 16], (float)le_byte(b.q[j / 4], j % 4)), b.m);
        }
    }
}

#define LE_GET_ROWS(name, T)                                                                             \
    extern "C" __global__ void name(const uint8_t *W, const int *ids, float *y, int n, int ncols) {     \
        get_rows<T>(W, ids, y, n, ncols);                                                                \
    }

LE_GET_ROWS(get_rows_q4_0, le_t_q4_0)
LE_GET_ROWS(get_rows_q8_0, le_t_q8_0)
LE_GET_ROWS(get_rows_q4_K, le_t_q4_K)
LE_GET_ROWS(get_rows_q5_K, le_t_q5_K)
LE_GET_ROWS(get_rows_q6_K, le_t_q6_K)
LE_GET_ROWS(get_rows_iq4_xs, le_t_iq4_xs)

extern "C" __global__ void get_rows_f32(const float *W, const int *ids, float *y, int n, int ncols) {
    for (int t = blockIdx.x; t < n; t += gridDim.x) {
        const float *w = W + (size_t)ids[t] * ncols;
        for (int i = threadIdx.x; i < ncols; i += GET_ROWS_THREADS) y[(size_t)t * ncols + i] = le_ldg(w + i);
    }
}

/* rows of raw bytes, copied as they are: y row t = W row ids[t], row_words 16-byte words a row (the Q8_1 rows of
 * a normed h gathered per (token, expert) pair: bit for bit what quantising the gathered f32 rows gives) */
extern "C" __global__ void get_rows_raw16(const uint4 *W, const int *ids, uint4 *y, int n, int row_words) {
    for (int t = blockIdx.x; t < n; t += gridDim.x) {
        const uint4 *w = W + (size_t)ids[t] * row_words;
        for (int i = threadIdx.x; i < row_words; i += GET_ROWS_THREADS) y[(size_t)t * row_words + i] = w[i];
    }
}
