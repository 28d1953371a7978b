"""Where a streamed prefill pass spends its time (GPU machine): per MoE layer, when the host issued the expert copy,
when the copy stream ran it, when the compute stream waited for it and when the layer's experts freed the slot
(CUDA events on both streams, one 2048-token pass of the planner's hybrid placement under a VRAM budget). The copy
stream's idle time is split by cause: waiting for a staging slot (the experts STAGING_LAYERS layers back still
running), a late issue (the host had not asked yet), or nothing to copy.

    python benchmarks/split_timeline.py MODEL.gguf [--vram 6GiB] [--n 2048] [--depths 2,3] [--pins counts,lowest]
                                       [--reps 3] [--layers]

--depths: staging depths to compare (layout.STAGING_LAYERS, the planner refilling the pins for each); --pins: the
pins from the saved routing counts (as the planner places them) and / or at consecutive ids (as without counts),
each timed in this process, with the host copies a layer issued (one per run of experts between its pins).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from legacy_engine import gpu
from legacy_engine.core import _native
from legacy_engine.cpu.model import Model
from legacy_engine.gpu import layout
from legacy_engine.plan import planner, probe
from legacy_engine.plan.planner import parse_size
from legacy_engine.tools.bench import seeded_tokens
from legacy_engine.tools.bench_split import _gpu_model


def instrument(res) -> dict:
    """Wraps res.stage / res.release to record, per call, the host time, the host copies it issued (one per run of
    experts between the layer's pins) and GPU events on the right streams."""
    log = {"stage": [], "release": [], "copies": 0}
    stage0, release0 = res.stage, res.release

    def stage(i, want, wait=True):
        t, k, s, c = time.perf_counter(), len(res._copy_marks), len(res._stalls), log["copies"]
        out = stage0(i, want, wait)
        copy = res._copy_marks[k] if len(res._copy_marks) > k else None
        stall = res._stalls[s] if len(res._stalls) > s else None
        log["stage"].append((i, t, copy, stall, log["copies"] - c))
        return out

    def release(i):
        release0(i)
        e = gpu.Event()
        e.record()
        log["release"].append((i, time.perf_counter(), e))

    res.stage, res.release = stage, release
    return log


def timeline(gm, ids) -> tuple[float, list, dict]:
    """One instrumented pass -> (pass ms, per-layer rows, idle split)."""
    res = gm.res
    log = instrument(res)
    htod0 = _native.gpu_copy_htod_addr

    def htod(*args):
        log["copies"] += 1
        return htod0(*args)
    _native.gpu_copy_htod_addr = htod
    try:
        st = gm.new_state(len(ids) + 8)
        gpu.synchronize()
        t0 = gpu.Event()
        t0.record()
        h0 = time.perf_counter()
        gm.forward(st, ids)
        t1 = gpu.Event()
        t1.record()
        gpu.synchronize()
    finally:
        del res.stage, res.release                  # the class's methods again
        _native.gpu_copy_htod_addr = htod0
    ms = lambda e: t0.elapsed_ms(e)             # noqa: E731
    freed = {i: ms(e) for i, _t, e in log["release"]}
    rows, idle = [], {"slot": 0.0, "late issue": 0.0, "other": 0.0}
    prev_end = 0.0
    d = len(res._staging)
    for i, t_host, copy, stall, n_copies in log["stage"]:
        if copy is None:
            continue
        c0, c1, nb = copy
        start, end = ms(c0), ms(c1)
        issued = (t_host - h0) * 1e3
        slot = freed.get(i - d, 0.0)
        gap = max(start - prev_end, 0.0)
        if gap > 0.05:
            cause = "slot" if slot >= start - 0.05 else "late issue" if issued >= start - 0.2 else "other"
            idle[cause] += gap
        rows.append({"layer": i, "issued": issued, "slot_free": slot, "start": start, "end": end,
                     "gbps": nb / max(end - start, 1e-6) / 1e6, "mib": nb / 2**20, "gap": gap, "copies": n_copies})
        prev_end = end
    # a layer's wait comes with its stage(wait=True), its copies with the prefetch a layer before (wait=False)
    waits = {i: (ms(stall[0]), ms(stall[1])) for i, _t, _c, stall, _n in log["stage"] if stall is not None}
    for r in rows:
        r["freed"] = freed.get(r["layer"], float("nan"))
        if r["layer"] in waits:
            r["wait"] = waits[r["layer"]]
    idle["tail"] = ms(t1) - prev_end
    idle["busy"] = sum(r["end"] - r["start"] for r in rows)
    res._copy_marks, res._stalls = [], []
    return ms(t1), rows, idle


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--vram", default="6GiB")
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--depths", default="2")
    ap.add_argument("--pins", default="counts",
                    help="counts (the saved routing's hottest, as the planner pins), lowest (consecutive ids, as "
                         "without counts), or both, comma-separated: each timed in this process")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", action="store_true", help="print every layer's row")
    a = ap.parse_args()
    dev = gpu.init()
    vram = parse_size(a.vram)
    model = Model(a.model, pin=True)
    m = probe.measure(model.n_threads)
    counts = planner.load_routing(model)
    ids = seeded_tokens(a.n, model.hparams.n_vocab)
    n_ctx = a.n + 16
    print(f"{dev.get('name', 'GPU')}, {a.model}, {a.n} tokens, budget {a.vram}")
    for depth, pins_by in [(int(d), p) for d in a.depths.split(",") for p in a.pins.split(",")]:
        layout.STAGING_LAYERS = depth
        c = counts if pins_by == "counts" else None
        st0 = next(s for s in planner.plan(model.file, m, vram, a.n, 8, n_ctx=n_ctx, counts=c)
                   if s.name == "hybrid")
        gm, _runner, _link = _gpu_model(model, "hybrid", st0, m, vram, n_ctx, c, None, None, [a.n])
        try:
            pins = sum(map(len, gm.placement.pinned.values()))
            times = []
            for _ in range(a.reps + 1):
                st = gm.new_state(n_ctx)
                gpu.synchronize()
                t = time.perf_counter()
                gm.forward(st, ids)
                gpu.synchronize()
                times.append(time.perf_counter() - t)
            gm.res._copy_marks, gm.res._stalls = [], []
            pass_ms, rows, idle = timeline(gm, ids)
            med = statistics.median(times[1:])
            copies = sum(r["copies"] for r in rows)
            print(f"depth {depth}, pins by {pins_by}{'' if c or pins_by != 'counts' else ' (none saved)'}: chunk "
                  f"{st0.chunk}, {pins} pinned, {copies} host copies ({copies / max(len(rows), 1):.0f} a layer), "
                  f"pp{a.n} {a.n / med:,.0f} tok/s "
                  f"(median of {a.reps}: {med * 1e3:.1f} ms; runs {', '.join(f'{x * 1e3:.1f}' for x in times)}); "
                  f"instrumented pass {pass_ms:.1f} ms: copy busy {idle['busy']:.1f} ms "
                  f"({np.mean([r['gbps'] for r in rows]):.1f} GB/s mean), idle waiting for a slot "
                  f"{idle['slot']:.1f}, late issue {idle['late issue']:.1f}, other {idle['other']:.1f}, after the "
                  f"last copy {idle['tail']:.1f} ms", flush=True)
            if a.layers:
                print("  layer  issued  slot_free  start    end    gap  MiB  copies   GB/s  wait(start-end)  freed")
                for r in rows:
                    w = r.get("wait")
                    print(f"  {r['layer']:5d} {r['issued']:7.1f} {r['slot_free']:9.1f} {r['start']:7.1f} "
                          f"{r['end']:7.1f} {r['gap']:5.1f} {r['mib']:5.0f} {r['copies']:6d} {r['gbps']:6.1f}  "
                          + (f"{w[0]:7.1f}-{w[1]:7.1f}" if w else " " * 15) + f"  {r['freed']:7.1f}")
        finally:
            gm.close()


if __name__ == "__main__":
    main()
