"""Whether a streamed model's pass length changes its bits (GPU machine): the last logits of an N-token prompt with
the routed experts streamed (none pinned), in passes of 2048 and of 4096 tokens (planner.STREAM_CHUNKS), and the
time of each prefill.

    python benchmarks/split_pass_lengths.py MODEL.gguf [N]      (N: 8192)

2026-11-29, H200, the 35B-A3B shape (make-model --preset qwen3.6-35b-a3b), N = 8192: bit-equal; 1.44 s vs 0.87 s
(benchmarks/results/prefill_s42_2026-11-29.md)."""
from __future__ import annotations

import argparse
import time

import numpy as np

from legacy_engine.cpu.model import Model
from legacy_engine.gpu import layout
from legacy_engine.gpu.model import GpuModel, GpuOptions
from legacy_engine.gpu.placement import place

PASSES = (2048, 4096)


def last_logits(cpu: Model, ids: list, chunk: int) -> tuple[np.ndarray, float]:
    """(the last token's logits, seconds) of one prefill of ids in passes of `chunk` tokens, experts streamed."""
    n_ctx = len(ids) + 8
    fp = layout.vram_footprint(cpu.file, stream_experts=True, pinned={}, n_ctx=n_ctx, chunk=chunk, int8=True)
    pl = place(cpu.file, budget=fp.total, n_ctx=n_ctx, chunk=chunk, int8=True, stream=True, pinned={}, decode="cpu")
    gm = GpuModel(cpu, pl, GpuOptions())
    try:
        st = gm.new_state(n_ctx)
        t = time.perf_counter()
        out = np.asarray(gm.forward(st, ids), dtype=np.float64).reshape(-1)
        return out, time.perf_counter() - t
    finally:
        gm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("n", nargs="?", type=int, default=8192)
    a = ap.parse_args()
    cpu = Model(a.model, pin=False)
    ids = np.random.default_rng(5).integers(0, cpu.hparams.n_vocab, a.n).tolist()
    got = {}
    for chunk in PASSES:
        got[chunk], s = last_logits(cpu, ids, chunk)
        print(f"passes of {chunk}: {s:.2f} s", flush=True)
    x, y = got[PASSES[0]], got[PASSES[1]]
    print(f"last logits, passes of {PASSES[0]} vs {PASSES[1]}: max|d| {np.abs(x - y).max():.3e}, "
          f"bit-equal {np.array_equal(x, y)}, argmax {int(x.argmax())} / {int(y.argmax())}")


if __name__ == "__main__":
    main()
