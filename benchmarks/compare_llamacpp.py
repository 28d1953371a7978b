"""Prefill and decode speed of legacy_engine against llama.cpp on the same GGUF and the same threads.

    python benchmarks/compare_llamacpp.py MODEL.gguf [--threads 2] [--pp 64] [--tg 16] [--reps 1]
                                          [--bandwidth GBPS] [--json OUT.json] [--no-llama | --no-ours]

pp N: one batched (chunked) forward of N tokens from an empty state, logits of the last token only: tok/s = N / time.
tg N: N single-token steps from an empty state (recurrent GDN path, KV cache growing): tok/s = N / time.
Both after one untimed warm-up of the same work (page cache, thread pool); with --reps R the median of R runs counts
and the table shows the runs' range (min–max tok/s) beside it.
Tokens are seeded random ids. llama.cpp runs through llama-cpp-python 0.3.36 (`Llama(model, n_threads=T,
n_threads_batch=T, n_batch=512)`; prefill = one `eval` of N tokens, decode = N `eval`s of one token), which is what
llama-bench's pp/tg measure, plus a small Python overhead per call (≈ 0.1 ms: negligible at these speeds).

Roofline: decode has to read the active weights once per token. Bytes per decoded token = every tensor of the
layers that run, except that expert tensors (ffn_*_exps) count n_expert_used/n_expert of their bytes (the top-k
experts), token_embd counts one row (a lookup) unless it is also the LM head (tied); recurrent state (GDN S, conv,
KV) is not counted. decode GB/s = bytes/token × tok/s; with --bandwidth (benchmarks/bandwidth.py) also its % of that.
prefill GFLOP/s counts 2 × active weights per token (LM head once): attention and GDN state FLOPs are left out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from a checkout without installing

from legacy_engine.gguf_model import ModelFile  # noqa: E402


# ------------------------------------------------------------------------------------------------ bytes moved

@dataclass
class Footprint:
    """Weight bytes and elements of a model file, and what one decoded token has to read."""
    file_bytes: int = 0            # all tensor data
    decode_bytes: int = 0          # weights read per decoded token (top-k experts only)
    decode_params: int = 0         # weight elements used per token (for FLOPs), LM head included
    head_params: int = 0           # LM head elements
    parts: dict = field(default_factory=dict)   # decode_bytes split: experts, lm_head, other (attention, GDN, ...)


def _layer(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("blk.") else None


def weight_footprint(mf: ModelFile) -> Footprint:
    hp, tensors = mf.hparams, mf.tensors
    fp = Footprint(parts={"experts": 0, "lm_head": 0, "other": 0})
    tied = "output.weight" not in tensors
    for t in tensors.values():
        fp.file_bytes += t.n_bytes
        layer = _layer(t.name)
        if layer is not None and layer >= hp.n_layer:          # MTP block: not run
            continue
        n_bytes, n_el = t.n_bytes, t.n_elements
        if t.name == "output.weight" or (tied and t.name == "token_embd.weight"):
            part, fp.head_params = "lm_head", n_el
        elif t.name == "token_embd.weight":                    # one row looked up
            n_bytes, n_el, part = n_bytes // t.ne[1], 0, "other"
        elif "_exps." in t.name:                                # [E, out, in]: top-k of E experts
            n_bytes = n_bytes * hp.n_expert_used // hp.n_expert
            n_el = n_el * hp.n_expert_used // hp.n_expert
            part = "experts"
        else:
            part = "other"
        fp.decode_bytes += n_bytes
        fp.decode_params += n_el if len(t.ne) >= 2 and t.ne[1] > 1 else 0     # matmul weights only
        fp.parts[part] += n_bytes
    return fp


def _kernels(mf: ModelFile) -> str:
    """Which integer-kernel tier serves each quantised weight type of the file ("f32" where none does)."""
    from legacy_engine import _native
    kernel_isa = getattr(_native, "kernel_isa", None)
    types = sorted({(t.type_name, t.type) for t in mf.tensors.values()} - {("F32", 0), ("F16", 1), ("BF16", 30)})
    if kernel_isa is None:
        return "f32 dot products on dequantised rows (no integer kernels in this build)"
    return ", ".join(f"{name} {kernel_isa(t) or 'f32'}" for name, t in types)


def seeded_tokens(n: int, n_vocab: int, seed: int = 0) -> list[int]:
    # ordinary token ids (below the specials at the top of the Qwen vocabulary)
    return np.random.default_rng(seed).integers(0, max(1, n_vocab - 512), n).tolist()


# ------------------------------------------------------------------------------------------------ the engines

def _times(run, reps: int) -> list[float]:
    """Seconds of `reps` runs after one untimed warm-up."""
    run()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return times


def _result(engine: str, load: float, pp: int, tg: int, t_pp: list[float], t_tg: list[float]) -> dict:
    """tok/s from the median time; the runs' range kept to show the noise."""
    r = dict(engine=engine, load_s=load, pp_runs_s=t_pp, tg_runs_s=t_tg)
    for k, n, ts in (("pp", pp, t_pp), ("tg", tg, t_tg)):
        r[f"{k}_s"] = statistics.median(ts) if ts else float("nan")
        r[f"{k}_tok_s"] = n / r[f"{k}_s"] if ts else float("nan")
        r[f"{k}_tok_s_range"] = (n / max(ts), n / min(ts)) if ts else None
    return r


def bench_ours(path: str, threads: int, pp: int, tg: int, reps: int, ids: list[int], int8: bool = True) -> dict:
    """int8=False: integer kernels off (dequantise + f32 dot products: the reference path)."""
    from legacy_engine.model import Model
    t0 = time.perf_counter()
    model = Model(path, n_threads=threads)
    load = time.perf_counter() - t0
    if not int8:
        model.native.set_int8(False)
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
    del state, model
    return _result("legacy_engine" + ("" if int8 else " (f32)"), load, pp, tg, t_pp, t_tg)


def bench_llama(path: str, threads: int, pp: int, tg: int, reps: int, ids: list[int]) -> dict:
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
    return _result("llama.cpp", load, pp, tg, t_pp, t_tg)


# ------------------------------------------------------------------------------------------------ report

def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def add_roofline(r: dict, fp: Footprint, pp: int, bandwidth: float | None) -> dict:
    r["decode_GBps"] = fp.decode_bytes * r["tg_tok_s"] / 1e9
    r["decode_pct_bw"] = 100 * r["decode_GBps"] / bandwidth if bandwidth else None
    flops = 2 * ((fp.decode_params - fp.head_params) * pp + fp.head_params)
    r["pp_GFLOPs"] = flops / r["pp_s"] / 1e9 if pp else float("nan")
    return r


def _rate(r: dict, k: str) -> str:
    """median tok/s, with the runs' range when there were several"""
    lo_hi = r[f"{k}_tok_s_range"]
    out = f"{r[f'{k}_tok_s']:.2f}"
    return out + (f" ({lo_hi[0]:.2f}–{lo_hi[1]:.2f})" if lo_hi and len(r[f"{k}_runs_s"]) > 1 else "")


def table(results: list[dict], pp: int, tg: int, bandwidth: float | None) -> str:
    cols = ["engine", f"pp{pp} tok/s", f"tg{tg} tok/s", "pp GFLOP/s", "decode GB/s"]
    cols += [f"% of {bandwidth:g} GB/s"] if bandwidth else []
    rows = []
    for r in results:
        cells = [r["engine"], _rate(r, "pp"), _rate(r, "tg"), f"{r['pp_GFLOPs']:.1f}", f"{r['decode_GBps']:.2f}"]
        rows.append(cells + ([f"{r['decode_pct_bw']:.1f} %"] if bandwidth else []))
    theirs = [r for r in results if r["engine"] == "llama.cpp"]
    for a in (r for r in results if theirs and r["engine"].startswith("legacy_engine")):
        b = theirs[0]
        rows.append([f"ratio {a['engine']} / {b['engine']}", f"{a['pp_tok_s'] / b['pp_tok_s']:.3f}",
                     f"{a['tg_tok_s'] / b['tg_tok_s']:.3f}"] + [""] * (len(cols) - 3))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(c) + " |" for c in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="GGUF file (qwen35 / qwen35moe)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="threads for both engines")
    ap.add_argument("--pp", type=int, default=64, help="prompt tokens of the prefill test (0: skip)")
    ap.add_argument("--tg", type=int, default=16, help="decoded tokens of the decode test (0: skip)")
    ap.add_argument("--reps", type=int, default=1, help="timed runs after the warm-up; the median counts")
    ap.add_argument("--bandwidth", type=float, default=None, metavar="GBPS",
                    help="measured read bandwidth (benchmarks/bandwidth.py) to report decode as %% of")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--also-f32", action="store_true",
                    help="also time legacy_engine with its integer kernels off (f32 on dequantised rows)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--no-llama", action="store_true", help="only legacy_engine")
    g.add_argument("--no-ours", action="store_true", help="only llama.cpp")
    args = ap.parse_args(argv)

    mf = ModelFile.open(args.model)
    hp, fp = mf.hparams, weight_footprint(mf)
    ids = seeded_tokens(max(args.pp, args.tg), hp.n_vocab, args.seed)
    mix = ", ".join(f"{k} {_gib(v[1])}" for k, v in mf.bytes_by_type().items())
    print(f"{args.model}: {hp.arch}, {hp.n_layer} layers, n_embd {hp.n_embd}"
          + (f", {hp.n_expert} experts top-{hp.n_expert_used}" if hp.is_moe else "") + f"; {mix}")
    print(f"weights read per decoded token: {_gib(fp.decode_bytes)} of {_gib(fp.file_bytes)} "
          f"(experts {_gib(fp.parts['experts'])}, LM head {_gib(fp.parts['lm_head'])}, "
          f"other {_gib(fp.parts['other'])}); {fp.decode_params / 1e9:.3f} G active weights")
    print(f"threads {args.threads}, pp {args.pp}, tg {args.tg}, reps {args.reps} (after one warm-up); "
          f"load average before {os.getloadavg()[0]:.2f}", flush=True)
    print(f"legacy_engine kernels: {_kernels(mf)}")
    del mf

    results = []
    if not args.no_ours:
        results.append(bench_ours(args.model, args.threads, args.pp, args.tg, args.reps, ids))
        if args.also_f32:
            results.append(bench_ours(args.model, args.threads, args.pp, args.tg, args.reps, ids, int8=False))
    if not args.no_llama:
        results.append(bench_llama(args.model, args.threads, args.pp, args.tg, args.reps, ids))
    for r in results:
        add_roofline(r, fp, args.pp, args.bandwidth)
    print(f"load average after {os.getloadavg()[0]:.2f} (other work on these cores skews the numbers)\n")
    print(table(results, args.pp, args.tg, args.bandwidth))
    if args.json:
        args.json.write_text(json.dumps(dict(model=str(args.model), threads=args.threads, pp=args.pp, tg=args.tg,
                                             reps=args.reps, bandwidth_GBps=args.bandwidth,
                                             footprint=asdict(fp), results=results), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
