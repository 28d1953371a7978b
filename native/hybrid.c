/* hybrid.c — the CPU's half of the hybrid decode: serves each MoE layer's unpinned experts through the channel
 * of le_hybrid.h, which the GPU's kernels (cuda8/hybrid_sync.cu) read and write directly.
 *
 * Per layer: spin on READY (a load-acquire; the GPU fenced its writes before setting it), run the experts with
 * le_moe_routed on the thread pool (its workers spin between jobs, so a layer costs no wake-up), write ROW, then
 * DONE with a store-release. The caller's thread spins: the gap between layers is the GPU's ~50-100 µs of
 * attention and routing, shorter than any sleep's wake-up.
 * Reference: the host steps this replaces (gpu_model._hybrid_read/_hybrid_cpu before 2026-11-25e): the same
 * le_moe_routed call on the same ids and weights.
 * Test: tests/test_hybrid_serve.py (a Python thread plays the GPU), tests/test_gpu_model.py (hybrid vs CPU). */
#include <string.h>
#include <time.h>

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

int le_hybrid_serve(le_model *m, int32_t *chan, int32_t seq, const int32_t *layers, int n_layers,
                    int64_t *counts, double timeout_s, double *stats) {
    int rc = check_layers(m, chan, layers, n_layers, "le_hybrid_serve");
    if (rc) return rc;
    if (!(timeout_s > 0)) return LE_FAIL(LE_ERR_INVALID_ARG, "le_hybrid_serve: timeout %g s", timeout_s);
    const int E = m->hp.n_embd, k = m->hp.n_expert_used, ne = m->hp.n_expert;
    double wait_s = 0, cpu_s = 0, n_exp = 0;
    int j = 0;
    for (; j < n_layers; j++) {
        const int layer = layers[j];
        int32_t *slot = slot_of(m, chan, layer);
        const double t0 = now_s();
        for (unsigned spins = 0; __atomic_load_n(&slot[LE_HY_READY], __ATOMIC_ACQUIRE) != seq; spins++) {
            cpu_relax();
            if ((spins & 1023) == 1023 && now_s() - t0 > timeout_s) {
                rc = LE_FAIL(LE_ERR_TIMEOUT, "le_hybrid_serve: layer %d's routing did not arrive in %g s (token %d)",
                             layer, timeout_s, (int)seq);
                break;
            }
        }
        if (rc) break;
        const double t1 = now_s();
        wait_s += t1 - t0;
        const int32_t *ids = slot + LE_HY_IDS(E), *cpu_ids = slot + LE_HY_CPU_IDS(E, k);
        int n_cpu = 0;
        for (int s = 0; s < k; s++) {
            if (ids[s] < 0 || ids[s] >= ne || cpu_ids[s] >= ne || (cpu_ids[s] >= 0 && cpu_ids[s] != ids[s])) {
                rc = LE_FAIL(LE_ERR_FORMAT, "le_hybrid_serve: layer %d slot %d: expert id %d / %d outside [0, %d)",
                             layer, s, (int)ids[s], (int)cpu_ids[s], ne);
                break;
            }
            n_cpu += cpu_ids[s] >= 0;
            if (counts) counts[(int64_t)layer * ne + ids[s]]++;
        }
        if (rc) break;
        float *row = (float *)(slot + LE_HY_ROW(E, k));
        if (n_cpu) {
            rc = le_moe_routed(m, layer, (const float *)(slot + LE_HY_H), k, cpu_ids,
                               (const float *)(slot + LE_HY_WTS(E, k)), row);
            if (rc) break;
        } else {
            memset(row, 0, (size_t)E * sizeof(float));
        }
        __atomic_store_n(&slot[LE_HY_DONE], seq, __ATOMIC_RELEASE);
        cpu_s += now_s() - t1;
        n_exp += n_cpu;
    }
    if (rc) release(m, chan, seq, layers + j, n_layers - j);
    if (stats) {
        stats[0] += wait_s;
        stats[1] += cpu_s;
        stats[2] += n_exp;
        stats[3] += j;
    }
    return rc;
}
