/* le_vision.h — the Qwen3.5/3.6 vision tower on the CPU (spec §2.7; transformers' Qwen3_5VisionModel), f32.
 *
 * One image (t frames of h x w patches, in the processor's order: frame, h/M blocks, w/M blocks, M x M group
 * row-major) goes from preprocessed patches [n, C*T*P*P] to the merged embeddings [n / M^2, out_hidden] that
 * replace the <|image_pad|> tokens:
 *   patch embed (Conv3d as a matmul, + bias) + learned position grid bilinearly interpolated (align_corners)
 *   -> depth x { x += proj(attn(rope2d(qkv(LN1 x)))); x += fc2(gelu_tanh(fc1(LN2 x))) }   (attention per frame)
 *   -> merger: LN per patch, M^2 consecutive patches side by side, fc1, gelu (erf form), fc2.
 * Weights point into the mmproj GGUF's map (never copied), except the two halves of the Conv3d kernel, which
 * le_vision_finalize joins into one f32 matrix, and a non-f32 position grid, which it dequantises once.
 * This header is fed to cffi's cdef: declarations only, no macros. */
#ifndef LE_VISION_H
#define LE_VISION_H

#include <stdint.h>

typedef struct {
    int depth;            /* ViT blocks */
    int hidden;           /* H */
    int n_head;           /* head_dim = H / n_head, a multiple of 4 (the 2-D RoPE's two halves of pairs) */
    int ffn;              /* F: the blocks' MLP width */
    int patch_size;       /* P (16) */
    int temporal_patch;   /* T (2): 2 kernels in the file (v.patch_embd.weight, .weight.1), or 1 */
    int in_channels;      /* C (3) */
    int merge;            /* M (2): M x M patches per LM token */
    int pos_side;         /* side of the learned position grid (48): n_pos = pos_side^2 */
    int out_hidden;       /* O: the LM's n_embd */
    float eps;            /* every LayerNorm's epsilon (1e-6) */
    float rope_theta;     /* 2-D RoPE base (10000; not in the file) */
    int faults;           /* 0 always, except in negative-control tests: LE_VFAULT_* bits inject a known bug */
} le_vision_hparams;

/* Known bugs the oracle tests must catch (tests/test_vision_tower.py negative controls). */
typedef enum {
    LE_VFAULT_MERGER_GELU_TANH = 1, /* the merger's GELU in tanh form (llama.cpp's) instead of erf */
    LE_VFAULT_FFN_GELU_ERF = 2,     /* the blocks' GELU in erf form instead of tanh */
    LE_VFAULT_POS_NEAREST = 4,      /* the position grid sampled at the nearest point, not interpolated */
    LE_VFAULT_ROPE_SWAP = 8         /* 2-D RoPE with rows and columns swapped */
} le_vision_fault;

/* Weight slots: the roles of legacy_engine/format/mmproj.py; the first 10 global (block -1), then per block. */
typedef enum {
    LE_VW_PATCH_W0 = 0, LE_VW_PATCH_W1 = 1, LE_VW_PATCH_B = 2, LE_VW_POS_EMBD = 3,
    LE_VW_MERGER_NORM_W = 4, LE_VW_MERGER_NORM_B = 5, LE_VW_MERGER_FC1_W = 6, LE_VW_MERGER_FC1_B = 7,
    LE_VW_MERGER_FC2_W = 8, LE_VW_MERGER_FC2_B = 9,
    LE_VW_LN1_W = 10, LE_VW_LN1_B = 11, LE_VW_QKV_W = 12, LE_VW_QKV_B = 13, LE_VW_O_W = 14, LE_VW_O_B = 15,
    LE_VW_LN2_W = 16, LE_VW_LN2_B = 17, LE_VW_FC1_W = 18, LE_VW_FC1_B = 19, LE_VW_FC2_W = 20, LE_VW_FC2_B = 21,
    LE_VW_COUNT = 22
} le_vision_slot;

typedef struct le_vision le_vision;

/* Creates a tower with n_threads worker threads (>= 1); weights are set afterwards. */
int le_vision_create(const le_vision_hparams *hp, int n_threads, le_vision **out);
void le_vision_free(le_vision *v);

/* Sets one weight: `data` holds the tensor in ggml `type` with ne[0..n_dims) (ne[0] fastest), as in the GGUF.
 * block: -1 for the global slots (< LE_VW_LN1_W), else 0..depth-1. 1-D tensors must be F32; matrices any type
 * with a dequantiser (the converter writes F32/F16/BF16). Shapes are checked against the hyperparameters.
 * The memory must outlive the tower. */
int le_vision_set_weight(le_vision *v, int block, int slot, const void *data, int type, const int64_t *ne,
                         int n_dims);
/* Checks that every weight is set, joins the Conv3d kernel halves into one [H, C*T*P*P] f32 matrix (and
 * dequantises a non-f32 position grid). Required before le_vision_encode. */
int le_vision_finalize(le_vision *v);

/* Encodes one image: patches [n_patches = t*h*w, patch_len = C*T*P*P] f32 in the processor's order;
 * out [n_patches / M^2, O] f32 (out_len floats). h and w must be multiples of M. */
int le_vision_encode(le_vision *v, const float *patches, int64_t n_patches, int64_t patch_len, int t, int h, int w,
                     float *out, int64_t out_len);
/* The scratch of the last encode (planned once per encode, grown only when an image needs more): bytes, growths. */
int64_t le_vision_scratch_bytes(const le_vision *v);
int64_t le_vision_scratch_growths(const le_vision *v);

/* Phase timing of le_vision_encode (0 off, the default; 1 on; on resets the counters). le_vision_profile copies
 * up to n accumulated seconds per phase, in the order patch_embed (conv matmul + position grid), layernorm,
 * qkv (matmul), qkv_rope (bias + 2-D RoPE), attention, proj (matmul), fc1 (matmul), gelu (bias + GELU), fc2
 * (matmul), residual (the two bias + residual adds), merger; returns the number of phases. */
int le_vision_set_profile(le_vision *v, int on);
int le_vision_profile(const le_vision *v, double *seconds, int n);

/* ---- the tower's ops, for the differential tests (each the scalar reference the tower runs) ---------------- */
/* out[r] = (x[r] - mean) / sqrt(var + eps) * w + b for rows r < rows of n (biased variance); w, b may be NULL. */
void le_layernorm_ref(const float *x, const float *w, const float *b, int64_t rows, int n, float eps, float *out);
/* out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))  (gelu_pytorch_tanh); in place allowed */
void le_gelu_tanh_ref(const float *x, int64_t n, float *out);
/* out = 0.5 x (1 + erf(x / sqrt(2)))  (nn.GELU()); in place allowed */
void le_gelu_erf_ref(const float *x, int64_t n, float *out);
/* The 2-D RoPE of n rows: row r holds n_head heads of head_dim at x + r * row_stride; pos [n, 2] = (row, col)
 * of each patch. Pairs (i, i + hd/2); angle of pair i: row * theta^(-4i/hd) for i < hd/4, col *
 * theta^(-4(i - hd/4)/hd) after (faults: LE_VFAULT_ROPE_SWAP swaps row and col). */
int le_vision_op_rope(float *x, int64_t n, int n_head, int head_dim, int64_t row_stride, const int32_t *pos,
                      float theta, int faults);
/* Bidirectional attention within segments of seg_len rows: qkv [n, 3 * n_head * head_dim] (q | k | v, each
 * head-major); out [n, n_head * head_dim]; softmax(q k^T / sqrt(head_dim)) v in f32, on n_threads threads. */
int le_vision_op_attention(const float *qkv, int64_t n, int64_t seg_len, int n_head, int head_dim, int n_threads,
                           float *out);
/* The learned position grid table [side^2, hidden] f32 resampled to t frames of h x w patches in the processor's
 * order (merge-block order), bilinear with align_corners: out [t*h*w, hidden]. faults: LE_VFAULT_POS_NEAREST. */
int le_vision_op_pos_embed(const float *table, int side, int hidden, int t, int h, int w, int merge, int faults,
                           float *out);

#endif
