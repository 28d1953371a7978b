"""The yield hook of a single-sequence pass (le_model_set_yield, Model.set_yield): between two layers, once woken, the
pass calls the hook on its own thread, and the hook may run whole passes of other states there. The server starts a
new request's prompt there (serve/worker.py _between_layers; its test: tests/test_server.py).

Contract tested on the tiny MoE and dense checkpoints (f32) and a Q4_K_M random file on the integer kernels:
- a woken pass calls the hook once per wake, after a layer (never after the last: the head follows), and its logits
  and state bytes equal those of a pass without the hook, bit for bit;
- passes the hook runs (single-sequence and batched, of other states) give the bits they give alone, and never call
  the hook again (it is not re-entered);
- the hook runs with the caller's float mode (denormals not flushed, as numpy expects);
- an exception of the hook is raised by forward() after its pass, which completed;
- a batched pass (forward_batch) never calls it (its scratch is the model's, the hook's passes may use it).
"""
from __future__ import annotations

import numpy as np
import pytest

from fixtures.make_reference import tiny_gguf
from legacy_engine.cpu.model import Model
from gguf_writer import small_quantized

pytestmark = pytest.mark.cpu

PROMPT = list(range(3, 73))          # 70 tokens: across the 64-token GDN chunk
OTHER = [7, 11, 13, 17, 19]


@pytest.fixture(scope="module", params=["moe-f32", "dense-f32", "moe-q4_k_m"])
def model(request, tmp_path_factory):
    kind, quant = request.param.split("-")
    root = tmp_path_factory.mktemp("yield")
    path = tiny_gguf(kind, root / "m.gguf") if quant == "f32" else small_quantized(f"tiny-{kind}", quant,
                                                                                    root / "m.gguf")
    m = Model(path, 2)
    yield m
    m.set_yield(None)


def run_alone(m: Model, tokens, prefix=()) -> tuple[np.ndarray, bytes]:
    s = m.new_state(256)
    if prefix:
        m.forward(s, list(prefix))
    out = m.forward(s, list(tokens))
    return out, s.save()


def test_woken_pass_calls_the_hook_between_layers_and_keeps_its_bits(model):
    want, want_state = run_alone(model, PROMPT)
    other_want, other_state = run_alone(model, OTHER)
    pairs = [(model.new_state(256), model.new_state(256)) for _ in range(2)]
    for a, b in pairs:
        model.forward(a, [5, 6])
        model.forward(b, [9])
    batch_want = model.forward_batch(list(pairs[1]), [[8], [4]])
    batch_a, batch_b = pairs[0]
    calls, got, depth = [], {}, [0]

    def hook():
        calls.append(depth[0])     # how many hooks were running when this one started: 0, or it was re-entered
        depth[0] += 1
        try:
            if len(calls) == 1:    # a pass of another state and a batched pass of two others, inside the pause
                y.wake()           # inside the hook: its own passes do not call it; the paused pass, after its layer
                s = model.new_state(256)
                got["other"] = (model.forward(s, OTHER), s.save())
                got["batch"] = model.forward_batch([batch_a, batch_b], [[8], [4]])
        finally:
            depth[0] -= 1
    y = model.set_yield(hook)
    try:
        before = model.native.yields
        y.wake()
        s = model.new_state(256)
        out = model.forward(s, PROMPT)
        assert model.native.yields - before == 2 and calls == [0, 0]    # the wake, then the one the hook raised
        np.testing.assert_array_equal(out, want)
        assert s.save() == want_state
        np.testing.assert_array_equal(got["other"][0], other_want)
        assert got["other"][1] == other_state
        np.testing.assert_array_equal(got["batch"], batch_want)
        model.forward(s, [1])                       # not woken: no call
        assert len(calls) == 2
    finally:
        model.set_yield(None)


def test_last_layer_and_batched_passes_do_not_yield(model):
    y = model.set_yield(lambda: None)
    try:
        before = model.native.yields
        y.wake()
        model.forward_batch([model.new_state(64), model.new_state(64)], [[1, 2], [3]])
        assert model.native.yields == before        # the flag stays up for the next single-sequence pass
        model.forward(model.new_state(64), [1, 2])
        assert model.native.yields == before + 1
    finally:
        model.set_yield(None)


def test_hook_runs_with_the_callers_float_mode(model):
    seen = []

    def hook():
        tiny = np.float32(1e-38) * np.float32(1e-3)     # a denormal unless the core's FTZ leaked into the hook
        seen.append(tiny != 0 and tiny * np.float32(1e3) != 0)
    y = model.set_yield(hook)
    try:
        y.wake()
        model.forward(model.new_state(64), PROMPT[:8])
    finally:
        model.set_yield(None)
    assert seen == [True]


def test_hook_exception_is_raised_after_its_pass(model):
    want, want_state = run_alone(model, PROMPT[:10])

    def hook():
        raise KeyError("from the hook")
    y = model.set_yield(hook)
    try:
        y.wake()
        s = model.new_state(256)
        with pytest.raises(KeyError, match="from the hook"):
            model.forward(s, PROMPT[:10])
        assert s.save() == want_state             # the pass ran to its end
        np.testing.assert_array_equal(model.forward(model.new_state(256), PROMPT[:10]), want)
    finally:
        model.set_yield(None)
