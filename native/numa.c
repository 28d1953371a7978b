/* numa.c — NUMA topology through libnuma, loaded with dlopen so that the engine
 * builds and runs where libnuma is absent (then: one node, and `reason` says why).
 *
 * One loader (le_numa_lib_get) serves this file and memory.c (policies). Which library
 * it opens: le_numa_set_library's name, else $LE_NUMA_LIB, else libnuma.so.1 then
 * libnuma.so. A name that does not load is how tests simulate a machine without
 * libnuma; le_numa_set_library(NULL) goes back to the default. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "le_caps.h"
#include "le_internal.h"
#include "le_memory.h"
#include "le_numa.h"

/* ---- the loader ------------------------------------------------------------------------ */

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_state;              /* 0: not tried, 1: loaded, -1: failed (g_reason says why) */
static le_numa_lib g_lib;
static char g_reason[512];
static char g_override[200];     /* le_numa_set_library's name; empty: default */

/* dlsym of every entry point into L; the first one missing -> its name, else NULL. */
static const char *resolve(void *h, le_numa_lib *L) {
#define SYM(field, name)                                   \
    do {                                                   \
        *(void **)(&L->field) = dlsym(h, name);            \
        if (!L->field) return name;                        \
    } while (0)
    SYM(available, "numa_available");
    SYM(num_configured_nodes, "numa_num_configured_nodes");
    SYM(max_node, "numa_max_node");
    SYM(get_mems_allowed, "numa_get_mems_allowed");
    SYM(allocate_cpumask, "numa_allocate_cpumask");
    SYM(node_to_cpus, "numa_node_to_cpus");
    SYM(bitmask_isbitset, "numa_bitmask_isbitset");
    SYM(bitmask_nbytes, "numa_bitmask_nbytes");
    SYM(bitmask_free, "numa_bitmask_free");
    SYM(mbind, "mbind");
    SYM(get_mempolicy, "get_mempolicy");
    SYM(set_mempolicy, "set_mempolicy");
    SYM(move_pages, "move_pages");
#undef SYM
    return NULL;
}

/* Called with g_mu held. */
static void load_locked(void) {
    const char *env = getenv("LE_NUMA_LIB");
    const char *names[2] = {"libnuma.so.1", "libnuma.so"};
    int n_names = 2;
    const char *why = "";
    if (g_override[0]) {
        names[0] = g_override, n_names = 1, why = " (le_numa_set_library)";
    } else if (env && env[0]) {
        names[0] = env, n_names = 1, why = " ($LE_NUMA_LIB)";
    }
    void *h = NULL;
    for (int i = 0; i < n_names && !h; i++) h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(g_reason, sizeof g_reason,
                 "libnuma not found (tried %.200s%s%s%s): install libnuma1 (apt) / numactl-libs (dnf), "
                 "or --numa off",
                 names[0], n_names > 1 ? ", " : "", n_names > 1 ? names[1] : "", why);
        g_state = -1;
        return;
    }
    le_numa_lib L;
    memset(&L, 0, sizeof L);
    const char *missing = resolve(h, &L);
    if (missing) {
        snprintf(g_reason, sizeof g_reason, "libnuma (%.200s) lacks %s: too old (need 2.0.8+)", names[0], missing);
        g_state = -1;  /* the handle stays open: dlclose of a half-used library buys nothing */
        return;
    }
    if (L.available() < 0) {
        snprintf(g_reason, sizeof g_reason, "numa_available() < 0: the kernel has no NUMA support (CONFIG_NUMA off)");
        g_state = -1;
        return;
    }
    g_lib = L;
    g_state = 1;
}

/* LE_OK and *out, or LE_ERR_UNAVAILABLE and the reason in reason[0 .. len). */
static int lib_get(le_numa_lib *out, char *reason, size_t len) {
    pthread_mutex_lock(&g_mu);
    if (g_state == 0) load_locked();
    int ok = g_state == 1;
    if (ok) *out = g_lib;
    snprintf(reason, len, "%s", g_reason);
    pthread_mutex_unlock(&g_mu);
    return ok ? LE_OK : LE_ERR_UNAVAILABLE;
}

int le_numa_lib_get(le_numa_lib *out) {
    char reason[sizeof g_reason];
    int rc = lib_get(out, reason, sizeof reason);
    return rc == LE_OK ? LE_OK : LE_FAIL(rc, "%s", reason);
}

int le_numa_set_library(const char *name) {
    if (name && strlen(name) >= sizeof g_override)
        return LE_FAIL(LE_ERR_INVALID_ARG, "library name longer than %zu bytes", sizeof g_override - 1);
    pthread_mutex_lock(&g_mu);
    snprintf(g_override, sizeof g_override, "%s", name ? name : "");
    g_state = 0;  /* reload on next use; a library already opened stays mapped */
    g_reason[0] = 0;
    pthread_mutex_unlock(&g_mu);
    return LE_OK;
}

/* ---- node masks ------------------------------------------------------------------------- */

int le_numa_allowed_mask(const le_numa_lib *L, unsigned long *kmask, int *n_nodes) {
    memset(kmask, 0, LE_KMASK_WORDS * sizeof *kmask);
    *n_nodes = 0;
    struct bitmask *mems = L->get_mems_allowed();
    if (!mems) return LE_FAIL(LE_ERR_NO_MEMORY, "numa_get_mems_allowed failed");
    int max = L->max_node();
    const int bits = 8 * (int)sizeof(unsigned long);
    for (int n = 0; n <= max && n < LE_MAX_NODES; n++) {
        if (L->bitmask_isbitset(mems, (unsigned)n)) {
            kmask[n / bits] |= 1UL << (n % bits);
            (*n_nodes)++;
        }
    }
    L->bitmask_free(mems);
    if (*n_nodes == 0) return LE_FAIL(LE_ERR_DEVICE, "no memory node is allowed to this process (Mems_allowed empty)");
    return LE_OK;
}

void le_numa_mask_str(const unsigned long *kmask, char *buf, int len) {
    const int bits = 8 * (int)sizeof(unsigned long);
    int pos = 0;
    buf[0] = 0;
    for (int n = 0; n < LE_MAX_NODES && pos < len - 1;) {
        if (!(kmask[n / bits] >> (n % bits) & 1)) { n++; continue; }
        int end = n;
        while (end + 1 < LE_MAX_NODES && (kmask[(end + 1) / bits] >> ((end + 1) % bits) & 1)) end++;
        int w = end > n ? snprintf(buf + pos, (size_t)(len - pos), "%s%d-%d", pos ? "," : "", n, end)
                        : snprintf(buf + pos, (size_t)(len - pos), "%s%d", pos ? "," : "", n);
        if (w < 0) break;
        pos += w;
        n = end + 1;
    }
    if (!buf[0]) snprintf(buf, (size_t)len, "none");
}

/* ---- topology ----------------------------------------------------------------------------- */

int le_numa_detect(le_numa_info *out) {
    memset(out, 0, sizeof *out);
    out->nodes = 1;
    le_numa_lib L;
    char reason[sizeof g_reason];
    if (lib_get(&L, reason, sizeof reason) != LE_OK) {
        snprintf(out->reason, sizeof out->reason, "%.127s", reason);  /* le_numa_info.reason: 128 bytes */
        return LE_OK;
    }
    out->available = 1;
    int n = L.num_configured_nodes();
    out->nodes = n > 0 ? n : 1;
    return LE_OK;
}

int le_numa_nodes(int *nodes, int max_nodes, int *n_out) {
    if (!nodes || max_nodes < 1 || !n_out) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL output or max_nodes < 1");
    *n_out = 0;
    le_numa_lib L;
    int rc = le_numa_lib_get(&L);
    if (rc) return rc;
    unsigned long kmask[LE_KMASK_WORDS];
    int count;
    if ((rc = le_numa_allowed_mask(&L, kmask, &count))) return rc;
    const int bits = 8 * (int)sizeof(unsigned long);
    for (int n = 0; n < LE_MAX_NODES && *n_out < max_nodes; n++)
        if (kmask[n / bits] >> (n % bits) & 1) nodes[(*n_out)++] = n;
    return LE_OK;
}

/* The CPUs of `node` (all of them, or only those in `allowed` when it is not NULL), ascending. */
static int node_cpus(const le_numa_lib *L, int node, const cpu_set_t *allowed, int *cpus, int max_cpus,
                     int *n_out) {
    *n_out = 0;
    if (node < 0 || node > L->max_node())
        return LE_FAIL(LE_ERR_INVALID_ARG, "NUMA node %d does not exist (nodes 0..%d)", node, L->max_node());
    struct bitmask *mask = L->allocate_cpumask();
    if (!mask) return LE_FAIL(LE_ERR_NO_MEMORY, "numa_allocate_cpumask failed");
    if (L->node_to_cpus(node, mask) < 0) {
        int e = errno;
        L->bitmask_free(mask);
        return LE_FAIL(LE_ERR_INVALID_ARG, "numa_node_to_cpus(%d): %s", node, strerror(e));
    }
    unsigned int n_bits = 8 * L->bitmask_nbytes(mask);
    for (unsigned int c = 0; c < n_bits && *n_out < max_cpus; c++) {
        if (!L->bitmask_isbitset(mask, c)) continue;
        if (allowed && (c >= CPU_SETSIZE || !CPU_ISSET(c, allowed))) continue;
        cpus[(*n_out)++] = (int)c;
    }
    L->bitmask_free(mask);
    return LE_OK;
}

int le_numa_cpus_of_node(int node, int *cpus, int max_cpus, int *n_out) {
    if (!cpus || max_cpus < 1 || !n_out) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL output or max_cpus < 1");
    *n_out = 0;
    le_numa_lib L;
    int rc = le_numa_lib_get(&L);
    if (rc) return rc;
    return node_cpus(&L, node, NULL, cpus, max_cpus, n_out);
}

int le_numa_spread_cpus(int *cpus, int max_cpus, int *n_out) {
    if (!cpus || max_cpus < 1 || !n_out) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL output or max_cpus < 1");
    *n_out = 0;
    le_numa_lib L;
    int rc = le_numa_lib_get(&L);
    if (rc) return rc;
    cpu_set_t allowed;
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0)
        return LE_FAIL(LE_ERR_DEVICE, "sched_getaffinity: %s", strerror(errno));
    int n_nodes = L.max_node() + 1;
    if (n_nodes < 1) n_nodes = 1;
    int *per = malloc(sizeof(int) * (size_t)n_nodes * CPU_SETSIZE);  /* [node][cpu] */
    int *count = calloc((size_t)n_nodes, sizeof(int));
    if (!per || !count) {
        free(per), free(count);
        return LE_FAIL(LE_ERR_NO_MEMORY, "%d nodes x %d CPUs", n_nodes, CPU_SETSIZE);
    }
    for (int n = 0; n < n_nodes; n++) {
        if (node_cpus(&L, n, &allowed, per + (size_t)n * CPU_SETSIZE, CPU_SETSIZE, &count[n]) != LE_OK) {
            count[n] = 0;  /* a node number without CPUs or memory: skip it */
            le_clear_error();
        }
    }
    /* deal: round r takes the r-th CPU of every node that has one */
    for (int r = 0; *n_out < max_cpus; r++) {
        int took = 0;
        for (int n = 0; n < n_nodes && *n_out < max_cpus; n++)
            if (r < count[n]) cpus[(*n_out)++] = per[(size_t)n * CPU_SETSIZE + r], took = 1;
        if (!took) break;
    }
    free(per), free(count);
    if (*n_out == 0) return LE_FAIL(LE_ERR_DEVICE, "no allowed CPU belongs to any NUMA node");
    return LE_OK;
}
