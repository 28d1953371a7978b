"""plan/slots: one slot's state bytes (against the native state's own sizes) and the default slot count."""
import numpy as np
import pytest

from legacy_engine.cpu.model import Model
from legacy_engine.plan.slots import DEFAULT_PARALLEL, STATE_SHARE, serve_slots, state_bytes
from legacy_engine.tools.make_model import make_model

N_CTX = 300


def test_state_bytes_is_the_native_states(tmp_path):
    for preset, layers in (("tiny-moe", 4), ("tiny-dense", 5)):
        path = make_model(preset, str(tmp_path / f"{preset}.gguf"), layers=layers, quant="q8_0", progress=False)
        m = Model(path, n_threads=1)
        st = m.new_state(N_CTX)
        assert state_bytes(m.hparams, N_CTX) == st.recurrent_nbytes() + st.kv_nbytes(N_CTX), preset


def test_default_slots(tmp_path):
    path = make_model("tiny-moe", str(tmp_path / "m.gguf"), layers=4, quant="q8_0", progress=False)
    hp = Model(path, n_threads=1).hparams
    one = state_bytes(hp, N_CTX)
    assert serve_slots(hp, N_CTX, batched=False, available=1 << 40).n == 1          # no batched pass: one
    assert serve_slots(hp, N_CTX, batched=True, available=1 << 40).n == DEFAULT_PARALLEL
    fits3 = int(3.5 * one / STATE_SHARE)                                             # the memory holds 3 states
    p = serve_slots(hp, N_CTX, batched=True, available=fits3)
    assert p.n == 3 and p.state_bytes == one and "available" in p.why
    assert serve_slots(hp, N_CTX, batched=True, available=1).n == 1                  # never fewer than one


def test_distinct_experts():
    from legacy_engine.plan.slots import distinct_experts
    assert distinct_experts(256, 8, 1) == pytest.approx(8)                  # one token: its k
    assert distinct_experts(256, 8, 8) == pytest.approx(256 * (1 - (1 - 8 / 256) ** 8))
    assert distinct_experts(4, 2, 50) == pytest.approx(4)                   # every expert, once
    skew = np.array([100.0] + [1.0] * 63)                                   # one hot expert: fewer distinct
    assert distinct_experts(64, 4, 8, skew) < distinct_experts(64, 4, 8)
    rng = np.random.default_rng(0)                                          # against a simulation (uniform)
    sim = np.mean([len({e for _ in range(8) for e in rng.choice(256, 8, replace=False)}) for _ in range(2000)])
    assert distinct_experts(256, 8, 8) == pytest.approx(sim, rel=0.01)


def test_batched_decode_prediction():
    from legacy_engine.format.footprint import weight_footprint
    from legacy_engine.format.presets import DescribedFile
    from legacy_engine.plan.probe import Machine
    from legacy_engine.plan.slots import batched_decode_bytes, predict_batched_decode
    f = DescribedFile("qwen3.6-35b-a3b", "q4_k_m", 8)
    fp = weight_footprint(f)
    one = batched_decode_bytes(f.hparams, fp, 1, 512)
    assert one["weights"] + one["experts"] == pytest.approx(fp.decode_bytes, rel=1e-6)   # B = 1 reads one token's
    eight = batched_decode_bytes(f.hparams, fp, 8, 512)
    assert eight["weights"] == one["weights"] and one["experts"] < eight["experts"] < 8 * one["experts"]
    assert eight["states"] == 8 * one["states"] and eight["kv"] == 8 * one["kv"]
    pr = predict_batched_decode(Machine(cpu_threads=16, cpu_read_gbps=80.0), f.hparams, fp)
    assert all(pr[a] < pr[b] < pr[a] * b / a for a, b in ((1, 2), (2, 4), (4, 8), (8, 16)))
