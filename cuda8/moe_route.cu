/* moe_route.cu — the MoE router after its matmul (spec §2.5): softmax, top-k, renormalise, per token.
 *
 * Reference: native/moe.c moe():
 *   p = softmax(logits) over n_expert (e^(l - max) / sum);  k times: the largest p not yet taken (ties: the
 *   lower expert index);  w_s = p_s / max(sum_s p_s, wsum_min)   (wsum_min = 6.103515625e-5, as llama.cpp)
 *
 *   moe_route_f32(logits, ids, weights, n_tok, n_expert, k, wsum_min)
 *     logits: [n_tok, n_expert] f32;  ids: [n_tok, k] int32 (in the order chosen: largest first);
 *     weights: [n_tok, k] f32;  k <= MOE_MAX_K;  any n_expert
 *     launch: block MOE_THREADS (256) x 1 x 1, grid min(n_tok, 65535) x 1 x 1 (tokens grid-strided)
 * One block per token. Up to MOE_RANK_E experts (every Qwen3.5/3.6 MoE): p goes to shared memory once and
 * each thread ranks its experts against all of them (rank = how many have a larger p, or an equal p and a lower
 * index: the reference's order); the expert of rank s < k is the s-th choice. One pass and two barriers instead
 * of k block argmaxes (those took 10 us of a decode token's router on an H100 under ncu). A NaN p takes no rank,
 * so its slots keep id INT_MAX (the callers' check). More experts: p is recomputed from the logits in each of
 * k argmax passes (le_block_argmax, ties to the lower index, as the reference's strict > over increasing e),
 * so n_expert has no limit; each pass is the same expression, so a probability has one value in all of them.
 * The sum of the k weights and the division run in thread 0 in the reference's order; only the
 * softmax denominator differs (f32 tree here, f64 there) and expf (<= 2 ulp): a probability is a
 * few ulp off, the renormalised weights likewise, and ids can only differ between probabilities
 * that close.
 * Tiers: all (fermi: block reductions in shared memory).
 * Build and test: python -m legacy_engine.gpu build --out DIR; pytest tests/test_gpu.py -m gpu -k moe_route
 */
#include "compat.cuh"

#define MOE_THREADS 256
#define MOE_MAX_K 32 /* Qwen3.5 MoE: 8 of 256 (35B-A3B), 10 of 512 (397B) */
#define MOE_RANK_E 1024 /* the most experts ranked in shared memory (4 KiB) */

extern "C" __global__ void moe_route_f32(const float *LE_RESTRICT logits, int *LE_RESTRICT ids,
                                         float *LE_RESTRICT weights, int n_tok, int n_expert, int k, float wsum_min) {
    LE_SCRATCH(scratch, MOE_THREADS);
    __shared__ int sel[MOE_MAX_K];
    __shared__ float psel[MOE_MAX_K];
    __shared__ float ps[MOE_RANK_E];
    for (int t = blockIdx.x; t < n_tok; t += gridDim.x) {
        const float *l = logits + (size_t)t * n_expert;
        float mx = le_neg_inf();
        for (int e = threadIdx.x; e < n_expert; e += MOE_THREADS) mx = fmaxf(mx, le_ldg(l + e));
        mx = le_block_max(mx, scratch);
        float sum = 0.0f;
        for (int e = threadIdx.x; e < n_expert; e += MOE_THREADS) sum += expf(le_ldg(l + e) - mx);
        sum = le_block_sum(sum, scratch);
        if (n_expert <= MOE_RANK_E) {
            for (int s = threadIdx.x; s < k; s += MOE_THREADS) {
                sel[s] = LE_INT_MAX;
                psel[s] = __int_as_float(0x7fc00000);
            }
            for (int e = threadIdx.x; e < n_expert; e += MOE_THREADS) ps[e] = expf(le_ldg(l + e) - mx) / sum;
            __syncthreads(); /* ps complete, sel cleared */
            for (int e = threadIdx.x; e < n_expert; e += MOE_THREADS) {
                const float p = ps[e];
                if (p != p) continue; /* NaN: no rank */
                int rank = 0;
                /* no early exit at rank k: a loop bound that depends on the sum serialises the shared loads (one
                 * warp holding a top expert scans them all anyway; 18.8 us a token under ncu, 2026-11-25) */
#pragma unroll 8
                for (int j = 0; j < n_expert; j++) {
                    const float q = ps[j];
                    rank += (q > p) | ((q == p) & (j < e));
                }
                if (rank < k) {
                    sel[rank] = e;
                    psel[rank] = p;
                }
            }
            __syncthreads(); /* sel and psel are read by thread 0 */
        } else {
            for (int s = 0; s < k; s++) {
                float best = le_neg_inf();
                int bi = LE_INT_MAX;
                for (int e = threadIdx.x; e < n_expert; e += MOE_THREADS) {
                    bool taken = false;
                    for (int r = 0; r < s; r++) taken |= sel[r] == e;
                    const float p = expf(le_ldg(l + e) - mx) / sum;
                    if (!taken && p > best) { /* strict: over increasing e, the lower index stays */
                        best = p;
                        bi = e;
                    }
                }
                le_block_argmax(best, bi, scratch);
                if (threadIdx.x == 0) {
                    sel[s] = bi;
                    psel[s] = best;
                }
                __syncthreads(); /* sel[s] is read by the next pass */
            }
        }
        if (threadIdx.x == 0) {
            float wsum = 0.0f;
            for (int s = 0; s < k; s++) wsum += psel[s];
            if (wsum < wsum_min) wsum = wsum_min;
            for (int s = 0; s < k; s++) {
                ids[(size_t)t * k + s] = sel[s];
                weights[(size_t)t * k + s] = psel[s] / wsum;
            }
        }
        __syncthreads(); /* the next token rewrites sel and psel */
    }
}
