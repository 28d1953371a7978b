/* numa.c — NUMA topology through libnuma, loaded with dlopen so that the engine
 * builds and runs where libnuma is absent (then: one node, and `reason` says why).
 * The interleave policy for weights builds on this (issue: fast CPU decode). */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "le_caps.h"

typedef int (*fn_int_void)(void);

int le_numa_detect(le_numa_info *out) {
    memset(out, 0, sizeof *out);
    out->nodes = 1;
    void *h = dlopen("libnuma.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) h = dlopen("libnuma.so", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(out->reason, sizeof out->reason, "libnuma not found (install libnuma1)");
        return 0;
    }
    fn_int_void numa_available = (fn_int_void)dlsym(h, "numa_available");
    fn_int_void numa_num_configured_nodes = (fn_int_void)dlsym(h, "numa_num_configured_nodes");
    if (!numa_available || !numa_num_configured_nodes) {
        snprintf(out->reason, sizeof out->reason, "libnuma lacks numa_available/numa_num_configured_nodes");
    } else if (numa_available() < 0) {
        snprintf(out->reason, sizeof out->reason, "numa_available() < 0: kernel without NUMA support");
    } else {
        out->available = 1;
        int n = numa_num_configured_nodes();
        out->nodes = n > 0 ? n : 1;
    }
    dlclose(h);
    return 0;
}
