/* gdn.c — the Gated DeltaNet mixer (spec §2.3), scalar reference.
 *
 *   qkv = W_qkv x, z = W_gate x, beta = sigmoid(W_beta x), g = softplus(W_alpha x + dt_bias) * ssm_a
 *   u   = SiLU(causal depthwise conv_K(qkv))           (conv state: the last K-1 raw qkv rows)
 *   q, k = l2norm per head (q also * 1/sqrt(d_k)); v-head j reads k-head j % H_k (tiled GGUF order)
 *   per v-head, state S [d_k, d_v] (f32):
 *     S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q
 *   o   = RMSNorm(o) * ssm_norm * SiLU(z) per head;  out = W_out o
 *
 * Two forms of the recurrence, equal in exact arithmetic: the recurrent step (decode,
 * token by token) and the chunked form (prefill, chunks of 64 tokens: the intra-chunk
 * interactions solved as a unit-lower-triangular system, one state update per chunk;
 * transformers' torch_chunk_gated_delta_rule, llama.cpp's build_delta_net_chunking).
 * A pass may hold several sequences (le_seqs): the projections run over all their rows at once, the conv and the
 * recurrence per sequence in its own state (items (sequence, channel group) and (sequence, v-head)), chunks counted
 * from each sequence's first row. Test: tests/test_model.py (against transformers and llama.cpp),
 * tests/test_batch_decode.py (several sequences = each alone, bit for bit). */
#include <math.h>
#include <string.h>

#include "le_internal.h"
#include "le_ops.h"
#include "le_simd.h"

#define GDN_CHUNK 64
#define L2NORM_EPS 1e-6f /* transformers' l2norm eps */

typedef struct {
    const le_model *m;
    const le_seqs *sq;
    int gi;             /* the layer's index among the GDN layers: each state's ssm of this layer */
    const float *u;     /* [n, conv_dim]: q | k | v after conv + SiLU + l2norm + q scale */
    const float *beta;  /* [n, H_v] */
    const float *g;     /* [n, H_v] log decay (<= 0) */
    float *o;           /* [n, d_inner] */
    const float *z;     /* [n, d_inner] output gate (pre-SiLU) */
    const float *norm_w; /* [d_v] ssm_norm */
    float *chunk;       /* chunked form: [n_threads][chunk_floats] each thread's scratch */
    int64_t chunk_floats;
    int chunked;
} gdn_job;

/* Floats of one thread's scratch for the chunked form (gdn_chunked_head): G [C], E [C, C], Kt [dk, C], Kb [C, dk],
 * Vb [C, dv], A [C, C], Ti [C, C], U [C, dv], W [C, dk], X [C, dv], Vp [C, dv], D [dk, dv] */
static int64_t chunk_floats(const le_hparams *hp) {
    int64_t C = GDN_CHUNK, dk = hp->ssm_d_state, dv = hp->ssm_d_inner / hp->ssm_dt_rank;
    return le_floats64(C + 3 * C * C + 2 * dk * C + 2 * C * dk + 4 * C * dv + dk * dv);
}

static int k_head_of(const le_hparams *hp, int j) {
    return hp->gdn_tiled ? j % hp->ssm_n_group : j / (hp->ssm_dt_rank / hp->ssm_n_group);
}

/* The recurrent step of v-head j (state S [d_k, d_v]) for the token of row t: the selected tier's gdn_step kernel
 * (native/f32_ref.c is its reference). */
static void gdn_step_token(const gdn_job *jb, float *S, int j, int t, le_gdn_step_fn step) {
    const le_hparams *hp = &jb->m->hp;
    int dk = hp->ssm_d_state, dv = hp->ssm_d_inner / hp->ssm_dt_rank, Hv = hp->ssm_dt_rank, Hk = hp->ssm_n_group;
    int kh = k_head_of(hp, j);
    const float *row = jb->u + (int64_t)t * (2 * Hk * dk + hp->ssm_d_inner);
    step(S, row + kh * dk, row + Hk * dk + kh * dk, row + 2 * Hk * dk + j * dv,
         expf(jb->g[(int64_t)t * Hv + j]), jb->beta[(int64_t)t * Hv + j], dk, dv,
         jb->o + (int64_t)t * hp->ssm_d_inner + j * dv);
}

/* The recurrent step for rows [r0, r0 + n) of v-head j (one sequence's, state S). */
static void gdn_recurrent_head(const gdn_job *jb, float *S, int j, int r0, int n) {
    le_gdn_step_fn step = le_get_f32_kernels()->gdn_step;
    for (int t = r0; t < r0 + n; t++) gdn_step_token(jb, S, j, t, step);
}

/* y[c] -= a x[c] for the GDN_CHUNK columns of a row of Ti: past row m's own columns Ti_m is zero and y - a * 0 is y,
 * so every column is taken: a constant count of rows that do not overlap (restrict) is a vector loop at -O2 */
static inline void sub_scaled_row(float *restrict y, const float *restrict x, float a) {
    for (int c = 0; c < GDN_CHUNK; c++) y[c] -= a * x[c];
}

/* The chunked form for rows [r0, r0 + n) of v-head j (one sequence's, state S [dk, dv]; spec §2.3, chunk C = 64,
 * chunks counted from r0); scratch: the thread's chunk slice. Per chunk of L rows, with G the cumulative log decay
 * and E_ij = exp(G_i - G_j) (j <= i):
 *   A = strictly lower (beta_i k_i.k_j E_ij);  Ti = (I + A)^-1 (forward substitution on [L, L])
 *   U = Ti (beta V);  W = Ti (beta e^G K);  V' = U - W S
 *   O = e^G (Q S) + (lower (q_i.k_j E_ij)) V'; S <- e^{G_L} S + (e^{G_L - G} K)^T V'
 * transformers' torch_chunk_gated_delta_rule in that form. Every product of more than [L, L] work is a call of the
 * f32 table's gemm_nn, so the form runs at the tier's GEMM speed (an element's sum order fixed by the shapes: the
 * same bits on every call, so a snapshot at a chunk boundary equals a recompute). */
static void gdn_chunked_head(const gdn_job *jb, float *S, int j, int r0, int n, float *scratch) {
    const le_hparams *hp = &jb->m->hp;
    int dk = hp->ssm_d_state, dv = hp->ssm_d_inner / hp->ssm_dt_rank, Hv = hp->ssm_dt_rank;
    int kh = k_head_of(hp, j);
    int64_t ld = 2 * hp->ssm_n_group * dk + hp->ssm_d_inner; /* u's row stride */
    const int C = GDN_CHUNK;
    float *G = scratch, *E = G + C, *Kt = E + C * C, *Kb = Kt + dk * C, *Vb = Kb + C * dk, *A = Vb + C * dv;
    float *Ti = A + C * C, *U = Ti + C * C, *W = U + C * dv, *X = W + C * dk, *Vp = X + C * dv, *D = Vp + C * dv;
    const le_f32_kernels *kern = le_get_f32_kernels();
    le_gdn_step_fn step = kern->gdn_step;
    for (int c0 = r0; c0 < r0 + n; c0 += C) { /* c0: the chunk's first row */
        int L = r0 + n - c0 < C ? r0 + n - c0 : C;
        if (L == 1) { /* a chunk of one token is the recurrent step: so a one-token call (decode) and
                       * the last chunk of a longer call that ends on the same token agree bit for bit */
            gdn_step_token(jb, S, j, c0, step);
            continue;
        }
        const float *Q = jb->u + (int64_t)c0 * ld + kh * dk;                               /* rows [L, dk], stride ld */
        const float *K = jb->u + (int64_t)c0 * ld + hp->ssm_n_group * dk + kh * dk;        /* [L, dk] */
        const float *V = jb->u + (int64_t)c0 * ld + 2 * hp->ssm_n_group * dk + j * dv;     /* [L, dv] */
        const float *beta = jb->beta + (int64_t)c0 * Hv + j, *g = jb->g + (int64_t)c0 * Hv + j; /* stride Hv */
        float acc = 0.0f;
        for (int i = 0; i < L; i++) {
            acc += g[(int64_t)i * Hv];
            G[i] = acc;
        }
        for (int i = 0; i < L; i++) {
            for (int jj = 0; jj <= i; jj++) E[i * C + jj] = expf(G[i] - G[jj]);
            float b = beta[(int64_t)i * Hv], be = b * expf(G[i]);
            for (int e = 0; e < dk; e++) {
                Kt[e * C + i] = K[i * ld + e];
                Kb[i * dk + e] = be * K[i * ld + e];
            }
            for (int c = 0; c < dv; c++) Vb[i * dv + c] = b * V[i * ld + c];
        }
        /* A = K K^T (lower part used), Ti = (I + strict lower(beta_i A_ij E_ij))^-1 */
        kern->gemm_nn(K, ld, Kt, C, A, C, L, L, dk);
        for (int i = 0; i < L; i++) {
            float b = beta[(int64_t)i * Hv];
            for (int jj = 0; jj < i; jj++) A[i * C + jj] *= b * E[i * C + jj];
        }
        for (int i = 0; i < L; i++) { /* row i of Ti: e_i - sum_{m<i} A_im Ti_m (Ti_m zero beyond column m) */
            float *Tr = Ti + i * C;
            for (int c = 0; c < C; c++) Tr[c] = c == i ? 1.0f : 0.0f;
            for (int m2 = 0; m2 < i; m2++) {
                float a = A[i * C + m2];
                const float *Tm = Ti + m2 * C;
                sub_scaled_row(Tr, Tm, a);
            }
        }
        kern->gemm_nn(Ti, C, Vb, dv, U, dv, L, dv, L);  /* U [L, dv] */
        kern->gemm_nn(Ti, C, Kb, dk, W, dk, L, dk, L);  /* W [L, dk] */
        kern->gemm_nn(W, dk, S, dv, X, dv, L, dv, dk);  /* X = W S */
        for (int64_t e = 0; e < (int64_t)L * dv; e++) Vp[e] = U[e] - X[e];
        /* O */
        kern->gemm_nn(Q, ld, S, dv, X, dv, L, dv, dk);  /* X = Q S */
        kern->gemm_nn(Q, ld, Kt, C, A, C, L, L, dk);    /* A = Q K^T */
        for (int i = 0; i < L; i++)
            for (int jj = 0; jj < L; jj++) A[i * C + jj] = jj <= i ? A[i * C + jj] * E[i * C + jj] : 0.0f;
        float *o0 = jb->o + (int64_t)c0 * hp->ssm_d_inner + j * dv;
        kern->gemm_nn(A, C, Vp, dv, U, dv, L, dv, L);   /* U = P V' */
        for (int i = 0; i < L; i++) {
            float eg = expf(G[i]);
            float *o = o0 + (int64_t)i * hp->ssm_d_inner;
            for (int c = 0; c < dv; c++) o[c] = eg * X[i * dv + c] + U[i * dv + c];
        }
        /* S <- e^{G_L} S + (e^{G_L - G_j} k_j)^T V' */
        float glast = G[L - 1], elast = expf(glast);
        for (int jj = 0; jj < L; jj++) {
            float f = expf(glast - G[jj]);
            for (int e = 0; e < dk; e++) Kt[e * C + jj] *= f;
        }
        kern->gemm_nn(Kt, C, Vp, dv, D, dv, dk, dv, L); /* D [dk, dv] */
        for (int64_t e = 0; e < (int64_t)dk * dv; e++) S[e] = elast * S[e] + D[e];
    }
}

/* The heads job, one item per (sequence, v-head): the recurrence of v-head j over the sequence's rows (recurrent
 * or chunked form) in its state, then its gated RMSNorm: o = RMSNorm(o) * ssm_norm * SiLU(z). */
static void gdn_heads(void *ctx, int64_t i0, int64_t i1, int thread) {
    gdn_job *jb = ctx;
    const le_hparams *hp = &jb->m->hp;
    int Hv = hp->ssm_dt_rank, dv = hp->ssm_d_inner / Hv, dk = hp->ssm_d_state;
    le_silu_f32_fn silu = le_get_f32_kernels()->silu;
    for (int64_t item = i0; item < i1; item++) {
        int s = (int)(item / Hv), j = (int)(item % Hv);
        const le_state *st = jb->sq->st[s];
        int r0 = jb->sq->row0[s], n = jb->sq->row0[s + 1] - r0;
        float *S = st->ssm + jb->gi * st->ssm_floats + (int64_t)j * dk * dv; /* [d_k, d_v] */
        if (jb->chunked && n > 1) { /* one token: the recurrent step */
            gdn_chunked_head(jb, S, j, r0, n, jb->chunk + (int64_t)thread * jb->chunk_floats);
        } else {
            gdn_recurrent_head(jb, S, j, r0, n);
        }
        for (int t = r0; t < r0 + n; t++) {
            float *oh = jb->o + (size_t)t * hp->ssm_d_inner + j * dv, gate[LE_GDN_MAX_DV];
            const float *zh = jb->z + (size_t)t * hp->ssm_d_inner + j * dv;
            le_rmsnorm(oh, jb->norm_w, dv, hp->rms_eps, oh);
            silu(zh, dv, gate);
            for (int c = 0; c < dv; c++) oh[c] *= gate[c];
        }
    }
}

/* The prep job, one item per (sequence, channel group): the q head and k head groups (d_k channels each)
 * and the v head groups (d_v channels, plus that head's beta and g). A sequence of n tokens convolves its
 * input rows xin = its K-1 conv state rows, then its n qkv rows (read where they lie: no copy):
 *   u[t, c] = SiLU(sum_k w[c, k] xin[t + k, c])   (tap K-1 is the current token)
 *   q, k groups: l2norm; q also * 1/sqrt(d_k);  new conv state: the last K-1 rows of xin */
typedef struct {
    const le_model *m;
    const le_seqs *sq;
    int gi;              /* the layer's index among the GDN layers: each state's conv of this layer */
    const float *qkv;    /* [n, conv_dim]: the pass's raw projections */
    const float *cw;     /* [conv_dim, K] */
    float *u;            /* [n, conv_dim] */
    float *b, *a;        /* [n, H_v]: in: projections; out: beta, g */
    const float *dt, *A; /* [H_v] */
} prep_job;

/* Row i of a sequence's conv input xin: its conv state row i, then its qkv rows (row r0 is xin row K-1). */
static const float *xin_row(const float *conv, const float *qkv, int K, int conv_dim, int r0, int i) {
    return i < K - 1 ? conv + (size_t)i * conv_dim : qkv + (size_t)(r0 + i - (K - 1)) * conv_dim;
}

#define PREP_BLOCK 64 /* channels of a conv block (gdn_prep) */
typedef float le_v4f __attribute__((vector_size(16))); /* GCC / Clang vector extension: SSE2 at the baseline */

static void gdn_prep(void *ctx, int64_t i0, int64_t i1, int thread) {
    prep_job *jb = ctx;
    const le_hparams *hp = &jb->m->hp;
    int Hk = hp->ssm_n_group, Hv = hp->ssm_dt_rank, dk = hp->ssm_d_state, dv = hp->ssm_d_inner / Hv;
    int K = hp->ssm_conv_kernel, conv_dim = 2 * Hk * dk + hp->ssm_d_inner, n_groups = 2 * Hk + Hv;
    float qscale = 1.0f / sqrtf((float)dk);
    le_silu_f32_fn silu = le_get_f32_kernels()->silu;
    for (int64_t item = i0; item < i1; item++) {
        int s = (int)(item / n_groups), gi = (int)(item % n_groups);
        const le_state *st = jb->sq->st[s];
        float *conv = st->conv + jb->gi * st->conv_floats; /* [K-1, conv_dim] */
        int r0 = jb->sq->row0[s], n = jb->sq->row0[s + 1] - r0;
        int v_head = gi >= 2 * Hk ? gi - 2 * Hk : -1;
        int c0 = v_head < 0 ? gi * dk : 2 * Hk * dk + v_head * dv, width = v_head < 0 ? dk : dv;
        /* the conv in blocks of PREP_BLOCK channels, taps outer: each sum adds its taps in order from 0 (the bits of
         * a plain loop) and the channel loop is a vector loop over contiguous rows; the block's taps transposed once */
        for (int cb = c0; cb < c0 + width; cb += PREP_BLOCK) {
            int nb = c0 + width - cb < PREP_BLOCK ? c0 + width - cb : PREP_BLOCK;
            float wt[LE_GDN_MAX_CONV_K][PREP_BLOCK];
            for (int k = 0; k < K; k++)
                for (int c = 0; c < nb; c++) wt[k][c] = jb->cw[(cb + c) * K + k];
            for (int t = r0; t < r0 + n; t++) {
                le_v4f acc4[PREP_BLOCK / 4] = {0}; /* float acc[c] = acc4[c / 4][c % 4] */
                float *acc = (float *)acc4, *ut = jb->u + (size_t)t * conv_dim + cb;
                for (int k = 0; k < K; k++) {
                    const float *x = xin_row(conv, jb->qkv, K, conv_dim, r0, t - r0 + k) + cb;
                    if (nb == PREP_BLOCK) { /* 4 channels a vector op (GCC's vectoriser leaves this loop scalar) */
                        for (int q = 0; q < PREP_BLOCK / 4; q++) {
                            le_v4f w4, x4;
                            memcpy(&w4, &wt[k][4 * q], sizeof w4);
                            memcpy(&x4, x + 4 * q, sizeof x4);
                            acc4[q] += w4 * x4; /* a product then a sum, as the scalar loop: the same bits */
                        }
                    } else {
                        for (int c = 0; c < nb; c++) acc[c] += wt[k][c] * x[c];
                    }
                }
                silu(acc, nb, ut);
            }
        }
        for (int t = r0; t < r0 + n; t++) {
            float *ut = jb->u + (size_t)t * conv_dim;
            if (v_head < 0) {
                le_l2norm(ut + c0, dk, L2NORM_EPS);
                if (gi < Hk)
                    for (int c = c0; c < c0 + dk; c++) ut[c] *= qscale;
            } else { /* beta = sigmoid(b);  g = softplus(a + dt_bias) * ssm_a  (ssm_a = -exp(A_log) < 0) */
                float *b = jb->b + (size_t)t * Hv + v_head, *a = jb->a + (size_t)t * Hv + v_head;
                *b = le_sigmoid(*b);
                *a = le_softplus(*a + jb->dt[v_head]) * jb->A[v_head];
            }
        }
        /* new conv state row k = xin row n + k, in place: ascending k reads a state row (n + k > k) before
         * it is overwritten */
        for (int k = 0; k < K - 1; k++)
            memcpy(conv + (size_t)k * conv_dim + c0, xin_row(conv, jb->qkv, K, conv_dim, r0, n + k) + c0,
                   (size_t)width * sizeof(float));
    }
}

/* The four input projections of n tokens: one batch, x quantised once. */
static void proj_mm(const le_weight *w, const float *x, int n, float *qkv, float *z, float *b, float *a,
                    le_mm proj[4]) {
    int64_t E = w[LE_W_GDN_QKV].ne0;
    proj[0] = (le_mm){&w[LE_W_GDN_QKV], 0, x, n, E, qkv, w[LE_W_GDN_QKV].ne1, NULL};
    proj[1] = (le_mm){&w[LE_W_GDN_GATE], 0, x, n, E, z, w[LE_W_GDN_GATE].ne1, NULL};
    proj[2] = (le_mm){&w[LE_W_SSM_BETA], 0, x, n, E, b, w[LE_W_SSM_BETA].ne1, NULL};
    proj[3] = (le_mm){&w[LE_W_SSM_ALPHA], 0, x, n, E, a, w[LE_W_SSM_ALPHA].ne1, NULL};
}

/* The layer's own scratch: qkv [n, conv_dim], u [n, conv_dim], z [n, dinner], b, a [n, Hv], o [n, dinner] */
static size_t own_floats(const le_hparams *hp, int n) {
    size_t conv_dim = 2 * (size_t)hp->ssm_n_group * hp->ssm_d_state + hp->ssm_d_inner;
    return 2 * (size_t)n * conv_dim + 2 * (size_t)n * hp->ssm_d_inner + 2 * (size_t)n * hp->ssm_dt_rank;
}

size_t le_gdn_plan(const le_model *m, const le_weight *w, int n) {
    const le_hparams *hp = &m->hp;
    int T = le_pool_threads(m->pool);
    static const float x_id[2]; /* distinct addresses: the plan's stand-ins for distinct inputs */
    le_mm proj[4];
    proj_mm(w, x_id, n, NULL, NULL, NULL, NULL, proj);
    le_mm out = {&w[LE_W_SSM_OUT], 0, x_id + 1, n, hp->ssm_d_inner, NULL, hp->n_embd, NULL};
    size_t in = le_matmul_batch_plan(T, m->int8, proj, 4), outp = le_matmul_batch_plan(T, m->int8, &out, 1);
    size_t chunk = n > 1 ? (size_t)T * (size_t)chunk_floats(hp) * sizeof(float) : 0; /* taken when a sequence has > 1 */
    size_t most = in > outp ? in : outp;
    return le_align64(own_floats(hp, n) * sizeof(float)) + (chunk > most ? chunk : most);
}

int le_gdn_layer(const le_model *m, le_arena *ar, const le_weight *w, const float *x, const le_seqs *sq, int gi,
                 int chunked, float *out) {
    const le_hparams *hp = &m->hp;
    int E = hp->n_embd, Hk = hp->ssm_n_group, Hv = hp->ssm_dt_rank, dk = hp->ssm_d_state;
    int dinner = hp->ssm_d_inner, dv = dinner / Hv;
    int conv_dim = 2 * Hk * dk + dinner, n = sq->row0[sq->n_seq];
    if (dv > LE_GDN_MAX_DV) return LE_FAIL(LE_ERR_UNSUPPORTED, "value head size %d > %d", dv, LE_GDN_MAX_DV);
    int rc = LE_OK;
    size_t mark = ar->used;
    int T = le_pool_threads(m->pool);
    float *buf = le_arena_take(ar, own_floats(hp, n) * sizeof(float));
    if (!buf) return LE_FAIL(LE_ERR_NO_MEMORY, "gdn scratch for %d tokens: beyond the plan", n);
    float *qkv = buf, *u = qkv + (size_t)n * conv_dim, *z = u + (size_t)n * conv_dim;
    float *b = z + (size_t)n * dinner, *a = b + (size_t)n * Hv, *o = a + (size_t)n * Hv;

    /* projections of every row of the pass (one parallel job: each weight row read once for all sequences) */
    double tp = le_prof_start(m);
    le_mm proj[4];
    proj_mm(w, x, n, qkv, z, b, a, proj);
    if ((rc = le_matmul_batch(m->pool, ar, m->int8, proj, 4))) goto done;
    le_prof(m, &tp, LE_PROF_GDN_PROJ);

    /* conv + SiLU + l2norm per (sequence, channel group), beta and g; then the heads per (sequence, v-head) */
    int64_t n_prep = (int64_t)sq->n_seq * (2 * Hk + Hv), n_heads = (int64_t)sq->n_seq * Hv;
    prep_job pj = {m, sq, gi, qkv, (const float *)w[LE_W_SSM_CONV].data, u, b, a,
                   (const float *)w[LE_W_SSM_DT].data, (const float *)w[LE_W_SSM_A].data};
    /* a prefill's items take ~0.1-2 ms each (a head's chunked rule over its rows): one a claim, so that 16 heads split
     * 8 / 8 over 2 threads and not by chunks of 5 (10 / 6); decode items are a row each, claimed in bigger chunks */
    int64_t g_prep = n > sq->n_seq ? 1 : n_prep / (2 * T) + 1, g_heads = n > sq->n_seq ? 1 : n_heads / (2 * T) + 1;
    le_parallel_for(m->pool, n_prep, g_prep, gdn_prep, &pj);
    int any_long = 0; /* a sequence of more than one token: the chunked form needs its scratch */
    for (int s = 0; s < sq->n_seq; s++) any_long |= sq->row0[s + 1] - sq->row0[s] > 1;
    gdn_job jb = {m, sq, gi, u, b, a, o, z, (const float *)w[LE_W_SSM_NORM].data, NULL, chunk_floats(hp),
                  chunked != 0};
    size_t core = ar->used;
    if (jb.chunked && any_long &&
        !(jb.chunk = le_arena_take(ar, (size_t)T * (size_t)jb.chunk_floats * sizeof(float)))) {
        rc = LE_FAIL(LE_ERR_NO_MEMORY, "gdn chunk scratch: beyond the plan");
        goto done;
    }
    le_parallel_for(m->pool, n_heads, g_heads, gdn_heads, &jb);
    ar->used = core;
    le_prof(m, &tp, LE_PROF_GDN_CORE);
    rc = le_matmul(m->pool, ar, m->int8, &w[LE_W_SSM_OUT], 0, o, n, dinner, out, E);
    le_prof(m, &tp, LE_PROF_GDN_OUT);
done:
    ar->used = mark;
    return rc;
}
