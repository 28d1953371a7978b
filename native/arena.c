/* arena.c — the scratch arena of le_ops.h: one block, grown only between passes to the plan of the longest so far.
 * Test: tests/test_model.py (test_decode_steps_do_not_grow_the_scratch). */
#include <stdlib.h>

#include "le_internal.h"
#include "le_ops.h"

int le_arena_reserve(le_arena *a, size_t bytes, const char *what) {
    if (bytes <= a->size) return LE_OK;
    size_t size = le_align64(bytes);
    /* the new block first: on failure the old one (and its size) stay valid */
    uint8_t *base = aligned_alloc(LE_ARENA_ALIGN, size);
    if (!base) return LE_FAIL(LE_ERR_NO_MEMORY, "scratch arena of %zu bytes for %s", size, what);
    free(a->base);
    a->base = base;
    a->size = size;
    a->used = 0;
    a->growths++;
    return LE_OK;
}

void le_arena_free(le_arena *a) {
    free(a->base);
    a->base = NULL;
    a->size = a->used = 0;
}
