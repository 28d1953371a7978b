"""`legacy-engine bench gpu`: the GPU-resident engine (legacy_engine/gpu) per kernel tier, next to llama.cpp's CUDA build.

    legacy-engine bench gpu MODEL.gguf [--pp 512,2048] [--tg 64] [--reps 3] [--variants all|TIER-smARCH,...]
                                       [--llama PATH] [--sample temp=0.8,top_p=0.95|off] [--json]

Rows: legacy_engine with each tier variant (fermi-sm35, kepler-sm35: compute_35 PTX; dp4a-sm61, dp4a-sm70: the
Pascal/Volta PTX; and every tier built for the card's own arch), DP4A decode GEMVs on the dp4a tier (int8) and f32
GEMVs below it; llama.cpp = a llama-bench binary built with CUDA (`-ngl 99`, all layers on the GPU). Same file.
  pp N      one forward of N seeded tokens from an empty state (chunks of 512), last logits: tok/s = N / time
  tg N      N single-token steps after a 16-token prefill, logits downloaded each step: tok/s = N / time
  greedy, sampled  the same steps as generation runs them (logits -> Sampler.sample on the CPU -> the next token),
            temperature 0 and --sample (default temp=0.8,top_p=0.95, seed 0), runs interleaved; smp/gr = sampled
            tok/s / greedy tok/s (the issue's target: >= 0.9 on the GPU-resident 0.8B)
  bytes/tok weights read per decoded token (footprint.weight_footprint: experts at top-k/n_expert of their bytes)
  % HBM     tg tok/s * bytes/tok / the device-to-device copy bandwidth measured here (read + write counted)
Each measurement: one untimed warm-up, then --reps runs; the median counts.
--profile: one more pass of the longest pp per row, timed per phase on the GPU (embed, gdn, attention, ffn rest,
head: the phases GpuModel.profile marks) and per prefill GEMM kernel: its TFLOP/s (2 operations per weight per
token) and % of the tier's peak, the peak being the same instruction's rate measured on this card (cuda8/peak.cu:
FMA for gemm_f32, dp4a for gemm_dp4a, mma.sync for gemm_mma).
"""
from __future__ import annotations

import functools
import json
import statistics
import subprocess
import sys
import time

import numpy as np

from .. import gpu
from .bench import (SAMPLE_DEFAULT, _times, generate_steps, parse_sample, sampled_vs_greedy, seeded_tokens,
                    times_interleaved)
from ..core import _native
from ..core.errors import UnavailableError
from ..cpu.model import Model
from ..format.footprint import weight_footprint
from ..format.gguf_model import ModelFile
from ..gpu.launch import PEAK_THREADS
from ..gpu.model import GpuModel
from ..gpu.options import GpuOptions
from ..plan.planner import save_routing
from ..serve.sampling import Sampler, SamplingParams

WARM_PREFILL = 16
PEAK_ITERS = 4096          # steps per thread of a peak kernel: ~1 ms on an H200, launch cost negligible
PEAK_BLOCKS_PER_SM = 8     # 2048 threads: every SM full whatever its resident-thread limit


def instruction_peak(k, gemm: str, reps: int = 3) -> float:
    """Operations/s of `gemm`'s instruction on this card (Kernels.peak: cuda8/peak.cu), best of `reps` after one
    warm-up."""
    blocks = PEAK_BLOCKS_PER_SM * _native.gpu_info()["devices"][_native.gpu_current_device()]["multiprocessors"]
    best = float("inf")
    with gpu.Buffer(4 * blocks * PEAK_THREADS, "peak out") as out:
        e0, e1 = gpu.Event(), gpu.Event()
        for rep in range(reps + 1):
            e0.record()
            ops = k.peak(gemm, out, blocks, PEAK_ITERS)
            e1.record()
            if rep:
                best = min(best, e0.elapsed_ms(e1) / 1e3)
            else:
                e1.synchronize()
    return ops / best


def gemm_table(k, gemms: dict, passes: int = 1) -> list[dict]:
    """GpuModel.profile_gemms' {(phase, kernel): [s, ops, launches]} summed over `passes` passes -> per pass rows
    {"phase", "kernel", "s", "tflops", "peak_tflops", "pct_peak", "launches"}, the peak being the kernel's
    instruction measured on this card (instruction_peak of the variant's kernels k)."""
    peaks = {mod: instruction_peak(k, mod) for mod in {m for _, m in gemms}}
    return [{"phase": ph, "kernel": mod, "s": s / passes, "tflops": ops / s / 1e12, "peak_tflops": peaks[mod] / 1e12,
             "pct_peak": 100 * ops / s / peaks[mod], "launches": n // passes}
            for (ph, mod), (s, ops, n) in sorted(gemms.items(), key=lambda kv: -kv[1][0])]


def print_gemms(rows: list[dict], indent: str = "  ") -> None:
    for g in rows:
        print(f"{indent}{g['phase']:<26} {g['kernel']:<10} {1e3 * g['s']:8.2f} ms  {g['launches']:4d} launches "
              f"{g['tflops']:7.1f} TFLOP/s = {g['pct_peak']:5.1f} % of the {g['peak_tflops']:.0f} TFLOP/s peak")


def profile_pass(gm, st, ids) -> dict:
    """One pass of `ids` from an empty state with GpuModel.profile on -> {"phases": {phase: s}, "gemms": [{"phase",
    "kernel", "s", "tflops", "peak_tflops", "pct_peak", "launches"}], "total_s"}."""
    st.reset()
    gm.profile(True)
    try:
        gm.forward(st, ids)
        phases, gemms = gm.profile_report(), gm.profile_gemms()
    finally:
        gm.profile(False)
    rows = gemm_table(gm.k, gemms)
    return {"phases": phases, "gemms": rows, "total_s": sum(phases.values())}


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Device-to-device copy bandwidth in bytes/s, read + write counted (the HBM figure to compare with)."""
    a, b = gpu.Buffer(nbytes, "bw src"), gpu.Buffer(nbytes, "bw dst")
    try:
        e0, e1 = gpu.Event(), gpu.Event()
        _native.gpu_copy_dtod(b.ptr, a.ptr, nbytes)
        best = float("inf")
        for _ in range(reps):
            e0.record()
            _native.gpu_copy_dtod(b.ptr, a.ptr, nbytes)
            e1.record()
            best = min(best, e0.elapsed_ms(e1) / 1e3)
        return 2 * nbytes / best
    finally:
        a.free()
        b.free()


def _median_time(fn, reps: int) -> float:
    """Median seconds of `reps` runs after one warm-up."""
    return statistics.median(_times(fn, reps))


def bench_ours(model, variant: tuple[str, int], pps, tg: int, reps: int, n_ctx: int,
               graphs: bool | None = None, sample=None, profile: bool = False) -> dict:
    tier, arch = variant
    gm = GpuModel.resident(model, GpuOptions(tier=tier, arch=arch, graphs=graphs,
                                             save_routing=functools.partial(save_routing, model)))
    n_vocab = model.hparams.n_vocab
    ids = seeded_tokens(max(list(pps) + [tg + WARM_PREFILL]), n_vocab)
    st = gm.new_state(n_ctx)
    row = {"engine": f"legacy_engine {gm.k.name}" + (" int8" if gm.int8 else "") + (" graph" if gm.graphs else ""),
           "variant": gm.k.name, "int8": gm.int8, "graphs": gm.graphs, "pp": {}, "vram_gib": gm.vram_bytes / 2**30}

    for pp in pps:
        def prefill(pp=pp):
            st.reset()
            gm.forward(st, ids[:pp])
        row["pp"][pp] = pp / _median_time(prefill, reps)
    if profile and max(pps, default=0) > 1:         # one token is a decode step: no phases to mark
        row["profile"] = {"pp": max(pps), **profile_pass(gm, st, ids[:max(pps)])}

    def decode():
        st.reset()
        gm.forward(st, ids[:WARM_PREFILL], want_logits=False)
        t0 = time.perf_counter()
        for t in ids[WARM_PREFILL:WARM_PREFILL + tg]:
            gm.forward(st, [t])
        return time.perf_counter() - t0
    decode()
    row["tg"] = tg / statistics.median(decode() for _ in range(reps))
    row["launches_per_token"] = len(st._plan) if st._plan is not None else None
    if tg and sample is not None:
        row.update(generation_vs_greedy(gm, st, ids, tg, reps, sample))
    gm.close()
    return row


def generation_vs_greedy(gm, st, ids, tg: int, reps: int, sample) -> dict:
    """tg steps after the warm prefill as generation runs them, greedy and with `sample`, interleaved
    (bench.sampled_vs_greedy's fields); only the steps are timed."""
    def generation(params):
        def run():
            st.reset()
            gm.forward(st, ids[:WARM_PREFILL], want_logits=False)
            t0 = time.perf_counter()
            # the CPU model's pool (idle while the GPU decodes) runs the sampler's passes, as Session.stream does
            generate_steps(gm, st, ids[WARM_PREFILL], tg, Sampler(params, model=getattr(gm, "model", gm)))
            return time.perf_counter() - t0
        return run
    row = sampled_vs_greedy(*times_interleaved([generation(SamplingParams()), generation(sample)], reps), tg, sample)
    ds = getattr(gm, "_sampler", None)      # draws from VRAM candidates / from the downloaded row (gpu/sample.py)
    if ds is not None:
        row["device_sampling"] = dict(ds.stats)
    return row


def bench_llama(binary: str, path: str, pps, tg: int, reps: int, flags=("-ngl", "99"),
                engine: str = "llama.cpp CUDA (llama-bench -ngl 99)") -> dict:
    """One llama-bench run (its JSON output) -> {"engine", "pp": {n: tok/s}, "tg", "tg_at": {depth: tok/s}, "build",
    "backend"}; `flags` are llama-bench's placement flags (-ngl, -ncmoe, -t …; with -d, pp counts depth 0 only and
    tg is depth 0's when there). UnavailableError with its stderr when it fails."""
    cmd = [binary, "-m", str(path), *flags, "-p", ",".join(str(p) for p in pps) or "0", "-n", str(tg), "-r", str(reps),
           "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, encoding="utf-8", errors="replace")
    if out.returncode != 0:
        raise UnavailableError(f"{' '.join(cmd)} exited {out.returncode}: {out.stderr.strip()[-500:]}")
    row = {"engine": engine, "pp": {}, "tg": float("nan"), "tg_at": {}}
    for test in json.loads(out.stdout):
        depth = int(test.get("n_depth", 0))        # -d: the context already in the cache when a test starts
        if test.get("n_gen", 0) == 0:
            if depth == 0:
                row["pp"][int(test["n_prompt"])] = float(test["avg_ts"])
        else:
            row["tg_at"][depth] = float(test["avg_ts"])
            if depth == 0 or row["tg"] != row["tg"]:
                row["tg"] = float(test["avg_ts"])
        row["build"] = test.get("build_commit", "")
        row["backend"] = test.get("backends", "")
    return row


def bench_gpu(path: str, pps=(512, 2048), tg: int = 64, reps: int = 3, variants=None, llama: str | None = None,
              log=None, sample=None, profile: bool = False) -> dict:
    log = log or (lambda s: None)
    dev = gpu.init()
    arch = gpu.device_arch()
    if variants is None:
        variants = [v for v in gpu.LEGACY_VARIANTS] + [(t, arch) for t in gpu.TIERS]
    fp = weight_footprint(ModelFile.open(path))
    res = {"model": str(path), "device": dev["name"], "arch": arch, "bytes_per_token": fp.decode_bytes,
           "copy_bandwidth": copy_bandwidth(), "rows": [], "pp": list(pps), "tg": tg}
    model = Model(path, pin=False)
    n_ctx = max(list(pps) + [tg + WARM_PREFILL]) + 8
    runs = [(v, None) for v in variants]
    if ("dp4a", arch) in variants and gpu.graphs_available():
        runs.append((("dp4a", arch), False))      # the same without CUDA graphs: what the graph saves
    for v, graphs in runs:
        log(f"legacy_engine {gpu.variant_name(*v)}{' no graphs' if graphs is False else ''} …")
        try:
            res["rows"].append(bench_ours(model, v, pps, tg, reps, n_ctx, graphs, sample, profile and graphs is None))
        except Exception as e:      # a variant that cannot be built or run here: its row says why
            res["rows"].append({"engine": f"legacy_engine {gpu.variant_name(*v)}", "error": str(e)[:300]})
    if llama:
        log("llama.cpp …")
        try:
            res["rows"].append(bench_llama(llama, path, pps, tg, reps))
        except UnavailableError as e:
            res["rows"].append({"engine": "llama.cpp", "error": str(e)})
    ref = next((r for r in res["rows"] if r["engine"].startswith("llama.cpp") and "error" not in r), None)
    for r in res["rows"]:
        if "error" in r:
            continue
        r["hbm_pct"] = 100 * r["tg"] * fp.decode_bytes / res["copy_bandwidth"]
        if ref:
            r["tg_ratio"] = r["tg"] / ref["tg"]
            r["pp_ratio"] = {p: r["pp"].get(p, float("nan")) / ref["pp"][p] for p in ref["pp"]}
    return res


def print_gpu(res: dict) -> None:
    pps = res["pp"]
    print(f"{res['model']} on {res['device']} (sm_{res['arch']}): {res['bytes_per_token'] / 2**20:.1f} MiB read per "
          f"decoded token, device copy bandwidth {res['copy_bandwidth'] / 1e9:.0f} GB/s")
    head = f"{'engine':<40}" + "".join(f"{'pp' + str(p):>10}" for p in pps) + f"{'tg' + str(res['tg']):>9}"
    head += f"{'tg ratio':>9}{'% HBM':>7}{'greedy':>9}{'sampled':>9}{'smp/gr':>8}"
    print(head)
    for r in res["rows"]:
        if "error" in r:
            print(f"{r['engine']:<40} error: {r['error']}")
            continue
        line = f"{r['engine']:<40}" + "".join(f"{r['pp'].get(p, float('nan')):>10.1f}" for p in pps)
        line += f"{r['tg']:>9.1f}{r.get('tg_ratio', float('nan')):>9.2f}{r['hbm_pct']:>6.1f}%"
        if "sampled_over_greedy" in r:
            line += f"{r['tg_greedy_tok_s']:>9.1f}{r['tg_sampled_tok_s']:>9.1f}{r['sampled_over_greedy']:>8.3f}"
        print(line)
    sp = next((r["sample"] for r in res["rows"] if "sample" in r), None)
    if sp:
        print(f"greedy / sampled: tg{res['tg']} as generation runs it, sampled with " + ", ".join(
            f"{k} {sp[k]}" for k in ("temperature", "top_k", "top_p", "min_p", "seed")))
        ds = next((r["device_sampling"] for r in res["rows"] if "device_sampling" in r), None)
        if ds:
            print(f"draws where the logits are (gpu/sample.py): from candidates {ds['candidates']}, through top-p's "
                  f"window {ds['window']}, from the downloaded row {ds['row']}")


def print_profiles(res: dict) -> None:
    """Each profiled row's pass: GPU ms per phase, then each GEMM kernel's share, TFLOP/s and % of the tier's peak."""
    for r in res["rows"]:
        pr = r.get("profile")
        if not pr or not pr["total_s"] > 0:
            continue
        tot = pr["total_s"]
        print(f"\n{r['engine']}: one pp{pr['pp']} pass, {1e3 * tot:.2f} ms of GPU work: " + ", ".join(
            f"{ph} {1e3 * s:.2f} ms ({100 * s / tot:.0f} %)" for ph, s in sorted(pr["phases"].items(),
                                                                               key=lambda kv: -kv[1])))
        print_gemms(pr["gemms"])


def main(args) -> int:
    try:
        pps = [int(p) for p in str(args.pp).split(",") if p.strip()]
    except ValueError:
        raise SystemExit(f"bench gpu: --pp {args.pp!r}: prompt lengths are integers, comma-separated")
    if any(p < 0 for p in pps) or args.tg < 0:
        raise SystemExit(f"bench gpu: --pp {args.pp} / --tg {args.tg}: lengths are >= 0 (0 skips the test)")
    pps = [p for p in pps if p]                      # --pp 0: no prefill test
    if not pps and not args.tg:
        raise SystemExit("bench gpu: --pp 0 and --tg 0: nothing to measure")
    variants = None
    if args.variants != "all":
        variants = []
        for v in args.variants.split(","):
            tier, _, sm = v.partition("-sm")
            variants.append((tier, int(sm)))
    res = bench_gpu(args.model, pps, args.tg, args.reps, variants, args.llama,
                    log=lambda s: print(s, flush=True, file=sys.stderr), sample=parse_sample(args.sample),
                    profile=args.profile)
    if args.json:
        print(json.dumps(res, indent=1, default=float))
    else:
        print_gpu(res)
        print_profiles(res)
    return 0


def add_parser(sub) -> None:
    gp = sub.add_parser("gpu", help="GPU-resident prefill/decode tok/s per kernel tier next to llama.cpp's CUDA build",
                        description=__doc__)
    gp.add_argument("model", help="a Qwen3.5/3.6 GGUF file that fits the VRAM")
    gp.add_argument("--pp", default="512,2048", help="prompt lengths, comma-separated; 0 skips the prefill test "
                    "(512,2048)")
    gp.add_argument("--tg", type=int, default=64, help="decoded tokens (64)")
    gp.add_argument("--reps", type=int, default=3, help="timed runs after one warm-up; the median counts (3)")
    gp.add_argument("--variants", default="all", help="all, or TIER-smARCH,... e.g. dp4a-sm90,fermi-sm35 (all)")
    gp.add_argument("--llama", default=None, metavar="PATH", help="a llama-bench binary built with CUDA (none)")
    gp.add_argument("--sample", default=SAMPLE_DEFAULT, metavar="KEY=V,...|off",
                    help="also decode as generation does, greedy and sampled with these settings (bench decode's "
                         f"--sample); off: skip ({SAMPLE_DEFAULT})")
    gp.add_argument("--profile", action="store_true",
                    help="also time one pass of the longest --pp per phase and per GEMM kernel, with the GEMMs' "
                         "TFLOP/s and %% of the tier's peak measured on this card")
    gp.add_argument("--json", action="store_true", help="print JSON instead of the table")
