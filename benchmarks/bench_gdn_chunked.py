"""The GDN recurrence on the GPU, chunked (cuda8/gdn_chunked.cu: prep + scan) against token by token
(gdn_recurrent_f32), one layer of the 35B-A3B's shape (Hk 16, Hv 32, d 128), per kernel variant of this GPU; and,
with --split MODEL, whole streamed prefill passes of that file under a 6 GiB budget with the GDN either way and the
GPU's phases per 2048-token pass (GpuModel.profile_report).

    python benchmarks/bench_gdn_chunked.py [--n 2048] [--variants dp4a,kepler,fermi] [--split a3b.gguf]

Results: benchmarks/results/gdn_chunked_2026-11-29.md (NVIDIA H200).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from legacy_engine import gpu
from legacy_engine.cpu.model import Model
from legacy_engine.gpu.kernels import Kernels
from legacy_engine.gpu.launch import GDNC_C, GDNC_THREADS, _ptr
from legacy_engine.gpu.model import GpuModel
from legacy_engine.gpu.options import GpuOptions
from legacy_engine.gpu.placement import place
from legacy_engine.gpu.runtime import synchronize
from legacy_engine.tools.bench import seeded_tokens

HK, HV, DK, DV = 16, 32, 128, 128     # Qwen3.5/3.6-35B-A3B's GDN
REPS = 5


def timed(fn) -> float:
    """ms per call: one warm-up, then the mean of REPS."""
    fn()
    synchronize()
    t = time.perf_counter()
    for _ in range(REPS):
        fn()
    synchronize()
    return (time.perf_counter() - t) / REPS * 1e3


def one_layer(n: int, tier: str) -> dict:
    k = Kernels(tier)
    rng = np.random.default_rng(0)
    conv_dim = 2 * HK * DK + HV * DV
    u = (rng.standard_normal((n, conv_dim)) * 0.05).astype(np.float32)
    g = -rng.uniform(0.01, 1.0, (n, HV)).astype(np.float32)
    beta = rng.uniform(0.05, 1.0, (n, HV)).astype(np.float32)
    with gpu.Buffer.from_array(u) as bu, gpu.Buffer.from_array(g) as bg, gpu.Buffer.from_array(beta) as bb, \
            gpu.Buffer(4 * HV * DK * DV) as bs, gpu.Buffer(4 * n * HV * DV) as bo, gpu.Buffer(4 * n * HV * DK) as w, \
            gpu.Buffer(4 * n * HV * DV) as uu, gpu.Buffer(4 * -(-n // GDNC_C) * HV * GDNC_C ** 2) as p, \
            gpu.Buffer(4 * n * HV) as gc:
        shape = [("i32", n), ("i32", conv_dim), ("i32", HK), ("i32", HV), ("i32", DK), ("i32", DV), ("i32", 1)]
        prep = k.modules["gdn_chunked"].kernel("gdn_chunk_prep_f32")
        return {"variant": k.name,
                "recurrent_ms": timed(lambda: k.gdn_recurrent(bu, bg, bb, bs, bo, n, HK, HV, DK, DV)),
                "chunked_ms": timed(lambda: k.gdn_chunked(bu, bg, bb, bs, bo, n, HK, HV, DK, DV, (w, uu, p, gc))),
                "prep_ms": timed(lambda: prep.launch(
                    (-(-n // GDNC_C), HV, 1), (GDNC_THREADS, 1, 1),
                    [("ptr", _ptr(x)) for x in (bu, bg, bb, w, uu, p, gc)] + shape))}


def split_passes(path: str) -> None:
    m = Model(path)
    gm = GpuModel(m, place(m.file, budget=6 << 30, n_ctx=8448, chunk=2048, stream=True, decode="cpu"), GpuOptions())
    ids = seeded_tokens(8200, m.hparams.n_vocab)
    try:
        for n in (2048, 8192):
            for chunked in (True, False, True):     # the first run warms up
                st = gm.new_state(8448)
                gm.profile()
                t = time.perf_counter()
                gm.forward(st, ids[:n], chunked=chunked)
                dt = time.perf_counter() - t
                per = -(-n // 2048)
                print(f"n={n} chunked={chunked}: {n / dt:.0f} tok/s; per 2048-token pass: "
                      + ", ".join(f"{k} {v / per * 1e3:.1f} ms" for k, v in gm.profile_report().items()), flush=True)
    finally:
        gm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2048, help="tokens of the one-layer measurement (2048)")
    ap.add_argument("--variants", default="dp4a,kepler,fermi", help="kernel tiers, forced on this GPU")
    ap.add_argument("--split", metavar="MODEL", help="also time streamed prefill passes of MODEL under 6 GiB")
    a = ap.parse_args()
    print(f"GPU: {gpu.init().get('name', '?')}")
    for tier in a.variants.split(","):
        r = one_layer(a.n, tier)
        print(f"{r['variant']}: n={a.n} one layer: recurrent {r['recurrent_ms']:.3f} ms, chunked {r['chunked_ms']:.3f}"
              f" ms ({r['recurrent_ms'] / r['chunked_ms']:.2f}x), of which prep {r['prep_ms']:.3f} ms")
    if a.split:
        split_passes(a.split)


if __name__ == "__main__":
    main()
