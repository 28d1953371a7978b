/* threads.c — the persistent thread pool of le_threads.h.
 *
 * One job at a time: the caller publishes (fn, ctx, n, grain), bumps `generation`,
 * and works on chunks itself; workers notice the new generation (spinning for a
 * short while, then sleeping on `wake`), take chunks with an atomic fetch-add, and
 * count themselves out. The caller waits until every worker has finished the job. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "le_internal.h"
#include "le_threads.h"

#define SPIN_ITERS 20000 /* ~ tens of microseconds before a worker sleeps */

struct le_pool {
    int n_threads;                 /* including the caller */
    pthread_t *workers;            /* n_threads - 1 */
    pthread_mutex_t mu;
    pthread_cond_t wake, done;
    atomic_uint generation;        /* bumped once per job */
    atomic_int busy;               /* workers still inside the current job */
    atomic_llong next;             /* next unclaimed item */
    int stop;
    /* the current job */
    le_task_fn fn;
    void *ctx;
    int64_t n, grain;
};

typedef struct {
    le_pool *p;
    int index;
} worker_arg;

static void run_chunks(le_pool *p, int thread) {
    for (;;) {
        int64_t begin = atomic_fetch_add(&p->next, p->grain);
        if (begin >= p->n) break;
        int64_t end = begin + p->grain < p->n ? begin + p->grain : p->n;
        p->fn(p->ctx, begin, end, thread);
    }
}

static void *worker_main(void *arg) {
    worker_arg *wa = arg;
    le_pool *p = wa->p;
    int index = wa->index;
    free(wa);
    unsigned seen = 0;
    for (;;) {
        unsigned gen;
        int spins = 0;
        while ((gen = atomic_load(&p->generation)) == seen && spins < SPIN_ITERS) spins++;
        if (gen == seen) {
            pthread_mutex_lock(&p->mu);
            while ((gen = atomic_load(&p->generation)) == seen && !p->stop) pthread_cond_wait(&p->wake, &p->mu);
            int stop = p->stop;
            pthread_mutex_unlock(&p->mu);
            if (stop) return NULL;
        }
        seen = gen;
        run_chunks(p, index);
        if (atomic_fetch_sub(&p->busy, 1) == 1) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
    }
}

int le_pool_create(int n_threads, le_pool **out) {
    *out = NULL;
    if (n_threads < 1 || n_threads > 1024) return LE_FAIL(LE_ERR_INVALID_ARG, "n_threads = %d, expected 1..1024", n_threads);
    le_pool *p = calloc(1, sizeof *p);
    if (!p) return LE_FAIL(LE_ERR_NO_MEMORY, "thread pool");
    p->n_threads = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    atomic_init(&p->generation, 0);
    atomic_init(&p->busy, 0);
    atomic_init(&p->next, 0);
    p->workers = calloc((size_t)n_threads, sizeof(pthread_t));
    if (!p->workers) {
        free(p);
        return LE_FAIL(LE_ERR_NO_MEMORY, "thread pool");
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
    free(p);
}

int le_pool_threads(const le_pool *p) { return p ? p->n_threads : 1; }

void le_parallel_for(le_pool *p, int64_t n, int64_t grain, le_task_fn fn, void *ctx) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    if (!p || p->n_threads == 1 || n <= grain) {
        fn(ctx, 0, n, 0);
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    p->n = n;
    p->grain = grain;
    atomic_store(&p->next, 0);
    atomic_store(&p->busy, p->n_threads - 1);
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add(&p->generation, 1);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    run_chunks(p, 0);
    if (atomic_load(&p->busy) > 0) {
        int spins = 0;
        while (atomic_load(&p->busy) > 0 && spins < SPIN_ITERS) spins++;
        pthread_mutex_lock(&p->mu);
        while (atomic_load(&p->busy) > 0) pthread_cond_wait(&p->done, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
}
