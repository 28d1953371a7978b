"""le_hybrid_serve / le_hybrid_release (native/hybrid.c): the CPU's half of the hybrid decode's channel
(native/include/le_hybrid.h). A Python thread plays the GPU's kernels (cuda8/hybrid_sync.cu): it publishes each
layer's h, ids, cpu_ids and weights, sets READY, waits for DONE and reads ROW; the row must be exactly what
le_moe_routed gives for those inputs (the same call on the same data), and the counts, stats, timeouts and releases
are what the header promises. The layout used here is gpu_model's Python mirror (HybridLayout), so a mismatch with
the C macros fails these tests. The GPU's side is tested in tests/test_gpu_model.py (hybrid decode vs CPU)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from legacy_engine.core._native import lib
from legacy_engine.core.errors import NativeError
from legacy_engine.gpu.model import HybridLayout
from legacy_engine.tools.make_model import make_model
from legacy_engine.cpu.model import Model

PLAY_TIMEOUT_S = 30.0       # the playing thread's own wait for DONE (a failure, never reached when serve works)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_model("tiny-moe", str(tmp_path_factory.mktemp("hy") / "moe.q4_k_m.gguf"), layers=3,
                      quant="q4_k_m", progress=False)
    return Model(path, n_threads=2, pin=False)


def channel(model):
    hp = model.hparams
    lay = HybridLayout(hp.n_embd, hp.n_expert_used, hp.n_layer)
    return lay, np.zeros(lay.channel_words, dtype=np.int32)


def publish(lay, chan, layer, seq, h, ids, cpu_ids, wts):
    s = lay.slot(chan, layer)
    s[lay.h:lay.h + lay.E] = h.view(np.int32)
    s[lay.ids:lay.ids + lay.k] = ids
    s[lay.cpu_ids:lay.cpu_ids + lay.k] = cpu_ids
    s[lay.wts:lay.wts + lay.k] = wts.view(np.int32)
    s[lay.ready] = seq


def play_gpu(lay, chan, seq, tokens, rows, errors):
    """tokens: [(layer, h, ids, cpu_ids, wts)] in order; rows: out list of the ROW read after each DONE."""
    import time
    try:
        for layer, h, ids, cpu_ids, wts in tokens:
            publish(lay, chan, layer, seq, h, ids, cpu_ids, wts)
            s, t0 = lay.slot(chan, layer), time.monotonic()
            while s[lay.done] != seq:
                if time.monotonic() - t0 > PLAY_TIMEOUT_S:
                    raise TimeoutError(f"layer {layer}: no DONE")
            rows.append(s[lay.row:lay.row + lay.E].view(np.float32).copy())
    except Exception as e:          # reported by the test
        errors.append(e)


def draw(rng, hp, layer, mask):
    h = rng.standard_normal(hp.n_embd).astype(np.float32)
    ids = rng.choice(hp.n_expert, hp.n_expert_used, replace=False).astype(np.int32)
    wts = rng.dirichlet(np.ones(hp.n_expert_used)).astype(np.float32)
    return layer, h, ids, np.where(mask, -1, ids).astype(np.int32), wts


def test_serve_matches_moe_routed(model):
    hp = model.hparams
    lay, chan = channel(model)
    rng = np.random.default_rng(5)
    counts = np.zeros((hp.n_layer, hp.n_expert), dtype=np.int64)
    stats = np.zeros(lib.LE_HY_STATS)
    masks = [np.zeros(hp.n_expert_used, bool), np.arange(hp.n_expert_used) % 2 == 1,
             np.ones(hp.n_expert_used, bool)]                      # all on the CPU, half, none (all pinned)
    for seq in (1, 2):
        tokens = [draw(rng, hp, layer, masks[layer]) for layer in range(hp.n_layer)]
        chan[lay.seq] = seq
        rows, errors = [], []
        t = threading.Thread(target=play_gpu, args=(lay, chan, seq, tokens, rows, errors))
        t.start()
        model.native.hybrid_serve(chan, seq, np.arange(hp.n_layer), counts=counts, stats=stats)
        t.join()
        assert not errors, errors
        for (layer, h, ids, cpu_ids, wts), row in zip(tokens, rows):
            if (cpu_ids >= 0).any():
                want = model.native.moe_routed(layer, h, cpu_ids, wts)
                assert np.array_equal(row, want)        # the same call on the same inputs: the same bits
                assert np.abs(row).max() > 0
            else:
                assert not row.any()                     # nothing for the CPU: a zero row
    assert counts.sum() == 2 * hp.n_layer * hp.n_expert_used
    assert stats[3] == 2 * hp.n_layer
    assert stats[2] == 2 * sum(int((~m).sum()) for m in masks)
    # the experts' jobs' start lag and slowest-thread tail: parts of the experts' seconds (2 threads here)
    assert 0 <= stats[11] <= stats[1] and 0 <= stats[12] <= stats[1] and stats[11] + stats[12] > 0


def expert_bytes(model, layer):
    f, p = model.file.gguf, f"blk.{layer}."
    return sum(f.tensors[p + n].n_bytes for n in ("ffn_gate_exps.weight", "ffn_up_exps.weight",
                                                   "ffn_down_exps.weight")) // model.hparams.n_expert


@pytest.mark.parametrize("budget_experts", [1, 100])
def test_serve_prefetches_predicted_experts(model, budget_experts):
    """The lookahead: slots 1.. hold this token's predicted ids (PRED_READY == seq; -1 = pinned, an id out of range
    or a repeat is ignored); serve prefetches them in order up to the byte budget and the rows are the same bits
    as without; stats count the experts aimed at and how many of them the CPU then ran."""
    hp = model.hparams
    k = hp.n_expert_used
    lay, chan = channel(model)
    rng = np.random.default_rng(9)
    seq = 4
    chan[lay.seq] = seq
    tokens = [draw(rng, hp, layer, np.arange(k) % 3 == 1) for layer in range(hp.n_layer)]
    want_aimed = want_hits = 0
    for layer, _h, ids, cpu_ids, _w in tokens:
        pred = np.full(lay.PRED_MAX, -1, np.int32)
        guess = np.concatenate([ids[:k // 2], rng.choice(hp.n_expert, 2)]).astype(np.int32)
        pred[:guess.size + 3] = np.concatenate([guess, [-1, hp.n_expert, guess[0]]])
        s = lay.slot(chan, layer)
        s[lay.pred:lay.pred + lay.PRED_MAX] = pred
        s[lay.pred_ready] = seq if layer else seq - 1      # layer 0: no prediction (none is ever made for it)
        if layer:
            aimed = list(dict.fromkeys(int(e) for e in guess))[:budget_experts]
            want_aimed += len(aimed)
            want_hits += sum(int(e) in aimed for e in cpu_ids if e >= 0)
    stats = np.zeros(lib.LE_HY_STATS)
    rows, errors = [], []
    t = threading.Thread(target=play_gpu, args=(lay, chan, seq, tokens, rows, errors))
    t.start()
    budget = budget_experts * max(expert_bytes(model, i) for i in range(hp.n_layer))
    model.native.hybrid_serve(chan, seq, np.arange(hp.n_layer), stats=stats, prefetch_bytes=budget)
    t.join()
    assert not errors, errors
    for (layer, h, ids, cpu_ids, wts), row in zip(tokens, rows):
        assert np.array_equal(row, model.native.moe_routed(layer, h, cpu_ids, wts))
    assert stats[5] == want_aimed and stats[6] == want_hits and want_hits > 0
    assert 0 <= stats[7] <= want_aimed * max(expert_bytes(model, i) for i in range(hp.n_layer))
    with pytest.raises(ValueError, match="stats"):
        model.native.hybrid_serve(chan, seq, np.arange(hp.n_layer), stats=np.zeros(8))


def test_serve_times_out_and_releases(model):
    hp = model.hparams
    lay, chan = channel(model)
    chan[lay.seq] = 7
    layer, h, ids, cpu_ids, wts = draw(np.random.default_rng(1), hp, 0, np.zeros(hp.n_expert_used, bool))
    publish(lay, chan, 0, 6, h, ids, cpu_ids, wts)      # an old token's routing: READY != seq
    lay.slot(chan, 1)[lay.row:lay.row + 4] = 123        # stale data the release must clear
    with pytest.raises(NativeError, match="timed out.*layer 0"):
        model.native.hybrid_serve(chan, 7, np.arange(hp.n_layer), timeout_s=0.05)
    for i in range(hp.n_layer):                          # every slot released for the GPU, rows zero
        s = lay.slot(chan, i)
        assert s[lay.done] == 7 and not s[lay.row:lay.row + lay.E].any()


def test_serve_refuses_bad_ids_and_releases(model):
    hp = model.hparams
    lay, chan = channel(model)
    layer, h, ids, cpu_ids, wts = draw(np.random.default_rng(2), hp, 0, np.zeros(hp.n_expert_used, bool))
    ids[1] = cpu_ids[1] = hp.n_expert                  # an id the model does not have
    publish(lay, chan, 0, 3, h, ids, cpu_ids, wts)
    with pytest.raises(NativeError, match="format error.*expert id"):
        model.native.hybrid_serve(chan, 3, np.array([0, 1]))
    assert lay.slot(chan, 0)[lay.done] == 3 and lay.slot(chan, 1)[lay.done] == 3
    with pytest.raises(NativeError, match="layer 9"):
        model.native.hybrid_serve(chan, 3, np.array([9]))
    with pytest.raises(NativeError, match="timeout"):
        model.native.hybrid_serve(chan, 3, np.array([0]), timeout_s=0)


def test_release(model):
    hp = model.hparams
    lay, chan = channel(model)
    model.native.hybrid_release(chan, 11, np.array([2, 0]))
    assert [lay.slot(chan, i)[lay.done] for i in range(hp.n_layer)] == [11, 0, 11]
