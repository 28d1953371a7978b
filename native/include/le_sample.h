/* le_sample.h — the token sampler (native/sample.c): penalties, top-k, top-p, min-p, temperature and one
 * draw over float logits[n_vocab], in O(n_vocab) without sorting the vocabulary.
 *
 * The chain is llama.cpp's (and legacy_engine/sampling.py's): penalties on the logits of the tokens seen; then
 * top-k, top-p and min-p on the T = 1 softmax of the penalised logits in the order "logit descending, token id
 * ascending" (a stable argsort of -x); then the temperature over the kept tokens; then a draw. Each of top-k,
 * top-p and min-p keeps a prefix of that order (top-p on the top-k set renormalised), so the kept set is one
 * prefix: the tokens with x > cut_logit, or x == cut_logit and id <= cut_id. The draw inverts u in [0, 1)
 * (drawn by the caller, so seeding stays with it) over w_i = exp((x_i - max) / T) of the kept tokens in INDEX
 * order: the first token whose running weight exceeds u * sum(w).
 * Temperature 0, or one whose 1/T is not finite (1e-320): greedy (the argmax, lowest id on ties).
 * NaN or +inf logits, or no finite one: LE_ERR_FORMAT (nothing is drawn from them); -inf is a masked token.
 *
 * Threads: le_sample_on / le_sample_probs_on run the passes over the whole vocabulary (the scan for the top list,
 * the mass pass of top-p, the draw's block sums, the weights) on the thread pool of a model (native/threads.c; its
 * n_threads, idle while a GPU decodes). The vocabulary is cut into slices fixed by n_vocab alone (16,384 tokens or
 * more each, at most 32) whose partial results merge in slice order: the kept set, the probabilities and the token
 * drawn for a given u are the same bits for any thread count, and without a model (le_sample, le_sample_probs:
 * the caller's thread only). Below 32,768 tokens everything runs on the caller's thread. The pool runs one job at
 * a time: not while the same model runs le_forward on another thread.
 *
 * Accuracy: weights are float exp of float arguments (exp within 1.2e-7 relative, the argument rounded to
 * float: 2^-24 |arg| more), sums in double; tests/test_sampling.py holds every path to a float64 numpy
 * reference (tests/tolerances.py SAMPLING_*).
 * This header is fed to cffi's cdef: declarations only, no macros. */
#ifndef LE_SAMPLE_H
#define LE_SAMPLE_H

#include <stdint.h>

#include "le_model.h" /* le_model (the pool of le_sample_on) */

typedef struct {
    double temperature;         /* 0 (or 1/T not finite): greedy */
    int32_t top_k;              /* 0, or >= n_vocab: off */
    double top_p;               /* (0, 1]; 1: off */
    double min_p;               /* [0, 1]; 0: off */
    double repetition_penalty;  /* > 0; 1: off. Seen logits: x > 0 ? x / rp : x * rp (float) */
    double presence_penalty;    /* subtracted once from each seen token's logit */
    double frequency_penalty;   /* subtracted once per occurrence */
    int32_t flags;              /* LE_SAMPLE_FORCE_*: tests only, to run every path; 0 otherwise */
} le_sample_params;

typedef enum {
    /* how the kept set was found (le_sample_info.path bits) */
    LE_SAMPLE_PATH_GREEDY = 1,    /* temperature 0: the argmax */
    LE_SAMPLE_PATH_LIST = 2,      /* the kept set lies in the list of top candidates: drawn from it */
    LE_SAMPLE_PATH_BAND = 4,      /* top-p: the cut lay in the band the subsample estimate bracketed */
    LE_SAMPLE_PATH_FALLBACK = 8,  /* top-p: the estimate missed; the region holding the cut was collected */
    LE_SAMPLE_PATH_ALL = 16,      /* every token collected (small vocabulary, or top-k above the list size) */
    LE_SAMPLE_PATH_PASS = 32,     /* the draw was one pass over the vocabulary (kept set larger than the list) */
    LE_SAMPLE_PATH_REGION = 64,   /* the draw was one pass over the region top-p collected (x above its band) */
    /* le_sample_params.flags (tests) */
    LE_SAMPLE_FORCE_ALL = 1,      /* top-p: no estimate, collect every token */
    LE_SAMPLE_FORCE_MISS_HIGH = 2, /* top-p: a bracket wholly above the cut (the fallback below it runs) */
    LE_SAMPLE_FORCE_MISS_LOW = 4  /* top-p: a bracket wholly below the cut (the fallback above it runs) */
} le_sample_enum;

typedef struct {
    int32_t token;      /* the drawn token (le_sample), the argmax (le_sample_probs) */
    int32_t path;       /* LE_SAMPLE_PATH_* bits */
    int64_t n_kept;     /* tokens kept by top-k / top-p / min-p (1 when greedy) */
    float cut_logit;    /* the kept set: x > cut_logit, or x == cut_logit and id <= cut_id */
    int32_t cut_id;
    float max_logit;    /* of the penalised logits */
    int32_t isa;        /* the tier that ran the passes (le_isa) */
} le_sample_info;

/* Bytes of the scratch buffer le_sample needs for n_vocab (about 34 bytes a token, 8.5 MB at 248k): allocate once,
 * reuse (one per sampler: two calls at once need two). */
int64_t le_sample_scratch_bytes(int64_t n_vocab);

/* One token from logits[n_vocab] (not modified). pen_ids/pen_counts[n_pen]: distinct token ids seen in the
 * penalty window and how often (NULL when n_pen = 0). u in [0, 1): the caller's uniform draw. *token: the
 * draw; info (NULL allowed): what was decided. */
int le_sample(const float *logits, int64_t n_vocab, const int32_t *pen_ids, const int32_t *pen_counts,
              int32_t n_pen, const le_sample_params *params, double u, void *scratch, int64_t scratch_bytes,
              int32_t *token, le_sample_info *info);

/* The distribution le_sample draws from: probs[n_vocab] (zero outside the kept set; one-hot when greedy). */
int le_sample_probs(const float *logits, int64_t n_vocab, const int32_t *pen_ids, const int32_t *pen_counts,
                    int32_t n_pen, const le_sample_params *params, void *scratch, int64_t scratch_bytes,
                    double *probs, le_sample_info *info);

/* le_sample and le_sample_probs with the passes over the vocabulary on model m's threads (m NULL: the caller's
 * thread, as le_sample). Same results, bit for bit, for any m. */
int le_sample_on(le_model *m, const float *logits, int64_t n_vocab, const int32_t *pen_ids,
                 const int32_t *pen_counts, int32_t n_pen, const le_sample_params *params, double u, void *scratch,
                 int64_t scratch_bytes, int32_t *token, le_sample_info *info);
int le_sample_probs_on(le_model *m, const float *logits, int64_t n_vocab, const int32_t *pen_ids,
                       const int32_t *pen_counts, int32_t n_pen, const le_sample_params *params, void *scratch,
                       int64_t scratch_bytes, double *probs, le_sample_info *info);

/* One token from candidates chosen where the logits are (a GPU: cuda8/sample_cut.cu), drawn as le_sample draws it
 * from the whole row (no penalties: sample the row when they apply). ids[n_cand]: distinct token ids in any order,
 * x[n_cand] their logits: the head of the row's order "logit descending" (the row's max among them); total: the
 * row's sum of exp(x - max) (top-p's mass); rest_max: the largest logit of the row not among them (-inf: none).
 * *token: the draw, or -1 when the kept set may reach past the candidates (then sample the whole row, same u).
 * info: as le_sample's, cut_id a token id. scratch: le_sample_cand_scratch_bytes(n_cand) bytes. */
int64_t le_sample_cand_scratch_bytes(int64_t n_cand);
int le_sample_cand(const int32_t *ids, const float *x, int64_t n_cand, int64_t n_vocab, double total, float rest_max,
                   const le_sample_params *params, double u, void *scratch, int64_t scratch_bytes, int32_t *token,
                   le_sample_info *info);

/* Top-p's cut when the kept set is too large to cross the link (a GPU draws from it: cuda8/sample_cut.cu's window):
 * ids / x[n_win] (any order) are every token of the row in one band of the order "logit descending"; base: the mass
 * sum exp(x - max) of every token ranked before them, total: the row's; max: the row's max logit. top-p (on, no
 * top-k) then min-p from params. *found = 1 and the kept set is x > *cut_logit, or x == *cut_logit and id <=
 * *cut_id; *found = 0 when the running mass does not reach top_p * total inside the window (then sample the whole
 * row). scratch: 8 * n_win + 64 bytes. */
int le_sample_window_cut(const int32_t *ids, const float *x, int64_t n_win, double base, double total, float max,
                         const le_sample_params *params, void *scratch, int64_t scratch_bytes, float *cut_logit,
                         int32_t *cut_id, int32_t *found);

/* The tier serving the sampler's passes now (le_isa: ref or avx2; follows le_set_isa). */
int le_sample_isa(void);

#endif
