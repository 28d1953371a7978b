"""`legacy-engine bench shared`: decode speed on a machine that is doing other things too (issue 21).

    legacy-engine bench shared MODEL.gguf [--threads 1,2] [--busy 1] [--busy-unpinned] [--tg 32] [--reps 5]
                                          [--also-pinned] [--json]

Two conditions: idle (nothing started by the benchmark; other work already on the machine is reported, not
removed) and busy (--busy N processes that spin in a loop, each pinned to one CPU: the first N CPUs this process
may run on, CPU 0 first; --busy-unpinned leaves them to the scheduler). Under each, the models are loaded after the
load has started (the engine reads the load at load time to decide pinning): one per --threads count and one with
the engine's defaults (threads.default_threads, pin_decision); --also-pinned adds each count > 1 with its workers
pinned whatever the load (pin="always"). Each model decodes --tg tokens (single-token steps from an empty state)
--reps times after one untimed run, the models taking turns (rep 1 of every model, then rep 2, ...) so that drift
in the machine's other work spreads over all of them; the median counts and the runs' range is printed. "default /
best" is the default's median over the best median of the condition (the --threads counts and the default; not the
--also-pinned rows). `other work` is the engine's own reading at the condition's start (cpu_load.sample).
Results: benchmarks/results/shared_cpu_2026-11-26.md.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from ..cpu import cpu_load
from ..cpu.model import Model
from .bench import seeded_tokens

SPIN = "while True: pass"
SETTLE_S = 0.5      # the busy processes run this long before the models load


def start_busy(n: int, pinned: bool = True) -> list[subprocess.Popen]:
    """n processes spinning in a loop; pinned: process i on the i-th allowed CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    procs = []
    for i in range(n):
        p = subprocess.Popen([sys.executable, "-c", SPIN])
        if pinned:
            os.sched_setaffinity(p.pid, {cpus[i % len(cpus)]})
        procs.append(p)
    time.sleep(SETTLE_S)
    return procs


def stop_busy(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def _decode_runs(models: dict, ids: list[int], reps: int, log) -> dict:
    """{name: [seconds of one decode run] * reps}, the models taking turns, after one untimed run each."""
    states = {k: m.new_state(len(ids) + 8) for k, m in models.items()}

    def run(k):
        st = states[k]
        st.reset()
        t0 = time.perf_counter()
        for tok in ids:
            models[k].forward(st, [tok])
        return time.perf_counter() - t0

    for k in models:
        run(k)
    times = {k: [] for k in models}
    for r in range(reps):
        for k in models:
            times[k].append(run(k))
        log(f"  rep {r + 1}: " + ", ".join(f"{k} {len(ids) / times[k][-1]:.1f}" for k in models) + " tok/s")
    return times


def bench_shared(path: str, threads=(1, 2), busy: int = 1, busy_pinned: bool = True, tg: int = 32, reps: int = 5,
                 also_pinned: bool = False, log=None) -> dict:
    """Runs the module docstring's measurements; returns {"conditions": {"idle": {...}, "busy": {...}}, ...}."""
    log = log or (lambda s: None)
    out = dict(model=str(path), threads=list(threads), busy=busy, busy_pinned=busy_pinned, tg=tg, reps=reps,
               also_pinned=also_pinned,
               cpus=sorted(os.sched_getaffinity(0)), conditions={})
    for cond in ("idle", "busy"):
        procs = start_busy(busy, busy_pinned) if cond == "busy" else []
        try:
            load = cpu_load.sample()
            log(f"{cond}: " + (load.describe() if load else "no /proc/stat"))
            models = {"default": Model(path)}
            for t in threads:
                models[f"t{t}"] = Model(path, n_threads=t)
                if also_pinned and t > 1:
                    models[f"t{t}-pin"] = Model(path, n_threads=t, pin="always")
            ids = seeded_tokens(tg, models["default"].hparams.n_vocab)
            times = _decode_runs(models, ids, reps, log)
        finally:
            stop_busy(procs)
        rows = {}
        for k, m in models.items():
            ts = times[k]
            rows[k] = dict(threads=m.n_threads, pinned=[c for c in m.pinned if c >= 0],
                           pin_why=getattr(m, "pin_why", ""), runs_s=ts, tok_s=tg / statistics.median(ts),
                           tok_s_range=(tg / max(ts), tg / min(ts)))
        best = max(r["tok_s"] for k, r in rows.items() if not k.endswith("-pin"))
        out["conditions"][cond] = dict(cpu_load=load.as_dict() if load else None, rows=rows,
                                       best_tok_s=best, default_ratio=rows["default"]["tok_s"] / best)
        del models
    return out


def print_shared(res: dict) -> None:
    busy = (f"{res['busy']} busy-loop process(es) " + ("pinned to CPU " + ",".join(
        str(c) for c in res["cpus"][:res["busy"]]) if res["busy_pinned"] else "unpinned"))
    print(f"{res['model']}: decode {res['tg']} tokens, median of {res['reps']} runs (range min-max); CPUs "
          f"{','.join(map(str, res['cpus']))}; busy = {busy}")
    for cond, c in res["conditions"].items():
        load = c["cpu_load"]
        print(f"\n{cond}: other work on {load['other']:.2f} CPUs at the start (engine's reading), load average "
              f"{load['load_avg']:.2f}" if load else f"\n{cond}:")
        print(f"{'':<9}{'threads':>8}{'pinned':>10}{'tg tok/s':>10}{'range':>16}")
        for k, r in c["rows"].items():
            lo, hi = r["tok_s_range"]
            pinned = ",".join(map(str, r["pinned"])) or "-"
            print(f"{k:<9}{r['threads']:>8}{pinned:>10}{r['tok_s']:>10.1f}{f'{lo:.1f}-{hi:.1f}':>16}")
        print(f"default / best: {c['default_ratio']:.2f}")


def add_parser(sub) -> None:
    sp = sub.add_parser("shared", help="decode tok/s per thread count with and without busy processes on the cores",
                        description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    sp.add_argument("model", help="a Qwen3.5/3.6 GGUF file")
    sp.add_argument("--threads", default="1,2", help="thread counts to try, comma-separated (1,2)")
    sp.add_argument("--busy", type=int, default=1, help="busy-loop processes in the busy condition (1)")
    sp.add_argument("--busy-unpinned", dest="busy_pinned", action="store_false",
                    help="leave the busy processes to the scheduler (default: process i pinned to the i-th CPU)")
    sp.add_argument("--tg", type=int, default=32, help="decoded tokens per run (32)")
    sp.add_argument("--reps", type=int, default=5, help="timed runs per model after one warm-up (5)")
    sp.add_argument("--also-pinned", action="store_true",
                    help="also each thread count > 1 with its workers pinned whatever the load (pin='always'): "
                         "what pinning costs where other work runs")
    sp.add_argument("--json", action="store_true", help="print JSON instead of the tables")


def main(args) -> int:
    try:
        threads = [int(t) for t in args.threads.split(",") if t]
    except ValueError:
        raise SystemExit(f"error: --threads takes N,N,..., not {args.threads!r}")
    if not threads or min(threads) < 1 or args.busy < 0 or args.tg < 1 or args.reps < 1:
        raise SystemExit("error: --threads >= 1, --busy >= 0, --tg and --reps >= 1")
    res = bench_shared(args.model, threads, args.busy, args.busy_pinned, args.tg, args.reps, args.also_pinned,
                       log=lambda s: print(s, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print_shared(res)
    return 0
