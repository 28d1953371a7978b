/* hybrid.c — the CPU's half of the hybrid decode: serves each MoE layer's unpinned experts through the channel
 * of le_hybrid.h, which the GPU's kernels (cuda8/hybrid_sync.cu) read and write directly.
 *
 * Per layer: spin on READY (a load-acquire; the GPU fenced its writes before setting it), run the experts with
 * le_moe_routed on the thread pool (its workers spin between jobs, so a layer costs no wake-up), write ROW, then
 * DONE with a store-release. The caller's thread spins: the gap between layers is the GPU's ~50-100 µs of
 * attention and routing, shorter than any sleep's wake-up. A wait longer than the pool's spin budget (LE_SPIN_US,
 * 1 ms: the GPU is slow, or the host is busy with other work that needs this CPU) backs off (backoff_step): it
 * sleeps POLL_SLEEP_US between looks (the GPU cannot wake a futex), so a long wait costs at most that much latency
 * and almost no CPU (stat SLEEPS). No sched_yield: on a CPU shared with a CPU-bound process a yield hands it the CPU
 * until its next tick (1-4 ms), a sleeper is woken in time (native/threads.c).
 * Lookahead (prefetch_bytes > 0, le_hybrid.h): done with a layer, if the next layer's slot holds this token's
 * predicted experts (PRED_READY == seq), the pool loads their weights (in predicted order, up to prefetch_bytes)
 * into the caches until the next layer's routing arrives; the experts it then runs are the same, only sooner.
 * Early experts (early, le_hybrid.h): instead, the first n_early predicted experts are copied into VRAM on the early
 * stream (DMA) and flagged once done; the GPU runs those the layer routes to, the CPU the rest.
 * Both are off by default (gpu_model: measured no faster, benchmarks/results/hybrid_lookahead_2026-11-25g.md).
 * Reference: the host steps this replaces (gpu_model._hybrid_read/_hybrid_cpu before 2026-11-25e): the same
 * le_moe_routed call on the same ids and weights.
 * Test: tests/test_hybrid_serve.py (a Python thread plays the GPU), tests/test_gpu_model.py (hybrid vs CPU). */
#include <string.h>
#include <time.h>

#include "le_gpu.h"
#include "le_hybrid.h"
#include "le_internal.h"
#include "le_ops.h"

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* READY's back-off: past the spin budget a look every POLL_SLEEP_US (plus the kernel's timer slack, 50 µs by
 * default): the latency a wait that long may add, small beside a wait that has lasted 1 ms already. */
#define POLL_SLEEP_US 50

/* One look's wait: spin (cpu_relax) until spin_s has passed since t0, then sleep; the clock is read every 1024 looks
 * while spinning. */
static void backoff_step(double t0, double spin_s, unsigned spins, int *sleeping, double *acc) {
    if (!*sleeping) {
        cpu_relax();
        if ((spins & 1023) != 1023 || now_s() - t0 <= spin_s) return;
        *sleeping = 1;
    }
    const struct timespec ts = {0, POLL_SLEEP_US * 1000L};
    nanosleep(&ts, NULL);
    acc[LE_HY_STAT_SLEEPS]++;
}

/* The lookahead's prefetch: each thread loads, expert after expert in predicted order, the rows of the gate, up and
 * down matrices it will compute (le_moe_routed splits every expert's rows over the threads the same way: le_split),
 * so the rows wait in its own caches; it stops when the layer's routing arrives. */
#define PREFETCH_CHECK 4096 /* bytes of prefetches a thread issues between two looks at READY */
#define PREFETCH_MARGIN 1   /* experts aimed at past the predicted CPU share (a miss in the share costs a DRAM read) */

typedef struct {
    const le_weight *mats[3];        /* gate, up, down of the layer */
    const int32_t *ids;
    int n_ids, n_threads;
    const int32_t *ready;            /* the layer's READY word: stop once it equals seq */
    int32_t seq;
    int64_t bytes;                   /* issued (atomic) */
    unsigned sink;
} prefetch_job;

static void prefetch_rows(void *ctx, int64_t t, int64_t t1, int thread) {
    (void)t1;
    (void)thread;
    prefetch_job *j = ctx;
    int64_t issued = 0;
    unsigned sink = 0; /* real loads, not prefetch hints: a hint that misses the TLB may be dropped, a load is not */
    for (int a = 0; a < j->n_ids; a++) {
        if (__atomic_load_n(j->ready, __ATOMIC_RELAXED) == j->seq) break; /* the routing is here: compute */
        for (int m = 0; m < 3; m++) {
            const le_weight *w = j->mats[m];
            if (!w->data) continue;
            int64_t r0, r1;
            le_split(w->ne1, (int)t, j->n_threads, &r0, &r1);
            const uint8_t *p = w->data + (int64_t)j->ids[a] * w->nb2 + r0 * w->nb1;
            const int64_t n = (r1 - r0) * w->nb1;
            for (int64_t b = 0; b < n; b += 64) {
                if (!(b & (PREFETCH_CHECK - 1)) && __atomic_load_n(j->ready, __ATOMIC_RELAXED) == j->seq) goto out;
                sink += p[b];
                issued += 64;
            }
        }
    }
out:
    __atomic_fetch_add(&j->bytes, issued, __ATOMIC_RELAXED);
    __atomic_fetch_add(&j->sink, sink, __ATOMIC_RELAXED); /* keeps the loads */
}

/* Prefetches layer's predicted experts (slot PRED, written for seq): the CPU's predicted share (the experts of the
 * predicted top k that are not pinned, less the n_link the GPU fetches: it takes the ones predicted last) plus
 * PREFETCH_MARGIN, in predicted order, as many as fit max_bytes; returns how many it aimed at (their ids in aimed[])
 * and adds the bytes it issued to *bytes. */
static int prefetch_predicted(le_model *m, int layer, int32_t *slot, int32_t seq, int n_link, int64_t max_bytes,
                              int32_t *aimed, double *bytes) {
    const int E = m->hp.n_embd, k = m->hp.n_expert_used, ne = m->hp.n_expert;
    const le_weight *w = m->layer[layer];
    prefetch_job job = {{&w[LE_W_GATE_EXPS], &w[LE_W_UP_EXPS], &w[LE_W_DOWN_EXPS]}, aimed, 0,
                        le_pool_threads(m->pool), slot + LE_HY_READY, seq, 0, 0};
    int64_t eb = 0, total = 0;
    for (int t = 0; t < 3; t++) eb += job.mats[t]->data ? job.mats[t]->ne1 * job.mats[t]->nb1 : 0;
    int share = 0;
    for (int r = 0; r < k && r < LE_HY_PRED_MAX; r++) {
        const int32_t id = __atomic_load_n(&slot[LE_HY_PRED(E, k) + r], __ATOMIC_RELAXED);
        share += id >= 0 && id < ne;
    }
    const int want = share > n_link ? share - n_link + PREFETCH_MARGIN : PREFETCH_MARGIN;
    int n_aimed = 0;
    for (int r = 0; r < LE_HY_PRED_MAX && n_aimed < want && total + eb <= max_bytes; r++) {
        const int32_t id = __atomic_load_n(&slot[LE_HY_PRED(E, k) + r], __ATOMIC_RELAXED);
        if (id < 0 || id >= ne) continue; /* pinned on the GPU, or no prediction: a hint, never an error */
        int seen = 0;
        for (int a = 0; a < n_aimed; a++) seen |= aimed[a] == id;
        if (seen) continue;
        aimed[n_aimed++] = id;
        total += eb;
    }
    job.n_ids = n_aimed;
    if (n_aimed) {
        le_parallel_each(m->pool, prefetch_rows, &job);
        *bytes += (double)job.bytes;
    }
    return n_aimed;
}

/* Early experts: the first n_early predicted experts of the layer (slot PRED, not pinned) copied into the early
 * buffer (slot r of each matrix's region in the parity's half) on the early stream; their ids into slot EARLY (the
 * rest -1). The halves alternate by layer, so a copy never lands where the layer before may still be reading.
 * Returns how many were copied (their ids in ids[]); ids of an earlier token stay out (EARLY_READY != seq). */
static int early_copy(le_model *m, int layer, int parity, int32_t *slot, const le_hybrid_early *early, int32_t *ids,
                      int *rc) {
    const int E = m->hp.n_embd, k = m->hp.n_expert_used, ne = m->hp.n_expert;
    const le_weight *w = m->layer[layer];
    const le_weight *mats[3] = {&w[LE_W_GATE_EXPS], &w[LE_W_UP_EXPS], &w[LE_W_DOWN_EXPS]};
    int n = 0;
    for (int r = 0; r < LE_HY_PRED_MAX && n < early->n_early; r++) {
        const int32_t id = __atomic_load_n(&slot[LE_HY_PRED(E, k) + r], __ATOMIC_RELAXED);
        if (id < 0 || id >= ne) continue;
        int seen = 0;
        for (int a = 0; a < n; a++) seen |= ids[a] == id;
        if (!seen) ids[n++] = id;
    }
    for (int a = 0; a < LE_HY_EARLY_MAX; a++) slot[LE_HY_EARLY(E, k) + a] = a < n ? ids[a] : -1;
    for (int a = 0; a < n && !*rc; a++)
        for (int t = 0; t < 3 && !*rc; t++) {
            const int64_t eb = early->eb[(int64_t)layer * 3 + t];
            if (eb != mats[t]->nb2) {
                *rc = LE_FAIL(LE_ERR_INVALID_ARG, "le_hybrid_serve: layer %d's early staging holds %lld-byte experts, "
                              "the weights %lld", layer, (long long)eb, (long long)mats[t]->nb2);
                break;
            }
            const uint64_t dst = early->dst[(int64_t)layer * 3 + t] + (uint64_t)(parity * early->parity_stride + a * eb);
            *rc = le_gpu_copy_htod_async(dst, mats[t]->data + (int64_t)ids[a] * mats[t]->nb2, (size_t)eb,
                                         (le_gpu_stream *)early->stream);
        }
    return n;
}

static int32_t *slot_of(const le_model *m, int32_t *chan, int layer) {
    const int E = m->hp.n_embd, k = m->hp.n_expert_used;
    return chan + LE_HY_HEADER + (int64_t)layer * LE_HY_SLOT_WORDS(E, k);
}

static int check_layers(const le_model *m, int32_t *chan, const int32_t *layers, int n_layers, const char *what) {
    if (!m || !chan || (!layers && n_layers)) return LE_FAIL(LE_ERR_INVALID_ARG, "%s: a NULL argument", what);
    if (!m->hp.n_expert) return LE_FAIL(LE_ERR_INVALID_ARG, "%s: the model has no experts", what);
    if (n_layers < 0 || n_layers > m->hp.n_layer) return LE_FAIL(LE_ERR_INVALID_ARG, "%s: %d layers", what, n_layers);
    for (int j = 0; j < n_layers; j++)
        if (layers[j] < 0 || layers[j] >= m->hp.n_layer)
            return LE_FAIL(LE_ERR_INVALID_ARG, "%s: layer %d outside [0, %d)", what, layers[j], m->hp.n_layer);
    return LE_OK;
}

static void release(const le_model *m, int32_t *chan, int32_t seq, const int32_t *layers, int n_layers) {
    const int E = m->hp.n_embd, k = m->hp.n_expert_used;
    for (int j = 0; j < n_layers; j++) {
        int32_t *slot = slot_of(m, chan, layers[j]);
        memset(slot + LE_HY_ROW(E, k), 0, (size_t)E * sizeof(float));
        __atomic_store_n(&slot[LE_HY_DONE], seq, __ATOMIC_RELEASE);
    }
}

int le_hybrid_release(le_model *m, int32_t *chan, int32_t seq, const int32_t *layers, int n_layers) {
    int rc = check_layers(m, chan, layers, n_layers, "le_hybrid_release");
    if (rc) return rc;
    release(m, chan, seq, layers, n_layers);
    return LE_OK;
}

static int serve_layers(le_model *m, int32_t *chan, int32_t seq, const int32_t *layers, int n_layers,
                        int64_t *counts, double timeout_s, int64_t prefetch_bytes, const le_hybrid_early *early,
                        double *stats);

/* serve_layers with denormals flushed on the calling thread too, as the CPU engine's forward (le_threads.h) */
int le_hybrid_serve(le_model *m, int32_t *chan, int32_t seq, const int32_t *layers, int n_layers,
                    int64_t *counts, double timeout_s, int64_t prefetch_bytes, const le_hybrid_early *early,
                    double *stats) {
    unsigned fp = le_fp_enter();
    int rc = serve_layers(m, chan, seq, layers, n_layers, counts, timeout_s, prefetch_bytes, early, stats);
    le_fp_leave(fp);
    return rc;
}

static int serve_layers(le_model *m, int32_t *chan, int32_t seq, const int32_t *layers, int n_layers,
                        int64_t *counts, double timeout_s, int64_t prefetch_bytes, const le_hybrid_early *early,
                        double *stats) {
    int rc = check_layers(m, chan, layers, n_layers, "le_hybrid_serve");
    if (rc) return rc;
    if (!(timeout_s > 0)) return LE_FAIL(LE_ERR_INVALID_ARG, "le_hybrid_serve: timeout %g s", timeout_s);
    const int E = m->hp.n_embd, k = m->hp.n_expert_used, ne = m->hp.n_expert;
    if (early && early->n_early > 0 && (early->n_early > LE_HY_EARLY_MAX || !early->dst || !early->eb))
        return LE_FAIL(LE_ERR_INVALID_ARG, "le_hybrid_serve: %d early experts (1..%d, with their staging)",
                       early->n_early, LE_HY_EARLY_MAX);
    double acc[LE_HY_STATS] = {0}; /* this call's stats, added to `stats` at the end */
    int32_t e_ids[LE_HY_EARLY_MAX];
    int32_t aimed[LE_HY_PRED_MAX];
    int n_aimed = 0; /* experts of layers[j] prefetched (aimed at) after layer j - 1 */
    int j = 0;
    for (; j < n_layers; j++) {
        const int layer = layers[j];
        int32_t *slot = slot_of(m, chan, layer);
        int n_early = 0, pending = 0; /* early copies of this layer, still in flight */
        const int use_early = early && early->n_early > 0;
        /* this layer's prediction is out (the GPU published it during the layer before) */
        const int predicted = j && (use_early || prefetch_bytes > 0) &&
                              __atomic_load_n(&slot[LE_HY_PRED_READY(E, k)], __ATOMIC_ACQUIRE) == seq;
        if (predicted && use_early) {
            n_early = early_copy(m, layer, j % 2, slot, early, e_ids, &rc);
            if (rc) break;
            pending = n_early > 0;
            acc[LE_HY_STAT_E_COPIED] += n_early;
        }
        if (predicted && prefetch_bytes > 0) {
            const double tp = now_s();
            const int n_link = __atomic_load_n(&chan[LE_HY_N_LINK], __ATOMIC_RELAXED);
            n_aimed = prefetch_predicted(m, layer, slot, seq, n_link, prefetch_bytes, aimed,
                                         &acc[LE_HY_STAT_PF_BYTES]);
            acc[LE_HY_STAT_PF_S] += now_s() - tp;
            acc[LE_HY_STAT_PF_AIMED] += n_aimed;
        } else {
            n_aimed = 0;
        }
        const double t0 = now_s();
        const double spin_s = 1e-9 * (double)le_pool_spin_ns(m->pool);
        int sleeping = 0;
        for (unsigned spins = 0; __atomic_load_n(&slot[LE_HY_READY], __ATOMIC_ACQUIRE) != seq; spins++) {
            if (pending) { /* the copies done: the GPU may use them (if its publish has not run yet) */
                int done = 0;
                if ((rc = le_gpu_stream_query((le_gpu_stream *)early->stream, &done))) break;
                if (done) {
                    __atomic_store_n(&slot[LE_HY_EARLY_READY(E, k)], seq, __ATOMIC_RELEASE);
                    pending = 0;
                    acc[LE_HY_STAT_E_READY] += n_early;
                }
            }
            backoff_step(t0, spin_s, spins, &sleeping, acc);
            if ((spins & 1023) == 1023 && now_s() - t0 > timeout_s) {
                rc = LE_FAIL(LE_ERR_TIMEOUT, "le_hybrid_serve: layer %d's routing did not arrive in %g s (token %d)",
                             layer, timeout_s, (int)seq);
                break;
            }
        }
        if (rc) break;
        const double t1 = now_s();
        acc[LE_HY_STAT_WAIT_S] += t1 - t0;
        const int32_t *ids = slot + LE_HY_IDS(E), *cpu_ids = slot + LE_HY_CPU_IDS(E, k);
        int n_cpu = 0;
        for (int s = 0; s < k; s++) {
            if (ids[s] < 0 || ids[s] >= ne || cpu_ids[s] >= ne || (cpu_ids[s] >= 0 && cpu_ids[s] != ids[s])) {
                rc = LE_FAIL(LE_ERR_FORMAT, "le_hybrid_serve: layer %d slot %d: expert id %d / %d outside [0, %d)",
                             layer, s, (int)ids[s], (int)cpu_ids[s], ne);
                break;
            }
            n_cpu += cpu_ids[s] >= 0;
            for (int a = 0; a < n_aimed && cpu_ids[s] >= 0; a++) acc[LE_HY_STAT_PF_HITS] += aimed[a] == cpu_ids[s];
            for (int a = 0; a < n_early; a++) acc[LE_HY_STAT_E_HITS] += e_ids[a] == ids[s];
            if (counts) counts[(int64_t)layer * ne + ids[s]]++;
        }
        if (rc) break;
        float *row = (float *)(slot + LE_HY_ROW(E, k));
        if (n_cpu) {
            double lag0, tail0, lag1, tail1;
            le_pool_each_totals(m->pool, &lag0, &tail0);
            rc = le_moe_routed(m, layer, (const float *)(slot + LE_HY_H), k, cpu_ids,
                               (const float *)(slot + LE_HY_WTS(E, k)), row);
            if (rc) break;
            le_pool_each_totals(m->pool, &lag1, &tail1);
            acc[LE_HY_STAT_SPLIT_LAG] += lag1 - lag0;
            acc[LE_HY_STAT_SPLIT_TAIL] += tail1 - tail0;
        } else {
            memset(row, 0, (size_t)E * sizeof(float));
        }
        __atomic_store_n(&slot[LE_HY_DONE], seq, __ATOMIC_RELEASE);
        acc[LE_HY_STAT_CPU_S] += now_s() - t1;
        acc[LE_HY_STAT_EXPERTS] += n_cpu;
    }
    if (rc) release(m, chan, seq, layers + j, n_layers - j);
    if (stats) {
        acc[LE_HY_STAT_LAYERS] = j;
        for (int i = 0; i < LE_HY_STATS; i++) stats[i] += acc[i];
    }
    return rc;
}
