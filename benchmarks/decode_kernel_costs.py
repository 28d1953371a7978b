"""What each kernel of a GPU decode step costs inside its CUDA graph (GPU machine): one token of the resident model
recorded, then replayed with every launch of one kernel left out, kernel by kernel; the step's time less that one's
is the kernel's share (its launches, its work and the wait on it). The values of such a replay are garbage; its
time is not (the kernels' work does not depend on the values). Median of --reps replays each.

    python benchmarks/decode_kernel_costs.py FILE [--variant dp4a | kepler:90 | fermi:90] [--reps 300]

One variant a run: a replay with a kernel left out may leave the context unusable (garbage indices), so a second
variant in the same process would measure nothing.
"""
from __future__ import annotations

import argparse
import collections

from legacy_engine import gpu
from legacy_engine.cpu.model import Model
from legacy_engine.gpu import runtime

from decode_graph_floor import decode_step      # the sibling benchmark's resident model at a decode step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--variant", default="dp4a", help="TIER[:ARCH] (default: dp4a, the card's arch)")
    ap.add_argument("--reps", type=int, default=300)
    a = ap.parse_args()
    gpu.init()
    model = Model(a.file, pin=False)
    gm, st = decode_step(model, a.variant)
    names: list[str] = []
    launch = runtime.Kernel.launch

    def named(self, *args, **kw):
        names.append(self.name)
        return launch(self, *args, **kw)
    runtime.Kernel.launch = named
    try:
        with gpu.record() as rec:
            gm._forward_chunk(st, None, False, True, planned=True)
    finally:
        runtime.Kernel.launch = launch
    launches = [x for x in rec if x[0] != "host"]
    if len(launches) != len(names):
        raise SystemExit(f"{len(launches)} launches recorded, {len(names)} named: host steps in the step?")
    full = gpu.LaunchPlan(launches, graph=gm.graphs)
    base = 1e3 * gpu.median_ms(full.replay, a.reps)
    print(f"{gm.k.name} ({'graph' if gm.graphs else 'launches'}): {len(launches)} launches, step {base:.1f} us")
    for name, count in collections.Counter(names).most_common():
        plan = gpu.LaunchPlan([x for x, nm in zip(launches, names) if nm != name], graph=gm.graphs)
        t = 1e3 * gpu.median_ms(plan.replay, a.reps)
        del plan
        print(f"  {count:4d} x {name:30s} {base - t:8.1f} us = {(base - t) / count:5.2f} us a launch", flush=True)
    print(f"  the whole step again: {1e3 * gpu.median_ms(full.replay, a.reps):.1f} us")
    gm.close()


if __name__ == "__main__":
    main()
