"""Memory read-bandwidth probe: the roofline denominator for decode (compare_llamacpp.py --bandwidth).

Streams a buffer far larger than the last-level cache through numpy reductions (integer add and float max; their
inner loops are SIMD and release the GIL, so Python threads read in parallel), on 1..T threads, each thread over its
own contiguous slice, and reports the best of `reps` passes in GB/s (1e9 bytes/s). No C code of ours is involved, so
the number is independent of the kernels it is used to judge.

    python benchmarks/bandwidth.py [--threads 2] [--size-mib 1024] [--reps 5]
"""
from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

# name -> reduction over a uint64 / float32 view of the same bytes
KERNELS = {
    "u64-add": lambda b: np.add.reduce(b.view(np.uint64)),
    "f32-max": lambda b: b.view(np.float32).max(),
}


def read_bandwidth(n_threads: int, size_mib: int = 1024, reps: int = 5, kernel: str = "u64-add",
                   buf: np.ndarray | None = None) -> float:
    """Best GB/s of reading `size_mib` MiB with `n_threads` threads (each reduces its slice once per pass)."""
    if buf is None:
        buf = np.ones(size_mib << 17, dtype=np.float64)        # MiB / 8 bytes; ones: touched, not a zero page
    slices = np.array_split(buf.view(np.uint8), n_threads)
    # 64-byte aligned slice lengths keep every view valid for the 8-byte kernels
    cut = [len(s) // 64 * 64 for s in slices]
    slices = [s[:c] for s, c in zip(slices, cut)]
    nbytes = sum(cut)
    f = KERNELS[kernel]
    with ThreadPoolExecutor(n_threads) as ex:
        list(ex.map(f, slices))                                   # warm-up: page-in, thread start
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            list(ex.map(f, slices))
            best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="most threads (default: cores)")
    ap.add_argument("--size-mib", type=int, default=1024, help="buffer size (default 1024 MiB)")
    ap.add_argument("--reps", type=int, default=5, help="passes per measurement; the best counts")
    args = ap.parse_args(argv)
    buf = np.ones(args.size_mib << 17, dtype=np.float64)
    best = 0.0
    print(f"read bandwidth, {args.size_mib} MiB buffer, best of {args.reps}")
    print(f"{'threads':>7}  " + "  ".join(f"{k:>12}" for k in KERNELS))
    for t in range(1, args.threads + 1):
        row = [read_bandwidth(t, reps=args.reps, kernel=k, buf=buf) for k in KERNELS]
        best = max(best, *row)
        print(f"{t:>7}  " + "  ".join(f"{v:7.1f} GB/s" for v in row))
    print(f"best: {best:.1f} GB/s  (pass to compare_llamacpp.py --bandwidth {best:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
