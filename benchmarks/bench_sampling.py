"""The sampler's cost per token at the real vocabulary (248,320), per parameter set x logit shape x kernel tier.

    python -m pytest benchmarks/bench_sampling.py --benchmark-enable     # timings + extra_info
    python -m pytest benchmarks/bench_sampling.py                        # plain tests: one call each
    python benchmarks/bench_sampling.py [--reps 200] [--threads 1,2,16] [--gap-us 1400]
                                                                         # a table of microseconds per token

What is timed: Sampler.sample(logits, history) as generation calls it (Python, the penalty window, one rng draw, the
C sampler), on fixed logits:
  lm      normal, std 3: the random-weight qwen3.5-0.8b's logits (std 3.0, max at 4.9 std): a 0.95 nucleus of ~19k
          tokens (8 % of the vocabulary)
  peaked  normal, std 8: a confident model, a nucleus of a few tokens
  flat    normal, std 1: a random model's near-flat logits, a 0.95 nucleus of 74 % of the vocabulary (the worst case)
and, for scale, `argsort`: the stable sort of the whole vocabulary the numpy sampler did per token (its floor).
extra_info: us per token, the path the sampler took (le_sample_info), tokens kept, the logits' bytes and the rate at
which one pass over them would go at this time (GB/s of logits: the sampler makes one to three passes, exp-bound).
A tier without its own kernels (ssse3 runs ref, avx512vnni runs avx2) is not timed under its name.
Threads: `--threads N` runs the passes over the vocabulary on the pool of a CPU model of N threads (a tiny generated
model: only its pool serves), as Session.stream does with engine.cpu_model; 1 is the caller's thread alone
(Sampler(params)). `--gap-us G` waits G us before each timed call, as decode does between two tokens (the GPU's
forward, ~1400 us for the 0.8B): past their spin budget (LE_SPIN_US, 1000) the workers sleep and each call then pays
their wake-up; without a gap they are still spinning from the previous call. The pytest cases time 1 and 2 threads.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from a checkout without installing

from legacy_engine.core import _native  # noqa: E402
from legacy_engine.serve.sampling import Sampler, SamplingParams  # noqa: E402

pytestmark = pytest.mark.cpu

N_VOCAB = 248_320
TIERS = ("ref", "avx2")
SHAPES = {"lm": 3.0, "peaked": 8.0, "flat": 1.0}
PARAMS = {
    "greedy": dict(),
    "temp0.8": dict(temperature=0.8),
    "temp0.8-top_p0.95": dict(temperature=0.8, top_p=0.95),
    "temp0.8-top_k40": dict(temperature=0.8, top_k=40),
    "temp0.8-min_p0.05": dict(temperature=0.8, min_p=0.05),
    "all": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "top_p0.95-penalties": dict(temperature=0.8, top_p=0.95, repetition_penalty=1.1, frequency_penalty=0.2),
}
THREADS = (1, 2)
CASES = [(p, s, t, n) for p in PARAMS for s in SHAPES for t in TIERS for n in THREADS]


def logits(shape: str) -> np.ndarray:
    return (np.random.default_rng(0).standard_normal(N_VOCAB) * SHAPES[shape]).astype(np.float32)


HISTORY = np.random.default_rng(1).integers(0, N_VOCAB, 200).tolist()   # the last 64 feed the penalties


def pool_model(n_threads: int, folder: str):
    """A CPU model with n_threads whose pool runs the sampler's passes (None for 1: the caller's thread alone)."""
    if n_threads <= 1:
        return None
    from legacy_engine.tools.make_model import make_model
    from legacy_engine.cpu.model import Model
    path = make_model("tiny-moe", str(Path(folder) / "tiny-moe-2.q8_0.gguf"), layers=2, quant="q8_0", progress=False)
    return Model(path, n_threads=n_threads)


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench_sampling")
    return {n: pool_model(n, str(folder)) for n in THREADS}


def select(tier: str) -> None:
    if not _native.isa_supported(tier):
        pytest.skip(f"this CPU cannot run {tier} kernels")
    _native.set_isa(tier)
    assert _native.sample_isa() == tier


@pytest.fixture
def restore_isa():
    prev = _native.get_isa()
    yield
    _native.set_isa(prev)


@pytest.mark.parametrize("pname,shape,tier,threads", CASES, ids=[f"{p}-{s}-{t}-t{n}" for p, s, t, n in CASES])
def test_sample(benchmark, pname, shape, tier, threads, pools, restore_isa):
    select(tier)
    x = logits(shape)
    s = Sampler(SamplingParams(seed=0, **PARAMS[pname]), model=pools[threads])
    tok = benchmark(s.sample, x, HISTORY)
    assert 0 <= tok < N_VOCAB
    info = s.native.last()
    benchmark.extra_info.update({"n_vocab": N_VOCAB, "path": info["path"], "n_kept": info["n_kept"],
                                 "logits_bytes": 4 * N_VOCAB, "tier": tier, "threads": threads})
    if benchmark.stats is not None:
        t = benchmark.stats.stats.median
        benchmark.extra_info.update({"us_per_token": t * 1e6, "logits_GBps": 4 * N_VOCAB / t / 1e9})


def test_argsort_floor(benchmark):
    """The stable sort of the vocabulary the numpy sampler did for every token: what the C sampler removed."""
    x = logits("lm")
    order = benchmark(np.argsort, -x, kind="stable")
    assert order[0] == int(np.argmax(x))


# ---- the table (python benchmarks/bench_sampling.py) -------------------------------------------------------------

def _median_us(f, reps: int, gap_us: float = 0.0) -> float:
    f()
    ts = []
    for _ in range(reps):
        if gap_us > 0:
            time.sleep(gap_us * 1e-6)
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="the sampler's microseconds per token at 248,320 tokens")
    ap.add_argument("--reps", type=int, default=200, help="calls per cell; the median counts (200)")
    ap.add_argument("--tiers", default=",".join(t for t in TIERS if _native.isa_supported(t)))
    ap.add_argument("--threads", default="1", help="thread counts, a table each (1: the caller's thread alone)")
    ap.add_argument("--gap-us", type=float, default=0.0, help="idle us before each timed call (decode's forward)")
    args = ap.parse_args(argv)
    tiers = args.tiers.split(",")
    prev = _native.get_isa()
    import os
    folder = tempfile.mkdtemp(prefix="bench_sampling")
    for n_threads in [int(n) for n in args.threads.split(",")]:
        model = pool_model(n_threads, folder)
        print(f"Sampler.sample at {N_VOCAB} tokens, {n_threads} thread(s), {args.gap_us:.0f} us idle before each, "
              f"median of {args.reps} calls, us per token; load average {os.getloadavg()[0]:.2f}")
        print(f"{'params':<22}" + "".join(f"{s + '-' + t:>14}" for s in SHAPES for t in tiers))
        for pname, kw in PARAMS.items():
            cells = []
            for shape in SHAPES:
                x = logits(shape)
                for tier in tiers:
                    _native.set_isa(tier)
                    s = Sampler(SamplingParams(seed=0, **kw), model=model)
                    cells.append(f"{_median_us(lambda: s.sample(x, HISTORY), args.reps, args.gap_us):>14.1f}")
            print(f"{pname:<22}" + "".join(cells))
        if model is not None:
            print(f"pool: {model.native.pool_stats()}")
    _native.set_isa(prev)
    x = logits("lm")
    print(f"{'argsort (numpy floor)':<22}{_median_us(lambda: np.argsort(-x, kind='stable'), 20):>14.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
