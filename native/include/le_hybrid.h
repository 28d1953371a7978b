/* le_hybrid.h — the hybrid decode's channel: page-locked host memory that the GPU reads and writes directly
 * (unified addressing: the host pointer is the device pointer) and the CPU polls, one slot per layer.
 *
 * One token, one MoE layer i (slot i):
 *   GPU  hybrid_publish (cuda8/hybrid_sync.cu): h, the routed ids, cpu_ids (the id where the expert is not pinned
 *        on the GPU, else -1) and the weights into the slot; __threadfence_system; READY = the channel's SEQ.
 *   CPU  le_hybrid_serve (native/hybrid.c): waits for READY == SEQ, runs the cpu_ids experts on h (le_moe_routed),
 *        writes their weighted sum to ROW, then DONE = SEQ (release store).
 *   GPU  hybrid_wait: spins until DONE == SEQ, copies ROW into device memory; moe_combine adds it to the pinned
 *        experts' and the shared expert's outputs.
 * Lookahead (optional): while layer i's experts run, the GPU predicts the next MoE layer j's routing from layer i's
 * h (hybrid_predict: j's router on h rescaled to j's norm) and writes, into slot j, PRED = up to LE_HY_PRED_MAX
 * expert ids in predicted order (-1 where the expert is pinned on the GPU), then PRED_READY = SEQ. The CPU, done
 * with layer i, prefetches PRED's experts of layer j into its caches while the GPU runs layer j's attention/GDN
 * (its memory is idle then), so the experts j really routes to are mostly read from cache.
 * Early experts (N_EARLY > 0, with the prediction): the CPU, done with layer i, also copies the first N_EARLY
 * predicted experts of layer j into VRAM (DMA on a copy stream of its own, beside the graph's kernels: the link and
 * the host's memory are idle during j's attention/GDN), writes their ids into j's EARLY and, once the copies have
 * completed, EARLY_READY = SEQ. hybrid_publish of layer j gives the GPU every routed expert among them (found there
 * when EARLY_READY == SEQ as it runs) and the CPU the rest.
 * SEQ (header word 0) is written by the host before each token's launches; comparing with == lets it wrap.
 * Layout in 32-bit words (int32 or float32), each flag alone on a 64-byte line. Shared by native/ (C11) and
 * cuda8/ (CUDA 8, C++11); not fed to cffi (macros only).
 */
#ifndef LE_HYBRID_H
#define LE_HYBRID_H

#define LE_HY_SEQ 0                                /* header: int32 token sequence number */
#define LE_HY_N_LINK 1                             /* header: int32 experts a layer fetches over the link (lookahead) */
#define LE_HY_N_EARLY 2                            /* header: int32 experts the CPU copies to VRAM early (0: off) */
#define LE_HY_HEADER 16                            /* words before slot 0 */
#define LE_HY_READY 0                              /* slot: int32, the SEQ whose routing is published */
#define LE_HY_DONE 16                              /* slot: int32, the SEQ whose CPU row is written */
#define LE_HY_H 32                                 /* slot: float[E], the layer's normed input */
#define LE_HY_IDS(E) (LE_HY_H + (E))               /* int32[k] the routed experts (largest weight first) */
#define LE_HY_CPU_IDS(E, k) (LE_HY_IDS(E) + (k))   /* int32[k] the id where the CPU runs it, else -1 */
#define LE_HY_WTS(E, k) (LE_HY_IDS(E) + 2 * (k))   /* float[k] routing weights */
#define LE_HY_ROW(E, k) ((LE_HY_IDS(E) + 3 * (k) + 15) / 16 * 16)   /* float[E] the CPU's weighted sum */
#define LE_HY_PRED_READY(E, k) (LE_HY_ROW(E, k) + ((E) + 15) / 16 * 16)  /* int32, the SEQ whose PRED is written */
#define LE_HY_PRED_MAX 32                          /* predicted ids a slot holds */
#define LE_HY_PRED(E, k) (LE_HY_PRED_READY(E, k) + 16) /* int32[LE_HY_PRED_MAX] predicted experts, -1: pinned/none */
#define LE_HY_EARLY_READY(E, k) (LE_HY_PRED(E, k) + LE_HY_PRED_MAX) /* int32, the SEQ whose EARLY copies are in VRAM */
#define LE_HY_EARLY_MAX 4                          /* experts a layer may have copied early */
#define LE_HY_EARLY(E, k) (LE_HY_EARLY_READY(E, k) + 16) /* int32[LE_HY_EARLY_MAX] the experts copied, -1: none */
#define LE_HY_SLOT_WORDS(E, k) (LE_HY_EARLY(E, k) + 16)
#define LE_HY_CHANNEL_WORDS(E, k, n_layer) (LE_HY_HEADER + (n_layer) * LE_HY_SLOT_WORDS(E, k))

#endif
