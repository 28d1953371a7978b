/* state.c — one sequence's state: GDN conv + SSM states, attention KV cache, position.
 *
 * Saved form (le_state_save): a header {magic, version, pos, sizes, rope delta} then the conv
 * states, the SSM states, and K and V rows [0, pos) of every attention layer, all f32.
 * The snapshot cache and the CPU<->GPU handoff build on save/restore/copy. The forward pass's scratch arena
 * (le_ops.h) lives here too: it is not part of the sequence (never saved, copied or reset).
 * Test: tests/test_model.py (restore then continue == uninterrupted run, bit for bit). */
#include <stdlib.h>
#include <string.h>

#include "le_internal.h"
#include "le_ops.h"

#define STATE_MAGIC 0x5453454cu /* "LEST" */
#define STATE_VERSION 1

typedef struct {
    uint32_t magic, version;
    int32_t pos, n_gdn, n_attn, rope_delta;
    int64_t conv_floats, ssm_floats, kv_floats;
} state_header;

int le_state_create(const le_model *m, int n_ctx, le_state **out) {
    *out = NULL;
    if (!m || n_ctx < 1) return LE_FAIL(LE_ERR_INVALID_ARG, "n_ctx = %d, expected >= 1", n_ctx);
    const le_hparams *hp = &m->hp;
    le_state *s = calloc(1, sizeof *s);
    if (!s) return LE_FAIL(LE_ERR_NO_MEMORY, "state");
    s->m = m;
    s->n_ctx = n_ctx;
    int conv_dim = 2 * hp->ssm_n_group * hp->ssm_d_state + hp->ssm_d_inner;
    s->conv_floats = (int64_t)(hp->ssm_conv_kernel - 1) * conv_dim;
    s->ssm_floats = (int64_t)hp->ssm_d_inner * hp->ssm_d_state;
    s->kv_floats = (int64_t)n_ctx * hp->n_head_kv * hp->head_dim;
    s->conv = calloc((size_t)(m->n_gdn * s->conv_floats) + 1, sizeof(float));
    s->ssm = calloc((size_t)(m->n_gdn * s->ssm_floats) + 1, sizeof(float));
    s->k = calloc((size_t)(m->n_attn * s->kv_floats) + 1, sizeof(float));
    s->v = calloc((size_t)(m->n_attn * s->kv_floats) + 1, sizeof(float));
    if (!s->conv || !s->ssm || !s->k || !s->v) {
        le_state_free(s);
        return LE_FAIL(LE_ERR_NO_MEMORY, "state for %d positions", n_ctx);
    }
    *out = s;
    return LE_OK;
}

void le_state_free(le_state *s) {
    if (!s) return;
    free(s->conv);
    free(s->ssm);
    free(s->k);
    free(s->v);
    le_arena_free(&s->scratch);
    free(s);
}

int le_state_pos(const le_state *s) { return s->pos; }
int le_state_n_ctx(const le_state *s) { return s->n_ctx; }
int64_t le_state_scratch_growths(const le_state *s) { return s->scratch.growths; }
int64_t le_state_scratch_bytes(const le_state *s) { return (int64_t)s->scratch.size; }

int le_state_rope_delta(const le_state *s) { return s->rope_delta; }

int le_state_set_rope_delta(le_state *s, int delta) {
    if (!s) return LE_FAIL(LE_ERR_INVALID_ARG, "NULL state");
    s->rope_delta = delta;
    return LE_OK;
}

void le_state_reset(le_state *s) {
    s->pos = 0;
    s->rope_delta = 0;
    memset(s->conv, 0, (size_t)(s->m->n_gdn * s->conv_floats) * sizeof(float));
    memset(s->ssm, 0, (size_t)(s->m->n_gdn * s->ssm_floats) * sizeof(float));
}

static int64_t row_floats(const le_state *s) { return (int64_t)s->m->hp.n_head_kv * s->m->hp.head_dim; }

int64_t le_state_nbytes(const le_state *s) {
    const le_model *m = s->m;
    /* why int64 first: 2 * n_attn * pos overflows an int from a few million positions up */
    return (int64_t)sizeof(state_header) +
           (int64_t)sizeof(float) * (m->n_gdn * (s->conv_floats + s->ssm_floats) +
                                     (int64_t)2 * m->n_attn * s->pos * row_floats(s));
}

int le_state_save(const le_state *s, void *buf, int64_t nbytes) {
    if (!buf || nbytes < le_state_nbytes(s))
        return LE_FAIL(LE_ERR_INVALID_ARG, "buffer of %lld bytes, %lld needed", (long long)nbytes,
                       (long long)le_state_nbytes(s));
    const le_model *m = s->m;
    state_header h = {STATE_MAGIC, STATE_VERSION, s->pos, m->n_gdn, m->n_attn, s->rope_delta, s->conv_floats, s->ssm_floats,
                      row_floats(s)};
    char *p = buf;
    memcpy(p, &h, sizeof h);
    p += sizeof h;
    size_t conv = (size_t)(m->n_gdn * s->conv_floats) * sizeof(float), ssm = (size_t)(m->n_gdn * s->ssm_floats) * sizeof(float);
    memcpy(p, s->conv, conv);
    p += conv;
    memcpy(p, s->ssm, ssm);
    p += ssm;
    size_t rows = (size_t)s->pos * row_floats(s) * sizeof(float);
    for (int a = 0; a < m->n_attn; a++) {
        memcpy(p, s->k + a * s->kv_floats, rows);
        p += rows;
        memcpy(p, s->v + a * s->kv_floats, rows);
        p += rows;
    }
    return LE_OK;
}

int le_state_restore(le_state *s, const void *buf, int64_t nbytes) {
    const le_model *m = s->m;
    state_header h;
    if (!buf || nbytes < (int64_t)sizeof h) return LE_FAIL(LE_ERR_FORMAT, "state buffer too short");
    memcpy(&h, buf, sizeof h);
    if (h.magic != STATE_MAGIC || h.version != STATE_VERSION)
        return LE_FAIL(LE_ERR_FORMAT, "not a legacy_engine state (magic %#x version %u)", h.magic, h.version);
    if (h.n_gdn != m->n_gdn || h.n_attn != m->n_attn || h.conv_floats != s->conv_floats ||
        h.ssm_floats != s->ssm_floats || h.kv_floats != row_floats(s))
        return LE_FAIL(LE_ERR_FORMAT, "state was saved for a model of another shape");
    if (h.pos < 0 || h.pos > s->n_ctx)
        return LE_FAIL(LE_ERR_INVALID_ARG, "state at position %d does not fit a context of %d", h.pos, s->n_ctx);
    size_t conv = (size_t)(m->n_gdn * s->conv_floats) * sizeof(float), ssm = (size_t)(m->n_gdn * s->ssm_floats) * sizeof(float);
    size_t rows = (size_t)h.pos * row_floats(s) * sizeof(float);
    if ((size_t)nbytes < sizeof h + conv + ssm + 2 * (size_t)m->n_attn * rows)
        return LE_FAIL(LE_ERR_FORMAT, "state buffer of %lld bytes is truncated", (long long)nbytes);
    const char *p = (const char *)buf + sizeof h;
    memcpy(s->conv, p, conv);
    p += conv;
    memcpy(s->ssm, p, ssm);
    p += ssm;
    for (int a = 0; a < m->n_attn; a++) {
        memcpy(s->k + a * s->kv_floats, p, rows);
        p += rows;
        memcpy(s->v + a * s->kv_floats, p, rows);
        p += rows;
    }
    s->pos = h.pos;
    s->rope_delta = h.rope_delta;
    return LE_OK;
}

int le_state_copy(le_state *dst, const le_state *src) {
    if (dst->m != src->m) return LE_FAIL(LE_ERR_INVALID_ARG, "states of different models");
    if (src->pos > dst->n_ctx)
        return LE_FAIL(LE_ERR_INVALID_ARG, "position %d does not fit a context of %d", src->pos, dst->n_ctx);
    const le_model *m = src->m;
    memcpy(dst->conv, src->conv, (size_t)(m->n_gdn * src->conv_floats) * sizeof(float));
    memcpy(dst->ssm, src->ssm, (size_t)(m->n_gdn * src->ssm_floats) * sizeof(float));
    size_t rows = (size_t)src->pos * row_floats(src) * sizeof(float);
    for (int a = 0; a < m->n_attn; a++) {
        memcpy(dst->k + a * dst->kv_floats, src->k + a * src->kv_floats, rows);
        memcpy(dst->v + a * dst->kv_floats, src->v + a * src->kv_floats, rows);
    }
    dst->pos = src->pos;
    dst->rope_delta = src->rope_delta;
    return LE_OK;
}

/* ---- pieces for the snapshot cache ---------------------------------------------- */

int64_t le_state_recurrent_nbytes(const le_state *s) {
    return (int64_t)sizeof(float) * s->m->n_gdn * (s->conv_floats + s->ssm_floats);
}

int le_state_save_recurrent(const le_state *s, void *buf, int64_t nbytes) {
    int64_t need = le_state_recurrent_nbytes(s);
    if (!buf || nbytes < need) return LE_FAIL(LE_ERR_INVALID_ARG, "buffer of %lld bytes, %lld needed", (long long)nbytes, (long long)need);
    size_t conv = (size_t)(s->m->n_gdn * s->conv_floats) * sizeof(float);
    memcpy(buf, s->conv, conv);
    memcpy((char *)buf + conv, s->ssm, (size_t)need - conv);
    return LE_OK;
}

int le_state_restore_recurrent(le_state *s, const void *buf, int64_t nbytes, int pos) {
    int64_t need = le_state_recurrent_nbytes(s);
    if (!buf || nbytes != need)
        return LE_FAIL(LE_ERR_FORMAT, "recurrent state of %lld bytes, %lld expected", (long long)nbytes, (long long)need);
    if (pos < 0 || pos > s->n_ctx) return LE_FAIL(LE_ERR_INVALID_ARG, "position %d outside the context of %d", pos, s->n_ctx);
    size_t conv = (size_t)(s->m->n_gdn * s->conv_floats) * sizeof(float);
    memcpy(s->conv, buf, conv);
    memcpy(s->ssm, (const char *)buf + conv, (size_t)need - conv);
    s->pos = pos;
    s->rope_delta = 0; /* text positions; a prefix with an image sets its delta after (le_state_set_rope_delta) */
    return LE_OK;
}

int64_t le_state_kv_nbytes(const le_state *s, int n) {
    return (int64_t)sizeof(float) * 2 * s->m->n_attn * (int64_t)n * row_floats(s);
}

static int check_kv_range(const le_state *s, int start, int n, const void *buf, int64_t nbytes) {
    /* why not start + n > n_ctx: the sum wraps for start near INT_MAX and the copy lands outside the cache */
    if (start < 0 || n < 0 || start > s->n_ctx || n > s->n_ctx - start)
        return LE_FAIL(LE_ERR_INVALID_ARG, "KV rows [%d, %lld) outside the context of %d", start,
                       (long long)start + n, s->n_ctx);
    if (!buf || nbytes != le_state_kv_nbytes(s, n))
        return LE_FAIL(LE_ERR_INVALID_ARG, "KV buffer of %lld bytes, %lld expected", (long long)nbytes,
                       (long long)le_state_kv_nbytes(s, n));
    return LE_OK;
}

int le_state_read_kv(const le_state *s, int start, int n, void *buf, int64_t nbytes) {
    int rc = check_kv_range(s, start, n, buf, nbytes);
    if (rc) return rc;
    size_t rows = (size_t)n * row_floats(s) * sizeof(float), off = (size_t)start * row_floats(s);
    char *p = buf;
    for (int a = 0; a < s->m->n_attn; a++) {
        memcpy(p, s->k + a * s->kv_floats + off, rows);
        p += rows;
        memcpy(p, s->v + a * s->kv_floats + off, rows);
        p += rows;
    }
    return LE_OK;
}

int le_state_write_kv(le_state *s, int start, int n, const void *buf, int64_t nbytes) {
    int rc = check_kv_range(s, start, n, buf, nbytes);
    if (rc) return rc;
    size_t rows = (size_t)n * row_floats(s) * sizeof(float), off = (size_t)start * row_floats(s);
    const char *p = buf;
    for (int a = 0; a < s->m->n_attn; a++) {
        memcpy(s->k + a * s->kv_floats + off, p, rows);
        p += rows;
        memcpy(s->v + a * s->kv_floats + off, p, rows);
        p += rows;
    }
    return LE_OK;
}
