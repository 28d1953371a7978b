"""le_moe_routed (native/moe.c): the routed experts of one token for experts chosen elsewhere — the CPU half of
the hybrid decode (gpu_model.GpuModel(cpu_experts=True)). Against a numpy reference on the file's dequantised
weights (gguf-py), on the f32 path and on the integer path, with entries masked (< 0) as the GPU's pinned ones are."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import quants

from legacy_engine.core import _native
from legacy_engine.core.errors import NativeError
from legacy_engine.tools.make_model import make_model
from legacy_engine.cpu.model import Model

# f32 path (integer kernels off): the same f32 products summed in another order than float64 numpy; rows of 256
# elements and 4 experts: measured ≤ 3e-7 relative to max|out|.
ROUTED_F32_REL = 1e-5
# integer path (W4A8/W8A8: x and SiLU(g)*u quantised to 8 bits per block before the dot products): measured ≤ 1.7e-2
# (Q8_0) and ≤ 2.5e-2 (Q4_K_M) relative to max|out| over 10 draws; a wrong expert moves it to 0.25-0.38. The masks
# are checked more sharply by additivity (below).
ROUTED_INT8_REL = 5e-2
# routed(ids) = routed(ids, some masked) + routed(ids, the others masked): every expert sees the same quantised x and
# its own quantised activations either way, so only the f32 accumulation order of `out` differs (≤ 4 terms).
ROUTED_SPLIT_REL = 1e-5


@pytest.fixture(scope="module", params=["f32", "q8_0", "q4_k_m"])
def model(request, tmp_path_factory):
    path = make_model("tiny-moe", str(tmp_path_factory.mktemp("routed") / f"moe2.{request.param}.gguf"), layers=2,
                      quant=request.param, progress=False)
    return Model(path, n_threads=2, pin=False)


def expert(model, layer: int, e: int, x: np.ndarray) -> np.ndarray:
    """down_e(SiLU(gate_e x) * up_e x) in float64 on the dequantised weights."""
    g = model.file.gguf
    def w(name):
        t = model.file.tensors[f"blk.{layer}.{name}.weight"]
        raw = g.data(f"blk.{layer}.{name}.weight").reshape(model.hparams.n_expert, -1)[e]
        return quants.dequantize(raw, t.type).reshape(-1, t.ne[0]).astype(np.float64)
    gate, up = w("ffn_gate_exps") @ x, w("ffn_up_exps") @ x
    act = gate / (1 + np.exp(-gate)) * up
    return w("ffn_down_exps") @ act


def token(rng, hp) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A random token's hidden state, its top-k experts and their weights (summing to 1)."""
    x = rng.standard_normal(hp.n_embd).astype(np.float32)
    ids = rng.choice(hp.n_expert, hp.n_expert_used, replace=False).astype(np.int32)
    return x, ids, rng.dirichlet(np.ones(hp.n_expert_used)).astype(np.float32)


@pytest.fixture(params=[False, True], ids=["f32", "int8"])
def int8(request, model):
    """The CPU model on its f32 or integer path for one test (back to the default, integer, after)."""
    model.native.set_int8(request.param)
    yield request.param
    model.native.set_int8(True)


def test_moe_routed_matches_reference(model, int8):
    hp = model.hparams
    rng = np.random.default_rng(3)
    for layer in range(hp.n_layer):
        x, ids, wts = token(rng, hp)
        for masked in ([], [1], [0, 2]):          # the GPU's pinned experts are masked (-1)
            m_ids = ids.copy()
            m_ids[masked] = -1
            got = model.native.moe_routed(layer, x, m_ids, wts)
            ref = sum(float(w) * expert(model, layer, int(e), x.astype(np.float64))
                      for e, w in zip(m_ids, wts) if e >= 0)
            tol = (ROUTED_INT8_REL if int8 and model.file.tensors[f"blk.{layer}.ffn_down_exps.weight"].type
                   else ROUTED_F32_REL)
            assert np.abs(got - ref).max() <= tol * np.abs(ref).max(), (layer, masked)
        all_masked = model.native.moe_routed(layer, x, np.full_like(ids, -1), wts)
        assert not all_masked.any()


def test_moe_routed_masks_add_up(model, int8):
    """The hybrid decode splits one token's experts between the GPU (pinned) and the CPU: the parts add up."""
    x, ids, wts = token(np.random.default_rng(5), model.hparams)
    whole = model.native.moe_routed(1, x, ids, wts)
    a, b = ids.copy(), ids.copy()
    a[::2], b[1::2] = -1, -1
    parts = model.native.moe_routed(1, x, a, wts) + model.native.moe_routed(1, x, b, wts)
    assert np.abs(whole - parts).max() <= ROUTED_SPLIT_REL * np.abs(whole).max()
    assert np.abs(whole - model.native.moe_routed(1, x, a, wts)).max() > 0.05 * np.abs(whole).max()


def test_moe_routed_refuses_bad_arguments(model):
    hp = model.hparams
    x = np.zeros(hp.n_embd, np.float32)
    with pytest.raises(NativeError, match="outside"):
        model.native.moe_routed(0, x, np.array([hp.n_expert], np.int32), np.ones(1, np.float32))
    with pytest.raises(NativeError, match="layer"):
        model.native.moe_routed(hp.n_layer, x, np.array([0], np.int32), np.ones(1, np.float32))
    with pytest.raises(ValueError):
        model.native.moe_routed(0, x, np.array([0, 1], np.int32), np.ones(1, np.float32))


def test_moe_routed_scratch_is_allocated_once(model):
    """le_moe_routed's scratch (the model's arena, planned for n_expert experts) is allocated on the first call and
    reused: 10 more calls on every layer, masked or not, allocate nothing (the hybrid decode calls it per layer)."""
    hp = model.hparams
    x, ids, wts = token(np.random.default_rng(9), hp)
    for layer in range(hp.n_layer):
        model.native.moe_routed(layer, x, ids, wts)
    grown = model.native.scratch_growths
    assert grown >= 1
    for i in range(10):
        for layer in range(hp.n_layer):
            m_ids = ids.copy()
            m_ids[i % ids.size] = -1
            model.native.moe_routed(layer, x, m_ids if i % 2 else ids, wts)
    assert model.native.scratch_growths == grown


def test_moe_routed_same_bits_any_threads(model):
    """le_moe_routed splits every expert's rows over the threads statically (each thread computes the rows the
    lookahead prefetched for it): each output sums the same products in the same order whatever the split, so 1, 2, 3
    and 5 threads give the same bits."""
    x, ids, wts = token(np.random.default_rng(8), model.hparams)
    ids[2] = -1
    outs = [model.native.moe_routed(1, x, ids, wts)]
    for n in (1, 3, 5):
        other = Model(model.file.gguf.path, n_threads=n, pin=False)
        outs.append(other.native.moe_routed(1, x, ids, wts))
    for o in outs[1:]:
        assert np.array_equal(o, outs[0])
    assert np.abs(outs[0]).max() > 0
