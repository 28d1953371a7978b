"""`legacy-engine bench`: measurements the issues ask for, run from one command.

    legacy-engine bench decode MODEL.gguf [--threads N[,N...]] [--pp 64] [--tg 32] [--reps 3] [--json]
                                          [--isa all|ref,ssse3,...] [--llama auto|off|PATH] [--bandwidth GBPS|auto]
                                          [--sample temp=0.8,top_p=0.95|off]
    legacy-engine bench cache MODEL.gguf [--lengths 947] [--threads N] [--disk DIR] [--json]
    legacy-engine bench gpu MODEL.gguf [--pp 512,2048] [--tg 64] [--variants all|...] [--llama PATH]  (bench_gpu.py)
    legacy-engine bench split MODEL.gguf --vram 6GiB [--prompt 512,2048] [--ballast] [--llama PATH]  (bench_split.py)
    legacy-engine bench shared MODEL.gguf [--threads 1,2] [--busy 1] [--tg 32] [--reps 5] [--json]  (bench_shared.py)

bench_batch_decode (a function; benchmarks/bench_batch_decode.py prints it) — aggregate decode tok/s of B sequences
advanced together by Model.forward_batch, against B = 1.

bench decode — prefill and decode speed, ours per CPU tier next to llama.cpp, against the bandwidth roofline.

One table; rows: legacy_engine with each ISA tier forced (_native.set_isa before the model loads, restored after;
`f32` = integer kernels off, dequantise + f32 dot products) and llama.cpp (llama-cpp-python 0.3.36 when importable,
or the llama-bench binary --llama names), per thread count. Same file, same threads.
  pp N      one batched (chunked) forward of N seeded tokens from an empty state, last logits: tok/s = N / time
  tg N      N single-token steps from an empty state (recurrent GDN path, KV cache growing): tok/s = N / time
  ratio     tok/s over llama.cpp's at the same threads
  bytes/tok weights read per decoded token: every tensor of the layers that run, expert tensors (ffn_*_exps) at
            n_expert_used/n_expert of their bytes (the routed top-k), token_embd one row unless it is the LM head
            (tied); recurrent state and KV are not counted (weight_footprint)
  roofline  read bandwidth / bytes per token: the decode tok/s if weights streamed at the measured bandwidth
  % roof    tg tok/s / roofline tok/s
Under the table, for our rows: decode as generation runs it (Session.stream: logits -> Sampler.sample -> the next
token, the tokens so far as the penalties' history), tg steps from an empty state, greedy (temperature 0) and
sampled with --sample (default temp=0.8,top_p=0.95, seed 0), their runs interleaved; sampled/greedy is the ratio
of tok/s, `sampler` the extra milliseconds a sampled token took. Not in the table: llama.cpp's tg samples nothing.
Each measurement: one untimed warm-up of the same work (page cache, thread pool), then --reps runs; the median
counts, the runs' range is kept (JSON; in the table when reps > 1). llama-cpp-python runs `Llama(model,
n_threads=T, n_threads_batch=T, n_batch=512)`, prefill = one `eval` of N tokens, decode = N `eval`s of one token
(what llama-bench's pp/tg measure, plus ~0.1 ms of Python per call); llama-bench runs `-p N -n N -r R -t T -ngl 0
-o json` (its own warm-up) and the median of its samples counts. --bandwidth auto measures the read bandwidth
with `read_bandwidth` at each thread count (numpy reductions over 1 GiB: no C code of ours involved).

bench cache — the prefix cache (legacy_engine/cache.py): time to first token with and without reused prefixes.

Per prompt length L (synthetic seeded ids), with a fresh PrefixCache (grid 256, pages of 64 tokens):
  plain     Session.prefill of the L tokens, no cache (the baseline)
  cold      cache.prefill of the L tokens, nothing cached (baseline + snapshot capture)
  repeat    the same L tokens again (an exact repeat: restores the end-of-prompt entry, runs nothing)
  follow    L + 50 appended tokens (a follow-up turn)
  shared    the first 900 tokens, then L - 900 other tokens (restores the largest snapshot <= 900)
  capture   the part of `cold` spent taking snapshots and pages (and writing them with --disk)
  restore   the restore part of `repeat`: recurrent state + KV pages written into the session (+ from disk
            with --disk: a new PrefixCache on the same directory, as after a restart)
and the sizes: bytes of one snapshot (all GDN layers), KV bytes per token (all attention layers), and the RAM the
cache holds per cached token after the L-token prompt. TTFT = the prefill call that returns the first logits
(sampling excluded). Every cached answer is checked against the plain one (np.array_equal).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict

import numpy as np

from ..core import _native
from ..core.errors import UnavailableError
from ..cpu.model import Model
from ..cpu.threads import default_threads
from ..format.fingerprint import model_fingerprint
from ..format.footprint import Footprint, weight_footprint
from ..format.gguf_model import ModelFile
from ..gpu.model import GpuModel
from ..gpu.options import GpuOptions
from ..plan.probe import READ_KERNELS, machine_bandwidth, read_bandwidth  # noqa: F401 (benchmarks/ import them here)
from ..serve.cache import PrefixCache, Sizes
from ..serve.generate import Engine
from ..serve.sampling import Sampler, SamplingParams

SHARED = 900
APPEND = 50


def _ids(seed: int, n: int, n_vocab: int) -> list[int]:
    return np.random.default_rng([7, seed, n]).integers(0, min(n_vocab, 150_000), n).tolist()


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def bench_cache(model_path: str, lengths=(947,), n_threads: int | None = None, grid: int = 256,
                page: int = 64, disk_dir: str | None = None, log=None) -> dict:
    """Runs the measurements of the module docstring; returns {"model", "threads", "L<n>": {...}, ...}.
    Times in seconds, sizes in bytes."""
    n_ctx = max(lengths) + APPEND + page
    eng = Engine(model_path, n_threads=n_threads, n_ctx=n_ctx)
    fp = model_fingerprint(eng.model)
    sizes = Sizes.of(eng.model, page)
    out = dict(model=os.path.basename(model_path), threads=eng.model.n_threads, grid=grid, page=page,
               snapshot_bytes=sizes.snapshot, kv_bytes_per_token=sizes.page // page)
    n_vocab = eng.model.hparams.n_vocab
    eng.session().prefill(_ids(0, page, n_vocab))  # warm-up: fault the mapped weights in before timing
    for L in lengths:
        ids = _ids(1, L, n_vocab)
        follow = ids + _ids(2, APPEND, n_vocab)
        shared = ids[:SHARED] + _ids(3, L - SHARED, n_vocab) if L > SHARED else None
        r: dict = {}

        def check(name, logits, prompt):
            ref = eng.session().prefill(prompt) if prompt is not ids else plain_logits
            r[f"{name}_equal"] = bool(np.array_equal(logits, ref))

        plain_logits, r["plain_s"] = _timed(eng.session().prefill, ids)
        cache, sess = PrefixCache(fp, grid=grid, page=page), eng.session()
        logits, r["cold_s"] = _timed(cache.prefill, sess, ids)
        check("cold", logits, ids)
        r["capture_s"] = cache.last["capture_s"]
        r["ram_bytes"] = cache.stats["ram_bytes"]
        r["ram_bytes_per_token"] = cache.stats["ram_bytes"] / L
        r["snapshots"], r["pages"] = cache.stats["snapshots"], cache.stats["pages"]
        logits, r["repeat_s"] = _timed(cache.prefill, sess, ids)
        check("repeat", logits, ids)
        r["repeat_reused"], r["restore_s"] = cache.last["reused"], cache.last["restore_s"]
        logits, r["follow_s"] = _timed(cache.prefill, sess, follow)
        r["follow_reused"] = cache.last["reused"]
        check("follow", logits, follow)
        if shared is not None:
            logits, r["shared_s"] = _timed(cache.prefill, sess, shared)
            r["shared_reused"] = cache.last["reused"]
            check("shared", logits, shared)
        if disk_dir is not None:
            with tempfile.TemporaryDirectory(dir=disk_dir) as d:
                writer = PrefixCache(fp, grid=grid, page=page, disk_dir=d)
                _, r["cold_disk_s"] = _timed(writer.prefill, eng.session(), ids)
                r["capture_disk_s"] = writer.last["capture_s"]
                r["disk_bytes"] = writer.stats["disk_bytes"]
                reader = PrefixCache(fp, grid=grid, page=page, disk_dir=d)   # as after a restart
                logits, r["repeat_disk_s"] = _timed(reader.prefill, eng.session(), ids)
                r["restore_disk_s"] = reader.last["restore_s"]
                check("repeat_disk", logits, ids)
        out[f"L{L}"] = r
        if log:
            log(f"L={L}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    return out


# ------------------------------------------------------------------------------------------------ bench decode
# Also used by benchmarks/compare_llamacpp.py (a thin wrapper), bench_e2e.py, bench_gemv.py and bandwidth.py.

def seeded_tokens(n: int, n_vocab: int, seed: int = 0) -> list[int]:
    # ordinary token ids (below the specials at the top of the Qwen vocabulary)
    return np.random.default_rng(seed).integers(0, max(1, n_vocab - 512), n).tolist()


def _times(run, reps: int) -> list[float]:
    """Seconds of `reps` runs after one untimed warm-up."""
    run()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return times


SAMPLE_DEFAULT = "temp=0.8,top_p=0.95"
_SAMPLE_KEYS = {"temp": "temperature", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                "min_p": "min_p", "repeat_penalty": "repetition_penalty", "repetition_penalty": "repetition_penalty",
                "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "seed": "seed"}


def parse_sample(spec: str | None):
    """"temp=0.8,top_p=0.95[,top_k=40,min_p=0.05,repeat_penalty=1.1,seed=S]" -> SamplingParams (seed 0 unless
    given); "off", "" or None -> None."""
    if spec is None or spec.strip() in ("", "off", "none"):
        return None
    kw = {"seed": 0}
    for item in spec.split(","):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in _SAMPLE_KEYS:
            raise ValueError(f"--sample: {item!r} is not KEY=VALUE with KEY one of {', '.join(_SAMPLE_KEYS)}")
        field_name = _SAMPLE_KEYS[key.strip()]
        kw[field_name] = int(value) if field_name in ("top_k", "seed") else float(value)
    params = SamplingParams(**kw)
    params.validate()
    return params


def generate_steps(model, state, first: int, n: int, sampler) -> None:
    """n decode steps as Session.decode_next runs them: one token through the model, the sampler's draw from its
    logits (the tokens fed so far as the penalties' history), the drawn token next. model: a Model, or a GpuModel
    (sample_next: the draw's candidates chosen in VRAM)."""
    history, tok = [], first
    step = getattr(model, "sample_next", None)
    for _ in range(n):
        history.append(tok)
        tok = step(state, tok, sampler, history) if step else sampler.sample(model.forward(state, [tok]), history)


def times_interleaved(runs, reps: int) -> list[list[float]]:
    """Seconds of each of `runs`, reps times in turn (a, b, a, b, ...) after one warm-up of each: other work on
    shared cores falls on all of them alike. A run that returns a number returns its own seconds (the part to
    time); else the whole call counts."""
    for run in runs:
        run()
    times = [[] for _ in runs]
    for _ in range(reps):
        for run, ts in zip(runs, times):
            t0 = time.perf_counter()
            own = run()
            ts.append(own if own is not None else time.perf_counter() - t0)
    return times


def sampled_vs_greedy(t_greedy: list[float], t_sampled: list[float], tg: int, params) -> dict:
    """The JSON fields of the greedy / sampled decode (medians)."""
    g, s = statistics.median(t_greedy), statistics.median(t_sampled)
    return dict(tg_greedy_tok_s=tg / g, tg_sampled_tok_s=tg / s, sampled_over_greedy=g / s,
                sampler_ms_per_token=1e3 * (s - g) / tg, tg_greedy_runs_s=t_greedy, tg_sampled_runs_s=t_sampled,
                sample=asdict(params))


def _result(engine: str, threads: int, load: float, pp: int, tg: int, t_pp: list[float],
            t_tg: list[float]) -> dict:
    """tok/s from the median time; the runs' range kept to show the noise."""
    r = dict(engine=engine, threads=threads, load_s=load, pp_runs_s=t_pp, tg_runs_s=t_tg)
    for k, n, ts in (("pp", pp, t_pp), ("tg", tg, t_tg)):
        r[f"{k}_s"] = statistics.median(ts) if ts else float("nan")
        r[f"{k}_tok_s"] = n / r[f"{k}_s"] if ts else float("nan")
        r[f"{k}_tok_s_range"] = (n / max(ts), n / min(ts)) if ts else None
    return r


def file_kernels(mf: ModelFile) -> dict[str, str]:
    """{weight type: tier whose integer kernel serves it now ("f32" where none does)} over the file's types."""
    types = sorted({(t.type_name, t.type) for t in mf.tensors.values()} - {("F32", 0), ("F16", 1), ("BF16", 30)})
    return {name: _native.kernel_isa(t) or "f32" for name, t in types}


def bench_ours(path: str, threads: int, pp: int, tg: int, reps: int, ids: list[int], isa: str | None = None,
               load_opts: dict | None = None, sample=None) -> dict:
    """Our pp/tg with tier `isa` forced (set before the model loads, the previous tier restored after); "f32":
    integer kernels off (dequantise + f32 dot products: the reference path); None: the tier in effect.
    load_opts: Model's mmap / numa / pin. After the timed runs, one more decode run with the C core's phase
    timer on gives `profile_ms`: milliseconds per decoded token per phase (le_model_profile). sample
    (SamplingParams): also decode as generation does, greedy and with these (sampled_vs_greedy's fields)."""
    prev = _native.get_isa()
    try:
        if isa not in (None, "f32"):
            _native.set_isa(isa)
        t0 = time.perf_counter()
        model = Model(path, n_threads=threads, **(load_opts or {}))
        load = time.perf_counter() - t0
        if isa == "f32":
            model.native.set_int8(False)
        kernels = {k: "f32" for k in file_kernels(model.file)} if isa == "f32" else file_kernels(model.file)
        state = model.new_state(max(pp, tg) + 8)

        def prefill():
            state.reset()
            model.forward(state, ids[:pp], all_logits=False, chunked=True)

        def decode():
            state.reset()
            for tok in ids[:tg]:
                model.forward(state, [tok], all_logits=False)

        t_pp = _times(prefill, reps) if pp else []
        t_tg = _times(decode, reps) if tg else []
        profile = {}
        if tg:
            model.native.set_profile(True)
            decode()
            profile = {k: 1e3 * v / tg for k, v in model.native.profile().items()}
            model.native.set_profile(False)
        gen = {}
        if tg and sample is not None:
            def generation(params):
                def run():
                    state.reset()
                    generate_steps(model, state, ids[0], tg, Sampler(params, model=model))   # one a request
                return run
            gen = sampled_vs_greedy(*times_interleaved([generation(SamplingParams()), generation(sample)], reps),
                                    tg, sample)
        pinned = sum(c >= 0 for c in model.pinned)
    finally:
        _native.set_isa(prev)
    r = _result(f"legacy_engine {isa or prev}", threads, load, pp, tg, t_pp, t_tg)
    r["isa"], r["kernels"], r["profile_ms"], r["pinned_threads"] = isa or prev, kernels, profile, pinned
    r.update(gen)
    return r


def bench_llama(path: str, threads: int, pp: int, tg: int, reps: int, ids: list[int]) -> dict:
    """llama.cpp through llama-cpp-python, the same work as bench_ours."""
    from llama_cpp import Llama
    t0 = time.perf_counter()
    llm = Llama(path, n_threads=threads, n_threads_batch=threads, n_ctx=max(pp, tg) + 8, n_batch=512, n_ubatch=512,
                logits_all=False, verbose=False)
    load = time.perf_counter() - t0

    def prefill():
        llm.reset()                                             # n_tokens = 0: eval drops the cache from there
        llm.eval(ids[:pp])

    def decode():
        llm.reset()
        for tok in ids[:tg]:
            llm.eval([tok])

    try:
        t_pp = _times(prefill, reps) if pp else []
        t_tg = _times(decode, reps) if tg else []
    finally:
        llm.close()
    return _result("llama.cpp", threads, load, pp, tg, t_pp, t_tg)


def bench_llama_bench(binary: str, path: str, threads: int, pp: int, tg: int, reps: int) -> dict:
    """llama.cpp's own llama-bench binary (`-o json`); the median of its per-run samples counts."""
    cmd = [binary, "-m", str(path), "-t", str(threads), "-p", str(pp), "-n", str(tg), "-r", str(reps),
           "-ngl", "0", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, encoding="utf-8", errors="replace")
    if out.returncode != 0:
        raise UnavailableError(f"{' '.join(cmd)} exited {out.returncode}: {out.stderr.strip()[-500:]}")
    t_pp: list[float] = []
    t_tg: list[float] = []
    for test in json.loads(out.stdout):
        ns = test.get("samples_ns") or [test["avg_ns"]]
        if test.get("n_prompt", 0) > 0 and test.get("n_gen", 0) == 0:
            t_pp = [x / 1e9 for x in ns]
        elif test.get("n_gen", 0) > 0 and test.get("n_prompt", 0) == 0:
            t_tg = [x / 1e9 for x in ns]
    return _result("llama.cpp (llama-bench)", threads, float("nan"), pp, tg, t_pp, t_tg)


def add_roofline(r: dict, fp: Footprint, pp: int, bandwidth: float | None) -> dict:
    """decode GB/s, roofline tok/s (bandwidth / bytes per token), % of it; prefill GFLOP/s (2 x active weights per
    token, LM head once; attention and GDN state FLOPs left out)."""
    r["bytes_per_token"] = fp.decode_bytes
    r["decode_GBps"] = fp.decode_bytes * r["tg_tok_s"] / 1e9
    r["bandwidth_GBps"] = bandwidth
    r["roofline_tok_s"] = bandwidth * 1e9 / fp.decode_bytes if bandwidth else None
    r["pct_of_roofline"] = 100 * r["tg_tok_s"] / r["roofline_tok_s"] if bandwidth else None
    flops = 2 * ((fp.decode_params - fp.head_params) * pp + fp.head_params)
    r["pp_GFLOPs"] = flops / r["pp_s"] / 1e9 if pp else float("nan")
    return r


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _rate(r: dict, k: str) -> str:
    """median tok/s, with the runs' range when there were several"""
    if r[f"{k}_tok_s_range"] is None:
        return "-"
    lo, hi = r[f"{k}_tok_s_range"]
    return f"{r[f'{k}_tok_s']:.2f}" + (f" ({lo:.2f}–{hi:.2f})" if len(r[f"{k}_runs_s"]) > 1 else "")


def decode_table(res: dict) -> str:
    """The markdown table of bench_decode's result: one row per (threads, engine)."""
    pp, tg = res["pp"], res["tg"]
    cols = ["engine", "threads", f"pp{pp} tok/s", f"tg{tg} tok/s", "pp ratio", "tg ratio", "bytes/tok",
            "roofline tok/s", "% roofline"]
    rows = []
    for r in res["results"]:
        theirs = next((x for x in res["results"] if x["engine"].startswith("llama.cpp")
                       and x["threads"] == r["threads"]), None)
        ratio = [f"{r[f'{k}_tok_s'] / theirs[f'{k}_tok_s']:.2f}" if theirs and theirs[f"{k}_tok_s"] > 0 else "-"
                 for k in ("pp", "tg")]
        roof = [f"{r['roofline_tok_s']:.1f} @ {r['bandwidth_GBps']:.1f} GB/s", f"{r['pct_of_roofline']:.1f} %"] \
            if r["roofline_tok_s"] else ["-", "-"]
        rows.append([r["engine"], str(r["threads"]), _rate(r, "pp"), _rate(r, "tg"), *ratio,
                     _gib(r["bytes_per_token"]), *roof])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(c) + " |" for c in rows]
    return "\n".join(lines)


def parse_isas(spec: str) -> list[str]:
    """"chosen" -> the tier `info` chooses (the one the engine runs); "all" -> every tier this CPU runs; "none" -> [];
    else a comma list of tiers, "f32", "chosen" and "all", each checked."""
    isas: list[str] = []
    for i in (s.strip() for s in spec.split(",")):
        if i in ("", "none"):
            continue
        if i == "all":
            isas += [n for n in _native.ISA_NAMES if _native.isa_supported(n) and n not in isas]
            continue
        if i == "chosen":
            isas += [_native.get_isa()] if _native.get_isa() not in isas else []
            continue
        if i != "f32" and i not in _native.ISA_NAMES:
            raise ValueError(f"--isa: unknown tier {i!r}; choose from all, none, f32, {', '.join(_native.ISA_NAMES)}")
        if i != "f32" and not _native.isa_supported(i):
            raise UnavailableError(f"--isa: this CPU cannot run {i} kernels; it runs "
                                   f"{', '.join(n for n in _native.ISA_NAMES if _native.isa_supported(n))}")
        isas += [i] if i not in isas else []
    return isas


def bench_decode(model_path: str, threads=(None,), pp: int = 64, tg: int = 32, reps: int = 3, isas=None,
                 llama: str = "auto", bandwidth: float | str | None = "auto", seed: int = 0, log=None,
                 load_opts: dict | None = None, sample=None) -> dict:
    """Runs the module docstring's `bench decode`; returns {"model", "footprint", "results": [row dicts], ...}.
    threads: thread counts (None: all cores). isas: tiers to force, "f32" for integer kernels off (None: every tier
    this CPU runs). llama: "auto" (llama-cpp-python if importable), "off", or the path of a llama-bench binary.
    bandwidth: GB/s, "auto" (measured per thread count) or None (no roofline). sample: SamplingParams of the
    sampled decode beside the greedy one (the command's --sample; None: neither)."""
    isas = parse_isas("all") if isas is None else list(isas)
    log = log or (lambda s: None)
    mf = ModelFile.open(model_path)
    hp, fp = mf.hparams, weight_footprint(mf)
    ids = seeded_tokens(max(pp, tg), hp.n_vocab, seed)
    out = dict(model=str(model_path), arch=hp.arch, n_layer=hp.n_layer, n_embd=hp.n_embd, n_expert=hp.n_expert,
               n_expert_used=hp.n_expert_used, bytes_by_type={k: v[1] for k, v in mf.bytes_by_type().items()},
               footprint=asdict(fp), pp=pp, tg=tg, reps=reps, seed=seed, isas=list(isas), notes=[], results=[])
    del mf
    use_llama = None
    if llama == "auto":
        try:
            import llama_cpp  # noqa: F401
            use_llama = "python"
        except ImportError:
            out["notes"].append("llama.cpp: llama-cpp-python is not importable; --llama PATH runs a llama-bench")
    elif llama != "off":
        binary = shutil.which(llama) or llama
        if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
            raise UnavailableError(f"--llama {llama}: not an executable llama-bench; give its path, auto or off")
        use_llama = binary
    out["load_avg_before"] = os.getloadavg()[0]
    for n in [t or default_threads() for t in threads]:
        bw = machine_bandwidth(n) if bandwidth == "auto" else bandwidth
        out.setdefault("bandwidth_GBps", {})[n] = bw
        log(f"threads {n}: read bandwidth {bw:.1f} GB/s" if bw else f"threads {n}")
        rows = []
        for isa in isas:
            rows.append(bench_ours(model_path, n, pp, tg, reps, ids, isa, load_opts, sample))
            log(f"  {rows[-1]['engine']}: pp {rows[-1]['pp_tok_s']:.2f} tok/s, tg {rows[-1]['tg_tok_s']:.2f} tok/s")
        if use_llama == "python":
            rows.append(bench_llama(model_path, n, pp, tg, reps, ids))
        elif use_llama:
            rows.append(bench_llama_bench(use_llama, model_path, n, pp, tg, reps))
        if use_llama:
            log(f"  {rows[-1]['engine']}: pp {rows[-1]['pp_tok_s']:.2f} tok/s, tg {rows[-1]['tg_tok_s']:.2f} tok/s")
        out["results"] += [add_roofline(r, fp, pp, bw) for r in rows]
    out["load_avg_after"] = os.getloadavg()[0]
    return out


def bench_batch_decode(model_path: str, threads: int | None = None, batches=(1, 2, 4, 8, 16), tg: int = 16,
                       prompt: int = 64, reps: int = 3, isa: str | None = None, seed: int = 0,
                       load_opts: dict | None = None, gpu_tier: str | None = None) -> dict:
    """Aggregate decode speed of B sequences advanced together (Model.forward_batch: each weight row read once for
    all B) for each B in batches; benchmarks/bench_batch_decode.py prints it. Per B: B states, each prefilled alone
    with `prompt` seeded tokens of its own (so the sequences route to different experts, as real ones do), then tg
    batched steps of one seeded token per sequence: tok/s = B * tg / time. The states go back to their prefilled
    bytes before every run, outside the timing. The batch sizes take turns (one warm-up round, then reps rounds of
    every B in order), so that other work on the machine slows them alike; tok/s from the median run, `best` from
    the fastest. `alone_tok_s`: the same tg steps of one sequence through Model.forward (le_forward), in the same
    rounds. profile_ms: the C core's phase milliseconds per batched step (le_model_profile) over one more run.
    isa: a tier forced (set before the model loads, restored after), "f32" for integer kernels off, None: the tier
    in effect. gpu_tier ('fermi' | 'kepler' | 'dp4a' | 'auto'): the GPU-resident model (GpuModel.forward_batch)
    instead, its states prefilled afresh before each run (outside the timing), no phase profile."""
    prev = _native.get_isa()
    try:
        if isa not in (None, "f32"):
            _native.set_isa(isa)
        model = Model(model_path, n_threads=threads or default_threads(), **(load_opts or {}))
        if isa == "f32":
            model.native.set_int8(False)
        cpu, n_vocab, n_ctx = model, model.hparams.n_vocab, prompt + tg + 8
        if gpu_tier is not None:
            model = GpuModel.resident(cpu, GpuOptions(tier=None if gpu_tier == "auto" else gpu_tier), n_ctx=n_ctx)
        starts, steps = [], []
        for s in range(max(batches)):                 # each sequence's prefilled state and decode tokens
            st = model.new_state(n_ctx)
            model.forward(st, seeded_tokens(prompt, n_vocab, seed + 1000 + s))
            starts.append(st.save() if gpu_tier is None else seeded_tokens(prompt, n_vocab, seed + 1000 + s))
            steps.append(seeded_tokens(tg, n_vocab, seed + 2000 + s))
        out = dict(model=str(model_path), threads=cpu.n_threads, isa=isa or prev, prompt=prompt, tg=tg, reps=reps,
                   kernels=file_kernels(cpu.file), load_avg_before=os.getloadavg()[0], rows=[],
                   gpu=model.describe() if gpu_tier is not None else None)

        def runner(B: int | None):
            """One run of tg steps: B sequences batched, or (None) sequence 0 alone through Model.forward."""
            states = [model.new_state(n_ctx) for _ in range(B or 1)]

            def run() -> float:
                for i, blob in enumerate(starts[:len(states)]):
                    if gpu_tier is None:
                        states[i].restore(blob)
                    else:                             # a fresh state, prefilled (GpuState has no restore of all)
                        states[i] = model.new_state(n_ctx)
                        model.forward(states[i], blob)
                t0 = time.perf_counter()
                for k in range(tg):
                    if B is None:
                        model.forward(states[0], [steps[0][k]])
                    else:
                        model.forward_batch(states, [[steps[s][k]] for s in range(B)])
                return time.perf_counter() - t0
            return run

        runs = {B: runner(B) for B in [None, *batches]}
        times: dict = {B: [] for B in runs}
        for r in range(reps + 1):                     # round 0: the warm-up (the batch arena grows, pages fault in)
            for B, run in runs.items():
                t = run()
                if r:
                    times[B].append(t)
        out["alone_tok_s"] = tg / statistics.median(times[None])
        for B in batches:
            profile = _step_profile(model, runs[B], tg) if gpu_tier is None else {}
            ts = times[B]
            out["rows"].append(dict(batch=B, tok_s=B * tg / statistics.median(ts), best_tok_s=B * tg / min(ts),
                                    step_ms=1e3 * statistics.median(ts) / tg, runs_s=ts,
                                    tok_s_range=(B * tg / max(ts), B * tg / min(ts)), profile_ms=profile))
        base = out["rows"][0] if batches[0] == 1 else None
        for r in out["rows"]:
            r["ratio_to_b1"] = r["tok_s"] / base["tok_s"] if base else None
            r["best_ratio_to_b1"] = r["best_tok_s"] / base["best_tok_s"] if base else None
        out["load_avg_after"] = os.getloadavg()[0]
        return out
    finally:
        _native.set_isa(prev)


def _step_profile(model, run, steps: int) -> dict:
    """The C core's phase milliseconds per step (le_model_profile) over one more run."""
    model.native.set_profile(True)
    run()
    profile = {k: 1e3 * v / steps for k, v in model.native.profile().items() if v > 0}
    model.native.set_profile(False)
    return profile


_OFF = {"temperature": None, "top_k": 0, "top_p": 1.0, "min_p": 0.0}   # print_decode names what is on


def print_decode(res: dict, profile: bool = False) -> None:
    """The header lines (file, bytes per token, kernels per tier, load), decode_table, and with profile=True
    the phase profile of each of our rows (where the decode time goes)."""
    fp = res["footprint"]
    mix = ", ".join(f"{k} {_gib(v)}" for k, v in res["bytes_by_type"].items())
    print(f"{res['model']}: {res['arch']}, {res['n_layer']} layers, n_embd {res['n_embd']}"
          + (f", {res['n_expert']} experts top-{res['n_expert_used']}" if res["n_expert"] else "") + f"; {mix}")
    print(f"weights read per decoded token: {_gib(fp['decode_bytes'])} of {_gib(fp['file_bytes'])} "
          f"(experts {_gib(fp['parts']['experts'])}, LM head {_gib(fp['parts']['lm_head'])}, "
          f"other {_gib(fp['parts']['other'])}); {fp['decode_params'] / 1e9:.3f} G active weights")
    seen = set()
    for r in res["results"]:
        if "kernels" in r and r["isa"] not in seen:
            seen.add(r["isa"])
            print(f"kernels with {r['isa']}: " + ", ".join(f"{k} {v}" for k, v in r["kernels"].items()))
    print(f"pp {res['pp']}, tg {res['tg']}: median of {res['reps']} after one warm-up; load average "
          f"{res['load_avg_before']:.2f} before, {res['load_avg_after']:.2f} after (other work on these cores "
          f"skews the numbers)")
    for note in res["notes"]:
        print(note)
    print()
    print(decode_table(res))
    gen = [r for r in res["results"] if "sampled_over_greedy" in r]
    if gen:
        sp = gen[0]["sample"]
        spec = ", ".join(f"{k} {sp[k]}" for k in ("temperature", "top_k", "top_p", "min_p") if sp[k] != _OFF[k])
        print(f"\ndecode as generation runs it (logits -> Sampler.sample -> next token), tg {res['tg']}, median of "
              f"{res['reps']}, greedy and sampled ({spec}) interleaved:")
        for r in gen:
            print(f"  {r['engine']}, {r['threads']} threads: greedy {r['tg_greedy_tok_s']:.2f} tok/s, sampled "
                  f"{r['tg_sampled_tok_s']:.2f} tok/s, sampled/greedy {r['sampled_over_greedy']:.3f} (sampler "
                  f"{r['sampler_ms_per_token']:+.3f} ms/token)")
    if profile:
        for r in res["results"]:
            if r.get("profile_ms"):
                total = sum(r["profile_ms"].values())
                parts = sorted(r["profile_ms"].items(), key=lambda kv: -kv[1])
                print(f"\nwhere a decoded token's time goes, {r['engine']}, {r['threads']} threads "
                      f"({r['pinned_threads']} pinned), {total:.2f} ms/token in the C core:")
                print("  " + ", ".join(f"{k} {v:.2f} ms ({100 * v / total:.0f}%)" for k, v in parts if v >= 0.005))
