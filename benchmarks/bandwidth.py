"""Memory read-bandwidth probe: the roofline denominator for decode (`legacy-engine bench decode --bandwidth`).

Streams a buffer far larger than the last-level cache through numpy reductions (integer add and float max; their
inner loops are SIMD and release the GIL, so Python threads read in parallel), on 1..T threads, each thread over its
own contiguous slice, and reports the best of `reps` passes in GB/s (1e9 bytes/s). No C code of ours is involved, so
the number is independent of the kernels it is used to judge. The probe itself is legacy_engine.tools.bench.read_bandwidth
(so `bench decode --bandwidth auto` has it installed); this is its table.

    python benchmarks/bandwidth.py [--threads 2] [--size-mib 1024] [--reps 5]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from a checkout without installing

from legacy_engine.tools.bench import READ_KERNELS, read_bandwidth  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="most threads (default: cores)")
    ap.add_argument("--size-mib", type=int, default=1024, help="buffer size (default 1024 MiB)")
    ap.add_argument("--reps", type=int, default=5, help="passes per measurement; the best counts")
    args = ap.parse_args(argv)
    buf = np.ones(args.size_mib << 17, dtype=np.float64)
    best = 0.0
    print(f"read bandwidth, {args.size_mib} MiB buffer, best of {args.reps}")
    print(f"{'threads':>7}  " + "  ".join(f"{k:>12}" for k in READ_KERNELS))
    for t in range(1, args.threads + 1):
        row = [read_bandwidth(t, reps=args.reps, kernel=k, buf=buf) for k in READ_KERNELS]
        best = max(best, *row)
        print(f"{t:>7}  " + "  ".join(f"{v:7.1f} GB/s" for v in row))
    print(f"best: {best:.1f} GB/s  (pass to legacy-engine bench decode --bandwidth {best:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
