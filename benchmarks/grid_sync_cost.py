"""What one grid-wide barrier costs on this card (GPU machine): le_grid_sync (cuda8/grid_sync.cuh) in a launch of
1 … 4 blocks an SM doing nothing but `--rounds` barriers, per variant; against it, the ~1.7 us a removed launch saves
in a decode step's CUDA graph (benchmarks/results/decode_s44_2026-11-29.md). A fused decode step pays one barrier per
dependent phase.

    python benchmarks/grid_sync_cost.py [--variants dp4a,kepler:90,fermi:90] [--rounds 2000] [--per-sm 1,2,4]
"""
from __future__ import annotations

import argparse
import json
import statistics

from legacy_engine import gpu
from legacy_engine.core import _native


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="dp4a", help="TIER[:ARCH], comma-separated")
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--per-sm", default="1,2,4", help="blocks an SM, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    gpu.init()
    for v in a.variants.split(","):
        tier, _, arch_s = v.partition(":")
        k = gpu.Kernels(tier, int(arch_s) if arch_s else None)
        with gpu.Buffer(8) as bar:
            _native.gpu_memset8(bar.ptr, 0, 8)
            for per in (int(p) for p in a.per_sm.split(",")):
                n = per * k.sm_count
                k.grid_sync_time(bar, n, 10)                     # warm: the module loaded, the blocks placed
                times = []
                for _ in range(a.reps):
                    e0, e1 = gpu.Event(), gpu.Event()
                    e0.record()
                    k.grid_sync_time(bar, n, a.rounds)
                    e1.record()
                    times.append(1e3 * e0.elapsed_ms(e1) / a.rounds)
                print(json.dumps({"variant": k.name, "blocks": n, "per_sm": per,
                                  "barrier_us": round(statistics.median(times), 3)}), flush=True)


if __name__ == "__main__":
    main()
