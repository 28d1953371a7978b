/* threads.c — the persistent thread pool of le_threads.h.
 *
 * One job at a time: the caller publishes (fn, ctx, n, grain), bumps `generation`,
 * and works on chunks itself; workers notice the new generation (spinning for up to
 * LE_SPIN_US, default 1 ms, then sleeping on `wake`), take chunks with an atomic
 * fetch-add, and count themselves out. The caller waits until every worker has
 * finished the job. A decode step issues a few hundred jobs back to back with short
 * serial work between them, so the spin keeps workers awake across a whole token and a
 * job costs a cache-line handoff, not a futex wake-up. The shared counters live on
 * separate cache lines so that claiming chunks does not bounce the job description.
 * le_pool_pin pins each worker to one CPU (the caller thread is left alone: it belongs
 * to the application). */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "le_internal.h"
#include "le_threads.h"

#define SPIN_US_DEFAULT 1000 /* how long an idle worker spins before it sleeps */
#define LINE 64

struct le_pool {
    int n_threads;                 /* including the caller */
    pthread_t *workers;            /* n_threads - 1 */
    pthread_mutex_t mu;
    pthread_cond_t wake, done;
    int stop;
    long spin_ns;
    int *pinned_cpu;               /* [n_threads]: the CPU each worker is pinned to, -1 none */
    long *each_start, *each_end;   /* [n_threads]: when each thread began and ended its share of the last each-job */
    long each_pub;                 /* when the last each-job was published */
    double each_lag, each_tail;    /* seconds summed over each-jobs (le_pool_each_totals) */
    /* the current job (written by the caller before `generation` is bumped) */
    le_task_fn fn;
    void *ctx;
    int64_t n, grain;
    int each;                      /* 1: le_parallel_each (every thread runs its own index once) */
    _Alignas(LINE) atomic_uint generation; /* bumped once per job */
    _Alignas(LINE) atomic_int busy;        /* workers still inside the current job */
    _Alignas(LINE) atomic_llong next;      /* next unclaimed item */
    _Alignas(LINE) atomic_int sleepers;    /* workers blocked on `wake` */
};

typedef struct {
    le_pool *p;
    int index;
} worker_arg;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void run_chunks(le_pool *p, int thread) {
    if (p->each) {
        p->each_start[thread] = now_ns();
        p->fn(p->ctx, thread, thread + 1, thread);
        p->each_end[thread] = now_ns();
        return;
    }
    for (;;) {
        int64_t begin = atomic_fetch_add_explicit(&p->next, p->grain, memory_order_relaxed);
        if (begin >= p->n) break;
        int64_t end = begin + p->grain < p->n ? begin + p->grain : p->n;
        p->fn(p->ctx, begin, end, thread);
    }
}

/* Spins until *word != seen or spin_ns passed; returns the last value read. */
static unsigned spin_while_equal(const le_pool *p, atomic_uint *word, unsigned seen) {
    long deadline = 0;
    for (unsigned i = 0;; i++) {
        unsigned v = atomic_load_explicit(word, memory_order_acquire);
        if (v != seen) return v;
        cpu_relax();
        if ((i & 255) == 255) {
            long t = now_ns();
            if (!deadline) deadline = t + p->spin_ns;
            else if (t > deadline) return v;
        }
    }
}

static void *worker_main(void *arg) {
    worker_arg *wa = arg;
    le_pool *p = wa->p;
    int index = wa->index;
    free(wa);
    unsigned seen = 0;
    for (;;) {
        unsigned gen = spin_while_equal(p, &p->generation, seen);
        if (gen == seen) {
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->sleepers, 1);
            while ((gen = atomic_load(&p->generation)) == seen && !p->stop) pthread_cond_wait(&p->wake, &p->mu);
            atomic_fetch_sub(&p->sleepers, 1);
            int stop = p->stop;
            pthread_mutex_unlock(&p->mu);
            if (stop) return NULL;
        }
        seen = gen;
        run_chunks(p, index);
        if (atomic_fetch_sub_explicit(&p->busy, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
    }
}

int le_pool_create(int n_threads, le_pool **out) {
    *out = NULL;
    if (n_threads < 1 || n_threads > 1024) return LE_FAIL(LE_ERR_INVALID_ARG, "n_threads = %d, expected 1..1024", n_threads);
    le_pool *p = aligned_alloc(LINE, (sizeof *p + LINE - 1) / LINE * LINE);
    if (!p) return LE_FAIL(LE_ERR_NO_MEMORY, "thread pool");
    memset(p, 0, sizeof *p);
    p->n_threads = n_threads;
    const char *spin = getenv("LE_SPIN_US");
    long us = spin && *spin ? atol(spin) : SPIN_US_DEFAULT;
    p->spin_ns = (us < 0 ? 0 : us) * 1000L;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    atomic_init(&p->generation, 0);
    atomic_init(&p->busy, 0);
    atomic_init(&p->next, 0);
    atomic_init(&p->sleepers, 0);
    p->workers = calloc((size_t)n_threads, sizeof(pthread_t));
    p->pinned_cpu = malloc((size_t)n_threads * sizeof(int));
    p->each_start = calloc((size_t)n_threads, sizeof(long));
    p->each_end = calloc((size_t)n_threads, sizeof(long));
    if (!p->workers || !p->pinned_cpu || !p->each_start || !p->each_end) {
        free(p->workers);
        free(p->pinned_cpu);
        free(p->each_start);
        free(p->each_end);
        free(p);
        return LE_FAIL(LE_ERR_NO_MEMORY, "thread pool");
    }
    for (int i = 0; i < n_threads; i++) p->pinned_cpu[i] = -1;
    for (int i = 1; i < n_threads; i++) {
        worker_arg *wa = malloc(sizeof *wa);
        if (wa) {
            wa->p = p;
            wa->index = i;
        }
        if (!wa || pthread_create(&p->workers[i - 1], NULL, worker_main, wa) != 0) {
            free(wa);
            p->n_threads = i; /* the ones started so far */
            le_pool_free(p);
            return LE_FAIL(LE_ERR_NO_MEMORY, "could not start worker thread %d", i);
        }
    }
    *out = p;
    return LE_OK;
}

void le_pool_free(le_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    atomic_fetch_add(&p->generation, 1);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n_threads; i++) pthread_join(p->workers[i - 1], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->wake);
    pthread_cond_destroy(&p->done);
    free(p->workers);
    free(p->pinned_cpu);
    free(p->each_start);
    free(p->each_end);
    free(p);
}

void le_pool_each_totals(const le_pool *p, double *lag_s, double *tail_s) {
    *lag_s = p ? p->each_lag : 0.0;
    *tail_s = p ? p->each_tail : 0.0;
}

int le_pool_threads(const le_pool *p) { return p ? p->n_threads : 1; }

int le_pool_pin(le_pool *p, const int *cpus, int n_cpus) {
    if (!p || !cpus || n_cpus < 1) return LE_FAIL(LE_ERR_INVALID_ARG, "no CPUs to pin to");
    /* worker i (1..n-1) gets cpus[i]; cpus[0] is left for the caller's thread */
    for (int i = 1; i < p->n_threads; i++) {
        int cpu = cpus[i % n_cpus];
        if (cpu < 0 || cpu >= CPU_SETSIZE) return LE_FAIL(LE_ERR_INVALID_ARG, "CPU %d out of range", cpu);
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpu, &set);
        int err = pthread_setaffinity_np(p->workers[i - 1], sizeof set, &set);
        if (err) return LE_FAIL(LE_ERR_INVALID_ARG, "pinning worker %d to CPU %d failed (error %d)", i, cpu, err);
        p->pinned_cpu[i] = cpu;
    }
    return LE_OK;
}

int le_pool_pinned_cpu(const le_pool *p, int thread) {
    return p && thread >= 0 && thread < p->n_threads ? p->pinned_cpu[thread] : -1;
}

static void run_job(le_pool *p, int64_t n, int64_t grain, le_task_fn fn, void *ctx, int each);

void le_parallel_for(le_pool *p, int64_t n, int64_t grain, le_task_fn fn, void *ctx) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    if (!p || p->n_threads == 1 || n <= grain) {
        fn(ctx, 0, n, 0);
        return;
    }
    run_job(p, n, grain, fn, ctx, 0);
}

void le_parallel_each(le_pool *p, le_task_fn fn, void *ctx) {
    if (!p || p->n_threads == 1) {
        fn(ctx, 0, 1, 0);
        return;
    }
    p->each_pub = now_ns();
    run_job(p, p->n_threads, 1, fn, ctx, 1);
    /* every thread's share is done (run_job waited): how late the last one started, how far the slowest ran past
     * the mean end */
    long last_start = p->each_start[0], last_end = p->each_end[0];
    double mean_end = 0;
    for (int t = 0; t < p->n_threads; t++) {
        last_start = p->each_start[t] > last_start ? p->each_start[t] : last_start;
        last_end = p->each_end[t] > last_end ? p->each_end[t] : last_end;
        mean_end += (double)(p->each_end[t] - p->each_pub) / p->n_threads;
    }
    p->each_lag += 1e-9 * (double)(last_start - p->each_pub);
    p->each_tail += 1e-9 * ((double)(last_end - p->each_pub) - mean_end);
}

static void run_job(le_pool *p, int64_t n, int64_t grain, le_task_fn fn, void *ctx, int each) {
    p->each = each;
    p->fn = fn;
    p->ctx = ctx;
    p->n = n;
    p->grain = grain;
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
    atomic_store_explicit(&p->busy, p->n_threads - 1, memory_order_relaxed);
    atomic_fetch_add(&p->generation, 1); /* seq_cst: ordered before the sleepers load (Dekker) */
    if (atomic_load(&p->sleepers) > 0) { /* someone went to sleep: wake them (spinners saw the bump) */
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->mu);
    }
    run_chunks(p, 0);
    if (atomic_load_explicit(&p->busy, memory_order_acquire) > 0) {
        long deadline = 0;
        for (unsigned i = 0; atomic_load_explicit(&p->busy, memory_order_acquire) > 0; i++) {
            cpu_relax();
            if ((i & 255) == 255) {
                long t = now_ns();
                if (!deadline) deadline = t + p->spin_ns;
                else if (t > deadline) break;
            }
        }
        if (atomic_load_explicit(&p->busy, memory_order_acquire) > 0) {
            pthread_mutex_lock(&p->mu);
            while (atomic_load(&p->busy) > 0) pthread_cond_wait(&p->done, &p->mu);
            pthread_mutex_unlock(&p->mu);
        }
    }
}
