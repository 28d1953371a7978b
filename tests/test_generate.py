"""Sampling, Session.stream/generate and the `run` command.

The Sampler is tested on crafted logits (no model). Sessions and the CLI run our f32 conversion of the tiny MoE
checkpoint (vocab 4096), rebuilt without torch by fixtures/make_reference.py, so every test here runs anywhere.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tolerances as tol
from fixtures.make_reference import sequence, tiny_gguf

from legacy_engine.serve.generate import Engine
from legacy_engine.serve.sampling import Sampler, SamplingParams

pytestmark = pytest.mark.cpu

N_THREADS = 2
REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ Sampler

def test_greedy_is_argmax():
    rng = np.random.default_rng(0)
    for _ in range(50):
        x = rng.standard_normal(1000).astype(np.float32) * 3
        # temperature 0 ignores the other truncations
        for p in (SamplingParams(), SamplingParams(temperature=0.0, top_k=5, top_p=0.3, min_p=0.5, seed=1)):
            assert Sampler(p).sample(x) == int(np.argmax(x))


def test_top_k_1_is_greedy():
    rng = np.random.default_rng(1)
    s = Sampler(SamplingParams(temperature=1.5, top_k=1, seed=3))
    for _ in range(50):
        x = rng.standard_normal(1000).astype(np.float32)
        assert s.sample(x) == int(np.argmax(x))


def test_same_seed_same_tokens():
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal(500).astype(np.float32) for _ in range(100)]

    def draws(seed):
        s = Sampler(SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.02, seed=seed))
        return [s.sample(x) for x in xs]
    assert draws(42) == draws(42)
    assert draws(42) != draws(43)
    assert len(set(draws(42))) > 1                  # it does sample, not just take the argmax


# probabilities 0.5, 0.3, 0.15, 0.05 on ids 2, 0, 3, 1 (not in id order, so the sort matters)
CRAFTED_IDS = np.array([2, 0, 3, 1])
CRAFTED_P = np.array([0.5, 0.3, 0.15, 0.05])


def _crafted_logits() -> np.ndarray:
    x = np.empty(4, dtype=np.float32)
    x[CRAFTED_IDS] = np.log(CRAFTED_P) + 1.7          # any offset
    return x


def _frequencies(params: SamplingParams, n: int = 20000) -> np.ndarray:
    s, x = Sampler(params), _crafted_logits()
    return np.bincount([s.sample(x) for _ in range(n)], minlength=4) / n


@pytest.mark.parametrize("kw,kept", [
    (dict(top_p=0.4), 1), (dict(top_p=0.75), 2), (dict(top_p=0.9), 3), (dict(top_p=0.99), 4),
    (dict(min_p=0.7), 1), (dict(min_p=0.5), 2), (dict(min_p=0.25), 3), (dict(min_p=0.05), 4),
    (dict(top_k=2), 2), (dict(top_k=3, top_p=0.75), 2), (dict(top_p=0.9, min_p=0.5), 2),
    (dict(top_p=0.9, temperature=3.0), 3),          # the kept set is chosen before the temperature
])
def test_truncation_keeps_the_right_set(kw, kept):
    """top-k, top-p (smallest set with mass ≥ p), min-p (≥ min_p · p_max) as llama.cpp's chain; then the
    temperature on what is left: the draws follow p^(1/T) renormalised over the kept set."""
    params = SamplingParams(**{"temperature": 1.0, "seed": 5, **kw})
    freq = _frequencies(params)
    keep = CRAFTED_IDS[:kept]
    assert set(np.flatnonzero(freq)) == set(keep.tolist())
    want = CRAFTED_P[:kept] ** (1 / params.temperature)
    assert np.abs(freq[keep] - want / want.sum()).max() <= tol.SAMPLING_FREQ_ABS


def test_penalties_change_the_right_logits():
    x = np.array([2.0, -1.0, 0.5, 3.0, -2.0, 1.0], dtype=np.float32)
    history = [0, 1, 1, 3, 0, 0]                      # counts: id 0 ×3, id 1 ×2, id 3 ×1
    orig = x.copy()

    def pen(**kw):
        return Sampler(SamplingParams(**kw)).apply_penalties(x, history)
    np.testing.assert_array_equal(pen(repetition_penalty=2.0), [1.0, -2.0, 0.5, 1.5, -2.0, 1.0])
    np.testing.assert_array_equal(pen(frequency_penalty=0.5), [0.5, -2.0, 0.5, 2.5, -2.0, 1.0])
    np.testing.assert_array_equal(pen(presence_penalty=0.25), [1.75, -1.25, 0.5, 2.75, -2.0, 1.0])
    np.testing.assert_allclose(pen(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
                               [1.0 - 1.5 - 0.25, -2.0 - 1.0 - 0.25, 0.5, 1.5 - 0.5 - 0.25, -2.0, 1.0], rtol=1e-6)
    np.testing.assert_array_equal(pen(frequency_penalty=0.5, penalty_last_n=2), [1.0, -1.0, 0.5, 3.0, -2.0, 1.0])
    np.testing.assert_array_equal(pen(frequency_penalty=0.5, penalty_last_n=0), x)
    np.testing.assert_array_equal(x, orig)                                   # the input is not modified
    # sample() sees the penalised logits: a presence penalty on the argmax makes greedy pick the runner-up
    assert Sampler(SamplingParams(presence_penalty=5.0)).sample(x, [3]) == 0


@pytest.mark.parametrize("kw", [
    dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.01),
    dict(top_p=float("nan")), dict(min_p=-0.1), dict(min_p=1.5), dict(repetition_penalty=0.0),
    dict(repetition_penalty=-1.0), dict(penalty_last_n=-1),
])
def test_invalid_sampling_params(kw):
    with pytest.raises(ValueError):
        Sampler(SamplingParams(**kw))


# ------------------------------------------------------------------------------------------------ Session

@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return tiny_gguf("moe", tmp_path_factory.mktemp("generate") / "moe.f32.gguf")


@pytest.fixture(scope="module")
def engine(model_path) -> Engine:
    return Engine(model_path, n_threads=N_THREADS, n_ctx=256)


PROMPT = sequence(32)[:12].tolist()


@pytest.fixture(scope="module")
def baseline(engine):
    """Greedy continuation of PROMPT, 24 tokens, no stop strings: (Generation, streamed pieces)."""
    result, pieces = [], []
    for p in engine.session().stream(PROMPT, max_tokens=24, result=result):
        pieces.append(p)
    return result[0], pieces


def _stream(engine, **kw):
    result = []
    pieces = list(engine.session().stream(PROMPT, result=result, **kw))
    return result[0], pieces


def test_stream_equals_generate_and_decode(engine, baseline):
    gen, pieces = baseline
    assert gen.finish_reason == "length" and len(gen.tokens) == 24
    assert "".join(pieces) == gen.text == engine.tokenizer.decode(gen.tokens)
    assert len(pieces) > 1                             # streamed, not delivered at the end
    assert engine.session().generate(PROMPT, max_tokens=24).tokens == gen.tokens


def _stop_across_pieces(engine, tokens) -> tuple[str, int]:
    """A stop string made of the end of one token's text and the start of the next (so it spans two streamed
    pieces), and the index of the token whose text completes its first occurrence."""
    texts = [engine.tokenizer.decode([t]) for t in tokens]
    for k in range(2, len(texts) - 1):
        a, b = texts[k], texts[k + 1]
        if len(a.strip()) >= 2 and len(b.strip()) >= 2 and "\ufffd" not in a + b:
            stop = a[-2:] + b[:2]
            for j in range(len(tokens)):
                if stop in engine.tokenizer.decode(tokens[:j + 1]):
                    return stop, j
    pytest.fail(f"no two neighbouring printable pieces in {texts!r}")


def test_stop_string_across_pieces(engine, baseline):
    gen, _ = baseline
    stop, j = _stop_across_pieces(engine, gen.tokens)
    res, pieces = _stream(engine, max_tokens=24, stop=[stop])
    assert res.finish_reason == "stop"
    assert "".join(pieces) == res.text == gen.text[:gen.text.find(stop)]
    assert stop not in res.text
    assert res.tokens == gen.tokens[:j + 1]           # it stops at the token that completes the stop string


def test_earliest_stop_string_wins(engine, baseline):
    """Of several stop strings the first to occur ends the text, whatever their order in the list."""
    gen, _ = baseline
    stop, _ = _stop_across_pieces(engine, gen.tokens)
    late = gen.text[-3:]
    assert gen.text.find(late) > gen.text.find(stop) + len(stop)
    res, pieces = _stream(engine, max_tokens=24, stop=[late, stop])
    assert res.finish_reason == "stop" and "".join(pieces) == res.text == gen.text[:gen.text.find(stop)]
    res, pieces = _stream(engine, max_tokens=24, stop=[stop, gen.text[:3]])   # at the very start: nothing
    assert res.finish_reason == "stop" and res.text == "" and pieces == []


def test_stop_string_never_seen(engine, baseline):
    """Held-back text is released at the end: nothing lost, nothing added; an empty stop string is ignored."""
    gen, _ = baseline
    for stop in (["\x00never\x00"], [""], ["\x00never\x00", ""]):
        res, pieces = _stream(engine, max_tokens=24, stop=stop)
        assert res.finish_reason == "length"
        assert "".join(pieces) == res.text == gen.text and res.tokens == gen.tokens


def test_max_tokens(engine, baseline):
    gen, _ = baseline
    sess = engine.session()
    res = sess.generate(PROMPT, max_tokens=5)
    assert res.tokens == gen.tokens[:5] and res.finish_reason == "length"
    # the last sampled token entered the state too: the session can continue from it
    assert sess.pos == len(PROMPT) + 5 and sess.tokens == PROMPT + gen.tokens[:5]
    sess = engine.session()
    res = sess.generate(PROMPT, max_tokens=0)
    assert (res.tokens, res.text, res.finish_reason, sess.pos) == ([], "", "length", len(PROMPT))
    with pytest.raises(ValueError):
        engine.session().generate(PROMPT, max_tokens=-1)


def test_eos_stops(engine, baseline, monkeypatch):
    """An end-of-generation id ends with finish "stop": the id is reported, its text is not."""
    gen, _ = baseline
    k = 6
    eos = gen.tokens[k]
    k = gen.tokens.index(eos)
    monkeypatch.setattr(engine.tokenizer, "eos_ids", frozenset({eos}))
    res = engine.session().generate(PROMPT, max_tokens=24)
    assert res.finish_reason == "stop"
    assert res.tokens == gen.tokens[:k + 1]
    assert res.text == engine.tokenizer.decode(gen.tokens[:k])


def test_full_context_stops_cleanly(model_path):
    """At a full context generation ends like max_tokens does (finish "length"), without an error."""
    eng = Engine(model_path, n_threads=N_THREADS, n_ctx=16)
    sess = eng.session()
    res = sess.generate(PROMPT[:10], max_tokens=100)
    assert res.finish_reason == "length"
    assert sess.pos == 16 and len(res.tokens) == 16 - 10 + 1   # the last one is sampled but has no room


def test_seeded_sampling_reproducible(engine):
    def run(seed):
        return engine.session().generate(PROMPT, max_tokens=16,
                                         params=SamplingParams(temperature=0.8, seed=seed)).tokens
    assert run(11) == run(11)
    assert run(11) != run(12)


# ------------------------------------------------------------------------------------------------ CLI

def _cli(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "legacy_engine", *map(str, args)], cwd=REPO, capture_output=True,
                          encoding="utf-8", errors="replace", timeout=timeout)


TIMING = re.compile(r"^\[(length|stop)\] load [\d.]+ s \| prefill \d+ tok, [\d.]+ tok/s \| decode \d+ tok, "
                    r"[\d.]+ tok/s$", re.M)


@pytest.mark.slow
def test_cli_run(model_path):
    r = _cli("run", model_path, "-p", "Hello, world", "-n", 8, "-t", N_THREADS)
    assert r.returncode == 0, r.stderr
    assert TIMING.search(r.stderr), r.stderr
    assert r.stdout.strip()


@pytest.mark.slow
@pytest.mark.parametrize("args,rc,message", [
    (["-p", ""], 2, "empty prompt"),
    (["-p", "Hi", "--top-p", "3"], 2, "top_p must be in (0, 1]"),
    (["-p", "Hi", "--temp", "-1"], 2, "temperature must be >= 0"),
    (["-p", "Hi", "--frobnicate"], 2, "unrecognized arguments: --frobnicate"),
    (["-p", "Hi", "-t", "0"], 2, "expected an integer >= 1"),
    ([], 2, "give a prompt with -p"),
])
def test_cli_rejects_bad_arguments(model_path, args, rc, message):
    r = _cli("run", model_path, *args)
    assert r.returncode == rc, (r.returncode, r.stderr)
    assert message in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_cli_missing_file(tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    r = _cli("run", missing, "-p", "Hi")
    assert r.returncode == 1
    assert str(missing) in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_cli_seed_reproducible(model_path):
    def run(seed):
        r = _cli("run", model_path, "-p", "Once upon a time", "-n", 12, "--temp", 0.8, "--seed", seed, "-t", N_THREADS)
        assert r.returncode == 0, r.stderr
        return r.stdout
    assert run(7) == run(7)
    assert run(7) != run(8)


def test_non_finite_logits_of_any_engine_are_an_error(model_path):
    """A GPU or split model's logits are checked where the session reads them (Model.forward checks the CPU's):
    a NaN is a FormatError naming the position, and the session, no longer trustworthy, starts over."""
    from legacy_engine.core.errors import FormatError

    class NanModel:                      # stands in for a GpuModel / SplitModel: same forward, a NaN in the logits
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def forward(self, state, ids, **kw):
            out = self.inner.forward(state, ids, **kw).copy()
            out[-1, 7] = np.nan
            return out

    eng = Engine(model_path, N_THREADS, 64)
    eng.model = NanModel(eng.cpu_model)
    s = eng.session()
    with pytest.raises(FormatError, match="non-finite logits at position 2"):
        s.prefill([1, 2, 3])
    assert s.pos == 0 and s.tokens == []
