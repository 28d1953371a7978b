/* le_memory.h — where the weights live: anonymous memory or the file map, transparent
 * huge pages, and NUMA placement (native/memory.c; topology in native/numa.c).
 *
 * Weights are memory-mapped by default. `--no-mmap` copies them into anonymous memory
 * (le_mem_alloc: 2 MiB aligned and sized, madvise(MADV_HUGEPAGE) asked for). A NUMA
 * policy (interleave over every node, or bind to one) is set with mbind BEFORE the
 * pages are first touched: the kernel places a page when it is allocated, so a policy
 * set later moves nothing unless asked to (these calls pass MPOL_MF_MOVE, which
 * migrates the anonymous pages already there).
 *
 * Page-cache pages of a file map do not follow the map's mbind policy: the kernel
 * allocates them under the policy of the thread that reads them in. So for the file
 * map the caller sets the thread's policy (le_numa_set_thread_policy), prefaults the
 * map (le_mem_prefault), and restores the policy; pages already cached by an earlier
 * run stay on the node where they are (le_mem_page_nodes says where).
 *
 * NUMA calls go through libnuma, dlopened (libnuma.so.1; $LE_NUMA_LIB or
 * le_numa_set_library name another): without it they return LE_ERR_UNAVAILABLE and
 * the message says what to install. Nothing here prints or exits.
 * This header is fed to cffi's cdef: declarations only, no macros. */
#ifndef LE_MEMORY_H
#define LE_MEMORY_H

#include <stddef.h>
#include <stdint.h>

/* ---- anonymous memory and madvise ---------------------------------------------------- */

typedef enum {
    LE_ADVISE_HUGEPAGE = 1,  /* madvise(MADV_HUGEPAGE): back the range with 2 MiB pages when the kernel can */
    LE_ADVISE_WILLNEED = 2   /* madvise(MADV_WILLNEED): start reading a file range in now */
} le_advice;

/* What the kernel answered to each piece of advice. "Accepted" is the kernel's return
 * value, not a promise: on a file-backed read-only map MADV_HUGEPAGE is accepted and
 * usually has no effect (only anonymous memory, tmpfs, and some filesystems' page
 * cache get huge pages). /proc/self/smaps (AnonHugePages, FilePmdMapped) says what happened. */
typedef struct {
    int hugepage;        /* 1: MADV_HUGEPAGE returned 0; 0: refused or not asked */
    int hugepage_errno;  /* errno of a refusal (EINVAL: kernel without THP), else 0 */
    int willneed;        /* 1: MADV_WILLNEED returned 0 */
    int willneed_errno;
} le_advice_result;

typedef struct {
    void *ptr;                /* 2 MiB aligned; zero-filled on first touch */
    size_t size;              /* bytes mapped: the request rounded up to 2 MiB */
    le_advice_result advice;  /* MADV_HUGEPAGE's answer (asked for on every allocation) */
} le_mem_region;

/* nbytes (> 0) of anonymous private memory for weights, 2 MiB aligned and sized, with
 * MADV_HUGEPAGE asked for. No page is touched: set a NUMA policy before filling it. */
int le_mem_alloc(size_t nbytes, le_mem_region *out);
/* Unmaps a region of le_mem_alloc (ptr and size as it returned them). */
int le_mem_free(void *ptr, size_t size);
/* madvise over the pages covering [ptr, ptr+size); advice: LE_ADVISE_* bits. Refusals
 * are reported in *out, not as an error (advice is advice); a NULL ptr or zero size is. */
int le_mem_advise(const void *ptr, size_t size, int advice, le_advice_result *out);
/* Faults in every page of [ptr, ptr+size) for reading (MADV_POPULATE_READ, or one read
 * per page on kernels before 5.14): for a file map, this reads the file into the page cache. */
int le_mem_prefault(const void *ptr, size_t size);

/* ---- NUMA policy ------------------------------------------------------------------------ */

typedef enum {
    LE_NUMA_OFF = 0,         /* no policy: the kernel's default (first touch: the node of the CPU that touches) */
    LE_NUMA_INTERLEAVE = 1,  /* pages round-robin over every memory node this process may use (MPOL_INTERLEAVE) */
    LE_NUMA_NODE = 2         /* every page on one node (MPOL_BIND) */
} le_numa_mode;

/* The kernel's policy modes (linux/mempolicy.h), as le_mempolicy.mode reports them. */
typedef enum {
    LE_MPOL_DEFAULT = 0,
    LE_MPOL_PREFERRED = 1,
    LE_MPOL_BIND = 2,
    LE_MPOL_INTERLEAVE = 3,
    LE_MPOL_LOCAL = 4,
    LE_MPOL_PREFERRED_MANY = 5,
    LE_MPOL_WEIGHTED_INTERLEAVE = 6
} le_mpol;

typedef struct {
    int mode;               /* LE_MPOL_* (with the kernel's mode flags, if any, in the high bits) */
    uint64_t nodemask[16];  /* bit n of word n/64 = node n (1024 nodes); all 0 for LE_MPOL_DEFAULT */
} le_mempolicy;

/* Sets the policy of the pages covering [ptr, ptr+size) (mbind, MPOL_MF_MOVE). mode:
 * LE_NUMA_OFF (back to the default), LE_NUMA_INTERLEAVE, or LE_NUMA_NODE with `node`.
 * LE_ERR_UNAVAILABLE without libnuma; LE_ERR_INVALID_ARG for a node that is not a memory
 * node this process may use (the message lists those). */
int le_mem_set_numa(void *ptr, size_t size, int mode, int node);
/* The policy of the mapping holding addr (get_mempolicy(MPOL_F_ADDR)). */
int le_mem_get_policy(const void *addr, le_mempolicy *out);
/* Where the pages of [ptr, ptr+size) are, sampling one page every `stride` bytes (0:
 * every page): counts[n] += pages on node n (n < n_counts), *absent += pages not in
 * memory (never touched, or swapped out). Queries only (move_pages), touches nothing. */
int le_mem_page_nodes(const void *ptr, size_t size, size_t stride, int *counts, int n_counts, int *absent);

/* The calling thread's policy (get_mempolicy without an address). */
int le_numa_get_thread_policy(le_mempolicy *out);
/* Sets the calling thread's policy (set_mempolicy): what pages it allocates from now on,
 * page-cache pages included. mode and node as le_mem_set_numa. */
int le_numa_set_thread_policy(int mode, int node);
/* Puts back a policy le_numa_get_thread_policy saved. */
int le_numa_restore_thread_policy(const le_mempolicy *saved);

/* ---- topology (native/numa.c) ------------------------------------------------------------ */

/* The memory nodes this process may allocate from (configured nodes in Mems_allowed),
 * ascending: nodes[0 .. *n_out). LE_ERR_UNAVAILABLE without libnuma. */
int le_numa_nodes(int *nodes, int max_nodes, int *n_out);
/* The CPUs of one node, ascending: cpus[0 .. *n_out) (numa_node_to_cpus). */
int le_numa_cpus_of_node(int node, int *cpus, int max_cpus, int *n_out);
/* Every CPU this process may run on, dealt round-robin over the nodes: node A's first,
 * node B's first, ..., node A's second ... Worker i pinned to cpus[i] spreads a pool
 * evenly over the nodes, each worker next to its share of interleaved pages. */
int le_numa_spread_cpus(int *cpus, int max_cpus, int *n_out);
/* Test hook: the library the NUMA calls load from now on (NULL: $LE_NUMA_LIB, else
 * libnuma.so.1 then libnuma.so). A name that does not load simulates a machine without libnuma. */
int le_numa_set_library(const char *name);

#endif
