"""The CPU decode's thread pool per decoded token: jobs published, workers joining them, jobs a worker came too late
for, futex sleeps of workers and of the caller (le_model_pool_stats over --tokens decode steps after a short prompt).

    python benchmarks/pool_per_token.py MODEL.gguf [--threads 16] [--tokens 32]
"""
from __future__ import annotations

import argparse
import time

from legacy_engine.cpu.model import Model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=None, help="decode threads (default: the engine's)")
    ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args()
    m = Model(a.model, n_threads=a.threads)
    st = m.new_state(a.tokens + 64)
    m.forward(st, list(range(100, 108)))
    for t in range(4):                                  # warm: the scratch sized, the workers spinning
        m.forward(st, [200 + t])
    before, t0 = m.native.pool_stats(), time.perf_counter()
    for t in range(a.tokens):
        m.forward(st, [300 + t])
    dt, after = time.perf_counter() - t0, m.native.pool_stats()
    per = {k: (after[k] - before[k]) / a.tokens for k in after if k != "spin_us"}
    print(f"{m.n_threads} threads: {a.tokens / dt:.1f} tok/s; per token: "
          + ", ".join(f"{k} {v:.2f}" for k, v in per.items())
          + f"; workers joining a job {per['joined'] / max(per['jobs'], 1):.2f}")


if __name__ == "__main__":
    main()
