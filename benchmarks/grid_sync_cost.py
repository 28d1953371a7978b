"""What one grid-wide barrier costs on this card (GPU machine), and what barriers cost a weight stream.

- barrier: le_grid_sync (cuda8/grid_sync.cuh) in a launch of 1 … 8 blocks an SM doing nothing but `--rounds`
  barriers, per variant; against it, the ~1.7 us a removed launch saves in a decode step's CUDA graph
  (benchmarks/results/decode_s44_2026-11-29.md). A fused decode step pays one barrier per dependent phase.
- stream: `--total` MiB read as phases of `--phase-kib` each with a barrier after each (one launch), against the
  same phases as one launch each replayed as a CUDA graph (what today's step does) and against one phase of it all
  (the copy rate's ceiling), in GB/s; ahead: the barriers with the next phase's first loads issued before each
  (grid_sync_stream_ahead_u32). A 0.8B decode token reads ~764 MiB in ~290 launches (~2.6 MiB a launch).

    python benchmarks/grid_sync_cost.py [--variants dp4a,kepler:90,fermi:90] [--rounds 2000] [--per-sm 1,2,4,8]
                                        [--total 768] [--phase-kib 256,1024,2688,8192]
"""
from __future__ import annotations

import argparse
import json

from legacy_engine import gpu
from legacy_engine.core import _native


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="dp4a", help="TIER[:ARCH], comma-separated")
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--per-sm", default="1,2,4,8", help="blocks an SM, comma-separated")
    ap.add_argument("--total", type=int, default=768, help="MiB streamed in the stream rows")
    ap.add_argument("--phase-kib", default="256,1024,2688,8192", help="KiB a phase, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    gpu.init()
    per_sm = [int(p) for p in a.per_sm.split(",")]
    total = a.total << 20
    with gpu.Buffer(8) as bar, gpu.Buffer(total) as src, gpu.Buffer(4) as sink:
        _native.gpu_memset8(bar.ptr, 0, 8)
        _native.gpu_memset8(src.ptr, 1, total)
        for v in a.variants.split(","):
            tier, _, arch_s = v.partition(":")
            k = gpu.Kernels(tier, int(arch_s) if arch_s else None)
            for per in per_sm:
                n = per * k.sm_count
                k.grid_sync_time(bar, n, 10)                     # warm: the module loaded, the blocks placed
                ms = gpu.median_ms(lambda: k.grid_sync_time(bar, n, a.rounds), a.reps)
                print(json.dumps({"variant": k.name, "blocks": n, "per_sm": per,
                                  "barrier_us": round(1e3 * ms / a.rounds, 3)}), flush=True)
            for per in per_sm:
                n = per * k.sm_count
                one = gpu.median_ms(lambda: k.grid_sync_stream(bar, src, total // 16, 1, sink, n), a.reps)
                for kib in (int(x) for x in a.phase_kib.split(",")):
                    n16, phases = (kib << 10) // 16, total // (kib << 10)
                    fused = gpu.median_ms(lambda: k.grid_sync_stream(bar, src, n16, phases, sink, n), a.reps)
                    ahead = gpu.median_ms(lambda: k.grid_sync_stream(bar, src, n16, phases, sink, n, ahead=True),
                                          a.reps)

                    with gpu.record() as rec:           # today's form: one launch a phase, replayed as a graph
                        for p in range(phases):
                            k.grid_sync_stream(bar, src.ptr + p * 16 * n16, n16, 1, sink, n)
                    plan = gpu.LaunchPlan(rec, graph=True)
                    plan.replay()
                    split = gpu.median_ms(plan.replay, a.reps)
                    del plan
                    nbytes = phases * n16 * 16
                    print(json.dumps({"variant": k.name, "per_sm": per, "phase_kib": kib, "phases": phases,
                                      "one_phase_GBs": round(total / one / 1e6, 1),
                                      "barriers_GBs": round(nbytes / fused / 1e6, 1),
                                      "ahead_GBs": round(nbytes / ahead / 1e6, 1),
                                      "graph_GBs": round(nbytes / split / 1e6, 1),
                                      "us_per_barrier_over_one": round(1e3 * (fused - one * nbytes / total) / phases,
                                                                       2)}), flush=True)


if __name__ == "__main__":
    main()
