/* le_numa.h — libnuma, dlopened once and shared by numa.c (topology) and memory.c
 * (policies). Internal; not fed to cffi.
 *
 * The policy calls (mbind, get_mempolicy, set_mempolicy, move_pages) are libnuma's
 * syscall wrappers: they return -1 with errno and print nothing, unlike its
 * numa_interleave_memory / numa_tonode_memory, which return void and write failures
 * to stderr (the C core never prints). Node masks handed to the kernel are
 * LE_KMASK_WORDS longs with maxnode LE_KMASK_MAXNODE: the kernel reads maxnode - 1 bits
 * (a historical off-by-one libnuma also follows), one spare word keeps the copy in bounds. */
#ifndef LE_NUMA_H
#define LE_NUMA_H

#include <stdint.h>

#define LE_MAX_NODES 1024                      /* le_mempolicy.nodemask: 16 x 64 bits */
#define LE_KMASK_WORDS (LE_MAX_NODES / (8 * sizeof(unsigned long)) + 1)  /* 17 on LP64 */
#define LE_KMASK_MAXNODE (LE_MAX_NODES + 1)

struct bitmask;  /* libnuma's; only through its functions */

typedef struct {
    int (*available)(void);
    int (*num_configured_nodes)(void);
    int (*max_node)(void);
    struct bitmask *(*get_mems_allowed)(void);
    struct bitmask *(*allocate_cpumask)(void);
    int (*node_to_cpus)(int node, struct bitmask *mask);
    int (*bitmask_isbitset)(const struct bitmask *bmp, unsigned int n);
    unsigned int (*bitmask_nbytes)(struct bitmask *bmp);
    void (*bitmask_free)(struct bitmask *bmp);
    long (*mbind)(void *start, unsigned long len, int mode, const unsigned long *nmask, unsigned long maxnode,
                  unsigned flags);
    long (*get_mempolicy)(int *mode, unsigned long *nmask, unsigned long maxnode, void *addr, unsigned long flags);
    long (*set_mempolicy)(int mode, const unsigned long *nmask, unsigned long maxnode);
    long (*move_pages)(int pid, unsigned long count, void **pages, const int *nodes, int *status, int flags);
} le_numa_lib;

/* Fills *out with libnuma's entry points: LE_OK, or LE_ERR_UNAVAILABLE with the last
 * error saying which library was tried and what to install. Loaded once (thread-safe). */
int le_numa_lib_get(le_numa_lib *out);

/* The memory nodes this process may use as a kernel node mask (LE_KMASK_WORDS longs,
 * zeroed first); *n_nodes counts them. LE_OK, or an error with the message set. */
int le_numa_allowed_mask(const le_numa_lib *L, unsigned long *kmask, int *n_nodes);

/* "0-1,4" style list of the bits of a kernel node mask, for messages. */
void le_numa_mask_str(const unsigned long *kmask, char *buf, int len);

#endif
