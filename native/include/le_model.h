/* le_model.h — the Qwen3.5/3.6 forward pass on the CPU (reference path, fp32 activations).
 *
 * A model is a set of weight pointers (into the memory-mapped GGUF: never copied) with
 * their ggml types, plus hyperparameters. A state holds one sequence: the conv and SSM
 * state of every Gated DeltaNet layer, the KV cache of every attention layer, and the
 * position. le_forward runs n tokens from the state's position, updates the state, and
 * writes logits; le_forward_seqs does so for several states in one pass (batched decode).
 * States can be saved to / restored from a flat buffer at any position.
 * This header is fed to cffi's cdef: declarations only, no macros. */
#ifndef LE_MODEL_H
#define LE_MODEL_H

#include <stdint.h>
#include <stddef.h>

typedef struct {
    int n_layer;          /* layers to run (MTP excluded) */
    int n_embd;
    int n_vocab;
    int n_head, n_head_kv, head_dim;
    int n_rot;            /* rotary dims (NeoX pairs (i, i + n_rot/2)) */
    int rope_sections[4]; /* IMRoPE sections (t, h, w, e); all 0 = plain NeoX */
    float rope_theta;
    float rms_eps;
    int ssm_conv_kernel;  /* K */
    int ssm_d_state;      /* d_k = d_v */
    int ssm_n_group;      /* H_k */
    int ssm_dt_rank;      /* H_v */
    int ssm_d_inner;      /* H_v * d_v */
    int gdn_tiled;        /* 1: v-head j uses k-head j % H_k (qwen35*); 0: j / (H_v/H_k) (qwen3next) */
    int n_ff;             /* dense FFN width, 0 for MoE */
    int n_expert, n_expert_used, n_ff_exp, n_ff_shexp;
    int recurrent[512];   /* per layer: 1 Gated DeltaNet, 0 full attention */
    int faults;           /* 0 always, except in negative-control tests: LE_FAULT_* bits inject a known bug */
} le_hparams;

/* Known bugs the oracle tests must catch (tests/test_model.py negative controls). */
typedef enum {
    LE_FAULT_ROPE_INTERLEAVED = 1, /* rotate pairs (2i, 2i+1) instead of NeoX (i, i + n_rot/2) */
    LE_FAULT_NO_TOPK_RENORM = 2    /* use the softmax weights of the top-k experts without renormalising */
} le_fault;

/* Weight slots; `layer` -1 for the global ones. */
typedef enum {
    LE_W_TOKEN_EMBD = 0, LE_W_OUTPUT_NORM, LE_W_OUTPUT,
    LE_W_ATTN_NORM, LE_W_POST_NORM,
    /* Gated DeltaNet */
    LE_W_GDN_QKV, LE_W_GDN_GATE, LE_W_SSM_CONV, LE_W_SSM_DT, LE_W_SSM_A, LE_W_SSM_BETA, LE_W_SSM_ALPHA,
    LE_W_SSM_NORM, LE_W_SSM_OUT,
    /* gated attention */
    LE_W_Q, LE_W_K, LE_W_V, LE_W_O, LE_W_Q_NORM, LE_W_K_NORM,
    /* dense FFN */
    LE_W_FFN_GATE, LE_W_FFN_UP, LE_W_FFN_DOWN,
    /* MoE */
    LE_W_GATE_INP, LE_W_GATE_EXPS, LE_W_UP_EXPS, LE_W_DOWN_EXPS,
    LE_W_GATE_INP_SHEXP, LE_W_GATE_SHEXP, LE_W_UP_SHEXP, LE_W_DOWN_SHEXP,
    LE_W_COUNT
} le_weight_slot;

typedef struct le_model le_model;
typedef struct le_state le_state;

/* Creates a model with n_threads worker threads (>= 1); weights are set afterwards. */
int le_model_create(const le_hparams *hp, int n_threads, le_model **out);
void le_model_free(le_model *m);

/* Sets one weight: `data` holds ne1 rows of ne0 elements of `type` (x ne2 matrices for
 * expert tensors, `nb2` bytes apart; nb2 = 0 means contiguous). The memory must outlive
 * the model. Shapes are checked against the hyperparameters. */
int le_model_set_weight(le_model *m, int layer, int slot, const void *data, int type,
                        int64_t ne0, int64_t ne1, int64_t ne2, int64_t nb2);

/* on = 1 (default): quantised weights use the integer dot products of the selected CPU
 * tier, activations quantised to Q8 per matmul (W4A8 ...); 0: dequantise weights and
 * compute in f32 (the faithful reference path). */
int le_model_set_int8(le_model *m, int on);

/* Phase timing of le_forward (0 off, the default; 1 on; on resets the counters).
 * le_model_profile copies up to n accumulated seconds per phase, in the order
 * embed+norms, gdn_proj, gdn_core, gdn_out, attn_proj, attn_core, attn_out, moe_router,
 * ffn_gate_up, ffn_act, ffn_down, ffn_combine, lm_head; returns the number of phases. */
int le_model_set_profile(le_model *m, int on);
int le_model_profile(const le_model *m, double *seconds, int n);
/* Pins the worker threads: worker i (1..n_threads-1) to cpus[i % n_cpus]; the calling
 * thread (thread 0) is not pinned. le_model_pinned_cpu: the CPU of thread i or -1. */
int le_model_pin_threads(le_model *m, const int *cpus, int n_cpus);
int le_model_pinned_cpu(const le_model *m, int thread);
/* The thread pool's counters since the model was created (native/threads.c): how its threads waited. */
typedef struct {
    int64_t jobs;          /* parallel jobs the caller published (a job of one thread runs inline: not counted) */
    int64_t joined;        /* workers' joins: a worker that joined a job and ran in it */
    int64_t missed;        /* jobs a worker came to after the caller had closed them (asleep, descheduled, held) */
    int64_t worker_sleeps; /* futex sleeps of workers waiting for a job, past their spin budget */
    int64_t caller_sleeps; /* futex sleeps of the caller waiting for workers still inside a job */
    int64_t yields;        /* sched_yield calls of a waiting thread to a thread of the pool with work on its CPU */
    int64_t stolen;        /* le_parallel_each shares a thread ran for another, late one */
    double spin_us;        /* a worker's spin budget before it sleeps (LE_SPIN_US, default 1000) */
} le_pool_stats;
int le_model_pool_stats(const le_model *m, le_pool_stats *out);
/* Test hook for worker `thread` (1..n_threads-1) until released (hold = 0): hold = 1 keeps it out of every job, as
 * a thread the scheduler does not run (the jobs run on the other threads); hold = 2 makes it sleep 20 ms inside
 * every job it joins, as a thread that lost its CPU there (the caller waits for it). */
int le_model_pool_hold(le_model *m, int thread, int hold);

/* Checks that every weight the hyperparameters need is set. */
int le_model_finalize(le_model *m);

/* A sequence state for up to n_ctx positions. */
int le_state_create(const le_model *m, int n_ctx, le_state **out);
void le_state_free(le_state *s);
int le_state_pos(const le_state *s);
int le_state_n_ctx(const le_state *s);
/* The state's scratch for le_forward (planned per pass from the pass length, n_ctx and the model; grown only when
 * a pass needs more than any before): how many times it was allocated, and its bytes. A decode step after the
 * first allocates nothing: the growths stay. */
int64_t le_state_scratch_growths(const le_state *s);
int64_t le_state_scratch_bytes(const le_state *s);
/* M-RoPE (images): a text token at sequence position i rotates at rope position i + rope_delta; 0 until a pass with
 * explicit positions (le_forward_embd), then the largest position used + 1 - the sequence position after it. Saved,
 * restored and copied with the state; le_state_restore_recurrent sets 0. */
int le_state_rope_delta(const le_state *s);
int le_state_set_rope_delta(le_state *s, int delta);
/* Forgets everything: position 0, rope delta 0, zero recurrent state. */
void le_state_reset(le_state *s);
/* Bytes le_state_save writes at the state's current position. */
int64_t le_state_nbytes(const le_state *s);
/* Serialises position, conv + SSM states and KV[0:pos] to buf (nbytes >= le_state_nbytes). */
int le_state_save(const le_state *s, void *buf, int64_t nbytes);
/* Restores from a buffer written by le_state_save for the same model. */
int le_state_restore(le_state *s, const void *buf, int64_t nbytes);
/* The pieces the snapshot cache stores separately:
 * the recurrent part (conv + SSM states of every GDN layer, f32) ... */
int64_t le_state_recurrent_nbytes(const le_state *s);
int le_state_save_recurrent(const le_state *s, void *buf, int64_t nbytes);
/* ... restored together with a position; KV rows [0, pos) must be written separately. */
int le_state_restore_recurrent(le_state *s, const void *buf, int64_t nbytes, int pos);
/* KV rows [start, start+n) of every attention layer: buf = [n_attn][K then V][n][n_head_kv*head_dim] f32. */
int64_t le_state_kv_nbytes(const le_state *s, int n);
int le_state_read_kv(const le_state *s, int start, int n, void *buf, int64_t nbytes);
int le_state_write_kv(le_state *s, int start, int n, const void *buf, int64_t nbytes);

/* dst := src (same model, dst->n_ctx >= src position). */
int le_state_copy(le_state *dst, const le_state *src);

/* Runs tokens[0..n) at positions pos..pos+n-1 and advances the state.
 * logits: [n_out, n_vocab] f32 where n_out = n if all_logits else 1 (the last token's);
 * may be NULL to skip the LM head. chunked: 1 uses the chunked Gated DeltaNet form for
 * the whole batch (prefill), 0 the recurrent step token by token. */
int le_forward(le_model *m, le_state *s, const int32_t *tokens, int n, float *logits, int all_logits,
               int chunked);
/* le_forward for a pass with embeddings and M-RoPE positions (an image in the prompt): row t is token tokens[t]'s
 * embedding, or where tokens[t] < 0 row t of embd ([n, n_embd] f32; may be NULL when no token is < 0). pos3: NULL
 * (text: every component = sequence position + rope_delta), or [n][3] rope positions (t, h, w), each >= 0; after
 * such a pass rope_delta = the largest of them + 1 - the sequence position after the pass. */
int le_forward_embd(le_model *m, le_state *s, const int32_t *tokens, const float *embd, const int32_t *pos3, int n,
                    float *logits, int all_logits, int chunked);

/* One pass that advances n_seq sequences (continuous batching: decode steps of some, a prefill chunk of another),
 * reading each weight row once for all of them. Sequence s runs its n_tok[s] >= 1 tokens (the next n_tok[s] of
 * tokens, the sequences' tokens concatenated; text only) in states[s] at its positions pos.. (rope: pos + i +
 * its rope_delta), as le_forward(states[s], those tokens, chunked) would: its logits and its state after the pass
 * are bit for bit the same (native/model.c says why). states: distinct states of m, each with room for its tokens.
 * logits: [n_seq, n_vocab] f32, each sequence's last token's, or NULL. On any error (checked before anything runs)
 * no state advances. Scratch: the model's own (le_model_batch_growths), grown for a pass with more tokens or
 * longer contexts than any before. */
int le_forward_seqs(le_model *m, le_state *const *states, int n_seq, const int32_t *tokens, const int32_t *n_tok,
                    float *logits, int chunked);
/* How many times le_forward_seqs' scratch was allocated. */
int64_t le_model_batch_growths(const le_model *m);

/* A single-sequence pass (le_forward, le_forward_embd) that finds *flag != 0 after a layer calls hook(ctx) there, on
 * its own thread with the caller's float mode, then runs its next layer: a server's new request starts inside a long
 * prompt's call instead of after it. The hook may run passes of other states and le_forward_seqs of states other than
 * this one (their scratch is not this pass's); within the hook no pass calls it again. It must not touch the pausing
 * pass's state, and it resets *flag itself. flag = NULL turns it off. The flag may be set from any thread. */
int le_model_set_yield(le_model *m, volatile int32_t *flag, void (*hook)(void *ctx), void *ctx);
/* Hook calls so far. */
int64_t le_model_yields(const le_model *m);

/* The routed experts of one token for experts chosen elsewhere (the hybrid decode: the GPU routes and
 * runs the pinned experts, the CPU the rest): out[E] = sum over j with ids[j] >= 0 of
 * wts[j] * down_e(SiLU(gate_e x) * up_e x), e = ids[j], on the model's threads with its int8 setting.
 * x, out: [n_embd] f32; ids, wts: [n_sel], 1 <= n_sel <= n_expert; ids[j] < 0 skips entry j. */
int le_moe_routed(le_model *m, int layer, const float *x, int n_sel, const int32_t *ids, const float *wts,
                  float *out);
/* How many times le_moe_routed's scratch (the model's, sized for n_expert experts) was allocated: at most once per
 * layer whose plan is larger than the layers' before. */
int64_t le_model_scratch_growths(const le_model *m);

/* The hybrid decode's CPU side (native/hybrid.c; the channel's layout: le_hybrid.h). For j in [0, n_layers):
 * waits until slot layers[j]'s READY == seq, runs its CPU experts (le_moe_routed on H with CPU_IDS and WTS),
 * writes ROW, then DONE = seq. chan: LE_HY_CHANNEL_WORDS(n_embd, n_expert_used, n_layer) words of memory the GPU
 * also reads and writes. counts: [n_layer * n_expert] routing counts, incremented for every routed id (NULL: not
 * counted). timeout_s: the longest wait for one READY (LE_ERR_TIMEOUT then). prefetch_bytes > 0: the lookahead
 * (le_hybrid.h): before waiting for slot layers[j] (j > 0) whose PRED_READY == seq, prefetch up to this many bytes
 * of its predicted experts' weights; 0: off. stats (may be NULL, else [LE_HY_STATS], added to): the LE_HY_STAT_*
 * entries below.
 * early (NULL or n_early 0: off; le_hybrid.h): before waiting for slot layers[j] (j > 0) whose PRED_READY == seq,
 * copy its first n_early predicted experts into the early buffer on early->stream (parity j % 2) and set
 * EARLY_READY = seq once the copies are done, if the routing has not come first.
 * On any error every slot not yet served gets DONE = seq (its ROW zero), so the GPU never waits on a dead host. */
enum {
    LE_HY_STAT_WAIT_S = 0,     /* seconds waiting for READY */
    LE_HY_STAT_CPU_S = 1,      /* seconds in the experts */
    LE_HY_STAT_EXPERTS = 2,    /* experts run */
    LE_HY_STAT_LAYERS = 3,     /* layers served */
    LE_HY_STAT_PF_S = 4,       /* seconds prefetching */
    LE_HY_STAT_PF_AIMED = 5,   /* experts prefetched (aimed at) */
    LE_HY_STAT_PF_HITS = 6,    /* of those, experts the CPU then ran */
    LE_HY_STAT_PF_BYTES = 7,   /* bytes prefetched */
    LE_HY_STAT_E_COPIED = 8,   /* experts copied early */
    LE_HY_STAT_E_READY = 9,    /* of those, copied before the layer's routing came */
    LE_HY_STAT_E_HITS = 10,    /* early experts the layer routed to */
    LE_HY_STAT_SPLIT_LAG = 11, /* seconds from the experts' parallel jobs' start to their last thread's (inside CPU_S) */
    LE_HY_STAT_SPLIT_TAIL = 12, /* seconds their slowest thread ran past the threads' mean (le_pool_each_totals) */
    LE_HY_STAT_SLEEPS = 13,    /* sleeps waiting for READY (past the pool's spin budget) */
    LE_HY_STATS = 14
};
typedef struct {
    int n_early;          /* experts a layer copies early (<= LE_HY_EARLY_MAX; 0: off) */
    void *stream;         /* the copy stream (le_gpu_stream *), apart from the graph's */
    const uint64_t *dst;  /* [n_layer * 3] device address of slot 0 (parity 0) of gate, up, down's early region */
    const int64_t *eb;    /* [n_layer * 3] bytes of one expert of each: slot r of parity p at dst + p stride + r eb */
    int64_t parity_stride; /* bytes between the two parities' regions */
} le_hybrid_early;
int le_hybrid_serve(le_model *m, int32_t *chan, int32_t seq, const int32_t *layers, int n_layers,
                    int64_t *counts, double timeout_s, int64_t prefetch_bytes, const le_hybrid_early *early,
                    double *stats);

/* DONE = seq (ROW zero) in slots layers[0..n_layers): lets the GPU's waits of a token end when the host will not
 * serve them (an error between the launch and le_hybrid_serve). */
int le_hybrid_release(le_model *m, int32_t *chan, int32_t seq, const int32_t *layers, int n_layers);

#endif
