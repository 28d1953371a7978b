"""`legacy-engine bench split`: every CPU/GPU split of a model under a VRAM budget, measured next to the planner's
prediction and to llama.cpp's offload settings on the same file.

    legacy-engine bench split MODEL.gguf --vram 6GiB [--prompt 512,2048] [--gen 32] [--tg-depth N[,N]] [--ballast]
                                         [--simulate-link GBPS]
                                         [--llama PATH] [--ncmoe 30,40,cpu] [--llama-flags F]
                                         [--no-mmap] [--plot FILE.png] [--json]

Strategies (planner.py): cpu (prefill and decode on the CPU), stream (GPU prefill with routed experts streamed
from host RAM, pinned ones in VRAM, CPU decode: the split `run --gpu --vram` uses when the model does not fit),
hybrid (the same prefill; decode steps with attention, GDN, shared and pinned experts on the GPU and the other
routed experts on the CPU; hybrid/linkN: the GPU also runs N of each layer's experts that are not pinned, fetching
their weights over the link; hybrid/look: the lookahead on (GpuModel lookahead); hybrid/earlyN, hybrid/earlyN-linkM:
N of the next layer's likeliest experts copied early (GpuModel early_experts)), resident (all in VRAM; only when it
fits the budget). For each: prefill tok/s per prompt length (one pass from an empty state, last logits), decode
tok/s (gen steps after a context of --tg-depth tokens, default the shortest prompt; llama.cpp's decode at the same
depths through llama-bench -d), where the prefill time went (expert bytes copied, copy GB/s, GPU compute and the
rest), and the planner's predictions beside the measurements.
--ballast allocates VRAM until only the budget is free (the budget then is all there is: an overrun would fail).
llama.cpp rows: llama-bench -ngl 99 with -ncmoe N (N layers' experts on the CPU) and CPU-only (-ngl 0), same file
and threads; --llama-flags adds flags to each (`-ub 2048` copies a layer's experts once per 2048-token pass). --plot writes prefill/decode tok/s against prompt length per strategy (matplotlib).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import time

from .. import gpu
from ..plan import planner, probe
from ..plan.split import SplitModel
from .bench import _times, seeded_tokens
from .bench_gpu import bench_llama as run_llama, gemm_table, print_gemms
from ..core.errors import UnavailableError
from ..cpu.model import Model
from ..gpu.model import GpuModel
from ..gpu.options import GpuOptions
from ..gpu.placement import place


def _measure(model, prompts, gen: int, reps: int, n_ctx: int, max_prompt: int | None = None,
             depths=None, gm=None) -> dict:
    """Prefill tok/s per prompt length (up to max_prompt) and decode tok/s of a Model-like object (Model,
    SplitModel, GpuModel) after a context of each of `depths` tokens (default: the shortest prompt), the same gen
    tokens decoded after each (after one untimed run); "tg" is the first depth's. gm: the GpuModel inside `model`,
    whose hybrid decode's split is reported per depth ("hybrid_at")."""
    depths = [prompts[0]] if depths is None else list(depths)
    ids = seeded_tokens(max(list(prompts) + depths) + gen + 1, model.hparams.n_vocab)
    # the decoded tokens are the same after every depth (the ones after the deepest context): the depths differ in
    # the context only, not in which experts the decoded tokens route to
    steps = ids[max(depths) + 1:max(depths) + 1 + gen]
    st = model.new_state(n_ctx)
    row = {"pp": {}, "pp_s": {}, "tg_at": {}, "tg_runs_at": {}}
    for p in prompts:
        if max_prompt is not None and p > max_prompt:
            continue
        def prefill(p=p):
            st.reset()
            model.forward(st, ids[:p])
        t = statistics.median(_times(prefill, reps))
        row["pp"][p], row["pp_s"][p] = p / t, t
    steal = []
    live = [d for d in depths if max_prompt is None or d <= max_prompt]
    if live and gen:      # one untimed decode run first, as llama-bench warms up (a process's first run is slow)
        st.reset()
        model.forward(st, ids[:live[0] + 1])
        for t in steps:
            model.forward(st, [t])
    for d in live:
        runs, hs0 = [], _hybrid_snapshot(gm)
        for _ in range(max(1, reps)):      # decode: gen steps after d tokens, reps times (the median is reported)
            st.reset()
            model.forward(st, ids[:d + 1])       # and one step untimed (a GPU decode records its plan there)
            c0, t0 = _cpu_times(), time.perf_counter()
            for t in steps:
                model.forward(st, [t])
            runs.append(gen / (time.perf_counter() - t0))
            steal.append(_steal_share(c0, _cpu_times()))
        row["tg_at"][d], row["tg_runs_at"][d] = statistics.median(runs), runs
        hs1 = _hybrid_snapshot(gm)
        if hs0 is not None and hs1["steps"] > hs0["steps"]:      # a hybrid decode: its split at this depth
            per_tok = gm.hparams.n_layer / (hs1["steps"] - hs0["steps"])
            row.setdefault("hybrid_at", {})[d] = {k: (hs1[k] - hs0[k]) * per_tok
                                                  for k in ("cpu_experts", "cpu_s", "read_s")}
    first = next(iter(row["tg_at"]), None)
    row["tg"] = row["tg_at"][first] if first is not None else float("nan")
    row["tg_runs"] = row["tg_runs_at"].get(first, [])
    if steal and steal[0] is not None:
        row["cpu_steal"] = max(steal)        # a virtual machine's host taking the CPUs: decode numbers then vary
    return row


def _hybrid_snapshot(model) -> dict | None:
    """A GpuModel's hybrid decode counters (hybrid_stats: summed over the layers it served), None for None."""
    hs = getattr(model, "hybrid_stats", None) if model is not None else None
    return dict(hs) if isinstance(hs, dict) else None


def _cpu_times() -> list | None:
    """The machine's aggregate CPU times (/proc/stat 'cpu' line: user nice system idle iowait irq softirq steal),
    or None where there is no /proc/stat."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            return [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None


def _steal_share(a: list | None, b: list | None) -> float | None:
    """The share of CPU time the hypervisor stole between two _cpu_times() readings."""
    if a is None or b is None or len(a) < 8 or len(b) < 8:
        return None
    d = [y - x for x, y in zip(a, b)]
    return d[7] / sum(d) if sum(d) > 0 else 0.0


def bench_llama(binary: str, path: str, prompts, gen: int, threads: int, ngl: int, ncmoe: int | None,
                extra=(), depths=(0,)) -> dict:
    """A llama-bench row of the split table (bench_gpu.bench_llama with -ngl/-ncmoe/-t and `extra` flags such as
    -ub 2048; decode at each of `depths` through llama-bench -d, prefill at depth 0); a failed run is a row that
    says why."""
    name = " ".join([f"llama.cpp -ngl {ngl}"] + ([f"-ncmoe {ncmoe}"] if ncmoe is not None else []) + list(extra))
    flags = ["-ngl", str(ngl), "-t", str(threads)] + (["-ncmoe", str(ncmoe)] if ncmoe is not None else [])
    flags += list(extra)
    depths = list(depths)
    if depths != [0]:
        flags += ["-d", ",".join(str(d) for d in sorted(set([0] + depths)))]
    try:
        row = run_llama(binary, path, prompts, gen, 2, flags, name)
    except UnavailableError as e:
        return {"strategy": name, "error": str(e)[-300:]}
    row["strategy"] = row.pop("engine")
    row["tg_at"] = {d: row["tg_at"].get(d, float("nan")) for d in depths}
    row["tg"] = row["tg_at"][depths[0]]
    return row


def _parse_strategy(name: str) -> tuple[str, str, int | None, bool | None, int, bool]:
    """stream[/pairs|/grouped], hybrid[/linkN|/look|/earlyN[-linkM]|/noextras], resident -> (base, form of the
    routed experts, link experts (None: the planner's), lookahead, early experts, decode extras on)."""
    base, _, form = name.partition("/")
    link, look, early, extras_on = None, None, 0, True
    if base == "hybrid" and form == "look":
        form, look = "", True
    if base == "hybrid" and form == "noextras":
        form, extras_on = "", False
    if base == "hybrid" and form.startswith("early"):
        head, _, rest = form.partition("-")
        if head[5:].isdigit():
            early, form = int(head[5:]), rest
    if base == "hybrid" and form.startswith("link") and form[4:].isdigit():
        form, link = "", int(form[4:])
    if form not in ("", "pairs", "grouped"):
        raise ValueError(f"strategy {name}: the form after / is pairs or grouped (hybrid: also linkN, look, "
                         "earlyN, earlyN-linkM, noextras)")
    return base, form, link, look, early, extras_on


def _hybrid_per_token(gm) -> dict:
    """The hybrid decode's counters per token (all layers)."""
    hs, L = gm.hybrid_stats, gm.hparams.n_layer
    per = lambda k: hs[k] / hs["steps"] * L     # noqa: E731
    return {"cpu_experts": per("cpu_experts"), "cpu_s": per("cpu_s"), "read_s": per("read_s"),
            "prefetch_s": per("prefetch_s"), "prefetch_mb": per("prefetch_bytes") / 1e6,
            # of the experts the CPU ran, the share it had prefetched
            "prefetch_hit": hs["prefetch_hits"] / max(hs["cpu_experts"], 1),
            # early experts: copied per token, of those in time, routed to
            "early_copied": per("early_copied"), "early_in_time": hs["early_in_time"] / max(hs["early_copied"], 1),
            "early_routed": hs["early_routed"] / max(hs["early_copied"], 1),
            # inside cpu_s: the experts' jobs' start lag, slowest thread's tail
            "cpu_lag_s": per("split_lag_s"), "cpu_tail_s": per("split_tail_s")}


def _per_prefill(gm, n_pp: int) -> dict:
    """The expert stream's copies per prefill."""
    s = gm.stream_report()
    return {"h2d_gib": s["h2d_bytes"] / n_pp / 2**30, "copy_stall_s": s["copy_stall_s"] / n_pp,
            "ids_wait_s": s["ids_wait_s"] / n_pp,
            # the copy stream busy copying, its mean and slowest layer's rate
            "copy_busy_s": s["copy_busy_s"] / n_pp, "copy_gbps": s["h2d_bytes"] / max(s["copy_busy_s"], 1e-9) / 1e9,
            "copy_slowest_gbps": s["copy_slowest_gbps"]}


def _gpu_model(model, name: str, st0, m, vram: int, n_ctx: int, counts, simulate_link, mma, prompts):
    """(GpuModel, what runs the passes, link experts) of a GPU strategy as the planner placed it (st0), or with the
    strategy name's overrides."""
    base, form, link, look, early, extras_on = _parse_strategy(name)
    grouped = {"": {}, "pairs": {"grouped_experts": False}, "grouped": {"grouped_experts": True}}[form]
    grouped["mma"] = mma
    pins = st0.pinned
    if link is None or base != "hybrid":
        link = st0.link_experts if base == "hybrid" else 0       # the planner's
    extras = st0.decode_extras if base == "hybrid" else {}
    if base == "hybrid" and (link != st0.link_experts or early):   # room for this staging: pins refilled
        pins, _ = planner.fill_pins(model.file, vram, n_ctx, st0.chunk, m.gpu_tier == "dp4a", counts, link, early)
        extras = planner.choose_decode_extras(model.file, pins, counts, link + early)
    if base == "hybrid" and not extras_on:
        extras = {}
    opts = GpuOptions(simulate_link=simulate_link, lookahead=look if base == "hybrid" else None,
                      save_routing=functools.partial(planner.save_routing, model), **grouped)
    if base == "resident":
        gm = GpuModel.resident(model, opts, n_ctx=n_ctx, vram=vram)
        return gm, gm, link
    pl = place(model.file, budget=vram, n_ctx=n_ctx, chunk=st0.chunk, int8=any(opts.precision(gpu.device_arch())),
               stream=True, pinned=pins, decode="hybrid" if base == "hybrid" else "cpu", link_experts=link,
               early_experts=early, decode_extras=extras)
    gm = GpuModel(model, pl, opts)
    # every measured prompt on the GPU, decode steps on the CPU (the split as run --gpu runs it)
    return gm, SplitModel(model, gm, min_gpu_tokens=min(prompts)), link


def _gpu_row(model, name: str, st0, m, vram, n_ctx, counts, simulate_link, mma, prompts, gen, reps, tg_depths,
             hold) -> dict:
    base = name.split("/")[0]
    gm, runner, link = _gpu_model(model, name, st0, m, vram, n_ctx, counts, simulate_link, mma, prompts)
    try:
        gm.profile()
        row = dict(strategy=name, describe=gm.describe(),
                   **_measure(runner, prompts, gen, reps, n_ctx, depths=tg_depths, gm=gm))
        if base == "hybrid":
            row["link_experts"] = link
        # the GPU prefills: (reps + 1) per prompt length (warm-up included), and each decode run's prompt that is
        # long enough for the GPU
        n_runs = (reps + 1) * len(prompts) + max(1, reps) * sum(d + 1 >= min(prompts) for d in tg_depths) \
            + bool(gen and tg_depths and tg_depths[0] + 1 >= min(prompts))      # the decode's warm-up
        row["gpu_phases_per_prefill_s"] = {k: v / n_runs for k, v in gm.profile_report().items()}
        row["gpu_gemms_per_prefill"] = gemm_table(gm.k, gm.profile_gemms(), n_runs)
        if base == "hybrid" and gm.hybrid_stats["steps"]:
            row["hybrid_per_token"] = _hybrid_per_token(gm)
        if base in ("stream", "hybrid"):
            row["chunk"] = st0.chunk
            row["per_prefill"] = _per_prefill(gm, n_runs)
        row["peak_vram_gib"] = (gpu.mem_stats()["peak"] - (hold.nbytes if hold else 0)) / 2**30
        return row
    finally:
        gm.close()


def _predictions(res: dict, preds: dict, prompts) -> None:
    """The planner's predictions beside each measured row."""
    for r in res["rows"]:
        base = r["strategy"].split("/")[0]
        if base in ("cpu", "stream", "hybrid", "resident") and "error" not in r:
            r["pred_pp"] = {p: p / preds[p][base].prefill_s for p in prompts}
            r["pred_tg"] = 1 / preds[prompts[0]][base].decode_s_per_tok
            r["pred_parts"] = {p: preds[p][base].prefill_parts for p in prompts}


def bench_split(path: str, vram: int, prompts=(512, 2048), gen: int = 32, reps: int = 1, ballast: bool = False,
                simulate_link: float | None = None, llama: str | None = None, ncmoe=(30, 40, None),
                threads: int | None = None,
                cpu_max_prompt: int | None = 512, strategies=("cpu", "stream", "hybrid", "resident"), log=None,
                llama_flags=(), mma: bool | None = None, mmap: bool = True, tg_depths=None) -> dict:
    log = log or (lambda s: None)
    have_gpu, why = gpu.available()
    if have_gpu:
        gpu.init()
    elif ballast:
        raise UnavailableError(f"--ballast needs a GPU: {why}")
    prompts = sorted(prompts)
    tg_depths = [prompts[0]] if tg_depths is None else list(tg_depths)   # decode after this many tokens (each)
    n_ctx = max(prompts + tg_depths) + gen + 8
    model = Model(path, threads, mmap=mmap, pin=True)
    threads = model.n_threads
    res = {"model": str(path), "vram": vram, "prompts": prompts, "gen": gen, "tg_depths": tg_depths,
           "threads": threads, "rows": [],
           "ballast": ballast, "mmap": mmap, "huge_bytes": model.load_report["huge_bytes"]}
    m = probe.measure(threads, log=log)
    if simulate_link:
        m = dataclasses.replace(m, link_gbps=simulate_link, simulated_link=True)
    res["machine"] = dataclasses.asdict(m)
    counts = planner.load_routing(model)        # saved by earlier runs: the pins take the hottest experts
    res["routing_counts"] = counts is not None
    preds = {p: {s.name: s for s in planner.plan(model.file, m, vram, p, gen, n_ctx=n_ctx, counts=counts)}
             for p in prompts}
    hold = None
    if ballast:
        free = gpu.mem_stats()["free_bytes"]
        if free > vram:
            hold = gpu.Buffer(free - vram, "ballast")
        res["free_after_ballast"] = gpu.mem_stats()["free_bytes"]
    try:
        if "cpu" in strategies:
            log("cpu …")
            res["rows"].append(dict(strategy="cpu", **_measure(model, prompts, gen, reps, n_ctx, cpu_max_prompt,
                                                                 tg_depths)))
        for name in [s for s in strategies if s.split("/")[0] in ("stream", "hybrid", "resident")]:
            _parse_strategy(name)                   # a bad name fails before anything runs
            st0 = preds[prompts[-1]][name.split("/")[0]]
            if not st0.fits:
                res["rows"].append({"strategy": name, "error": f"does not fit: {st0.why}"})
                continue
            log(f"{name} …")
            res["rows"].append(_gpu_row(model, name, st0, m, vram, n_ctx, counts, simulate_link, mma, prompts, gen,
                                        reps, tg_depths, hold))
    finally:
        if hold is not None:
            hold.free()
    if llama:     # after ours: the same file, the same threads, the ballast freed (llama.cpp takes what -ncmoe needs)
        for n in ncmoe:                             # None: CPU only (-ngl 0)
            log(f"llama.cpp {'-ncmoe ' + str(n) if n is not None else 'CPU only'} …")
            res["rows"].append(bench_llama(llama, path, prompts, gen, threads, 99 if n is not None else 0, n,
                                           llama_flags, tg_depths))
    _predictions(res, preds, prompts)
    return res


def print_split(res: dict) -> None:
    ps = res["prompts"]
    for r in res["rows"]:                      # JSON round trips turn the int keys into strings
        for key in ("pp", "pred_pp", "pp_s"):
            if key in r:
                r[key] = {int(k): v for k, v in r[key].items()}
    m = res["machine"]
    print(f"{res['model']}: VRAM budget {res['vram'] / 2**30:.2f} GiB"
          + (f" (ballast: {res['free_after_ballast'] / 2**30:.2f} GiB left free)" if res.get("ballast") else "")
          + f", {res['threads']} threads; link {m['link_gbps']:.2f} GB/s"
          + ("" if res.get("mmap", True) else
             f"; weights in anonymous memory ({res.get('huge_bytes', 0) / 2**30:.2f} GiB in huge pages)")
          + ("; pins from saved routing counts" if res.get("routing_counts") else "")
          + (" (simulated)" if m["simulated_link"] else ""))
    print(f"{'strategy':<28}" + "".join(f"{'pp' + str(p):>10}{'pred':>8}" for p in ps) + f"{'tg' + str(res['gen']):>9}"
          f"{'pred':>8}")
    for r in res["rows"]:
        if "error" in r:
            print(f"{r['strategy']:<28} {r['error']}")
            continue
        line = f"{r['strategy']:<28}"
        for p in ps:
            line += f"{r['pp'].get(p, float('nan')):>10.1f}"
            line += f"{r['pred_pp'][p]:>8.0f}" if "pred_pp" in r else f"{'':>8}"
        line += f"{r['tg']:>9.2f}" + (f"{r['pred_tg']:>8.1f}" if "pred_tg" in r else "")
        print(line)
        if len(r.get("tg_at", ())) > 1:
            print(f"{'':<28}decode after a context of " + ", ".join(f"{d} tokens {v:.2f}" for d, v in
                                                                     r["tg_at"].items()) + " tok/s")
        if len(r.get("hybrid_at", ())) > 1:
            print(f"{'':<28}hybrid split per token after " + "; ".join(
                f"{d} tokens: {h['cpu_experts']:.0f} experts on the CPU in {1e3 * h['cpu_s']:.2f} ms, host waiting "
                f"for the GPU {1e3 * h['read_s']:.2f} ms" for d, h in r["hybrid_at"].items()))
        if len(r.get("tg_runs", ())) > 1:
            steal = f"; the hypervisor took up to {100 * r['cpu_steal']:.1f} % of the CPUs" if "cpu_steal" in r else ""
            print(f"{'':<28}decode runs (median above): " + ", ".join(f"{v:.1f}" for v in r["tg_runs"]) + steal)
        if "per_prefill" in r:
            pp = r["per_prefill"]
            print(f"{'':<28}per prefill (mean over prompts): expert copies {pp['h2d_gib']:.2f} GiB, GPU waiting for "
                  f"copies {pp['copy_stall_s']:.3f} s, host waiting for routing {pp['ids_wait_s']:.3f} s; passes of "
                  f"{r['chunk']} tokens; peak VRAM {r['peak_vram_gib']:.2f} GiB")
            if "copy_busy_s" in pp:
                print(f"{'':<28}copy stream busy {pp['copy_busy_s']:.3f} s a prefill at {pp['copy_gbps']:.1f} GB/s "
                      f"(slowest layer {pp['copy_slowest_gbps']:.1f} GB/s)")
            print(f"{'':<28}{r['describe']}")
        if "hybrid_per_token" in r:
            h = r["hybrid_per_token"]
            print(f"{'':<28}hybrid decode per token: {r.get('link_experts', 0)} per layer fetched over the link, "
                  f"{h['cpu_experts']:.0f} experts on the CPU taking "
                  f"{1e3 * h['cpu_s']:.2f} ms (of which {1e3 * h.get('cpu_lag_s', 0):.2f} ms its jobs' threads "
                  f"starting late and {1e3 * h.get('cpu_tail_s', 0):.2f} ms the slowest thread past the mean), "
                  f"host waiting for the GPU's routing {1e3 * h['read_s']:.2f} ms"
                  + (f"; lookahead prefetched {h['prefetch_mb']:.1f} MB in {1e3 * h['prefetch_s']:.2f} ms, "
                     f"{100 * h['prefetch_hit']:.0f} % of the CPU's experts among those aimed at"
                     if h.get("prefetch_mb") else ""))
        if r.get("gpu_phases_per_prefill_s"):
            ph = r["gpu_phases_per_prefill_s"]
            print(f"{'':<28}GPU time per prefill (mean over prompts): " +
                  ", ".join(f"{k} {v:.3f} s" for k, v in sorted(ph.items(), key=lambda kv: -kv[1])))
        if r.get("gpu_gemms_per_prefill"):
            print(f"{'':<28}its GEMMs per prefill (TFLOP/s: 2 per weight per token; peak: the instruction's, "
                  "measured here):")
            print_gemms(r["gpu_gemms_per_prefill"], indent=" " * 30)


def plot(res: dict, out: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise UnavailableError("--plot needs matplotlib (pip install matplotlib)") from e
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1.2, 1]})
    names, tgs = [], []
    for r in res["rows"]:
        if "error" in r:
            continue
        ps = sorted(r["pp"])
        a.plot(ps, [r["pp"][p] for p in ps], marker="o", label=r["strategy"])
        names.append(r["strategy"])
        tgs.append(r["tg"])
    b.barh(names, tgs, color=[f"C{i}" for i in range(len(names))])
    b.invert_yaxis()
    a.set(xlabel="prompt tokens", ylabel="prefill tok/s", xscale="log", yscale="log", title="prefill")
    b.set(xlabel="decode tok/s", title=f"decode ({res['gen']} tokens)")
    a.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{res['model']}, VRAM {res['vram'] / 2**30:.1f} GiB")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def add_parser(sub) -> None:
    sp = sub.add_parser("split", help="every CPU/GPU split under a VRAM budget, measured vs predicted, vs llama.cpp",
                        description=__doc__)
    sp.add_argument("model", help="a Qwen3.5/3.6 GGUF file")
    sp.add_argument("--vram", required=True, help="VRAM budget, e.g. 6GiB")
    sp.add_argument("--prompt", default="512,2048", help="prompt lengths, comma-separated (512,2048)")
    sp.add_argument("--gen", type=int, default=32, help="decoded tokens (32)")
    sp.add_argument("--tg-depth", default=None, metavar="N[,N]",
                    help="decode measured after a context of N tokens, each N (ours and llama-bench -d N alike; "
                         "tg is the first's) (the shortest --prompt)")
    sp.add_argument("--reps", type=int, default=1, help="timed prefill runs after one warm-up (1)")
    sp.add_argument("--threads", type=int, default=None, help="CPU threads (physical cores)")
    sp.add_argument("--ballast", action="store_true", help="allocate VRAM until only the budget is free")
    sp.add_argument("--simulate-link", type=float, default=None, metavar="GBPS", help="pace expert copies to GBPS")
    sp.add_argument("--llama", default=None, metavar="PATH", help="a llama-bench binary built with CUDA")
    sp.add_argument("--ncmoe", default="30,40,cpu", type=parse_ncmoe,
                    help="llama.cpp rows: -ngl 99 -ncmoe N per number, 'cpu' for CPU only (-ngl 0) (30,40,cpu)")
    sp.add_argument("--llama-flags", default="", metavar="FLAGS",
                    help="more llama-bench flags for every llama.cpp row, e.g. '-ub 2048 -mmp 0' (none)")
    sp.add_argument("--cpu-max-prompt", type=int, default=512,
                    help="longest prompt the cpu strategy prefills (slow: ~1 pass per token; longer ones show only "
                         "the prediction) (512)")
    sp.add_argument("--strategies", default="cpu,stream,hybrid,resident",
                    help="which to run (cpu,stream,hybrid,resident); stream/pairs, stream/grouped (and resident/…) force "
                         "the routed experts' form: one GEMV per (token, expert) pair, or grouped GEMMs")
    sp.add_argument("--no-mmap", dest="mmap", action="store_false",
                    help="read the weights into anonymous memory (huge pages: the CPU's experts read faster, "
                         "benchmarks/bench_moe_routed.py; own RAM) instead of the file map (default)")
    sp.add_argument("--no-mma", dest="mma", action="store_const", const=False, default=None,
                    help="no tensor cores: int8 prefill GEMMs with DP4A, attention prefill on f32 FMA (default: "
                         "tensor cores from sm_75)")
    sp.add_argument("--plot", default=None, metavar="FILE.png", help="write the tok/s plot (needs matplotlib)")
    sp.add_argument("--json", action="store_true", help="print JSON")


def parse_depths(text: str | None) -> list | None:
    """'0,2048' -> [0, 2048]; None -> None (the shortest prompt)."""
    if text is None:
        return None
    out = [p.strip() for p in text.split(",") if p.strip()]
    if not out or not all(p.isdigit() for p in out):
        raise ValueError(f"--tg-depth takes token counts, comma-separated, not {text!r}")
    return [int(p) for p in out]


def parse_ncmoe(text: str) -> list:
    """'30,40,cpu' -> [30, 40, None] (None: the CPU-only row)."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if part == "cpu":
            out.append(None)
        elif part:
            if not part.isdigit():
                raise ValueError(f"--ncmoe takes layer counts and 'cpu', not {part!r}")
            out.append(int(part))
    return out


def main(args) -> int:
    import sys
    res = bench_split(args.model, planner.parse_size(args.vram), [int(p) for p in args.prompt.split(",") if p],
                      args.gen, args.reps, args.ballast, args.simulate_link, args.llama,
                      args.ncmoe, args.threads, args.cpu_max_prompt,
                      tuple(args.strategies.split(",")), log=lambda s: print(s, file=sys.stderr, flush=True),
                      llama_flags=tuple(args.llama_flags.split()), mma=args.mma, mmap=args.mmap,
                      tg_depths=parse_depths(args.tg_depth))
    if args.json:
        print(json.dumps(res, indent=1, default=float))
    else:
        print_split(res)
    if args.plot:
        plot(res, args.plot)
    return 0
