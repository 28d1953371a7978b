/* le_threads.h — a small persistent thread pool (internal; not fed to cffi).
 *
 * le_parallel_for splits [0, n) into chunks of `grain` items that the workers and the
 * calling thread take from a shared atomic counter (so no thread idles while another
 * has a long tail), and returns when all chunks are done. Workers spin briefly on a new
 * job, then sleep on a condition variable. `thread` passed to fn is 0..n_threads-1 (the
 * caller is 0), for per-thread scratch buffers. */
#ifndef LE_THREADS_H
#define LE_THREADS_H

#include <stdint.h>

typedef void (*le_task_fn)(void *ctx, int64_t begin, int64_t end, int thread);

typedef struct le_pool le_pool;

int le_pool_create(int n_threads, le_pool **out);
void le_pool_free(le_pool *p);
int le_pool_threads(const le_pool *p);
/* Pins worker i (1..n_threads-1) to cpus[i % n_cpus]; the caller's thread is not pinned. */
int le_pool_pin(le_pool *p, const int *cpus, int n_cpus);
/* The CPU a thread of the pool is pinned to, or -1. */
int le_pool_pinned_cpu(const le_pool *p, int thread);
void le_parallel_for(le_pool *p, int64_t n, int64_t grain, le_task_fn fn, void *ctx);
/* Every thread of the pool runs fn(ctx, t, t + 1, t) once, t = 0..n_threads-1 (the caller is 0): a static split,
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
