/* le_threads.h — a small persistent thread pool (internal; not fed to cffi).
 *
 * le_parallel_for splits [0, n) into chunks of `grain` items that the workers and the
 * calling thread take from a shared atomic counter (so no thread idles while another
 * has a long tail), and returns when all chunks are done. Workers spin briefly on a new
 * job, then sleep on a futex; a worker that comes after the caller has run out of chunks
 * is not waited for (threads.c). `thread` passed to fn is 0..n_threads-1 (the caller is
 * 0), for per-thread scratch buffers. */
#ifndef LE_THREADS_H
#define LE_THREADS_H

#include <stdint.h>

#include "le_model.h" /* le_pool_stats */

typedef void (*le_task_fn)(void *ctx, int64_t begin, int64_t end, int thread);

/* The C core's work runs with denormal floats flushed to zero (MXCSR FTZ | DAZ): the pool's workers from their start,
 * the calling thread inside le_parallel_for / le_parallel_each and the forward, hybrid and vision entry points, its
 * mode put back after (numpy's, in the same thread, is not changed). why: the chunked GDN's decays e^(G_i - G_j)
 * over 64 tokens reach 1e-38 and below, and each multiply by a denormal costs ~100 cycles: it was two thirds of the
 * GDN's prefill time (benchmarks/results/denormals_2026-11-28.md). Values under 1.2e-38 change nothing a tolerance
 * sees; every thread runs the same mode, so no bit depends on which thread ran a task. */
#if defined(__SSE2__) || defined(__x86_64__)
#include <xmmintrin.h>
#define LE_FP_FLUSH 0x8040u /* FTZ (bit 15) | DAZ (bit 6) */
static inline unsigned le_fp_enter(void) {
    unsigned old = _mm_getcsr();
    _mm_setcsr(old | LE_FP_FLUSH);
    return old;
}
static inline void le_fp_leave(unsigned old) { _mm_setcsr(old); }
#else
static inline unsigned le_fp_enter(void) { return 0; }
static inline void le_fp_leave(unsigned old) { (void)old; }
#endif

typedef struct le_pool le_pool;

int le_pool_create(int n_threads, le_pool **out);
void le_pool_free(le_pool *p);
int le_pool_threads(const le_pool *p);
/* Pins worker i (1..n_threads-1) to cpus[i % n_cpus]; the caller's thread is not pinned. */
int le_pool_pin(le_pool *p, const int *cpus, int n_cpus);
/* The CPU a thread of the pool is pinned to, or -1. */
int le_pool_pinned_cpu(const le_pool *p, int thread);
/* The spin budget of a waiting thread before it sleeps, ns (LE_SPIN_US at creation; the hybrid decode's poll uses it
 * too). */
long le_pool_spin_ns(const le_pool *p);
/* Test hook (le_model_pool_hold): hold 1, the worker joins no job; 2, it sleeps 20 ms inside each job it joins. */
int le_pool_hold(le_pool *p, int thread, int hold);
void le_pool_get_stats(const le_pool *p, le_pool_stats *out);
void le_parallel_for(le_pool *p, int64_t n, int64_t grain, le_task_fn fn, void *ctx);
/* The per-row work of a pass of n rows (norms, rope, routing: rows independent, so the split changes no bit):
 * le_parallel_for in chunks of LE_ROWS_GRAIN rows from LE_ROWS_PAR_MIN rows, on the calling thread below (a decode
 * step's few rows cost less than a job). */
#define LE_ROWS_PAR_MIN 32
#define LE_ROWS_GRAIN 8
void le_parallel_rows(le_pool *p, int64_t n, le_task_fn fn, void *ctx);
/* fn(ctx, t, t + 1, thread) runs once for every t = 0..n_threads-1, on thread t (the caller is 0), or, where
 * thread t is late, on another one (`thread` names whose scratch to use): a static split,
 * where a thread must later find in its own caches what it read before (the hybrid decode's lookahead: each thread
 * prefetches the rows of the predicted experts it will compute). */
void le_parallel_each(le_pool *p, le_task_fn fn, void *ctx);
/* Seconds summed over every le_parallel_each job so far: lag, from the job's publication to the last thread's start
 * (a thread asleep or descheduled); tail, how far the slowest thread's end was past the threads' mean end (the
 * static split's cost when one thread is slower). 0 without a pool of several threads. */
void le_pool_each_totals(const le_pool *p, double *lag_s, double *tail_s);

/* Thread t's share [*r0, *r1) of n items split over n_threads in order (the rule of every static split). */
static inline void le_split(int64_t n, int t, int n_threads, int64_t *r0, int64_t *r1) {
    *r0 = n * t / n_threads;
    *r1 = n * (t + 1) / n_threads;
}

#endif
