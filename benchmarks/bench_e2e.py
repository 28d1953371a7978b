"""End-to-end prefill and decode of tiny make-model files, timed with pytest-benchmark.

    python -m pytest benchmarks/bench_e2e.py --benchmark-enable          # timings + extra_info
    python -m pytest benchmarks/bench_e2e.py                             # plain tests: one run each (pyproject
                                                                         # adds --benchmark-disable)

Files: `make-model --preset tiny-moe` / `tiny-dense` (real structure and the real 248,320-token vocabulary, Q8_0,
tied embeddings: the LM head dominates the bytes per token). prefill = one chunked forward of PP tokens from an
empty state; decode = TG single-token steps from an empty state. extra_info (benchmarks/README.md): tokens,
weight bytes read per token / per run, FLOPs, tok/s, GB/s and, when benchmarks are enabled, % of the read
bandwidth measured by benchmarks/bandwidth.py's probe. Bytes: decode reads the top-k experts + everything else +
LM head per token (legacy_engine.tools.bench.weight_footprint); a prefill batch reads each weight row once, counted as the
whole file (every expert: an upper bound, ≈ exact for 64 tokens × top-4 of 16 experts).
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from legacy_engine.tools.bench import read_bandwidth, seeded_tokens, weight_footprint
from legacy_engine.format.gguf_model import ModelFile
from legacy_engine.tools.make_model import make_model
from legacy_engine.cpu.model import Model

pytestmark = pytest.mark.cpu

PRESETS = ("tiny-moe", "tiny-dense")
PP = 64
TG = 8


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    made, root = {}, tmp_path_factory.mktemp("bench_e2e")

    def get(preset: str) -> str:
        if preset not in made:
            made[preset] = make_model(preset, str(root / f"{preset}.gguf"), progress=False)
        return made[preset]
    return get


@pytest.fixture(scope="module")
def bandwidth(request):
    """Measured read GB/s when benchmarks run (a second or two), else None."""
    opt = request.config.getoption
    if opt("benchmark_disable", default=False) and not opt("benchmark_enable", default=False):
        return None
    return read_bandwidth(len(os.sched_getaffinity(0)), size_mib=512, reps=3)


def _timed(fn):
    """fn wrapped to keep its last wall time (pytest-benchmark keeps none when disabled)."""
    last = {}

    def run():
        t0 = time.perf_counter()
        out = fn()
        last["s"] = time.perf_counter() - t0
        return out
    return run, last


def _report(benchmark, last: dict, tokens: int, bytes_moved: int, flops: int, bandwidth) -> None:
    stats = getattr(benchmark, "stats", None)
    seconds = stats.stats.mean if stats is not None else last["s"]
    gbps = bytes_moved / seconds / 1e9
    benchmark.extra_info.update(tokens=tokens, bytes_moved=bytes_moved, flops=flops, tok_per_s=tokens / seconds,
                                GBps=gbps, GFLOPs=flops / seconds / 1e9)
    if bandwidth:
        benchmark.extra_info.update(bandwidth_GBps=bandwidth, pct_of_bandwidth=100 * gbps / bandwidth)


@pytest.mark.parametrize("preset", PRESETS)
def test_prefill(benchmark, preset, model_file, bandwidth):
    path = model_file(preset)
    fp = weight_footprint(ModelFile.open(path))
    model = Model(path)
    state = model.new_state(PP + 8)
    ids = seeded_tokens(PP, model.hparams.n_vocab)

    def prefill():
        state.reset()
        return model.forward(state, ids, all_logits=False, chunked=True)

    run, last = _timed(prefill)
    logits = benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    assert logits.shape == (1, model.hparams.n_vocab) and np.isfinite(logits).all()
    flops = 2 * ((fp.decode_params - fp.head_params) * PP + fp.head_params)
    _report(benchmark, last, PP, fp.file_bytes, flops, bandwidth)


@pytest.mark.parametrize("preset", PRESETS)
def test_decode(benchmark, preset, model_file, bandwidth):
    path = model_file(preset)
    fp = weight_footprint(ModelFile.open(path))
    model = Model(path)
    state = model.new_state(TG + 8)
    ids = seeded_tokens(TG, model.hparams.n_vocab, seed=1)

    def decode():
        state.reset()
        out = None
        for tok in ids:
            out = model.forward(state, [tok], all_logits=False)
        return out

    run, last = _timed(decode)
    logits = benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    assert logits.shape == (1, model.hparams.n_vocab) and np.isfinite(logits).all()
    assert state.pos == TG
    _report(benchmark, last, TG, fp.decode_bytes * TG, 2 * fp.decode_params * TG, bandwidth)
