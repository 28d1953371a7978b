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

#endif
