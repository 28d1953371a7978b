"""The GPU-resident forward pass (legacy_engine/gpu/model.py and its rooms) and the kernels it added (cuda8/rope.cu,
get_rows.cu, moe_combine.cu, the f32-weight and MoE `_ids` forms of the GEMV/GEMM files).

On a GPU (marker gpu), for every tier variant (as tests/test_gpu.py: fermi and kepler from compute_35 PTX, dp4a
from compute_61 and compute_70, and each tier on the card's own arch):
  - each new kernel against numpy / the C reference (exact where the math is exact);
  - the tiny f32 models (tests/fixtures/tiny_models.py: dense, dense_tied, moe, moe_hv_eq_hk), GPU prefill of the
    200-token sequence against the committed transformers logits (LOGIT_ABS_F32, the CPU engine's own bar) and
    against the CPU engine, then decode token by token on the GPU against the CPU engine's decode;
  - the handoff: prefill on the GPU, state moved to the CPU, decode there == decode on the GPU (and back);
  - a quantised file (Q4_K_M of the wide tiny MoE, with Q5_0/Q8_0 fallbacks dequantised at upload): the int8
    (DP4A) decode's KL to the CPU engine's f32 path stays at the CPU integer path's level.
GPU machine: LE_PTX_DIR=DIR LE_GPU_STRICT=1 python -m pytest tests/test_gpu_model.py -m gpu
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import tolerances as tol
from fixtures.make_reference import FULL_ROWS, compare, load_reference, sequence, tiny_gguf
from legacy_engine import gpu
from legacy_engine.cpu.model import Model
from test_gpu import (GPU_OK, GPU_WHY, NATIVE_ARCH, STRICT, TYPES, VARIANTS, VIDS, assert_close_sum, dequant,  # noqa: F401
                      expert_weights, gpu_device, kernels, random_weights, tname, variant_params)

pytestmark = pytest.mark.gpu
N_CTX = 256


# ================================================================================================ the new kernels

@pytest.mark.parametrize("qtype", TYPES + [gpu.F32], ids=[tname(t) for t in TYPES] + ["f32"])
@variant_params()
def test_get_rows(kernels, qtype):
    """The embedding rows, dequantised bit for bit as the C reference does."""
    rng = np.random.default_rng(300 + qtype)
    nrows, ncols = 50, 512
    if qtype == gpu.F32:
        w = rng.standard_normal(nrows * ncols).astype(np.float32)
        W = w.reshape(nrows, ncols)
    else:
        w = random_weights(rng, qtype, nrows, ncols)
        W = dequant(qtype, w, nrows, ncols)[0].astype(np.float32)
    ids = rng.integers(0, nrows, 9).astype(np.int32)
    with gpu.Buffer.from_array(w) as bw, gpu.Buffer.from_array(ids) as bi, gpu.Buffer(4 * 9 * ncols) as by:
        kernels.get_rows(qtype, bw, bi, by, 9, ncols)
        y = by.download(dtype=np.float32).reshape(9, ncols)
    np.testing.assert_array_equal(y, W[ids])


@variant_params()
def test_get_rows_raw(kernels):
    """Rows of raw bytes gathered as they are; on Q8_1 rows of x that is bit for bit quantising the gathered f32 rows
    (the grouped experts' inputs gathered from h's Q8_1)."""
    rng = np.random.default_rng(301)
    nrows, E, n = 40, 256, 23
    x = rng.standard_normal((nrows, E)).astype(np.float32)
    ids = rng.integers(0, nrows, n).astype(np.int32)
    rb = E // 32 * gpu.Q8_1_BYTES
    with gpu.Buffer.from_array(x) as bx, gpu.Buffer.from_array(ids) as bi, gpu.Buffer(nrows * rb) as bq, \
            gpu.Buffer(n * rb) as bg, gpu.Buffer(4 * n * E) as bf, gpu.Buffer(n * rb) as bfq:
        kernels.quantize_q8_1(bx, bq, nrows * E)
        kernels.get_rows_raw(bq, bi, bg, n, rb)
        kernels.get_rows(gpu.F32, bx, bi, bf, n, E)
        kernels.quantize_q8_1(bf, bfq, n * E)
        q, g, fq = (b.download(dtype=np.uint8) for b in (bq, bg, bfq))
    np.testing.assert_array_equal(g.reshape(n, rb), q.reshape(nrows, rb)[ids])
    np.testing.assert_array_equal(g, fq)
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.get_rows_raw(0, 0, 0, 1, 36)


@variant_params()
def test_gemv_gemm_f32_weights(kernels):
    """f32 weights (the tiny oracle files): GEMV and GEMM against f64."""
    rng = np.random.default_rng(7)
    nrows, ncols, ntok = 67, 1024, 37
    W = rng.standard_normal((nrows, ncols)).astype(np.float32)
    X = rng.standard_normal((ntok, ncols)).astype(np.float32)
    ref = X.astype(np.float64) @ W.T.astype(np.float64)
    mag = np.abs(X.astype(np.float64)) @ np.abs(W.T.astype(np.float64))
    with gpu.Buffer.from_array(W) as bw, gpu.Buffer.from_array(X) as bx, gpu.Buffer(4 * nrows * ntok) as by:
        kernels.gemv_f32(gpu.F32, bw, bx, by, nrows, ncols)
        y = by.download(dtype=np.float32, count=nrows)
        assert_close_sum(y, ref[0], mag[0], math.ceil(ncols / 4 / 32) * 4 + 5, "gemv_f32_f32")
        kernels.gemm_f32(gpu.F32, bw, bx, by, nrows, ncols, ntok)
        Y = by.download(dtype=np.float32).reshape(ntok, nrows)
        assert_close_sum(Y, ref, mag, ncols, "gemm_f32_f32")
    with pytest.raises(ValueError, match="int8"):
        kernels.gemv_dp4a(gpu.F32, 0, 0, 0, nrows, ncols)


@pytest.mark.parametrize("qtype", [2, 12, 14, gpu.F32], ids=["q4_0", "q4_K", "q6_K", "f32"])
@pytest.mark.parametrize("int8", [False, True], ids=["f32x", "int8"])
@variant_params()
def test_gemv_ids(kernels, qtype, int8):
    """The MoE GEMV: pair p = expert ids[p] times input p // x_group gives exactly what the plain GEMV gives for
    that expert and input (same code, other addresses); a pair with a negative id (the hybrid decode's CPU-side
    experts) gives a zero row, whatever the output held."""
    if int8 and qtype == gpu.F32:
        pytest.skip("f32 weights have no int8 path")
    rng = np.random.default_rng(400 + qtype)
    n_exp, nrows, ncols, n_tok, k = 6, 40, 512, 3, 2
    w, eb = expert_weights(rng, qtype, n_exp, nrows, ncols)
    x = rng.standard_normal((n_tok, ncols)).astype(np.float32)
    ids = np.array([[5, 0], [2, -1], [-1, 3]], dtype=np.int32)
    qb = ncols // 32 * gpu.Q8_1_BYTES
    with gpu.Buffer.from_array(w) as bw, gpu.Buffer.from_array(x) as bx, gpu.Buffer.from_array(ids) as bi, \
            gpu.Buffer(n_tok * qb) as bq, gpu.Buffer(4 * n_tok * k * nrows) as by, gpu.Buffer(4 * nrows) as b1:
        by.upload(np.full(n_tok * k * nrows, np.nan, dtype=np.float32))
        if int8:
            kernels.quantize_q8_1(bx, bq, n_tok * ncols)
            kernels.gemv_ids(qtype, bw, bq, by, nrows, ncols, bi, n_tok * k, eb, k, ncols // 32, int8=True,
                             n_experts=n_exp)
        else:
            kernels.gemv_ids(qtype, bw, bx, by, nrows, ncols, bi, n_tok * k, eb, k, ncols, n_experts=n_exp)
        got = by.download(dtype=np.float32).reshape(n_tok * k, nrows)
        for p in range(n_tok * k):
            e, t = int(ids.flat[p]), p // k
            if e < 0:
                assert not got[p].any(), f"pair {p}: skipped, its row must be zero"
                continue
            if int8:
                kernels.gemv_dp4a(qtype, bw.ptr + e * eb, bq.ptr + t * qb, b1, nrows, ncols)
            else:
                kernels.gemv_f32(qtype, bw.ptr + e * eb, bx.ptr + 4 * t * ncols, b1, nrows, ncols)
            np.testing.assert_array_equal(got[p], b1.download(dtype=np.float32), err_msg=f"pair {p}")


def qk_norm_rope_ref(x, w, cs, n_heads, head_stride, row_stride, hd, eps):
    """native/attention.c's per-head le_rmsnorm then rope.c's rotation, in f64 from the f32 inputs."""
    out = x.astype(np.float64).copy()
    half = cs.shape[1]
    for t in range(cs.shape[0]):
        for h in range(n_heads):
            o = t * row_stride + h * head_stride
            v = out[o:o + hd]
            v = v / np.sqrt((v * v).mean() + eps) * w
            c, s = cs[t, :, 0].astype(np.float64), cs[t, :, 1].astype(np.float64)
            a, b = v[:half].copy(), v[half:2 * half].copy()
            v[:half], v[half:2 * half] = a * c - b * s, a * s + b * c
            out[o:o + hd] = v
    return out


@variant_params()
def test_qk_norm_rope(kernels):
    """q heads (stride 2*hd, the gate halves untouched) and k heads, partial rotary (n_rot = hd/4), IMRoPE table."""
    from types import SimpleNamespace
    from legacy_engine.gpu.scratch import rope_table
    rng = np.random.default_rng(11)
    n, nh, hd, n_rot, eps = 5, 3, 256, 64, 1e-6
    hp = SimpleNamespace(n_rot=n_rot, rope_theta=1e7, rope_sections=(11, 11, 10, 0))
    cs = rope_table(hp, 40)[30:30 + n]                 # positions 30..34
    w = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32)
    for head_stride, row_stride in ((2 * hd, nh * 2 * hd), (hd, nh * hd)):
        x = rng.standard_normal(n * row_stride).astype(np.float32)
        ref = qk_norm_rope_ref(x, w.astype(np.float64), cs, nh, head_stride, row_stride, hd, eps)
        with gpu.Buffer.from_array(x) as bx, gpu.Buffer.from_array(w) as bw, gpu.Buffer.from_array(cs) as bc:
            kernels.qk_norm_rope(bx, bw, bc, n, nh, head_stride, row_stride, hd, n_rot, eps)
            y = bx.download(dtype=np.float32)
        # the norm's f32 sum and scale (GPU_RMSNORM_REL), then one rotation: two products and a sum
        np.testing.assert_allclose(y, ref, rtol=4 * tol.GPU_RMSNORM_REL, atol=4 * tol.GPU_RMSNORM_REL * np.abs(ref).max())
        if head_stride == 2 * hd:                       # gate halves untouched
            g = x.reshape(n, nh, 2, hd)[:, :, 1]
            np.testing.assert_array_equal(y.reshape(n, nh, 2, hd)[:, :, 1], g)


@variant_params()
def test_moe_combine(kernels):
    rng = np.random.default_rng(12)
    n, k, E = 3, 4, 160
    y = rng.standard_normal((n * k, E)).astype(np.float32)
    w = rng.uniform(0, 1, (n, k)).astype(np.float32)
    sh = rng.standard_normal((n, E)).astype(np.float32)
    sg = rng.standard_normal(n).astype(np.float32)
    y64 = y.astype(np.float64).reshape(n, k, E)
    base = (w.astype(np.float64)[:, :, None] * y64).sum(axis=1)
    gate = 1 / (1 + np.exp(-sg.astype(np.float64)))
    mag = (np.abs(w.astype(np.float64))[:, :, None] * np.abs(y64)).sum(axis=1) + np.abs(sh)
    with gpu.Buffer.from_array(y) as by, gpu.Buffer.from_array(w) as bw, gpu.Buffer.from_array(sh) as bs, \
            gpu.Buffer.from_array(sg) as bg, gpu.Buffer(4 * n * E) as bo:
        kernels.moe_combine(by, bw, None, None, bo, n, k, E)
        assert_close_sum(bo.download(dtype=np.float32).reshape(n, E), base, mag, k + 2, "moe_combine")
        kernels.moe_combine(by, bw, bs, bg, bo, n, k, E)
        ref = base + gate[:, None] * sh
        assert_close_sum(bo.download(dtype=np.float32).reshape(n, E), ref, mag, k + 8, "moe_combine shared")
    # rows: pair (t, s) read from row rows[t*k + s] of a permuted y (the grouped GEMMs' sorted output)
    perm = rng.permutation(n * k).astype(np.int32)
    yp = np.empty_like(y)
    yp[perm] = y
    with gpu.Buffer.from_array(yp) as by, gpu.Buffer.from_array(w) as bw, gpu.Buffer.from_array(sh) as bs, \
            gpu.Buffer.from_array(sg) as bg, gpu.Buffer(4 * n * E) as bo, gpu.Buffer.from_array(perm) as br:
        kernels.moe_combine(by, bw, bs, bg, bo, n, k, E, rows=br)
        assert_close_sum(bo.download(dtype=np.float32).reshape(n, E), ref, mag, k + 8, "moe_combine rows")
        kernels.moe_combine(by, bw, bs, bg, bo, n, k, E)          # negative control: without rows, wrong rows
        assert not np.allclose(bo.download(dtype=np.float32).reshape(n, E), ref, atol=1e-3)


def pinned_channel(lay, seq: int):
    """A zeroed hybrid channel in page-locked memory with SEQ = seq -> (buffer, int32 view, device-visible address)."""
    from legacy_engine.core import _native
    pb = gpu.PinnedBuffer(4 * lay.channel_words)
    chan = pb.array.view(np.int32)
    chan[:] = 0
    chan[lay.seq] = seq
    return pb, chan, int(_native.ffi.cast("uintptr_t", pb.ptr))


@variant_params()
def test_hybrid_sync(kernels):
    """hybrid_publish / hybrid_wait (cuda8/hybrid_sync.cu) against the channel layout (gpu.hybrid.HybridLayout =
    le_hybrid.h): the slot holds h, ids, cpu_ids, weights and READY = SEQ; meta holds the pin indices, the ids the
    GPU runs from its staging (the early ones the CPU copied and flagged for this token, then n_link fetched: the
    first not pinned nor early, or the ones predicted last), their staging slots, the fetched ones and the weights
    of each group (1 for the CPU's row); the wait copies ROW once DONE == SEQ, and gives NaN when the CPU never
    answers (a bounded spin, so a dead host cannot hang the stream)."""
    from legacy_engine.gpu.hybrid import HybridLayout
    rng = np.random.default_rng(21)
    E, k, ne, n_layer = 300, 5, 40, 3
    lay = HybridLayout(E, k, n_layer)
    h = rng.standard_normal(E).astype(np.float32)
    ids = rng.choice(ne, k, replace=False).astype(np.int32)
    w = rng.dirichlet(np.ones(k)).astype(np.float32)
    pin = np.full(ne, -1, dtype=np.int32)
    pin[ids[[1, 3]]] = [0, 7]
    pb, chan, cp = pinned_channel(lay, 9)
    try:
        slot = cp + 4 * lay.slot_offset(2)
        with gpu.Buffer.from_array(h) as bh, gpu.Buffer.from_array(ids) as bi, gpu.Buffer.from_array(w) as bw, \
                gpu.Buffer.from_array(pin) as bp, gpu.Buffer(4 * (7 * k + 1)) as bm, gpu.Buffer(4 * E) as br:
            # a lookahead prediction: ids[4] predicted first, ids[0] third, the others not at all
            pred = np.full(gpu.HY_PRED_MAX, -1, dtype=np.int32)
            pred[[0, 2]] = ids[[4, 0]]
            bpred = gpu.Buffer.from_array(pred)
            # decode extras: ids[3] (also pinned: the pin wins), ids[2] (also early: the extra wins) and ids[4]
            extra = np.full(ne, -1, dtype=np.int32)
            extra[ids[[3, 2, 4]]] = [5, 0, 2]
            bx = gpu.Buffer.from_array(extra)
            cases = [(bp, 0, None, 0, None), (None, 0, None, 0, None), (bp, 2, None, 0, None), (None, k, None, 0, None),
                     (bp, 2, bpred, 0, None), (None, 3, bpred, 0, None), (bp, 1, None, 2, None),
                     (None, 1, bpred, 2, None), (bp, 0, None, -2, None), (bp, 1, None, 0, bx), (None, 2, bpred, 2, bx),
                     (bp, 1, None, 2, bx)]
            for table, n_link, pr, n_early, xt in cases:
                # early experts (n_early > 0): the CPU copied ids[2] and ids[0] into its early buffer, in time;
                # n_early < 0: the same copies flagged for another token (not in time: none of them used)
                s = lay.slot(chan, 2)
                s[lay.early:lay.early + lay.EARLY_MAX] = [ids[2], ids[0], -1, -1]
                s[lay.early_ready] = 9 if n_early > 0 else 8
                ne_ = abs(n_early)
                m = np.full(7 * k + 1, -7, dtype=np.int32)
                bm.upload(m)
                kernels.hybrid_publish(bh, bi, bw, table, n_link, bm, slot, cp, E, k, pred=pr, n_early=ne_,
                                       extra_idx=xt)
                gpu.synchronize()
                gids = pin[ids] if table is not None else np.full(k, -1)
                xs = np.where(gids < 0, extra[ids], -1) if xt is not None else np.full(k, -1)
                early = {int(ids[2]): 0, int(ids[0]): 1} if n_early > 0 else {}
                er = np.array([early.get(int(e), -1) if g < 0 and x < 0 else -1 for e, g, x in zip(ids, gids, xs)])
                free = (gids < 0) & (er < 0) & (xs < 0)      # neither pinned, extra nor copied early
                if pr is None:
                    fids = np.where(free & (np.cumsum(free) <= n_link), ids, -1)   # the first n_link of those
                    fslots = np.where(fids >= 0, np.cumsum(fids >= 0) - 1, -1)
                else:   # the unpinned predicted last first: not predicted (later slot first), then by place
                    prank = [list(pred).index(e) if e in pred else gpu.HY_PRED_MAX for e in ids]
                    order = sorted((s_ for s_ in range(k) if free[s_]), key=lambda s_: -(prank[s_] * 64 + s_))
                    fids, fslots = np.full(k, -1), np.full(k, -1)
                    for r, s_ in enumerate(order[:n_link]):
                        fids[s_], fslots[s_] = ids[s_], r
                lids = np.where((er >= 0) | (fids >= 0) | (xs >= 0), ids, -1)
                lslots = np.where(er >= 0, n_link + er, np.where(xs >= 0, n_link + ne_ + xs,
                                                                 np.where(fids >= 0, fslots, -1)))
                assert xt is None or (xs >= 0).sum() == (2 if table is not None else 3)   # a pinned one is no extra
                assert s[lay.ready] == 9
                np.testing.assert_array_equal(s[lay.h:lay.h + E].view(np.float32), h)
                np.testing.assert_array_equal(s[lay.ids:lay.ids + k], ids)
                np.testing.assert_array_equal(s[lay.cpu_ids:lay.cpu_ids + k],
                                              np.where((gids >= 0) | (lids >= 0), -1, ids))
                np.testing.assert_array_equal(s[lay.wts:lay.wts + k].view(np.float32), w)
                m = bm.download(dtype=np.int32)
                np.testing.assert_array_equal(m[:k], gids)
                np.testing.assert_array_equal(m[k:2 * k], lids)
                np.testing.assert_array_equal(m[2 * k:3 * k], lslots)
                np.testing.assert_array_equal(m[3 * k:4 * k], fids)
                np.testing.assert_array_equal(m[4 * k:5 * k], er)
                np.testing.assert_array_equal(m[5 * k:].view(np.float32),
                                              np.r_[1.0, np.where(gids >= 0, w, 0), np.where(lids >= 0, w, 0)])
                assert not lay.slot(chan, 1).any()                      # the other slots untouched
            row = rng.standard_normal(E).astype(np.float32)
            s[lay.row:lay.row + E] = row.view(np.int32)
            s[lay.done] = 9
            kernels.hybrid_wait(slot, cp, br, E, k, 1 << 36)
            np.testing.assert_array_equal(br.download(dtype=np.float32), row)
            chan[lay.seq] = 10                                           # a token the CPU never serves
            kernels.hybrid_wait(slot, cp, br, E, k, 1 << 20)
            assert np.isnan(br.download(dtype=np.float32)).all()
            bpred.free()
            bx.free()
    finally:
        pb.free()


@variant_params()
def test_hybrid_predict(kernels):
    """The lookahead (cuda8/hybrid_sync.cu): hybrid_predict = R @ (h * s) against numpy (f64; the f32 sum of E
    products: assert_close_sum), hybrid_predict_publish = the n_pred largest logits (ties to the lower index, a NaN
    never chosen, pinned experts -1) into the device pred and the slot's PRED, then PRED_READY = SEQ."""
    from legacy_engine.gpu.hybrid import HybridLayout
    rng = np.random.default_rng(23)
    E, k, ne, n_layer = 300, 5, 40, 3
    lay = HybridLayout(E, k, n_layer)
    R = rng.standard_normal((ne, E)).astype(np.float32)
    h = rng.standard_normal(E).astype(np.float32)
    sc = rng.uniform(0.5, 2, E).astype(np.float32)
    ref = R.astype(np.float64) @ (h.astype(np.float64) * sc)
    mag = np.abs(R.astype(np.float64)) @ np.abs(h.astype(np.float64) * sc)
    logits = rng.standard_normal(ne).astype(np.float32)
    logits[[3, 17]] = logits[9] = 5.0                               # a three-way tie at the top: 3, 9, 17
    logits[20] = np.nan
    pin = np.full(ne, -1, dtype=np.int32)
    pin[9] = 0
    order = sorted((e for e in range(ne) if e != 20), key=lambda e: (-logits[e], e))
    pb, chan, cp = pinned_channel(lay, 6)
    try:
        slot = cp + 4 * lay.slot_offset(1)
        with gpu.Buffer.from_array(R) as bR, gpu.Buffer.from_array(h) as bh, gpu.Buffer.from_array(sc) as bs, \
                gpu.Buffer(4 * ne) as bl, gpu.Buffer.from_array(pin) as bp, gpu.Buffer(4 * gpu.HY_PRED_MAX) as bpr:
            kernels.hybrid_predict(bR, bh, bs, bl, ne, E)
            assert_close_sum(bl.download(dtype=np.float32), ref, mag, E, "hybrid_predict")
            bl.upload(logits)
            for n_pred, table in ((8, bp), (gpu.HY_PRED_MAX, None)):
                kernels.hybrid_predict_publish(bl, ne, n_pred, table, bpr, slot, cp, E, k)
                gpu.synchronize()
                want = np.full(gpu.HY_PRED_MAX, -1, dtype=np.int32)
                top = np.array(order[:n_pred])
                want[:top.size] = np.where(pin[top] >= 0, -1, top) if table is not None else top
                np.testing.assert_array_equal(bpr.download(dtype=np.int32), want)
                s = lay.slot(chan, 1)
                np.testing.assert_array_equal(s[lay.pred:lay.pred + lay.PRED_MAX], want)
                assert s[lay.pred_ready] == 6 and s[lay.ready] == 0
            assert not lay.slot(chan, 0).any() and not lay.slot(chan, 2).any()
            with pytest.raises(ValueError, match="n_pred"):
                kernels.hybrid_predict_publish(bl, ne, gpu.HY_PRED_MAX + 1, None, bpr, slot, cp, E, k)
    finally:
        pb.free()


@variant_params()
def test_hybrid_fetch(kernels):
    """hybrid_fetch (cuda8/hybrid_sync.cu): the link experts' bytes of three tensors (experts of 4 x 16,384 + 37
    words of 16 bytes: the copy's four-load loop and its tail; 64 and 4,096 bytes: short ones) from page-locked
    host memory to their slots in VRAM, exactly."""
    from legacy_engine.core import _native
    rng = np.random.default_rng(22)
    ne, k = 12, 5
    ebs = (16 * (4 * gpu.HYBRID_FETCH_BLOCKS * gpu.HYBRID_THREADS + 37), 64, 4096)
    lids = np.array([3, -1, 11, 0, -1], dtype=np.int32)
    lslots = np.array([0, -1, 1, 2, -1], dtype=np.int32)
    hosts = [gpu.PinnedBuffer(ne * eb) for eb in ebs]
    try:
        for hb in hosts:
            hb.array[:] = rng.integers(0, 256, hb.nbytes, dtype=np.uint8)
        with gpu.Buffer.from_array(lids) as bl, gpu.Buffer.from_array(lslots) as bs, \
                gpu.Buffer(3 * ebs[0]) as d0, gpu.Buffer(3 * ebs[1]) as d1, gpu.Buffer(3 * ebs[2]) as d2:
            dsts = (d0, d1, d2)
            for d in dsts:
                _native.gpu_memset8(d.ptr, 0, d.nbytes)
            kernels.hybrid_fetch(bl, bs, k, [(_native.gpu_host_device_pointer(int(_native.ffi.cast("uintptr_t", hb.ptr))),
                                              d, eb) for hb, d, eb in zip(hosts, dsts, ebs)])
            for hb, d, eb in zip(hosts, dsts, ebs):
                got = d.download().reshape(3, eb)
                src = hb.array.reshape(ne, eb)
                for e, sl in zip(lids, lslots):
                    if e >= 0:
                        np.testing.assert_array_equal(got[sl], src[e])
            with pytest.raises(ValueError, match="multiples of 16"):
                kernels.hybrid_fetch(bl, bs, k, [(0, d0, 24)])
    finally:
        for hb in hosts:
            hb.free()


# ================================================================================================ whole models

KINDS = ("dense", "dense_tied", "moe", "moe_hv_eq_hk")


@pytest.fixture(scope="session")
def tiny_file(tmp_path_factory):
    made, root = {}, tmp_path_factory.mktemp("gpu_tiny")

    def get(kind: str):
        if kind not in made:
            made[kind] = tiny_gguf(kind, root / f"{kind}.f32.gguf")
        return made[kind]
    return get


@pytest.fixture(scope="session")
def cpu_model(tiny_file):
    made = {}

    def get(kind: str) -> Model:
        if kind not in made:
            made[kind] = Model(tiny_file(kind), n_threads=2, pin=False)
        return made[kind]
    return get


_GPU_MODELS: dict = {}


def resident(cpu: Model, n_ctx: int = 4096, chunk: int = 512, **options):
    """A GpuModel of `cpu` with everything in VRAM (GpuModel.resident: passes of `chunk` tokens, states of up to
    n_ctx positions) and GpuOptions(**options)."""
    from legacy_engine.gpu.model import GpuModel, GpuOptions
    return GpuModel.resident(cpu, GpuOptions(**options), n_ctx=n_ctx, chunk=chunk)


def gpu_model(cpu: Model, kind: str, tier: str, arch: int):
    key = (kind, tier, arch)
    if key not in _GPU_MODELS:
        if arch > NATIVE_ARCH:
            pytest.skip(f"compute_{arch} PTX does not run on sm_{NATIVE_ARCH}")
        try:
            _GPU_MODELS[key] = resident(cpu, tier=tier, arch=arch)
        except gpu.UnavailableError as e:   # a variant that cannot be built here
            _GPU_MODELS[key] = e
    g = _GPU_MODELS[key]
    if isinstance(g, Exception):
        (pytest.fail if STRICT else pytest.skip)(f"{gpu.variant_name(tier, arch)}: {g}")
    return g


def cpu_logits(model: Model, ids, decode_from: int) -> np.ndarray:
    st = model.new_state(N_CTX)
    out = [model.forward(st, ids[:decode_from], all_logits=True)]
    out += [model.forward(st, ids[i:i + 1], all_logits=True, chunked=False) for i in range(decode_from, len(ids))]
    return np.concatenate(out)


@pytest.mark.parametrize("variant", VARIANTS, ids=VIDS)
@pytest.mark.parametrize("kind", KINDS)
def test_tiny_model_matches_reference_and_cpu(kind, variant, gpu_device, tiny_file, cpu_model):
    """200 tokens: prefill of 120 in one call on the GPU (all logits), then 80 decode steps; against transformers'
    committed logits with the f32 bar (LOGIT_ABS_F32) and against the CPU engine over every position."""
    tier, arch = variant
    cpu = cpu_model(kind)
    gm = gpu_model(cpu, kind, tier, arch)
    n = 200
    ids = sequence(n, cpu.hparams.n_vocab)
    st = gm.new_state(N_CTX)
    got = [gm.forward(st, ids[:120], all_logits=True)]
    got += [gm.forward(st, ids[i:i + 1], all_logits=True) for i in range(120, n)]
    got = np.concatenate(got)
    assert got.shape == (n, cpu.hparams.n_vocab) and st.pos == n
    d_ref = compare(load_reference(kind), got, n)
    ours = cpu_logits(cpu, ids, 120)
    d_cpu = float(np.abs(got.astype(np.float64) - ours).max())
    print(f"\n{kind} {gpu.variant_name(tier, arch)}: max|Δ| vs transformers {d_ref:.2e}, vs CPU engine {d_cpu:.2e}")
    assert d_ref <= tol.LOGIT_ABS_F32, f"vs transformers: {d_ref}"
    assert d_cpu <= tol.LOGIT_ABS_F32, f"vs the CPU engine: {d_cpu}"


@pytest.mark.parametrize("variant", VARIANTS, ids=VIDS)
@pytest.mark.parametrize("kind", KINDS)
def test_forward_batch_equals_each_alone(kind, variant, gpu_device, tiny_file, cpu_model):
    """Batched decode (GpuModel.forward_batch): 3 sequences of different lengths (GDN states and KV of their own)
    step together for 6 steps; every row within the f32 bar of the CPU engine decoding that sequence alone, and the
    states go on decoding alone afterwards as if batched never happened."""
    tier, arch = variant
    cpu = cpu_model(kind)
    gm = gpu_model(cpu, kind, tier, arch)
    V = cpu.hparams.n_vocab
    seqs = [np.random.default_rng(n).integers(0, V, n + 6).tolist() for n in (9, 30, 65)]
    states = [gm.new_state(N_CTX) for _ in seqs]
    for st, ids in zip(states, seqs):
        gm.forward(st, np.array(ids[:-6]))
    got = [gm.forward_batch(states, np.array([ids[len(ids) - 6 + j] for ids in seqs])) for j in range(6)]
    for s, ids in enumerate(seqs):
        ref = cpu_logits(cpu, np.array(ids), len(ids) - 6)[len(ids) - 6:]
        rows = np.stack([g[s] for g in got])
        d = float(np.abs(rows.astype(np.float64) - ref).max())
        assert d <= tol.LOGIT_ABS_F32, f"{gpu.variant_name(tier, arch)} sequence {s}: {d}"
        assert states[s].pos == len(ids)
    nxt = gm.forward(states[1], np.array([3]))            # alone again: the decode plan's step
    ref2 = cpu_logits(cpu, np.array(seqs[1] + [3]), len(seqs[1]))[-1:]
    assert np.abs(nxt - ref2).max() <= tol.LOGIT_ABS_F32
    with pytest.raises(ValueError):
        gm.forward_batch([states[0], states[0]], np.array([1, 2]))
    assert states[0].pos == len(seqs[0])


def test_server_decode_batches_on_the_gpu(gpu_device, tiny_file):
    """The server's decode step (serve/generate.batched_decode, forced: the server does not batch on the GPU until the
    batched pass is a CUDA graph) on the GPU-resident engine: one pass for every running session, the greedy tokens
    each session gets alone (its rows within the f32 bar: the test above)."""
    from legacy_engine.serve.generate import Engine, batched_decode, batched_decode_mode
    from legacy_engine.serve.sampling import Sampler
    eng = Engine(tiny_file("moe"), n_threads=2, pin=False, gpu=True, n_ctx=256)
    assert "not yet launched as a CUDA graph" in batched_decode_mode(eng)   # the server keeps one graph a sequence
    V = eng.model.hparams.n_vocab
    prompts = [np.random.default_rng(40 + n).integers(0, V, n).tolist() for n in (5, 21, 44)]
    alone = []
    for p in prompts:
        s = eng.session()
        t = int(np.argmax(s.prefill(p)))
        toks = [t]
        for _ in range(7):
            t = int(np.argmax(s.decode(t)))
            toks.append(t)
        alone.append(toks)
    sessions = [eng.session() for _ in prompts]
    firsts = [int(np.argmax(s.prefill(p))) for s, p in zip(sessions, prompts)]
    decode, got = batched_decode(eng, force=True), [[t] for t in firsts]
    for _ in range(7):
        nxt = decode(sessions, [g[-1] for g in got], [Sampler() for _ in sessions])
        for g, t in zip(got, nxt):
            g.append(int(t))
    assert got == alone
    assert [s.pos for s in sessions] == [len(p) + 7 for p in prompts]


QUANT_TYPES = ("q8_0", "q4_0")     # what convert writes (gguf-py's quantisers); K-quants: per kernel in test_gpu.py
QUANT_PREFILL, QUANT_DECODE = 32, 96


@pytest.fixture(scope="session")
def quant_file(tmp_path_factory):
    """The tame tiny checkpoint `kind` (oracle.md pitfall 7) converted with every matrix in `quant` (gguf-py's
    quantiser)."""
    import tempfile
    from fixtures.make_reference import build_checkpoint
    from legacy_engine.tools.convert import convert
    made, root = {}, tmp_path_factory.mktemp("gpu_quant")

    def get(kind: str, quant: str):
        if (kind, quant) not in made:
            with tempfile.TemporaryDirectory() as d:
                hf = build_checkpoint(kind, Path(d) / kind, tame=True)
                made[kind, quant] = convert(hf, root / f"{kind}.{quant}.gguf", quant, progress=False)
        return made[kind, quant]
    return get


def kl_stats(ref: np.ndarray, x: np.ndarray) -> dict:
    """Per-position KL(ref ‖ x) at the quantiles tol.GPU_QUANT_KL_QUANTILES (kl_p50, kl_p90), mean, max; top-5
    overlap (test_quantized's definitions)."""
    from test_quantized import _log_softmax, compare
    lp, lq = _log_softmax(ref), _log_softmax(x)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    lo, hi = tol.GPU_QUANT_KL_QUANTILES
    return dict(compare(ref, x), kl_p50=float(np.quantile(kl, lo)), kl_p90=float(np.quantile(kl, hi)))


def quant_gate(path, tier: str, arch: int, faults: dict | None = None, make=None) -> tuple[list[str], str]:
    """(why the GPU run of `path` fails the quantised gate, empty if it passes; a one-line report). The GPU model
    runs with `faults` injected (negative controls); the CPU reference and baseline never do. make(cpu model) ->
    the GpuModel to gate (default: resident, of tier/arch)."""
    cpu = Model(path, n_threads=4, pin=False)
    try:
        gm = (make(cpu) if make else
              resident(Model(path, n_threads=4, pin=False, _faults=faults) if faults else cpu, tier=tier, arch=arch))
    except gpu.UnavailableError as e:
        (pytest.fail if STRICT else pytest.skip)(f"{gpu.variant_name(tier, arch)}: {e}")
    assert not gm.converted, f"{path}: tensors dequantised at upload: {gm.converted}"
    n = QUANT_PREFILL + QUANT_DECODE
    ids = sequence(n, cpu.hparams.n_vocab)
    st = gm.new_state(n)
    got = np.concatenate([gm.forward(st, ids[:QUANT_PREFILL], all_logits=True)] +
                         [gm.forward(st, ids[i:i + 1]) for i in range(QUANT_PREFILL, n)])
    gm.close()
    cpu.native.set_int8(False)
    ref = cpu_logits(cpu, ids, QUANT_PREFILL)
    cpu.native.set_int8(True)
    got_s, base = kl_stats(ref, got), kl_stats(ref, cpu_logits(cpu, ids, QUANT_PREFILL))
    report = (f"{gpu.variant_name(tier, arch)}{' int8' if gm.int8 else ''}: KL p50/p90/max {got_s['kl_p50']:.2e}/"
              f"{got_s['kl_p90']:.2e}/{got_s['kl_max']:.2e} top5 {got_s['top5']:.3f} (CPU int8 {base['kl_p50']:.2e}/"
              f"{base['kl_p90']:.2e}/{base['kl_max']:.2e} top5 {base['top5']:.3f})")
    if not gm.int8:
        fails = [] if got_s["kl_max"] <= tol.QUANT_KL_FLOOR else [f"f32 paths: KL max {got_s['kl_max']:.3g}"]
        return fails, report
    fails = []
    for key in ("kl_p50",) if cpu.hparams.n_expert else ("kl_p50", "kl_p90"):     # tolerances: why not p90 on MoE
        bound = max(tol.QUANT_KL_RATIO * base[key], tol.QUANT_KL_FLOOR)
        if not got_s[key] <= bound:
            fails.append(f"DP4A {key} {got_s[key]:.3g} > {bound:.3g} (CPU int8 {base[key]:.3g})")
    if not got_s["top5"] >= base["top5"] - tol.GPU_QUANT_TOP5_SLACK:
        fails.append(f"top-5 {got_s['top5']:.3f} < CPU int8 {base['top5']:.3f} - {tol.GPU_QUANT_TOP5_SLACK}")
    return fails, report


@pytest.mark.parametrize("variant", VARIANTS, ids=VIDS)
@pytest.mark.parametrize("quant", QUANT_TYPES)
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_quantized_model_on_gpu(kind, quant, variant, gpu_device, quant_file):
    """A quantised file, 32 tokens of prefill (all logits) then 96 decode steps, against our CPU engine's f32 path on
    the same file: f32 GEMM/GEMVs (fermi, kepler) meet the f32 bar; the dp4a tier (expert and decode GEMVs in DP4A on
    Q8_1 activations) is held to the KL of our CPU integer path (tolerances.GPU_QUANT_KL_QUANTILES says why)."""
    tier, arch = variant
    if arch > NATIVE_ARCH:
        pytest.skip(f"compute_{arch} PTX does not run on sm_{NATIVE_ARCH}")
    fails, report = quant_gate(quant_file(kind, quant), tier, arch)
    print(f"\n{kind} {quant} {report}")
    assert not fails, fails


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_quantized_fault_is_caught(kind, gpu_device, quant_file):
    """Negative control of the quantised gate: the GDN v-heads grouped instead of tiled, on the DP4A tier."""
    fails, report = quant_gate(quant_file(kind, "q8_0"), "dp4a", NATIVE_ARCH, faults={"gdn_grouped": True})
    print(f"\n{kind} q8_0 gdn_grouped {report}")
    assert fails, report


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_fault_is_caught(kind, gpu_device, tiny_file):
    """Negative control: the GDN v-heads grouped instead of tiled (a real bug class) fails the f32 bar on the GPU."""
    cpu = Model(tiny_file(kind), n_threads=2, pin=False, _faults={"gdn_grouped": True})
    gm = resident(cpu, int8=False)
    ids = sequence(32, cpu.hparams.n_vocab)
    got = gm.forward(gm.new_state(64), ids, all_logits=True)
    assert compare(load_reference(kind), got, 32) > 10 * tol.LOGIT_ABS_F32


@pytest.mark.parametrize("kind", ["dense_tied", "moe"])
def test_handoff_gpu_cpu(kind, gpu_device, tiny_file, cpu_model):
    """Prefill on the GPU, decode on the CPU gives the CPU engine's logits (and the reverse); the state bytes the
    two engines hold after the same prefix agree within the f32 bar."""
    cpu = cpu_model(kind)
    gm = resident(cpu, int8=False)
    ids = sequence(200, cpu.hparams.n_vocab)
    ref = cpu_logits(cpu, ids, 100)
    # GPU prefill -> CPU decode
    gst, cst = gm.new_state(N_CTX), cpu.new_state(N_CTX)
    gm.forward(gst, ids[:100])
    gst.to_cpu(cst)
    assert cst.pos == 100
    dec = np.concatenate([cpu.forward(cst, ids[i:i + 1], all_logits=True, chunked=False) for i in range(100, 200)])
    assert np.abs(dec - ref[100:]).max() <= tol.LOGIT_ABS_F32
    # CPU prefill -> GPU decode
    cst2, gst2 = cpu.new_state(N_CTX), gm.new_state(N_CTX)
    cpu.forward(cst2, ids[:100])
    gst2.from_cpu(cst2)
    dec2 = np.concatenate([gm.forward(gst2, ids[i:i + 1], all_logits=True) for i in range(100, 200)])
    assert np.abs(dec2 - ref[100:]).max() <= tol.LOGIT_ABS_F32
    # the recurrent state and KV rows themselves
    a = np.frombuffer(gst.save_recurrent(), np.float32)
    cst3 = cpu.new_state(N_CTX)
    cpu.forward(cst3, ids[:100])
    b = np.frombuffer(cst3.save_recurrent(), np.float32)
    assert np.abs(a - b).max() <= tol.LOGIT_ABS_F32 * max(1.0, np.abs(b).max())


@pytest.mark.parametrize("graphs", [False, True], ids=["replay", "graph"])
def test_decode_plan_matches_unplanned(gpu_device, tiny_file, cpu_model, graphs):
    """Decode steps replayed from a LaunchPlan (position on the device), launch by launch or as one CUDA graph,
    equal the launch-by-launch path within the f32 bar; a plan whose buffers moved (a state with a longer context
    grows the rope table) is recorded again."""
    from legacy_engine import gpu
    if graphs and not gpu.graphs_available():
        pytest.skip("the driver has no CUDA graphs")
    cpu = cpu_model("moe")
    planned, plain = resident(cpu, int8=False, graphs=graphs), resident(cpu, int8=False, plan=False)
    ids = sequence(96, cpu.hparams.n_vocab)
    out = {}
    for name, gm in (("planned", planned), ("plain", plain)):
        st = gm.new_state(64)
        gm.forward(st, ids[:20])
        rows = [gm.forward(st, ids[i:i + 1]) for i in range(20, 40)]
        if name == "planned":
            first_plan = st._plan
            assert first_plan is not None and len(first_plan) > 50
            assert first_plan.graph == graphs
            gm.new_state(512)                   # the rope table grows: st's plan is stale
            rows.append(gm.forward(st, ids[40:41]))
            assert st._plan is not first_plan
        else:
            rows.append(gm.forward(st, ids[40:41]))
        out[name] = np.concatenate(rows)
    assert np.abs(out["planned"] - out["plain"]).max() <= tol.LOGIT_ABS_F32
    ref = cpu_logits(cpu, ids[:41], 20)[20:]
    assert np.abs(out["planned"] - ref).max() <= tol.LOGIT_ABS_F32


def test_prompt_ending_in_a_one_token_chunk_keeps_the_decode_plan(gpu_device, tiny_file, cpu_model):
    """A prompt of chunk + 1 tokens: its last chunk of one token runs as the decode plan's step (an unplanned
    one-token pass allocated decode buffers of its own, so the next token recorded the plan again), with the CPU
    engine's logits."""
    cpu = cpu_model("moe")
    gm = resident(cpu, int8=False, chunk=16)
    ids = sequence(24, cpu.hparams.n_vocab)
    st = gm.new_state(64)
    gm.forward(st, ids[:1])                        # records the plan
    plan, gen = st._plan, gm.scratch.gen
    st.reset()
    got = [gm.forward(st, ids[:17], all_logits=True)] + [gm.forward(st, ids[i:i + 1]) for i in range(17, 24)]
    assert st._plan is plan and gm.scratch.gen == gen
    got = np.concatenate(got)
    assert got.shape == (24, cpu.hparams.n_vocab)
    assert np.abs(got - cpu_logits(cpu, ids, 17)).max() <= tol.LOGIT_ABS_F32


def test_bad_input_is_refused_and_state_kept(gpu_device, tiny_file, cpu_model):
    cpu = cpu_model("dense")
    gm = resident(cpu, int8=False)
    st = gm.new_state(16)
    gm.forward(st, [1, 2, 3])
    for bad in ([], [cpu.hparams.n_vocab], [-1], list(range(14))):
        with pytest.raises(ValueError):
            gm.forward(st, bad)
    assert st.pos == 3
    with pytest.raises(ValueError, match="another model"):
        gm.forward(cpu.new_state(16), [1])


def test_session_and_snapshot_cache_on_gpu(gpu_device, tiny_file, cpu_model):
    """The Engine with gpu=True (what `run --gpu` uses): greedy tokens equal the CPU engine's."""
    from legacy_engine.serve.generate import Engine
    from legacy_engine.serve.sampling import SamplingParams
    path = tiny_file("moe")
    cpu_e = Engine(path, n_threads=2, n_ctx=128, pin=False)
    gpu_e = Engine(path, n_threads=2, n_ctx=128, pin=False, gpu=True, gpu_int8=False)
    ids = [int(t) for t in sequence(32, cpu_e.model.hparams.n_vocab)]
    outs = []
    for e in (cpu_e, gpu_e):
        s = e.session()
        logits = s.prefill(ids)
        toks = []
        for _ in range(16):
            t = int(np.argmax(logits))
            toks.append(t)
            logits = s.prefill([t])
        outs.append(toks)
    assert outs[0] == outs[1]


# ================================================================================================ issue 6: streamed
# experts, the VRAM budget, the split (GPU prefill, CPU decode)

def _stream_model(cpu, pinned, chunk, vram=None, int8=False, cpu_experts=False, link_experts=0, early_experts=0,
                  decode_extras=None, **options):
    """A GpuModel of `cpu` with its routed experts streamed, `pinned` in VRAM, passes of `chunk` tokens, under a budget
    of its planned footprint (or `vram`); cpu_experts: the hybrid decode (its link, early and extra experts);
    GpuOptions(int8=int8, **options)."""
    from legacy_engine.gpu import layout
    from legacy_engine.gpu.model import GpuModel, GpuOptions
    from legacy_engine.gpu.placement import place
    fp = layout.vram_footprint(cpu.file, stream_experts=True, pinned=pinned, n_ctx=N_CTX, chunk=chunk, int8=int8,
                               link_experts=link_experts, early_experts=early_experts)
    pl = place(cpu.file, budget=fp.total if vram is None else vram, n_ctx=N_CTX, chunk=chunk, int8=int8, stream=True,
               pinned=pinned, decode="hybrid" if cpu_experts else "cpu", link_experts=link_experts,
               early_experts=early_experts, decode_extras=decode_extras)
    return GpuModel(cpu, pl, GpuOptions(int8=int8, **options))


@pytest.mark.parametrize("pin_copy", ["kernel", "memcpy"])
@pytest.mark.parametrize("chunk", [16, 2], ids=["prefetch", "on-demand"])
def test_streamed_experts_match_cpu(chunk, pin_copy, gpu_device, tiny_file, cpu_model):
    """Routed experts streamed per layer (some pinned in VRAM, copied device to device into the staging by the copy
    kernel or cuMemcpyDtoD; the rest from the page-locked weight map) under a budget of exactly the planned
    footprint: prefill (chunk 16: every chunk routes to most experts, so the next layer is copied ahead; chunk 2:
    only the experts routed to, after the routing) and decode steps give the CPU engine's logits within the f32
    bar."""
    cpu = cpu_model("moe")
    pinned = {0: [0, 5, 6], 3: [1], 7: list(range(cpu.hparams.n_expert))}
    gm = _stream_model(cpu, pinned, chunk)
    gm.res.pin_copy_kernel = pin_copy == "kernel"
    try:
        assert gm.stream and not gm.plan
        ids = sequence(80, cpu.hparams.n_vocab)
        st = gm.new_state(N_CTX)
        got = np.concatenate([gm.forward(st, ids[:60], all_logits=True)] +
                             [gm.forward(st, ids[i:i + 1]) for i in range(60, 80)])
        ref = cpu_logits(cpu, ids, 60)
        d = float(np.abs(got.astype(np.float64) - ref).max())
        stats = gm.stream_report()
        peak = gpu.mem_stats()["peak"]
        # routing statistics: every (token, slot) of the 80 tokens counted once per MoE layer
        assert len(gm.route_counts) == cpu.hparams.n_layer
        assert all(int(c.sum()) == 80 * cpu.hparams.n_expert_used for c in gm.route_counts.values())
        print(f"\nchunk {chunk}: max|Δ| {d:.2e}; {stats}; {gm.describe()}")
        assert d <= tol.LOGIT_ABS_F32
        assert stats["h2d_bytes"] > 0 and stats["d2d_bytes"] > 0
        assert stats["copy_busy_s"] > 0                         # the copy stream's events around its copies
        assert "page-locked in place" in gm.host_pinned_why
        # the token embedding is read from the page-locked map (layout.host_embedding), not uploaded
        assert gm.embd_where == "host" and "token embedding read from host memory" in gm.describe()
    finally:
        gm.close()
    assert gpu.mem_stats()["budget"] < 0                      # close() lifted it
    assert peak > 0


def test_streamed_model_without_a_page_locked_map(gpu_device, tiny_file, cpu_model, monkeypatch):
    """Where the weight map cannot be page-locked (cuMemHostRegister refused), the experts are copied from pageable
    memory and the token embedding is read from a page-locked copy of it: the same logits as the CPU engine, the
    reason in describe()."""
    from legacy_engine.core import _native
    from legacy_engine.core.errors import NativeError

    def refuse(*_a, **_k):
        raise NativeError("le_gpu_host_register: refused (test)")

    monkeypatch.setattr(_native, "gpu_host_register", refuse)
    cpu = cpu_model("moe")
    gm = _stream_model(cpu, {0: [0, 5]}, 16)
    try:
        ids = sequence(40, cpu.hparams.n_vocab)
        st = gm.new_state(N_CTX)
        got = np.concatenate([gm.forward(st, ids[:30], all_logits=True)] +
                             [gm.forward(st, ids[i:i + 1]) for i in range(30, 40)])
        d = float(np.abs(got.astype(np.float64) - cpu_logits(cpu, ids, 30)).max())
        assert d <= tol.LOGIT_ABS_F32, d
        assert "NOT page-locked" in gm.host_pinned_why and "a page-locked copy" in gm.describe()
    finally:
        gm.close()


def test_budget_is_planned_before_anything_is_allocated(gpu_device, tiny_file, cpu_model):
    from legacy_engine.core.errors import PlanningError
    from legacy_engine.gpu import layout
    cpu = cpu_model("moe")
    fp = layout.vram_footprint(cpu.file, stream_experts=True, n_ctx=N_CTX, chunk=16, int8=False)
    used = gpu.mem_stats()["used"]
    with pytest.raises(PlanningError, match="staging"):
        _stream_model(cpu, {}, 16, vram=fp.total - 1)
    assert gpu.mem_stats()["used"] == used                     # nothing was uploaded
    gm = _stream_model(cpu, {}, 16)
    try:
        with pytest.raises(PlanningError, match="planned for"):
            gm.new_state(2 * N_CTX)
    finally:
        gm.close()


def test_budget_holds_under_ballast(gpu_device, tiny_file, cpu_model):
    """A ballast allocation leaves only the planned footprint (+ 64 MiB) free on the device: the streamed model
    loads, prefills and decodes inside its budget, and its peak use stays under the plan."""
    from legacy_engine.gpu import layout
    cpu = cpu_model("moe")
    pinned = {2: [0, 1]}
    fp = layout.vram_footprint(cpu.file, stream_experts=True, pinned=pinned, n_ctx=N_CTX, chunk=16, int8=False)
    free = gpu.mem_stats()["free_bytes"]
    ballast = gpu.Buffer(free - fp.total - 64 * 2**20, "ballast")
    try:
        base = gpu.mem_stats()["used"]
        gm = _stream_model(cpu, pinned, 16)
        try:
            st = gm.new_state(N_CTX)
            ids = sequence(48, cpu.hparams.n_vocab)
            gm.forward(st, ids[:40])
            for i in range(40, 48):
                gm.forward(st, ids[i:i + 1])
            gpu.synchronize()
            used_by_model = gpu.mem_stats()["used"] - base
            print(f"\nfree after ballast {(free - ballast.nbytes) / 2**20:.0f} MiB, model uses "
                  f"{used_by_model / 2**20:.1f} MiB of a {fp.total / 2**20:.1f} MiB plan")
            assert used_by_model <= fp.total
            del st
        finally:
            gm.close()
    finally:
        ballast.free()


def greedy(m, st, logits, steps: int) -> list[int]:
    """The argmax of the last row of `logits`, then `steps` greedy decode steps of model m on state st."""
    out = [int(np.argmax(logits[-1]))]
    for _ in range(steps):
        out.append(int(np.argmax(m.forward(st, [out[-1]])[-1])))
    return out


def split_vs_cpu(cpu, gm, prompt, steps: int, first: int | None = None):
    """SplitModel(cpu, gm, min_gpu_tokens=8) and the CPU engine each prefill `prompt` (prompt[:first] as a pass of its
    own first, when given) and decode `steps` greedy tokens -> (split, {engine: tokens}, {engine: state})."""
    from legacy_engine.plan.split import SplitModel
    split = SplitModel(cpu, gm, min_gpu_tokens=8)
    runs, states = {}, {}
    for name, m in (("split", split), ("cpu", cpu)):
        st = states[name] = m.new_state(N_CTX)
        if first is not None:
            m.forward(st, prompt[:first])
        runs[name] = greedy(m, st, m.forward(st, prompt[first or 0:]), steps)
    return split, runs, states


def test_split_greedy_tokens_equal_cpu(gpu_device, tiny_file, cpu_model):
    """The split engine (GPU prefill with streamed, partly pinned experts under a small budget; CPU decode) and
    the CPU engine produce the same greedy tokens; the prompt ran on the GPU, the decode steps on the CPU."""
    cpu = cpu_model("moe")
    gm = _stream_model(cpu, {1: [2, 3], 4: [0]}, 16)
    try:
        split, runs, _ = split_vs_cpu(cpu, gm, sequence(50, cpu.hparams.n_vocab), 30)
        assert runs["split"] == runs["cpu"]
        assert split.passes == {"gpu": 1, "cpu": 30, "hybrid": 0}
    finally:
        gm.close()


@pytest.mark.parametrize("graphs,link,look,early,extras",
                         [(False, 0, False, 0, False), (True, 0, False, 0, False), (True, 1, False, 0, False),
                          (False, 1, False, 0, False), (True, 1, True, 0, False), (True, 1, False, 2, False),
                          (True, 0, False, 1, False), (True, 0, False, 0, True), (False, 1, False, 0, True),
                          (True, 1, False, 1, True)],
                         ids=["replay", "graph", "graph-link1", "replay-link1", "graph-link1-lookahead",
                              "graph-link1-early2", "graph-early1", "graph-extras", "replay-link1-extras",
                              "graph-link1-early1-extras"])
def test_hybrid_decode_matches_cpu(graphs, link, look, early, extras, gpu_device, tiny_file, cpu_model):
    """The hybrid decode (cpu_experts): a streamed prefill, then decode steps whose routed experts are split
    between the GPU (pinned: some of layer 0 and 3, all of layer 7) and the CPU (le_hybrid_serve through the
    channel), replayed from a launch plan (one CUDA graph per token, the CPU serving every layer after its launch;
    or launch by launch with one host step per MoE layer); link1: the GPU also runs one expert per layer that is
    not pinned, fetching its weights from the page-locked host map (hybrid_fetch); lookahead: the next layer's
    experts predicted and loaded by the CPU ahead (the link's expert then the one predicted last). The CPU engine's
    logits within the f32 bar; every MoE layer of every step was served; routing counted; with the lookahead, the
    CPU loaded experts ahead and most of the ones it ran were among them. extras: the decode keeps every other
    expert of layer 3 (and one of layer 0) in the staging between prefills (decode_extras), copied back after each
    prefill (_extras_check_after_prefill)."""
    if graphs and not gpu.graphs_available():
        pytest.skip("the driver has no CUDA graphs")
    cpu = cpu_model("moe")
    hp = cpu.hparams
    pinned = {0: [0, 5, 6], 3: [1], 7: list(range(hp.n_expert))}
    dx = {3: [e for e in range(hp.n_expert) if e != 1], 0: [2]} if extras else None
    gm = _stream_model(cpu, pinned, 16, cpu_experts=True, graphs=graphs, link_experts=link,
                       lookahead=look, early_experts=early, decode_extras=dx)
    try:
        assert gm.plan and gm.graphs == graphs
        ids = sequence(80, hp.n_vocab)
        st = gm.new_state(N_CTX)
        got = np.concatenate([gm.forward(st, ids[:60], all_logits=True)] +
                             [gm.forward(st, ids[i:i + 1]) for i in range(60, 80)])
        ref = cpu_logits(cpu, ids, 60)
        d = float(np.abs(got.astype(np.float64) - ref).max())
        print(f"\nhybrid ({'graph' if graphs else 'replay'}): max|Δ| {d:.2e}; {gm.hybrid_stats}")
        assert d <= tol.LOGIT_ABS_F32
        assert st._plan is not None and st._plan.host_steps == (0 if graphs else hp.n_layer)
        assert gm.hybrid_stats["steps"] == 20 * hp.n_layer
        # layer 7 is all on the GPU; the other layers send most of their experts to the CPU (less the link's)
        assert 0 < gm.hybrid_stats["cpu_experts"] <= 20 * (hp.n_layer - 1) * (hp.n_expert_used - link)
        if not link and not early:
            assert gm.hybrid_stats["cpu_experts"] > 20 * (hp.n_layer - 1) * (hp.n_expert_used - 1) // 2
        assert all(int(c.sum()) == 80 * hp.n_expert_used for c in gm.route_counts.values())
        hs = gm.hybrid_stats
        if look:    # the tiny model's layers are random: the prediction is a weak one, but it is one
            assert hs["prefetch_aimed"] > 0 and hs["prefetch_hits"] > 0
        else:
            assert hs["prefetch_aimed"] == 0
        if early:   # copied every MoE layer after the first (all but the all-pinned layer 7's, whose ids are -1)
            print(f"early: {hs['early_copied']} copied, {hs['early_in_time']} in time, {hs['early_routed']} routed")
            assert hs["early_copied"] > 0 and hs["early_routed"] > 0
        else:
            assert hs["early_copied"] == 0
        if extras:
            assert gm.hy.extras_state == "ready" and gm.hy.extras_refills == 1
            _extras_check_after_prefill(gm, cpu, ids)
        else:
            assert gm.hy.extras_refills == 0
    finally:
        gm.close()


@pytest.mark.parametrize("extras", [False, True], ids=["pins", "pins-extras"])
def test_repin_follows_the_routing(extras, gpu_device, tiny_file, cpu_model):
    """planner.repin on the routing counted since the pins were chosen (GpuModel.recent_routes) that favours other
    experts (enough routes, the best pins for them taking REPIN_DRIFT more of the work) gives a new placement, and
    GpuModel.apply re-uploads the pins (and the decode extras re-chosen around them), the hybrid's tables follow, the
    decode plan is recorded again; prefill and decode after it give the CPU engine's logits; without new routes
    nothing changes."""
    from legacy_engine.plan import planner

    def maybe_repin(gm) -> bool:           # what Engine.repin does between requests
        new = planner.repin(gm.file, gm.placement, gm.recent_routes())
        if new is not None:
            gm.apply(new)
        return new is not None
    cpu = cpu_model("moe")
    hp = cpu.hparams
    pinned = {i: [0, 1] for i in range(hp.n_layer)}
    dx = {3: [2, 3]} if extras else None
    gm = _stream_model(cpu, pinned, 16, cpu_experts=True, decode_extras=dx)
    try:
        ids = sequence(40, hp.n_vocab)
        st = gm.new_state(N_CTX)
        gm.forward(st, ids[:20])
        gm.forward(st, ids[20:21])
        gen0 = gm.scratch.gen
        assert not maybe_repin(gm)                       # too few routes yet
        hot = {i: np.zeros(hp.n_expert, np.int64) for i in range(hp.n_layer)}
        for c in hot.values():
            c[[5, 6]] = planner.REPIN_MIN_ROUTES * hp.n_expert          # experts 5 and 6 now take the work
        for i, c in hot.items():
            gm.route_counts[i] = gm.route_counts.get(i, np.zeros(hp.n_expert, np.int64)) + c
        assert maybe_repin(gm) and gm.repins == 1 and gm.scratch.gen > gen0
        assert all(set(v) == {5, 6} for v in gm.pinned.values())
        assert all((gm.res.pin_idx[i][[5, 6]] == [0, 1]).all() and (gm.res.pin_idx[i][[0, 1]] == -1).all()
                   for i in gm.res.pin_idx)
        if extras:
            assert all(not set(v) & {5, 6} for v in gm.decode_extras.values())
        assert not maybe_repin(gm)                       # nothing new since
        st = gm.new_state(N_CTX)
        got = np.concatenate([gm.forward(st, ids[:30], all_logits=True)] +
                             [gm.forward(st, ids[i:i + 1]) for i in range(30, 40)])
        assert np.abs(got.astype(np.float64) - cpu_logits(cpu, ids, 30)).max() <= tol.LOGIT_ABS_F32
    finally:
        gm.close()


def _extras_check_after_prefill(gm, cpu, ids):
    """A second prompt after a hybrid decode with decode_extras (all of layer 3's experts on the GPU: pinned or
    extra): its prefill overwrote the staging, so the first step leaves layer 3's unpinned experts to the CPU and
    copies the extras back; once they are in, the CPU gets none of layer 3's; logits = the CPU engine's."""
    hp, hy = cpu.hparams, gm.hy.ch
    lay, k = hy["layout"], hp.n_expert_used
    st = gm.new_state(N_CTX)
    first = gm.forward(st, ids[:30], all_logits=True)
    assert gm.hy.extras_state == "empty"
    rows, cpu_runs = [], []
    for i in range(30, 45):
        rows.append(gm.forward(st, ids[i:i + 1]))
        sl = lay.slot(hy["arr"], 3)
        routed, on_cpu = sl[lay.ids:lay.ids + k].copy(), sl[lay.cpu_ids:lay.cpu_ids + k].copy()
        cpu_runs.append((gm.hy.extras_state, routed, on_cpu))
    assert gm.hy.extras_refills == 2 and gm.hy.extras_state == "ready"
    _state, routed, on_cpu = cpu_runs[0]           # the step that issued the copies: the CPU ran them
    if not gm.link_experts and not gm.early_experts:
        np.testing.assert_array_equal(on_cpu, np.where(routed == 1, -1, routed))
    else:                                           # less the link's and early ones
        assert (on_cpu >= 0).sum() >= (routed != 1).sum() - gm.link_experts - gm.early_experts
    used = [c for s_, _r, c in cpu_runs[2:] if s_ == "ready"]
    assert used and all((c == -1).all() for c in used)
    got = np.concatenate([first] + rows)
    assert np.abs(got.astype(np.float64) - cpu_logits(cpu, ids[:45], 30)).max() <= tol.LOGIT_ABS_F32


@pytest.mark.parametrize("link", [0, 1], ids=["link0", "link1"])
def test_hybrid_int8_decode_on_quantized_file(link, gpu_device, quant_file):
    """The hybrid decode on the int8 (DP4A) paths of a Q8_0 file (the f32 tiny models above never take them):
    streamed prefill, pinned experts on two layers (some, all), the other experts on the CPU's integer kernels (and
    one per layer over the link); held to the quantised gate (KL to the CPU's f32 path at the level of the CPU's
    own integer path). It caught h's Q8_1 overwritten by the shared expert's before the pinned and link experts
    read it (2026-11-25)."""
    def make(cpu):
        moe = [i for i in range(cpu.hparams.n_layer) if f"blk.{i}.ffn_gate_exps.weight" in cpu.file.tensors]
        pinned = {moe[0]: [0, 1, 2], moe[-1]: list(range(cpu.hparams.n_expert))}
        return _stream_model(cpu, pinned, 16, cpu_experts=True, link_experts=link, int8=True)
    fails, report = quant_gate(quant_file("moe", "q8_0"), "dp4a", NATIVE_ARCH, make=make)
    print(f"\nhybrid int8 link{link} {report}")
    assert not fails, fails


def test_split_hybrid_greedy_tokens_equal_cpu(gpu_device, tiny_file, cpu_model):
    """SplitModel over a hybrid GPU model: the sequence stays on the GPU (GpuState); the prompt runs streamed, a
    short follow-up pass and the decode steps run as hybrid steps; the greedy tokens equal the CPU engine's."""
    from legacy_engine.gpu.state import GpuState
    cpu = cpu_model("moe")
    gm = _stream_model(cpu, {1: [2, 3], 4: [0]}, 16, cpu_experts=True)
    try:
        # the follow-up pass: 6 tokens, below min_gpu_tokens
        split, runs, states = split_vs_cpu(cpu, gm, sequence(50, cpu.hparams.n_vocab), 30, first=44)
        assert isinstance(states["split"], GpuState)
        assert runs["split"] == runs["cpu"]
        assert split.passes == {"gpu": 1, "cpu": 0, "hybrid": 36}
    finally:
        gm.close()


@pytest.mark.parametrize("stream", [False, True], ids=["resident", "streamed"])
def test_long_pass_head_in_pieces(stream, gpu_device, tiny_file, cpu_model):
    """A pass longer than the head's rows (chunk 600 > 512 resident, > 32 streamed) with all logits: the head runs
    in pieces; equal to the CPU."""
    from legacy_engine.gpu.layout import LOGIT_ROWS, STREAM_LOGIT_ROWS
    from legacy_engine.gpu.model import GpuModel, GpuOptions
    from legacy_engine.gpu.placement import place
    cpu = cpu_model("moe")
    gm = GpuModel(cpu, place(cpu.file, n_ctx=640, chunk=600, int8=False, stream=stream), GpuOptions(int8=False))
    try:
        ids = sequence(600, cpu.hparams.n_vocab)
        assert gm.logit_rows == (STREAM_LOGIT_ROWS if stream else LOGIT_ROWS) and len(ids) > gm.logit_rows
        got = gm.forward(gm.new_state(640), ids, all_logits=True)
        ref = cpu.forward(cpu.new_state(640), ids, all_logits=True)
        assert got.shape == ref.shape
        assert np.abs(got.astype(np.float64) - ref).max() <= tol.LOGIT_ABS_F32
    finally:
        gm.close()


@pytest.mark.parametrize("form", ["resident", "streamed", "streamed-paced", "resident-int8"])
def test_last_layer_ffn_on_the_head_rows(form, gpu_device, tiny_file, quant_file, cpu_model):
    """A pass runs its last layer's FFN on the rows the head reads only (GpuModel._forward_chunk: none in a pass
    that wants no logits, the last row for the last logits): passes of 64, 64 and 22 tokens give the last logits of
    the CPU and of the all-logits passes' last row (f32: within the f32 bar; int8 on the Q8_0 file: one row's GEMVs
    against the pass's GEMMs on the same Q8_1 rows, within the f32 bar too). Streamed, the last layer brings in the
    last token's experts once and nothing in the passes that want no logits: fetched by the GPU from the
    page-locked map (Residency.fetch), or staged by the host when the link is paced (simulate_link: the copy
    stream's pacing)."""
    from legacy_engine.gpu.model import GpuModel, GpuOptions
    from legacy_engine.gpu.placement import place
    int8 = form.endswith("int8")
    cpu = Model(quant_file("moe", "q8_0"), n_threads=2, pin=False) if int8 else cpu_model("moe")
    hp = cpu.hparams
    ids = sequence(150, hp.n_vocab)
    opts = {"tier": "dp4a", "int8": True} if int8 else {"int8": False}
    if form == "streamed-paced":
        opts["simulate_link"] = 1000.0
    gm = GpuModel(cpu, place(cpu.file, n_ctx=N_CTX, chunk=64, int8=int8, stream=form.startswith("streamed")),
                  GpuOptions(**opts))
    brought = []
    if form.startswith("streamed"):
        stage, fetch = gm.res.stage, gm.res.fetch
        gm.res.stage = lambda i, want, wait=True: brought.append((i, "stage", len(want))) or stage(i, want, wait)
        gm.res.fetch = lambda i, e, k: brought.append((i, "fetch", k)) or fetch(i, e, k)
    try:
        last = gm.forward(gm.new_state(N_CTX), ids)
        last_layer = [b[1:] for b in brought if b[0] == hp.n_layer - 1]
        pinned_map = gm.res.host is not None
        full = gm.forward(gm.new_state(N_CTX), ids, all_logits=True)
    finally:
        gm.close()
    ref = cpu.forward(cpu.new_state(N_CTX), ids)
    assert last.shape == (1, hp.n_vocab) and full.shape == (len(ids), hp.n_vocab)
    assert np.abs(last.astype(np.float64) - full[-1]).max() <= tol.LOGIT_ABS_F32
    if not int8:             # the int8 paths against the CPU's f32: the quantised gates above
        assert np.abs(last.astype(np.float64) - ref[-1]).max() <= tol.LOGIT_ABS_F32
    if form == "streamed" and pinned_map:
        assert last_layer == [("fetch", hp.n_expert_used)], brought
    elif form.startswith("streamed"):
        assert len(last_layer) == 1 and last_layer[0][0] == "stage", brought
        assert 1 <= last_layer[0][1] <= hp.n_expert_used, brought


@pytest.mark.parametrize("int8", [False, True], ids=["f32", "int8"])
def test_sorted_pairs_bit_identical(int8, gpu_device, tiny_file, quant_file):
    """Prefill with the (token, expert) pairs in expert order (gathered, then scattered back) gives bit-identical
    logits to the pairs in token order: every pair runs the same GEMV on the same row (int8: the Q8_0 file, DP4A)."""
    path = quant_file("moe", "q8_0") if int8 else tiny_file("moe")
    cpu = Model(path, n_threads=2, pin=False)
    ids = sequence(100, cpu.hparams.n_vocab)
    out = []
    for sort in (True, False):
        gm = resident(cpu, tier="dp4a" if int8 else None, int8=int8, sort_pairs=sort, grouped_experts=False)
        try:
            out.append(gm.forward(gm.new_state(128), ids, all_logits=True))
        finally:
            gm.close()
    np.testing.assert_array_equal(out[0], out[1])


@pytest.mark.parametrize("kind", ["moe", "moe_hv_eq_hk"])
def test_grouped_experts_match_reference(kind, gpu_device, tiny_file, cpu_model):
    """The routed experts as grouped GEMMs (tiles of one expert's tokens; the default for passes of several tokens):
    prefill logits against transformers and the CPU engine within the f32 bar, and streamed too."""
    from legacy_engine.gpu.model import GpuModel, GpuOptions
    from legacy_engine.gpu.placement import place
    cpu = cpu_model(kind)
    ids = sequence(200, cpu.hparams.n_vocab)
    for kw in ({}, {"stream": True, "pinned": {1: [0, 2]}, "chunk": 64}):
        gm = GpuModel(cpu, place(cpu.file, int8=False, **kw), GpuOptions(int8=False, grouped_experts=True))
        try:
            got = gm.forward(gm.new_state(N_CTX), ids, all_logits=True)
        finally:
            gm.close()
        assert compare(load_reference(kind), got, 200) <= tol.LOGIT_ABS_F32
        ref = cpu.forward(cpu.new_state(N_CTX), ids, all_logits=True)
        assert np.abs(got.astype(np.float64) - ref).max() <= tol.LOGIT_ABS_F32


@pytest.mark.parametrize("decode", ["cpu", "hybrid"])
def test_engine_runs_split_when_the_model_does_not_fit(decode, gpu_device, tiny_file, cpu_model):
    """`run --gpu --vram SIZE --decode cpu|hybrid` with a budget below the resident footprint: the Engine plans the
    split (experts streamed, GPU prefill; decode on the CPU or hybrid) and its greedy text equals the CPU engine's."""
    from legacy_engine.gpu import layout
    from legacy_engine.serve.generate import Engine
    from legacy_engine.serve.sampling import SamplingParams
    from legacy_engine.plan.split import SplitModel
    path = tiny_file("moe")
    cpu = cpu_model("moe")
    res = layout.vram_footprint(cpu.file, n_ctx=128, int8=True)
    cpu_e = Engine(path, n_threads=2, n_ctx=128, pin=False)
    gpu_e = Engine(path, n_threads=2, n_ctx=128, pin=False, gpu=True, gpu_vram=res.total - 1, gpu_min_tokens=8,
                   gpu_decode=decode)
    try:
        assert isinstance(gpu_e.model, SplitModel) and gpu_e.placement.stream
        assert "streamed experts" in gpu_e.placement.why
        prompt = "The quick brown fox jumps over the lazy dog. " * 3
        outs = [e.session().generate(prompt, max_tokens=16, params=SamplingParams(temperature=0.0)).text
                for e in (cpu_e, gpu_e)]
        assert outs[0] == outs[1]
        assert gpu_e.placement.decode == decode and f"decode {decode} (asked)" in gpu_e.placement.why
        assert gpu_e.model.passes["gpu"] >= 1 and gpu_e.model.passes[decode] >= 15
    finally:
        gpu_e.gpu.close()


SAMPLE_NEXT_PARAMS = {"greedy": dict(), "top_k": dict(temperature=0.8, top_k=5),
                      "top_p": dict(temperature=0.8, top_p=0.95), "min_p": dict(temperature=1.2, min_p=0.1),
                      "all": dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02), "temp": dict(temperature=0.9),
                      "penalties": dict(temperature=0.8, top_p=0.95, presence_penalty=0.5)}


@pytest.mark.parametrize("graphs", [False, True], ids=["replay", "graph"])
@pytest.mark.parametrize("pname", list(SAMPLE_NEXT_PARAMS))
def test_sample_next_draws_what_the_row_draws(pname, graphs, gpu_device, tiny_file, cpu_model):
    """GpuModel.sample_next (the draw's candidates chosen in VRAM, gpu_sample) gives, for the same seed, the tokens
    Sampler.sample gives on the downloaded rows; the row itself is used for temperature alone and penalties."""
    from legacy_engine.serve.sampling import Sampler, SamplingParams
    if graphs and not gpu.graphs_available():
        pytest.skip("the driver has no CUDA graphs")
    cpu = cpu_model("moe")
    gm = resident(cpu, int8=False, graphs=graphs)
    ids = sequence(12, cpu.hparams.n_vocab)
    kw = SAMPLE_NEXT_PARAMS[pname]
    got, want = [], []
    for out, device in ((got, True), (want, False)):
        st, s = gm.new_state(64), Sampler(SamplingParams(seed=7, **kw))
        gm.forward(st, ids[:-1], want_logits=False)
        hist, tok = list(ids[:-1]), ids[-1]
        for _ in range(24):
            hist.append(tok)
            tok = gm.sample_next(st, tok, s, hist) if device else s.sample(gm.forward(st, [tok])[0], hist)
            out.append(tok)
    assert got == want
    row = pname in ("temp", "penalties")
    assert gm._sampler.stats == {"candidates": 0 if row else 24, "window": 0, "row": 24 if row else 0}
    gm.close()


@pytest.mark.parametrize("variant", VARIANTS, ids=VIDS)
def test_image_rows_and_mrope_match_cpu(variant, gpu_device, tiny_file, cpu_model):
    """An image's pass on the GPU (embedding rows where tokens are -1, M-RoPE positions), split over two passes,
    then decode steps at the state's rope delta (the decode plan's rope position), against the CPU engine; the
    delta crosses the GPU -> CPU handoff."""
    from legacy_engine.format.multimodal import ImageSpan, rope_positions
    tier, arch = variant
    cpu = cpu_model("moe")
    gm = gpu_model(cpu, "moe", tier, arch)
    hp = cpu.hparams
    n, span = 60, ImageSpan(10, (1, 4, 6), "x")               # 24 image rows at [10, 34)
    ids = np.array(sequence(n, hp.n_vocab), dtype=np.int64)
    ids[span.start:span.end] = -1
    embd = np.random.default_rng(3).standard_normal((n, hp.n_embd)).astype(np.float32)
    pos = rope_positions(n, [span])
    out = {}
    for name, model in (("cpu", cpu), ("gpu", gm)):
        st = model.new_state(N_CTX)
        got = [model.forward(st, ids[:20], all_logits=True, embd=embd[:20], positions=pos[:20]),
               model.forward(st, ids[20:], all_logits=True, embd=embd[20:], positions=pos[20:])]
        assert st.rope_delta == int(pos.max()) + 1 - n
        got += [model.forward(st, [t], all_logits=True) for t in (5, 9, 2)]
        out[name] = np.concatenate(got)
        if name == "gpu":
            back = cpu.new_state(N_CTX)
            st.to_cpu(back)
            assert (back.pos, back.rope_delta) == (st.pos, st.rope_delta)
    d = float(np.abs(out["gpu"].astype(np.float64) - out["cpu"]).max())
    print(f"\nimage rows {gpu.variant_name(tier, arch)}: max|Δ| vs the CPU engine {d:.2e}")
    assert d <= tol.LOGIT_ABS_F32, d


GDN_GEMMS = ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_out")
ATTN_GEMMS = ("attn_q", "attn_k", "attn_v", "attn_output")


@pytest.mark.parametrize("tier", ["kepler", "dp4a"])
def test_profile_counts_each_prefill_gemm(tier, gpu_device, quant_file):
    """GpuModel.profile on a Q8_0 pass of 40 tokens: the GEMMs of the GDN and attention phases count 2 operations per
    weight per token of exactly the matrices those layers multiply (bench gpu's TFLOP/s and % of peak rest on it),
    with the kernel the tier runs; each phase's GEMM time fits in the phase's."""
    cpu = Model(quant_file("dense", "q8_0"), n_threads=2, pin=False)
    gm = resident(cpu, tier=tier, arch=NATIVE_ARCH)
    n = 40
    try:
        gm.profile(True)
        gm.forward(gm.new_state(64), sequence(n, cpu.hparams.n_vocab))
        phases, gemms = gm.profile_report(), gm.profile_gemms()
        gm.profile(False)
    finally:
        gm.close()
    int8 = ("gemm_mma" if gm.k.has_mma else "gemm_dp4a") if tier == "dp4a" else "gemm_f32"
    want: dict = {}
    for i, L in enumerate(gm.layers):
        ph, slots = ("gdn", GDN_GEMMS) if cpu.hparams.recurrent[i] else ("attention", ATTN_GEMMS)
        for s in slots:
            key = (ph, "gemm_f32" if L[s].qtype == gpu.F32 else int8)
            want[key] = want.get(key, 0) + 2 * n * L[s].nrows * L[s].ncols
    assert {p for p, _ in want} == {"gdn", "attention"} and any(m == int8 for _, m in want)
    assert {key: gemms[key][1] for key in gemms if key[0] in ("gdn", "attention")} == want
    for ph in ("gdn", "attention"):
        assert 0 < sum(v[0] for (p, _), v in gemms.items() if p == ph) <= phases[ph]
    assert set(p for p, _ in gemms) <= set(phases) and {"gdn", "attention", "ffn rest"} <= set(phases)
