/* threads.c — the persistent thread pool of le_threads.h.
 *
 * One job at a time: the caller publishes (fn, ctx, n, grain), opens the job for joining and bumps
 * `generation`, then works on chunks itself. Workers notice the new generation, join the job (a CAS on `entry`:
 * the generation in the high half, the joiners counted in the low half), take chunks with an atomic fetch-add and
 * count themselves out on `finished`. When the caller runs out of chunks it closes the job (no more joiners) and
 * waits only for the workers that joined: a worker that the scheduler did not run in time (the machine is busy
 * with other work, or it was asleep) finds the job closed and is not waited for. Before this rule the caller
 * waited for every worker, so one descheduled worker cost every job a time slice (issue 21: 351 -> 6 tok/s on a
 * 2-core box with other work on the cores).
 * le_parallel_each (every thread its own index): each index is claimed once (a CAS of the generation into
 * each_claim[t]); a thread done with its own share runs the shares nobody has claimed yet, so a late worker's
 * share is run by another thread instead of waited for (same split, same bits).
 *
 * Waiting, on both sides (a worker for the next job, the caller for the workers still in a job): spin (cpu_relax)
 * for a budget, then sleep on the word with FUTEX_WAIT (private futex); the other side wakes the sleepers (a flag or
 * counter says whether any sleep, so a job between spinning threads costs no system call). A worker's budget is
 * spin_ns (LE_SPIN_US, default 1 ms: a decode step's jobs follow each other within microseconds, so the workers stay
 * awake across a token); the caller's is at most CALLER_SPIN_NS: a worker still inside a chunk after that has likely
 * lost its CPU to other work, and the caller's CPU, once it sleeps, is where the scheduler can run that worker.
 * While spinning, a thread yields its CPU (sched_yield) only to a thread of the pool that has work on the same CPU
 * (shares_cpu: the caller, for a waiting worker; a worker inside the job, for the waiting caller): with other work
 * on the machine the scheduler may put two of the pool's threads on one CPU, and a spinner there takes the time of
 * the thread it waits for. Never to other work: a yield on a CPU shared with a CPU-bound process hands it the CPU
 * until its next tick (1-4 ms), while a sleeper woken by the futex preempts it at once. Measured (`bench shared`,
 * tiny model, 2 CPUs, 2 threads over 1): one CPU busy, never yielding 0.59x, yielding in every spin 1.05x, this
 * rule 0.98x; both busy 1.84x, 1.36x, 1.90x (benchmarks/results/shared_cpu_2026-11-26.md).
 * The shared counters live on separate cache lines so that claiming chunks does not bounce the job description.
 * le_pool_pin pins each worker to one CPU (the caller thread is left alone: it belongs to the application); the
 * Python side pins only where no other work runs (legacy_engine/model.py pin_decision).
 * Reference: the pool before 2026-11-26 (git history): the caller waited for every worker. Tests:
 * tests/test_threads.py (a held worker, le_pool_hold, stands for a descheduled one; futex sleeps read back from
 * /proc). */
#define _GNU_SOURCE
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "le_internal.h"
#include "le_ops.h"
#include "le_threads.h"

#define SPIN_US_DEFAULT 1000    /* how long a waiting worker spins before it sleeps */
#define CALLER_SPIN_NS 100000L  /* the caller's budget waiting for workers inside a job (see above) */
#define LINE 64
#define HELD_SLEEP_NS 20000000L /* le_pool_hold 2: a worker that lost its CPU inside a job, for 20 ms */
#define CLOSED (1ULL << 31)  /* entry: the caller is done with the job's chunks, no more joiners */
#define JOINED_MASK (CLOSED - 1)

/* One thread's counters (le_pool_stats), each thread writing only its own line. */
typedef struct {
    _Alignas(LINE) int64_t joined, missed, sleeps, yields, stolen;
    atomic_int cpu;  /* the CPU the thread runs on while it has work: the caller from each publication, a worker
                      * from its join to its end of the job; -1 otherwise (shares_cpu) */
    atomic_int held; /* test hook (le_pool_hold): 1 the worker joins no job, 2 it sleeps HELD_SLEEP_NS once in */
} thread_stats;

struct le_pool {
    int n_threads;                 /* including the caller */
    pthread_t *workers;            /* n_threads - 1 */
    long spin_ns;
    int *pinned_cpu;               /* [n_threads]: the CPU each worker is pinned to, -1 none */
    thread_stats *st;              /* [n_threads] */
    long *each_start, *each_end;   /* [n_threads]: when each index of the last each-job began and ended */
    atomic_uint *each_claim;       /* [n_threads]: the generation that claimed each index */
    long each_pub;                 /* when the last each-job was published */
    double each_lag, each_tail;    /* seconds summed over each-jobs (le_pool_each_totals) */
    int64_t jobs, caller_sleeps;   /* written by the caller only */
    /* the current job (written by the caller before `generation` is bumped) */
    le_task_fn fn;
    void *ctx;
    int64_t n, grain;
    int each;                      /* 1: le_parallel_each (every index runs once) */
    _Alignas(LINE) atomic_uint generation;  /* bumped once per job; the workers' futex word */
    _Alignas(LINE) atomic_ullong entry;     /* generation << 32 | CLOSED? | workers joined */
    _Alignas(LINE) atomic_uint finished;    /* joined workers done with the job; the caller's futex word */
    _Alignas(LINE) atomic_llong next;       /* next unclaimed item */
    _Alignas(LINE) atomic_int sleepers;     /* workers asleep (or about to) on `generation` */
    atomic_int caller_waits;                /* 1 while the caller sleeps (or is about to) on `finished` */
    atomic_int stop;
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

#ifdef __linux__
/* Sleeps while *word == expected (returns at once if it differs: the kernel compares under its lock). */
static void futex_wait(atomic_uint *word, unsigned expected) {
    syscall(SYS_futex, (unsigned *)word, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}
static void futex_wake(atomic_uint *word, int n) {
    syscall(SYS_futex, (unsigned *)word, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
}
#else /* no futex: a short sleep stands for the wait, the wake is a no-op */
static void futex_wait(atomic_uint *word, unsigned expected) {
    struct timespec ts = {0, 50000};
    if (atomic_load(word) == expected) nanosleep(&ts, NULL);
}
static void futex_wake(atomic_uint *word, int n) {
    (void)word;
    (void)n;
}
#endif

static int this_cpu(void) {
#ifdef __linux__
    return sched_getcpu(); /* the vDSO / rseq: a few ns */
#else
    return -1;
#endif
}

/* Whether thread `self` shares its CPU with a thread of the pool that has work: for a worker, the caller; for the
 * caller, a worker inside the job. */
static int shares_cpu(le_pool *p, int self) {
    const int cpu = this_cpu();
    if (cpu < 0) return 0;
    if (self) return atomic_load_explicit(&p->st[0].cpu, memory_order_relaxed) == cpu;
    for (int t = 1; t < p->n_threads; t++)
        if (atomic_load_explicit(&p->st[t].cpu, memory_order_relaxed) == cpu) return 1;
    return 0;
}

/* Thread `self` spins until (*word == value) == until_equal or budget_ns has passed, yielding its CPU where a
 * thread of the pool with work shares it; returns the last value read. */
static unsigned spin_until(le_pool *p, int self, atomic_uint *word, unsigned value, int until_equal, long budget_ns) {
    long start = 0;
    for (unsigned i = 0;; i++) {
        unsigned v = atomic_load_explicit(word, memory_order_acquire);
        if ((v == value) == until_equal) return v;
        cpu_relax();
        if ((i & 255) == 255) {
            long t = now_ns();
            if (!start) start = t;
            else if (t - start > budget_ns) return v;
            if (shares_cpu(p, self)) {
                sched_yield();
                p->st[self].yields++;
            }
        }
    }
}

/* A worker's wait for a generation other than `seen`: spin, then sleep on the futex. */
static unsigned wait_generation(le_pool *p, int self, unsigned seen, thread_stats *st) {
    unsigned g = spin_until(p, self, &p->generation, seen, 0, p->spin_ns);
    while (g == seen && !atomic_load(&p->stop)) {
        atomic_fetch_add(&p->sleepers, 1); /* seq_cst: before the re-read (Dekker with run_job) */
        if (atomic_load(&p->generation) == seen) {
            st->sleeps++;
            futex_wait(&p->generation, seen);
        }
        atomic_fetch_sub(&p->sleepers, 1);
        g = atomic_load_explicit(&p->generation, memory_order_acquire);
    }
    return g;
}

/* Runs every index of the each-job that nobody has claimed yet, as thread `thread` (the stealer's scratch). */
static void run_unclaimed(le_pool *p, unsigned gen, int thread, int first) {
    for (int k = 0; k < p->n_threads; k++) {
        const int t = (first + k) % p->n_threads;
        unsigned c = atomic_load_explicit(&p->each_claim[t], memory_order_relaxed);
        if (c == gen || !atomic_compare_exchange_strong(&p->each_claim[t], &c, gen)) continue;
        p->each_start[t] = now_ns();
        p->fn(p->ctx, t, t + 1, thread);
        p->each_end[t] = now_ns();
        if (t != thread) p->st[thread].stolen++;
    }
}

static void run_chunks(le_pool *p, unsigned gen, int thread) {
    if (p->each) {
        run_unclaimed(p, gen, thread, thread); /* its own index first, then the unclaimed ones */
        return;
    }
    for (;;) {
        int64_t begin = atomic_fetch_add_explicit(&p->next, p->grain, memory_order_relaxed);
        if (begin >= p->n) break;
        int64_t end = begin + p->grain < p->n ? begin + p->grain : p->n;
        p->fn(p->ctx, begin, end, thread);
    }
}

/* Joins job `gen` if the caller has not closed it; 0 when the worker is too late. */
static int join(le_pool *p, unsigned gen) {
    unsigned long long e = atomic_load_explicit(&p->entry, memory_order_acquire);
    for (;;) {
        if ((unsigned)(e >> 32) != gen || (e & CLOSED)) return 0;
        if (atomic_compare_exchange_weak_explicit(&p->entry, &e, e + 1, memory_order_acq_rel, memory_order_acquire))
            return 1;
    }
}

static void *worker_main(void *arg) {
    worker_arg *wa = arg;
    le_pool *p = wa->p;
    int index = wa->index;
    free(wa);
    thread_stats *st = &p->st[index];
    unsigned seen = 0;
    le_fp_enter(); /* for the thread's life (le_threads.h) */
    for (;;) {
        unsigned gen = wait_generation(p, index, seen, st);
        if (atomic_load(&p->stop)) return NULL;
        seen = gen;
        const int held = atomic_load_explicit(&st->held, memory_order_relaxed);
        if (held == 1 || !join(p, gen)) {
            st->missed++;
            continue;
        }
        st->joined++;
        atomic_store_explicit(&st->cpu, this_cpu(), memory_order_relaxed);
        if (held == 2) {
            const struct timespec ts = {0, HELD_SLEEP_NS};
            nanosleep(&ts, NULL);
        }
        run_chunks(p, gen, index);
        atomic_store_explicit(&st->cpu, -1, memory_order_relaxed);
        atomic_fetch_add(&p->finished, 1); /* seq_cst: before the caller_waits read (Dekker with run_job) */
        if (atomic_load(&p->caller_waits)) futex_wake(&p->finished, 1);
    }
}

int le_pool_create(int n_threads, le_pool **out) {
    *out = NULL;
    if (n_threads < 1 || n_threads > 1024)
        return LE_FAIL(LE_ERR_INVALID_ARG, "n_threads = %d, expected 1..1024", n_threads);
    le_pool *p = aligned_alloc(LINE, (sizeof *p + LINE - 1) / LINE * LINE);
    if (!p) return LE_FAIL(LE_ERR_NO_MEMORY, "thread pool");
    memset(p, 0, sizeof *p);
    p->n_threads = n_threads;
    const char *spin = getenv("LE_SPIN_US");
    long us = spin && *spin ? atol(spin) : SPIN_US_DEFAULT;
    p->spin_ns = (us < 0 ? 0 : us) * 1000L;
    atomic_init(&p->generation, 0);
    atomic_init(&p->entry, 0);
    atomic_init(&p->finished, 0);
    atomic_init(&p->next, 0);
    atomic_init(&p->sleepers, 0);
    atomic_init(&p->caller_waits, 0);
    atomic_init(&p->stop, 0);
    p->workers = calloc((size_t)n_threads, sizeof(pthread_t));
    p->pinned_cpu = malloc((size_t)n_threads * sizeof(int));
    p->st = aligned_alloc(LINE, (size_t)n_threads * sizeof(thread_stats));
    p->each_start = calloc((size_t)n_threads, sizeof(long));
    p->each_end = calloc((size_t)n_threads, sizeof(long));
    p->each_claim = calloc((size_t)n_threads, sizeof(atomic_uint));
    if (!p->workers || !p->pinned_cpu || !p->st || !p->each_start || !p->each_end || !p->each_claim) {
        p->n_threads = 1; /* no worker started */
        le_pool_free(p);
        return LE_FAIL(LE_ERR_NO_MEMORY, "thread pool");
    }
    memset(p->st, 0, (size_t)n_threads * sizeof(thread_stats));
    for (int i = 0; i < n_threads; i++) {
        p->pinned_cpu[i] = -1;
        atomic_init(&p->st[i].cpu, -1);
    }
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
    atomic_store(&p->stop, 1);
    atomic_fetch_add(&p->generation, 1);
    futex_wake(&p->generation, INT_MAX);
    for (int i = 1; i < p->n_threads; i++) pthread_join(p->workers[i - 1], NULL);
    free(p->workers);
    free(p->pinned_cpu);
    free(p->st);
    free(p->each_start);
    free(p->each_end);
    free(p->each_claim);
    free(p);
}

void le_pool_each_totals(const le_pool *p, double *lag_s, double *tail_s) {
    *lag_s = p ? p->each_lag : 0.0;
    *tail_s = p ? p->each_tail : 0.0;
}

int le_pool_threads(const le_pool *p) { return p ? p->n_threads : 1; }

long le_pool_spin_ns(const le_pool *p) { return p ? p->spin_ns : SPIN_US_DEFAULT * 1000L; }

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

int le_pool_hold(le_pool *p, int thread, int hold) {
    if (!p || thread < 1 || thread >= p->n_threads)
        return LE_FAIL(LE_ERR_INVALID_ARG, "le_pool_hold: thread %d, the pool's workers are 1..%d", thread,
                       p ? p->n_threads - 1 : 0);
    if (hold < 0 || hold > 2) return LE_FAIL(LE_ERR_INVALID_ARG, "le_pool_hold: hold = %d, expected 0..2", hold);
    atomic_store(&p->st[thread].held, hold);
    return LE_OK;
}

void le_pool_get_stats(const le_pool *p, le_pool_stats *out) {
    memset(out, 0, sizeof *out);
    out->spin_us = (double)le_pool_spin_ns(p) / 1e3;
    if (!p) return;
    out->jobs = p->jobs;
    out->caller_sleeps = p->caller_sleeps;
    for (int t = 0; t < p->n_threads; t++) { /* racy reads of counters other threads write: a snapshot */
        const thread_stats *st = &p->st[t];
        out->joined += __atomic_load_n(&st->joined, __ATOMIC_RELAXED);
        out->missed += __atomic_load_n(&st->missed, __ATOMIC_RELAXED);
        out->worker_sleeps += __atomic_load_n(&st->sleeps, __ATOMIC_RELAXED);
        out->yields += __atomic_load_n(&st->yields, __ATOMIC_RELAXED);
        out->stolen += __atomic_load_n(&st->stolen, __ATOMIC_RELAXED);
    }
}

/* le_model's entry points to its pool (le_model.h): here, beside the pool they read */
int le_model_pool_stats(const le_model *m, le_pool_stats *out) {
    if (!m || !out) return LE_FAIL(LE_ERR_INVALID_ARG, "le_model_pool_stats: a NULL argument");
    le_pool_get_stats(m->pool, out);
    return LE_OK;
}

int le_model_pool_hold(le_model *m, int thread, int hold) {
    if (!m) return LE_FAIL(LE_ERR_INVALID_ARG, "le_model_pool_hold: NULL model");
    return le_pool_hold(m->pool, thread, hold);
}

static void run_job(le_pool *p, int64_t n, int64_t grain, le_task_fn fn, void *ctx, int each);

int le_fp_flushes(void) {
#ifdef LE_FP_FLUSH
    return 1;
#else
    return 0;
#endif
}

void le_parallel_for(le_pool *p, int64_t n, int64_t grain, le_task_fn fn, void *ctx) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    unsigned fp = le_fp_enter();
    if (!p || p->n_threads == 1 || n <= grain) fn(ctx, 0, n, 0);
    else run_job(p, n, grain, fn, ctx, 0);
    le_fp_leave(fp);
}

void le_parallel_rows(le_pool *p, int64_t n, le_task_fn fn, void *ctx) {
    le_parallel_for(p, n, n < LE_ROWS_PAR_MIN ? n : LE_ROWS_GRAIN, fn, ctx); /* grain n: inline, one chunk */
}

void le_parallel_each(le_pool *p, le_task_fn fn, void *ctx) {
    unsigned fp = le_fp_enter();
    if (!p || p->n_threads == 1) {
        fn(ctx, 0, 1, 0);
        le_fp_leave(fp);
        return;
    }
    p->each_pub = now_ns();
    run_job(p, p->n_threads, 1, fn, ctx, 1);
    le_fp_leave(fp);
    /* every index is done (run_job waited): how late the last one started, how far the slowest ran past the mean
     * end */
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

/* The caller's wait until the `joined` workers that joined the closed job have finished it. */
static void wait_finished(le_pool *p, unsigned joined) {
    if (atomic_load_explicit(&p->finished, memory_order_acquire) == joined) return;
    unsigned f = spin_until(p, 0, &p->finished, joined, 1, p->spin_ns < CALLER_SPIN_NS ? p->spin_ns : CALLER_SPIN_NS);
    while (f != joined) {
        atomic_store(&p->caller_waits, 1); /* seq_cst: before the re-read (Dekker with worker_main) */
        if ((f = atomic_load(&p->finished)) != joined) {
            p->caller_sleeps++;
            futex_wait(&p->finished, f);
        }
        atomic_store(&p->caller_waits, 0);
        f = atomic_load_explicit(&p->finished, memory_order_acquire);
    }
}

static void run_job(le_pool *p, int64_t n, int64_t grain, le_task_fn fn, void *ctx, int each) {
    /* every worker that joined the last job has finished it (wait_finished): the job description is free */
    const unsigned gen = atomic_load_explicit(&p->generation, memory_order_relaxed) + 1;
    p->each = each;
    p->fn = fn;
    p->ctx = ctx;
    p->n = n;
    p->grain = grain;
    p->jobs++;
    atomic_store_explicit(&p->st[0].cpu, this_cpu(), memory_order_relaxed);
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
    atomic_store_explicit(&p->finished, 0, memory_order_relaxed);
    atomic_store_explicit(&p->entry, (unsigned long long)gen << 32, memory_order_release); /* open */
    atomic_store(&p->generation, gen); /* seq_cst: ordered before the sleepers load (Dekker) */
    if (atomic_load(&p->sleepers) > 0) futex_wake(&p->generation, INT_MAX);
    run_chunks(p, gen, 0);
    /* no chunk (no index) is left unclaimed: close the job; only those who joined can still be in it */
    const unsigned long long e = atomic_fetch_or(&p->entry, CLOSED);
    wait_finished(p, (unsigned)(e & JOINED_MASK));
}
