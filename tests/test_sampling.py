"""The sampler (native/sample.c through legacy_engine.serve.sampling) against a plain float64 numpy reference of the chain:
penalties; top-k, top-p, min-p on the T = 1 softmax in the order of a stable argsort of -x (ties: lower id first);
the temperature over the kept tokens; u inverted over the probabilities in id order.

On fixed seeds, for every kernel tier this CPU runs (ids `...-ref`, `...-avx2`), every logit shape (normal of std 1,
3 and 8 at the real 248,320 vocabulary, a peaked one, one made of exact ties, one with masked -inf tokens, small
vocabularies) and every parameter set (greedy, temperature, top-k, top-p, min-p, all together, penalties over a
repeating history, T = 1e-320, top-k above the vocabulary, top-k above the candidate list): the probability vectors
agree within tolerances.SAMPLING_* (float exp against float64 exp), the kept sets are identical, and the same u
draws the same token. Also: draw frequencies against the probabilities (chi-square), penalties bit-exact against
numpy, every internal path exercised by name, errors on NaN / +inf, and negative controls that must fail.
Threads (le_sample_on, Sampler(params, model=...)): the matrix again with the passes on a model's pool of 2 threads
(ids `...-pool2`), and the same bits (kept set, probabilities, token of each u, info) for 1, 2, 3 threads and none.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import tolerances as tol

from legacy_engine.core import _native
from legacy_engine.core.errors import NativeError
from legacy_engine.serve.sampling import Sampler, SamplingParams

pytestmark = pytest.mark.cpu

N_REAL = 248_320                       # the Qwen3.5/3.6 vocabulary
SAMPLE_TIERS = ("ref", "avx2")         # the sampler's kernels (ssse3 runs ref, avx512vnni runs avx2)
tiers = pytest.mark.parametrize("forced_isa", SAMPLE_TIERS, indirect=True)


# ------------------------------------------------------------------------------------------------ the reference

def penalise_ref(x: np.ndarray, history, p: SamplingParams) -> np.ndarray:
    """The penalties as the numpy sampler applied them (float32 repetition penalty, float64 subtraction)."""
    if not len(history) or p.penalty_last_n == 0 or (
            p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0):
        return x
    ids, counts = np.unique(np.asarray(history[-p.penalty_last_n:], dtype=np.int64), return_counts=True)
    out = x.copy()
    sel = out[ids]
    if p.repetition_penalty != 1.0:
        sel = np.where(sel > 0, sel / p.repetition_penalty, sel * p.repetition_penalty)
    out[ids] = sel - counts * p.frequency_penalty - p.presence_penalty
    return out


class Ref:
    """The reference's answer: probs (float64, id order), kept ids (sorted order), the top-p running mass fractions
    (sorted order, over the top-k set; None without top-p), arg = (z - z_max) / T of the kept ids (id order)."""

    def __init__(self, x, p: SamplingParams, history=(), top_p_after_temperature=False, renormalise_top_k=True,
                 ties_high_first=False, no_temperature=False):
        x = penalise_ref(np.asarray(x, np.float32), list(history), p)
        self.x = x
        n = x.size
        self.probs = np.zeros(n)
        self.arg = np.zeros(n)
        self.cum = None
        if p.temperature == 0.0 or not np.isfinite(1.0 / p.temperature):
            self.kept = np.array([int(np.argmax(x))])
            self.probs[self.kept] = 1.0
            return
        ids = np.argsort(-x, kind="stable")
        if ties_high_first:     # negative control: equal logits, higher id first
            ids = (n - 1 - np.argsort(-x[::-1], kind="stable"))
        if p.top_k > 0:
            ids = ids[:p.top_k]
        z = x[ids].astype(np.float64)
        t = p.temperature if top_p_after_temperature else 1.0
        pr = np.exp(z / t - z[0] / t)
        pr /= pr.sum() if renormalise_top_k else np.exp(x.astype(np.float64) - z[0]).sum()
        if p.top_p < 1.0:
            self.cum = np.cumsum(pr)
            keep = int(np.searchsorted(self.cum, p.top_p) + 1)
            ids, z, pr = ids[:keep], z[:keep], pr[:keep] / pr[:keep].sum()
        if p.min_p > 0.0:
            keep = pr >= p.min_p * pr[0]
            ids, z = ids[keep], z[keep]
        zt = z if no_temperature else z / p.temperature
        w = np.exp(zt - zt.max())
        self.kept = ids
        self.probs[ids] = w / w.sum()
        self.arg[ids] = zt - zt.max()

    def token(self, u: float) -> int:
        """The inversion of u in id order: the first token whose running probability exceeds u."""
        c = np.cumsum(self.probs)
        return min(int(np.searchsorted(c, u * c[-1], side="right")), c.size - 1)


def prob_bound(ref: Ref) -> np.ndarray:
    """tolerances.SAMPLING_W_REL / SAMPLING_FLUSH_ABS per token (see there)."""
    arg = np.where(ref.probs > 0, np.abs(ref.arg), 0.0)     # masked tokens: -inf, probability 0
    return tol.SAMPLING_W_REL * (2 + arg + float((ref.probs * arg).sum())) * ref.probs + tol.SAMPLING_FLUSH_ABS


def kept_by_cut(x: np.ndarray, info: dict) -> np.ndarray:
    """The ids the C sampler kept, from its cut: x > cut_logit, or x == cut_logit and id <= cut_id."""
    ids = np.arange(x.size)
    return np.flatnonzero((x > info["cut_logit"]) | ((x == info["cut_logit"]) & (ids <= info["cut_id"])))


# ------------------------------------------------------------------------------------------------ cases

def _logits(shape: str) -> np.ndarray:
    rng = np.random.default_rng(["std1", "std3", "std8", "peaked", "ties", "masked", "small", "tiny"].index(shape))
    if shape.startswith("std"):
        return (rng.standard_normal(N_REAL) * float(shape[3:])).astype(np.float32)
    if shape == "peaked":       # a confident model: one token far ahead, a few behind it, a flat rest
        x = rng.standard_normal(N_REAL).astype(np.float32)
        x[rng.choice(N_REAL, 6, replace=False)] = [12.0, 10.5, 10.5, 9.0, 8.0, 8.0]
        return x
    if shape == "ties":         # ~20 distinct values: ties everywhere, the top one held by ~20 tokens
        return (np.round(rng.standard_normal(N_REAL) * 2) / 2).astype(np.float32)
    if shape == "masked":       # a tenth of the vocabulary masked with -inf
        x = (rng.standard_normal(N_REAL) * 3).astype(np.float32)
        x[rng.choice(N_REAL, N_REAL // 10, replace=False)] = -np.inf
        return x
    if shape == "small":
        return (rng.standard_normal(1000) * 2).astype(np.float32)
    return np.array([1.0, 3.0, -2.0, 3.0, 0.5, -np.inf, 2.0], np.float32)     # tiny: a tie at the top, a mask


SHAPES = ["std1", "std3", "std8", "peaked", "ties", "masked", "small", "tiny"]
PARAMS = {
    "greedy": dict(temperature=0.0, top_k=5, top_p=0.3),     # the truncations are ignored
    "temp": dict(temperature=0.8),
    "temp_hot": dict(temperature=1.7),
    "top_k": dict(temperature=0.8, top_k=40),
    "top_p": dict(temperature=0.8, top_p=0.95),
    "top_p_half": dict(temperature=1.0, top_p=0.5),
    "min_p": dict(temperature=0.8, min_p=0.05),
    "all": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "penalties": dict(temperature=0.8, top_p=0.95, repetition_penalty=1.3, presence_penalty=0.4,
                      frequency_penalty=0.3),
    "tiny_T": dict(temperature=1e-320, top_p=0.9),
    "k_above_vocab": dict(temperature=0.8, top_k=10**7, top_p=0.9),
    "k_above_list": dict(temperature=0.8, top_k=5000, top_p=0.9),
}


def _history(x: np.ndarray) -> list[int]:
    """Recent tokens repeating the current favourites (so the penalties move the cut), plus random ones."""
    top = np.argsort(-x, kind="stable")[:6].tolist()
    rnd = np.random.default_rng(11).integers(0, x.size, 12).tolist()
    return rnd + top * 3 + top[:2] * 4


@functools.lru_cache(maxsize=8)   # ~7 MB each at 248k; the tiers of a case run one after the other
def case(shape: str, pname: str):
    x = _logits(shape)
    p = SamplingParams(**PARAMS[pname])
    history = _history(x) if pname == "penalties" else []
    return x, p, history, Ref(x, p, history)


def cut_ambiguous(ref: Ref, p: SamplingParams, k_c: int) -> bool:
    """Whether the reference's top-p walk passes top_p within tolerances.SAMPLING_CUT_MASS_REL at every position
    between the two kept counts (then either count is right to float precision)."""
    k_r = len(ref.kept)
    if ref.cum is None or k_c == k_r:
        return k_c == k_r
    lo, hi = sorted((k_c, k_r))
    return bool(np.all(np.abs(ref.cum[lo - 1:hi - 1] - p.top_p) <= tol.SAMPLING_CUT_MASS_REL))


def draw_ambiguous(ref: Ref, u: float, a: int, b: int) -> bool:
    """Whether u lies within tolerances.SAMPLING_DRAW_ABS of a running sum between tokens a and b."""
    c = np.cumsum(ref.probs)
    lo, hi = sorted((a, b))
    return bool(np.min(np.abs(c[lo:hi] - u * c[-1])) <= tol.SAMPLING_DRAW_ABS * c[-1])


U_DRAWS = np.random.default_rng(99).random(24).tolist() + [0.0, 1.0 - 2**-53]


def check(x, p: SamplingParams, history, ref: Ref, force=(), model=None) -> dict:
    """The C sampler (on `model`'s threads when given) against `ref`: kept set, probabilities, and the token of each
    u in U_DRAWS."""
    ns = _native.NativeSampler(p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
                               p.frequency_penalty, force=force, model=model)
    ids, counts = Sampler(p).penalty_counts(history)
    probs = ns.probs(x, ids, counts)
    info = ns.last()
    kept = kept_by_cut(ref.x, info)
    if not np.array_equal(np.sort(kept), np.sort(ref.kept)):
        assert cut_ambiguous(ref, p, kept.size), f"kept {kept.size} tokens, the reference {ref.kept.size}"
    assert info["n_kept"] == kept.size
    err = np.abs(probs - ref.probs)
    bound = prob_bound(ref)
    worst = int(np.argmax(err / bound))
    assert np.all(err <= bound), (f"token {worst}: {probs[worst]!r} vs {ref.probs[worst]!r} (arg {ref.arg[worst]:.2f}, "
                                  f"bound {bound[worst]:.3g})")
    for u in U_DRAWS:
        t = ns.draw(x, u, ids, counts)
        want = ref.token(u)
        assert t == want or draw_ambiguous(ref, u, t, want), f"u = {u}: token {t}, the reference {want}"
        assert ref.probs[t] > 0
    return info


# ------------------------------------------------------------------------------------------------ the matrix

@pytest.fixture(scope="module")
def pools(tiny_file):
    """NativeModels of the tiny model with 1, 2 and 3 threads: only their pools serve the sampler."""
    from legacy_engine.cpu.model import Model
    return {n: Model(tiny_file, n_threads=n, pin=False).native for n in (1, 2, 3)}


threads = pytest.mark.parametrize("pool", ["caller", "pool2"])


@tiers
@threads
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pname", list(PARAMS))
def test_matches_reference(forced_isa, pool, shape, pname, pools):
    assert _native.sample_isa() == forced_isa
    x, p, history, ref = case(shape, pname)
    info = check(x, p, history, ref, model=pools[2] if pool == "pool2" else None)
    assert info["isa"] == forced_isa
    if pname in ("greedy", "tiny_T"):
        assert info["path"] == ["greedy"] and info["token"] == int(np.argmax(ref.x))


@tiers
@threads
@pytest.mark.parametrize("shape", ["std1", "std3", "std8", "ties", "masked"])
@pytest.mark.parametrize("force", ["miss_high", "miss_low", "all"])
def test_top_p_fallbacks(forced_isa, pool, shape, force, pools):
    """The paths an estimate rarely takes (its band wholly above or below the cut; no estimate) give the same
    answer."""
    x, p, history, ref = case(shape, "top_p")
    info = check(x, p, history, ref, force=(force,), model=pools[2] if pool == "pool2" else None)
    assert ("all" if force == "all" else "fallback") in info["path"]


def test_every_path_runs():
    """Each way of finding the cut and of drawing is taken by name on the logits it is meant for."""
    def paths(shape, **kw):
        ns = _native.NativeSampler(**kw)
        ns.draw(_logits(shape), 0.5)
        return set(ns.last()["path"])
    assert paths("std3", temperature=0.0) == {"greedy"}
    assert paths("std3", temperature=0.8, top_k=40) == {"list"}
    assert paths("std8", temperature=0.8, top_p=0.95) == {"band", "list"}        # a nucleus of a few tokens
    assert paths("std3", temperature=0.8, top_p=0.95) == {"band", "region"}      # ~19k tokens, 8 % of the vocab
    assert paths("std1", temperature=0.8, top_p=0.95) == {"band", "pass"}        # 74 % of the vocab
    assert paths("small", temperature=0.8, top_p=0.95) == {"all", "region"}      # below the estimate's size
    assert paths("std3", temperature=0.8, top_k=5000) == {"all", "pass"}
    assert paths("std1", temperature=0.8, min_p=0.05) == {"pass"}
    assert "fallback" in paths("std3", temperature=0.8, top_p=0.95, force=("miss_low",))


# ------------------------------------------------------------------------------------------------ threads

def _runs(x, p: SamplingParams, history, model, force=()) -> tuple:
    """Everything a sampler decides on x: probabilities, info, the token of each u in U_DRAWS (and its info)."""
    ns = _native.NativeSampler(p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
                               p.frequency_penalty, force=force, model=model)
    ids, counts = Sampler(p).penalty_counts(history)
    probs = ns.probs(x, ids, counts)
    out = [ns.last()]
    for u in U_DRAWS:
        out.append((ns.draw(x, u, ids, counts), ns.last()))
    return probs, out


@tiers
@pytest.mark.parametrize("shape", ["std1", "std3", "std8", "ties", "masked", "peaked"])
@pytest.mark.parametrize("pname,force", [("temp", ()), ("top_p", ()), ("top_p", ("all",)), ("top_p", ("miss_low",)),
                                         ("top_p", ("miss_high",)), ("min_p", ()), ("k_above_list", ()),
                                         ("all", ()), ("penalties", ()), ("greedy", ()), ("tiny_T", ())])
def test_thread_count_invariance(forced_isa, shape, pname, force, pools):
    """The same bits for any thread count: probabilities, kept set, max, path and the token of every u, with the
    passes on the caller's thread only (no model) and on pools of 1, 2 and 3 threads."""
    x, p, history, _ = case(shape, pname)
    want_probs, want = _runs(x, p, history, None, force)
    for n, model in pools.items():
        probs, got = _runs(x, p, history, model, force)
        assert np.array_equal(probs.view(np.uint64), want_probs.view(np.uint64)), f"{n} threads: probabilities"
        assert got == want, f"{n} threads"


def test_pool_runs_the_passes_and_small_vocabularies_stay_on_the_caller(pools):
    """At 248k the passes are parallel jobs on the pool; below two slices (32,768 tokens) none is published, the
    caller's thread does everything. A worker that never comes (held out of every job) changes nothing."""
    m = pools[2]
    p = SamplingParams(temperature=0.8, top_p=0.95, seed=1)
    for n, parallel in [(7, False), (1000, False), (32_767, False), (32_768, True), (N_REAL, True)]:
        x = (np.random.default_rng(n).standard_normal(n) * 3).astype(np.float32)
        jobs = m.pool_stats()["jobs"]
        tok = Sampler(p, model=m).sample(x)
        assert (m.pool_stats()["jobs"] > jobs) == parallel, n
        assert tok == Sampler(p).sample(x)
    x = _logits("std3")
    s = Sampler(p)
    want = [s.sample(x) for _ in range(3)]
    m.pool_hold(1, 1)
    try:
        s = Sampler(p, model=m)
        assert [s.sample(x) for _ in range(3)] == want
        assert m.pool_stats()["missed"] > 0
    finally:
        m.pool_hold(1, 0)


# ------------------------------------------------------------------------------------------------ draws, penalties

def test_draw_frequencies_follow_the_probabilities():
    """20,000 seeded draws through Sampler.sample on a 6-token vocabulary: chi-square against the reference's
    probabilities below its 99.9 % quantile, and the token top-p drops never drawn."""
    stats = pytest.importorskip("scipy.stats")
    x = np.array([0.3, 2.0, -1.0, 1.2, 2.0, -3.0], np.float32)
    p = SamplingParams(temperature=0.9, top_p=0.99, seed=1234)   # running mass .37 .74 .91 .98 .998: keeps 5
    ref = Ref(x, p)
    s, n = Sampler(p), 20_000
    counts = np.bincount([s.sample(x) for _ in range(n)], minlength=x.size)
    kept = ref.probs > 0
    assert kept.sum() == 5 and counts[~kept].sum() == 0
    expected = n * ref.probs[kept]
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < stats.chi2.ppf(0.999, kept.sum() - 1), chi2


def test_same_seed_same_tokens_and_greedy_draws_nothing():
    x = _logits("std3")
    def run(seed):
        s = Sampler(SamplingParams(temperature=0.8, top_p=0.95, seed=seed))
        return [s.sample(x) for _ in range(5)]
    assert run(7) == run(7) and run(7) != run(8)
    s = Sampler(SamplingParams(temperature=1e-320, seed=3))     # 1/T = inf: greedy, no error, no draw
    state = s.rng.bit_generator.state
    assert s.sample(x) == int(np.argmax(x)) and s.rng.bit_generator.state == state


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.3), dict(repetition_penalty=0.7),
                                dict(presence_penalty=0.5), dict(frequency_penalty=0.35),
                                dict(repetition_penalty=1.1, presence_penalty=-0.2, frequency_penalty=0.13)])
def test_penalties_bit_exact(kw):
    """Each penalised logit of the C sampler equals numpy's to the bit: made the max in turn, it is max_logit."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(64) * 4).astype(np.float32)
    history = rng.integers(0, 64, 30).tolist() + [3, 3, 3, 9]
    p = SamplingParams(temperature=0.0, **kw)
    want = penalise_ref(x, history, p)
    np.testing.assert_array_equal(Sampler(p).apply_penalties(x, history), want)
    s = Sampler(p)
    ids, counts = s.penalty_counts(history)
    for t in np.unique(history)[:12]:
        y = np.full_like(x, -1e30)
        y[t] = x[t]
        assert s.native.draw(y, 0.0, ids, counts) == t
        assert np.float32(s.native.last()["max_logit"]) == want[t]


def test_extreme_temperature_is_uniform_over_tied_maxima():
    """1/T finite but beyond float (T = 1e-300): exp((x - max) / T) is 1 on the tied maxima and 0 elsewhere."""
    x = np.array([1.0, 5.0, 5.0, 4.999999, 5.0, -2.0], np.float32)
    probs = Sampler(SamplingParams(temperature=1e-300)).probs(x)
    np.testing.assert_allclose(probs, [0, 1 / 3, 1 / 3, 0, 1 / 3, 0], rtol=1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_logits_raise(bad, temperature):
    x = _logits("small").copy()
    x[417] = bad
    with pytest.raises(NativeError, match="logit 417 .* is (NaN|\\+inf)"):
        Sampler(SamplingParams(temperature=temperature, top_p=0.9)).sample(x)
    with pytest.raises(NativeError, match="no finite logit"):
        Sampler(SamplingParams(temperature=temperature)).sample(np.full(50, -np.inf, np.float32))


def test_bad_arguments_raise():
    x = _logits("small")
    ns = _native.NativeSampler(0.8)
    with pytest.raises(NativeError, match="u = 1"):
        ns.draw(x, 1.0)
    with pytest.raises(NativeError, match="penalty entry"):
        Sampler(SamplingParams(temperature=0.8, presence_penalty=1.0)).sample(x, [5, 1000])
    with pytest.raises(ValueError, match="top_k"):
        _native.NativeSampler(0.8, top_k=2**31)


# ------------------------------------------------------------------------------------------------ negative controls

@pytest.mark.parametrize("variant,shape,pname", [
    (dict(top_p_after_temperature=True), "std3", "top_p"),    # top-p on the tempered distribution
    (dict(renormalise_top_k=False), "std1", "all"),           # top-p on the whole vocabulary's mass
    (dict(ties_high_first=True), "ties", "top_k"),            # equal logits: the higher id first
    (dict(no_temperature=True), "std3", "min_p"),             # the temperature left out
])
def test_negative_controls(variant, shape, pname):
    """A reference with one step of the chain done differently must fail the check that the real one passes."""
    x, p, history, ref = case(shape, pname)
    check(x, p, history, ref)
    with pytest.raises(AssertionError):
        check(x, p, history, Ref(x, p, history, **variant))


# ------------------------------------------------------------------------------------------------ the benches
# `bench decode` and `bench gpu` time decode as generation runs it (logits -> Sampler.sample -> next token), greedy
# and sampled. The GPU bench's loop and table run here with the CPU model in the GPU model's place (same forward).

@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    from legacy_engine.tools.make_model import make_model
    return make_model("tiny-moe", str(tmp_path_factory.mktemp("sampling") / "tiny-moe-2.q8_0.gguf"), layers=2,
                      quant="q8_0", progress=False)


def test_parse_sample():
    from legacy_engine.tools.bench import SAMPLE_DEFAULT, parse_sample
    assert parse_sample(SAMPLE_DEFAULT) == SamplingParams(temperature=0.8, top_p=0.95, seed=0)
    assert parse_sample("temp=1,top_k=40,min_p=0.05,repeat_penalty=1.1,seed=3") == SamplingParams(
        temperature=1.0, top_k=40, min_p=0.05, repetition_penalty=1.1, seed=3)
    assert parse_sample("off") is None and parse_sample(None) is None
    for bad in ("temp", "heat=1", "top_p=2"):
        with pytest.raises(ValueError):
            parse_sample(bad)


def test_bench_decode_sampled_vs_greedy(tiny_file, capsys):
    from legacy_engine.tools.bench import bench_decode, parse_sample, print_decode
    res = bench_decode(tiny_file, [1], pp=0, tg=3, reps=2, isas=[_native.get_isa()], llama="off", bandwidth=None,
                       sample=parse_sample("temp=0.8,top_p=0.95"))
    (r,) = res["results"]
    assert r["tg_greedy_tok_s"] > 0 and r["tg_sampled_tok_s"] > 0
    assert r["sampled_over_greedy"] == pytest.approx(r["tg_sampled_tok_s"] / r["tg_greedy_tok_s"])
    assert len(r["tg_greedy_runs_s"]) == len(r["tg_sampled_runs_s"]) == 2 and r["sample"]["top_p"] == 0.95
    print_decode(res)
    out = capsys.readouterr().out
    assert "greedy and sampled (temperature 0.8, top_p 0.95) interleaved" in out and "sampled/greedy" in out
    assert "sampled_over_greedy" not in bench_decode(tiny_file, [1], pp=0, tg=2, reps=1, isas=[_native.get_isa()],
                                                     llama="off", bandwidth=None)["results"][0]


def test_bench_gpu_generation_on_the_cpu(tiny_file, capsys):
    from legacy_engine.tools import bench_gpu
    from legacy_engine.tools.bench import parse_sample, seeded_tokens
    from legacy_engine.cpu.model import Model
    model = Model(tiny_file, n_threads=1)
    ids = seeded_tokens(bench_gpu.WARM_PREFILL + 4, model.hparams.n_vocab)
    row = bench_gpu.generation_vs_greedy(model, model.new_state(64), ids, 4, 2, parse_sample("temp=0.8,top_p=0.95"))
    assert row["tg_greedy_tok_s"] > 0 and row["tg_sampled_tok_s"] > 0 and row["sampled_over_greedy"] > 0
    row.update(engine="legacy_engine dp4a-sm90 int8 graph", pp={512: 1000.0}, tg=100.0, hbm_pct=50.0)
    bench_gpu.print_gpu({"model": tiny_file, "device": "(none)", "arch": 90, "bytes_per_token": 2**20,
                         "copy_bandwidth": 1e12, "pp": [512], "tg": 4, "rows": [row]})
    out = capsys.readouterr().out
    assert "smp/gr" in out.splitlines()[1] and f"{row['sampled_over_greedy']:.3f}" in out
    assert "sampled with temperature 0.8, top_k 0, top_p 0.95, min_p 0.0, seed 0" in out


# ------------------------------------------------------------------------------------------------ candidates

from legacy_engine.gpu.sample import CAP  # noqa: E402  (the candidates a GPU lets cross)

CAND_PARAMS = ["greedy", "top_k", "top_p", "top_p_half", "min_p", "all", "tiny_T", "k_above_vocab", "k_above_list"]


def _candidates(x: np.ndarray, p: SamplingParams, n_vocab: int):
    """(ids shuffled, their logits, total, rest_max) as cuda8/sample_cut.cu chooses them (sample_cut_ref)."""
    from sample_cut_ref import sample_cut_ref
    f = Sampler(p).filters(n_vocab)
    if f is None:            # temperature alone: the kept set is the row (GpuModel downloads it)
        return None
    top_k, top_p, min_p = f
    c = sample_cut_ref(x, top_k, top_p, min_p, allow_masked=True)
    ids = np.random.default_rng(5).permutation(c.ids).astype(np.int32)   # the kernel writes them in no order
    return ids, x[ids], c.z, c.rest_max


@tiers
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pname", CAND_PARAMS)
def test_candidates_draw_what_the_row_draws(forced_isa, shape, pname):
    """le_sample_cand on the candidates the GPU chooses draws, for every u, the token le_sample draws from the whole
    row (the same kept set; the row's mass from `total`)."""
    x, p, _, ref = case(shape, pname)
    s = Sampler(p)
    cand = _candidates(x, p, x.size)
    if cand is None:
        assert shape == "tiny" and pname == "top_k"     # top-k 40 of 7 tokens: off
        return
    ids, xc, total, rest_max = cand
    for u in U_DRAWS:
        t = s.draw_candidates(ids, xc, x.size, total, rest_max, u)
        want = s.draw(x, u)
        assert t is not None, f"u = {u}: the candidates ({ids.size}) were refused"
        assert t == want or draw_ambiguous(ref, u, t, want), f"u = {u}: token {t}, the row's {want}"
    info = s.native.last()
    if info["cut_id"] != 2**31 - 1:
        assert info["cut_id"] in set(ids.tolist())            # a token id, not a position


@pytest.mark.parametrize("pname", ["top_p", "top_p_half", "min_p", "top_k"])
def test_candidates_too_few_are_refused(pname):
    """A candidate set that may not hold the kept set gives None (the caller samples the row): top-p's mass not
    reached, min-p's threshold below the largest logit left out, top-k above the candidates."""
    x, p, _, _ = case("std3", pname)
    s = Sampler(p)
    order = np.argsort(-x, kind="stable")
    head = order[:3].astype(np.int32)
    total = float(np.exp(x.astype(np.float64) - x.max()).sum())
    assert s.draw_candidates(head, x[head], x.size, total, float(x[order[3]]), 0.5) is None
    ids, xc, total, rest_max = _candidates(x, p, x.size)            # the kernel's own set is accepted
    assert s.draw_candidates(ids, xc, x.size, total, rest_max, 0.5) is not None


def test_candidates_bad_arguments_raise():
    s = Sampler(SamplingParams(temperature=0.8, top_p=0.9))
    ids, x = np.array([3, 1], np.int32), np.array([1.0, 2.0], np.float32)
    for args in [(np.array([3, 3], np.int32), x, 10, 5.0, 0.0), (np.array([3, 10], np.int32), x, 10, 5.0, 0.0),
                 (ids, x, 1, 5.0, 0.0), (ids, x, 10, float("nan"), 0.0), (ids, x, 10, 5.0, float("inf")),
                 (ids, np.array([1.0, np.nan], np.float32), 10, 5.0, 0.0)]:
        with pytest.raises(NativeError):
            s.draw_candidates(*args, 0.5)
    with pytest.raises(ValueError):
        s.draw_candidates(ids, x[:1], 10, 5.0, 0.0, 0.5)


@pytest.mark.parametrize("shape,top_p,min_p", [("std1", 0.95, 0.0), ("std1", 0.5, 0.0), ("std1", 0.9, 0.001),
                                                ("std3", 0.95, 0.0), ("masked", 0.95, 0.0)])
def test_window_cut_is_the_rows_cut(shape, top_p, min_p):
    """le_sample_window_cut on the bin a GPU's window holds (sample_cut_ref: top-p's head beyond CAP, its bin within)
    gives the cut le_sample finds over the whole row; a window the target is not crossed in gives None."""
    from sample_cut_ref import sample_cut_ref
    x = _logits(shape)
    p = SamplingParams(temperature=0.8, top_p=top_p, min_p=min_p)
    s = Sampler(p)
    c = sample_cut_ref(x, 0, p.top_p, p.min_p, cap=CAP, allow_masked=True)
    assert c.mode == 1, f"the head fits the cap, or the bin does not (mode {c.mode})"
    m = float(x[np.isfinite(x)].max())
    cut = s.window_cut(c.ids, x[c.ids], c.base, c.z, m)
    s.native.probs(x)
    info = s.native.last()
    ref = Ref(x, p)
    if cut != (info["cut_logit"], info["cut_id"]):
        kept = kept_by_cut(x, {"cut_logit": cut[0], "cut_id": cut[1]})
        assert cut_ambiguous(ref, p, kept.size), (cut, info["cut_logit"], info["cut_id"])
    assert s.window_cut(c.ids, x[c.ids], 0.0, c.z, m) is None or c.base < p.top_p * c.z   # target not reached
    assert s.window_cut(c.ids, x[c.ids], c.z * p.top_p * 1.01, c.z, m) is None             # crossed before it
