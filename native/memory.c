/* memory.c — anonymous memory for weights, madvise, and NUMA policies (le_memory.h).
 *
 * Sizes and addresses: the kernel works in pages (4 KiB base, 2 MiB transparent huge
 * pages on x86-64). madvise/mbind need a page-aligned start, so a range [ptr, ptr+size)
 * is widened to the pages that cover it; a policy set on a weight buffer from
 * le_mem_alloc covers exactly that buffer (2 MiB aligned and sized).
 *
 * Order for weights in anonymous memory (--no-mmap), as legacy_engine/gguf_file.py does it:
 *   le_mem_alloc (MADV_HUGEPAGE) -> le_mem_set_numa (mbind) -> fill (first touch places
 *   each page by the policy) -> le_mem_page_nodes (where they went).
 * Test: tests/test_memory.py reads the policies back with libnuma's get_mempolicy
 * through ctypes, independently of this file. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "le_internal.h"
#include "le_memory.h"
#include "le_numa.h"

#define HUGE_2M ((size_t)2 << 20)

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  /* Linux 5.14 */
#endif

/* kernel constants (linux/mempolicy.h) */
#define K_MPOL_F_ADDR (1 << 1)
#define K_MPOL_MF_MOVE (1 << 1)

static size_t page_size(void) {
    long p = sysconf(_SC_PAGESIZE);
    return p > 0 ? (size_t)p : 4096;
}

/* [ptr, ptr+size) widened to whole pages: *start, *len. */
static void page_span(const void *ptr, size_t size, void **start, size_t *len) {
    size_t pg = page_size();
    uintptr_t a = (uintptr_t)ptr & ~(uintptr_t)(pg - 1);
    uintptr_t b = ((uintptr_t)ptr + size + pg - 1) & ~(uintptr_t)(pg - 1);
    *start = (void *)a;
    *len = b - a;
}

/* ---- anonymous memory and madvise ------------------------------------------------------ */

static void advise_one(void *start, size_t len, int advice, int *ok, int *err) {
    if (madvise(start, len, advice) == 0) {
        *ok = 1, *err = 0;
    } else {
        *ok = 0, *err = errno;
    }
}

int le_mem_advise(const void *ptr, size_t size, int advice, le_advice_result *out) {
    if (!ptr || !size || !out) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL pointer or zero size");
    memset(out, 0, sizeof *out);
    void *start;
    size_t len;
    page_span(ptr, size, &start, &len);
    if (advice & LE_ADVISE_HUGEPAGE) {
#ifdef MADV_HUGEPAGE
        advise_one(start, len, MADV_HUGEPAGE, &out->hugepage, &out->hugepage_errno);
#else
        out->hugepage_errno = EINVAL;  /* headers without THP: as a kernel without it answers */
#endif
    }
    if (advice & LE_ADVISE_WILLNEED) advise_one(start, len, MADV_WILLNEED, &out->willneed, &out->willneed_errno);
    return LE_OK;
}

int le_mem_alloc(size_t nbytes, le_mem_region *out) {
    if (!out || nbytes == 0) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL output or zero size");
    memset(out, 0, sizeof *out);
    if (nbytes > SIZE_MAX - 2 * HUGE_2M) return LE_FAIL(LE_ERR_NO_MEMORY, "%zu bytes", nbytes);
    size_t size = (nbytes + HUGE_2M - 1) & ~(HUGE_2M - 1);
    /* why: mmap aligns to 4 KiB only; a 2 MiB aligned start lets every 2 MiB of the
     * buffer be one huge page. Map 2 MiB more, then unmap the unaligned head and tail. */
    size_t span = size + HUGE_2M;
    uint8_t *raw = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED)
        return LE_FAIL(LE_ERR_NO_MEMORY, "mmap of %zu bytes of anonymous memory: %s", span, strerror(errno));
    uint8_t *p = (uint8_t *)(((uintptr_t)raw + HUGE_2M - 1) & ~(uintptr_t)(HUGE_2M - 1));
    size_t head = (size_t)(p - raw), tail = span - head - size;
    if (head) munmap(raw, head);
    if (tail) munmap(p + size, tail);
    out->ptr = p;
    out->size = size;
    le_mem_advise(p, size, LE_ADVISE_HUGEPAGE, &out->advice);
    return LE_OK;
}

int le_mem_free(void *ptr, size_t size) {
    if (!ptr || !size) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL pointer or zero size");
    if (munmap(ptr, size) != 0) return LE_FAIL(LE_ERR_INVALID_ARG, "munmap(%p, %zu): %s", ptr, size, strerror(errno));
    return LE_OK;
}

int le_mem_prefault(const void *ptr, size_t size) {
    if (!ptr || !size) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL pointer or zero size");
    void *start;
    size_t len;
    page_span(ptr, size, &start, &len);
    if (madvise(start, len, MADV_POPULATE_READ) == 0) return LE_OK;
    if (errno != EINVAL)  /* EINVAL: a kernel before 5.14; anything else is real (EFAULT: past the file's end) */
        return LE_FAIL(LE_ERR_DEVICE, "madvise(MADV_POPULATE_READ, %zu bytes): %s", len, strerror(errno));
    /* one read per page, from the original range (the widened one may run past a file's end) */
    size_t pg = page_size();
    const volatile uint8_t *b = ptr;
    uint8_t sink = 0;
    for (size_t i = 0; i < size; i += pg) sink ^= b[i];
    sink ^= b[size - 1];
    (void)sink;
    return LE_OK;
}

/* ---- NUMA policy -------------------------------------------------------------------------- */

/* le_numa_mode + node -> kernel mode and node mask. */
static int policy_mask(const le_numa_lib *L, int mode, int node, int *kmode, unsigned long *kmask) {
    unsigned long allowed[LE_KMASK_WORDS];
    int n_allowed, rc;
    memset(kmask, 0, LE_KMASK_WORDS * sizeof *kmask);
    const int bits = 8 * (int)sizeof(unsigned long);
    switch (mode) {
    case LE_NUMA_OFF:
        *kmode = LE_MPOL_DEFAULT;
        return LE_OK;
    case LE_NUMA_INTERLEAVE:
        if ((rc = le_numa_allowed_mask(L, kmask, &n_allowed))) return rc;
        *kmode = LE_MPOL_INTERLEAVE;  /* with one node: valid, and the same as no policy */
        return LE_OK;
    case LE_NUMA_NODE:
        if ((rc = le_numa_allowed_mask(L, allowed, &n_allowed))) return rc;
        if (node < 0 || node >= LE_MAX_NODES || !(allowed[node / bits] >> (node % bits) & 1)) {
            char list[128];
            le_numa_mask_str(allowed, list, sizeof list);
            return LE_FAIL(LE_ERR_INVALID_ARG, "NUMA node %d is not a memory node of this machine that this process "
                           "may use (nodes: %s)", node, list);
        }
        kmask[node / bits] = 1UL << (node % bits);
        *kmode = LE_MPOL_BIND;
        return LE_OK;
    default:
        return LE_FAIL(LE_ERR_INVALID_ARG, "unknown NUMA mode %d (LE_NUMA_OFF, _INTERLEAVE, _NODE)", mode);
    }
}

static void mask_out(const unsigned long *kmask, le_mempolicy *out) {
    /* little-endian: bit n of the longs is bit n of the uint64 words on LP64 and ILP32 alike */
    memcpy(out->nodemask, kmask, sizeof out->nodemask);
}

int le_mem_set_numa(void *ptr, size_t size, int mode, int node) {
    if (!ptr || !size) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL pointer or zero size");
    le_numa_lib L;
    int rc = le_numa_lib_get(&L);
    if (rc) return rc;
    int kmode;
    unsigned long kmask[LE_KMASK_WORDS];
    if ((rc = policy_mask(&L, mode, node, &kmode, kmask))) return rc;
    void *start;
    size_t len;
    page_span(ptr, size, &start, &len);
    /* MPOL_MF_MOVE: pages already there (touched before the policy) migrate to match */
    if (L.mbind(start, len, kmode, kmode == LE_MPOL_DEFAULT ? NULL : kmask, LE_KMASK_MAXNODE, K_MPOL_MF_MOVE) != 0)
        return LE_FAIL(LE_ERR_DEVICE, "mbind(%p, %zu bytes, mode %d): %s", start, len, kmode, strerror(errno));
    return LE_OK;
}

int le_mem_get_policy(const void *addr, le_mempolicy *out) {
    if (!addr || !out) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL address or output");
    memset(out, 0, sizeof *out);
    le_numa_lib L;
    int rc = le_numa_lib_get(&L);
    if (rc) return rc;
    unsigned long kmask[LE_KMASK_WORDS] = {0};
    int mode = 0;
    if (L.get_mempolicy(&mode, kmask, LE_KMASK_MAXNODE, (void *)addr, K_MPOL_F_ADDR) != 0)
        return LE_FAIL(LE_ERR_INVALID_ARG, "get_mempolicy(%p, MPOL_F_ADDR): %s", addr, strerror(errno));
    out->mode = mode;
    mask_out(kmask, out);
    return LE_OK;
}

int le_mem_page_nodes(const void *ptr, size_t size, size_t stride, int *counts, int n_counts, int *absent) {
    if (!ptr || !size || !counts || n_counts < 1 || !absent)
        return LE_FAIL(LE_ERR_INVALID_ARG, "NULL pointer, zero size or no counts");
    le_numa_lib L;
    int rc = le_numa_lib_get(&L);
    if (rc) return rc;
    size_t pg = page_size();
    if (stride < pg) stride = pg;
    void *start;
    size_t len;
    page_span(ptr, size, &start, &len);
    enum { BATCH = 512 };
    void *pages[BATCH];
    int status[BATCH];
    for (size_t off = 0; off < len;) {
        unsigned long n = 0;
        for (; n < BATCH && off < len; n++, off += stride) pages[n] = (uint8_t *)start + off;
        /* nodes == NULL: query only; status[i] = the page's node, or -errno (-ENOENT: not present) */
        if (L.move_pages(0, n, pages, NULL, status, 0) != 0)
            return LE_FAIL(LE_ERR_DEVICE, "move_pages (query of %lu pages): %s", n, strerror(errno));
        for (unsigned long i = 0; i < n; i++) {
            if (status[i] >= 0 && status[i] < n_counts) counts[status[i]]++;
            else (*absent)++;
        }
    }
    return LE_OK;
}

int le_numa_get_thread_policy(le_mempolicy *out) {
    if (!out) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL output");
    memset(out, 0, sizeof *out);
    le_numa_lib L;
    int rc = le_numa_lib_get(&L);
    if (rc) return rc;
    unsigned long kmask[LE_KMASK_WORDS] = {0};
    int mode = 0;
    if (L.get_mempolicy(&mode, kmask, LE_KMASK_MAXNODE, NULL, 0) != 0)
        return LE_FAIL(LE_ERR_DEVICE, "get_mempolicy (thread): %s", strerror(errno));
    out->mode = mode;
    mask_out(kmask, out);
    return LE_OK;
}

int le_numa_set_thread_policy(int mode, int node) {
    le_numa_lib L;
    int rc = le_numa_lib_get(&L);
    if (rc) return rc;
    int kmode;
    unsigned long kmask[LE_KMASK_WORDS];
    if ((rc = policy_mask(&L, mode, node, &kmode, kmask))) return rc;
    if (L.set_mempolicy(kmode, kmode == LE_MPOL_DEFAULT ? NULL : kmask, LE_KMASK_MAXNODE) != 0)
        return LE_FAIL(LE_ERR_DEVICE, "set_mempolicy(mode %d): %s", kmode, strerror(errno));
    return LE_OK;
}

int le_numa_restore_thread_policy(const le_mempolicy *saved) {
    if (!saved) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL policy");
    le_numa_lib L;
    int rc = le_numa_lib_get(&L);
    if (rc) return rc;
    unsigned long kmask[LE_KMASK_WORDS] = {0};
    memcpy(kmask, saved->nodemask, sizeof saved->nodemask);
    int empty = 1;
    for (size_t i = 0; i < LE_KMASK_WORDS; i++) empty &= kmask[i] == 0;
    if (L.set_mempolicy(saved->mode, empty ? NULL : kmask, LE_KMASK_MAXNODE) != 0)
        return LE_FAIL(LE_ERR_DEVICE, "set_mempolicy(mode %#x) restoring the saved policy: %s", saved->mode,
                       strerror(errno));
    return LE_OK;
}
