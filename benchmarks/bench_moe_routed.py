"""The CPU's routed experts (le_moe_routed, the hybrid decode's CPU half) per call: GB/s of expert weights and % of
the machine's read bandwidth, for 1..8 experts a call, the file map against anonymous huge pages.

    python benchmarks/bench_moe_routed.py MODEL.gguf [--threads 16[,8]] [--experts 1,2,5,8] [--calls 300]
                                          [--pages map,anon] [--json]

Each call takes a random MoE layer and random distinct experts (the working set of a real decode: a 35B-A3B layer's
experts are ~470 MB, far past any cache), x random; the median µs of the timed calls (after a third as warm-up) and
GB/s = a call's mean expert bytes / that median time; the C core's phase clocks split a call into the gate/up job and the down job (their
means; the rest is the serial quantisation and bookkeeping). `map`: the weights in the file's memory map (4 KiB page-cache pages, the default of
`run`), every page faulted in first (MADV_POPULATE_READ: as the hybrid decode's page-locked map is; a first touch
would cost a fault per 4 KiB and show as slowness that is not the kernels'); `anon`: read into anonymous memory with MADV_HUGEPAGE (`--no-mmap`), `huge MiB` says how much the kernel
really backed with 2 MiB pages. The read bandwidth beside is legacy_engine.tools.bench.read_bandwidth at the same thread
count (numpy, no code of ours). CPU only; the GPU machine's 16 cores give the numbers of
benchmarks/results/hybrid_fixes_2026-11-25f.md.
"""
from __future__ import annotations

import argparse
import gc
import json
import time

import numpy as np


def measure(path: str, threads: int, mmap: bool, experts: list[int], calls: int, seed: int = 0) -> dict:
    from legacy_engine.core import _native
    from legacy_engine.cpu.model import Model
    from legacy_engine.gpu.layout import expert_tensors
    m = Model(path, threads, mmap=mmap, pin=True)
    try:
        hp = m.hparams
        names = {i: expert_tensors(m.file, i) for i in range(hp.n_layer)}
        layers = [i for i in names if names[i]]
        if not layers:
            raise SystemExit(f"{path}: not a MoE model")
        # bytes of one expert of a layer: its rows of the layer's expert tensors (as stored in the file)
        eb = {i: sum(m.file.tensors[n].n_bytes for n in names[i]) / hp.n_expert for i in layers}
        if mmap:
            for i in layers:
                for n in names[i]:
                    _native.mem_prefault(m.file.gguf.data(n))
        rng = np.random.default_rng(seed)
        x = rng.standard_normal(hp.n_embd).astype(np.float32)
        out = np.empty(hp.n_embd, np.float32)
        row = {"pages": "map" if mmap else "anon", "threads": threads, "huge_mib": m.load_report["huge_bytes"] >> 20}
        for k in experts:
            ts, bs = [], []
            for c in range(calls):
                if c == calls // 3:
                    m.native.set_profile(True)      # the C core's phase clocks over the timed calls
                i = layers[rng.integers(len(layers))]
                ids = rng.choice(hp.n_expert, k, replace=False).astype(np.int32)
                t0 = time.perf_counter()
                m.native.moe_routed(i, x, ids, np.full(k, 1.0 / k, np.float32), out)
                dt = time.perf_counter() - t0
                if c >= calls // 3:
                    ts.append(dt)
                    bs.append(k * eb[i])
            prof = m.native.profile()
            m.native.set_profile(False)
            # GB/s of the median call (the µs beside it): a call's mean bytes over the median time (a mean of
            # the times would let a few slow calls, a page fault or a preempted thread, set the rate)
            row[k] = {"us": float(np.median(ts) * 1e6), "gbps": float(np.mean(bs) / np.median(ts) / 1e9),
                      "gate_up_us": 1e6 * prof["ffn_gate_up"] / len(ts), "down_us": 1e6 * prof["ffn_down"] / len(ts)}
        return row
    finally:
        del m
        gc.collect()


def main(argv=None) -> int:
    from legacy_engine.tools.bench import read_bandwidth
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--threads", default="16", help="thread counts, comma-separated (16)")
    p.add_argument("--experts", default="1,2,5,8", help="experts per call, comma-separated (1,2,5,8)")
    p.add_argument("--calls", type=int, default=300, help="calls per count, the first third untimed (300)")
    p.add_argument("--pages", default="map,anon", help="map (the file map), anon (--no-mmap: huge pages) (both)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    a = p.parse_args(argv)
    experts = [int(v) for v in a.experts.split(",")]
    rows = []
    for t in (int(v) for v in a.threads.split(",")):
        bw = read_bandwidth(t)
        for pages in a.pages.split(","):
            if pages not in ("map", "anon"):
                raise SystemExit(f"--pages: map or anon, not {pages!r}")
            r = measure(a.model, t, pages == "map", experts, a.calls)
            r["read_gbps"] = bw
            rows.append(r)
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'pages':<6}{'threads':>8}{'huge MiB':>10}{'read GB/s':>10}"
          + "".join(f"{f'{k} exp: µs':>12}{'GB/s':>7}{'%':>5}{'g+u/down µs':>13}" for k in experts))
    for r in rows:
        print(f"{r['pages']:<6}{r['threads']:>8}{r['huge_mib']:>10}{r['read_gbps']:>10.1f}"
              + "".join(f"{r[k]['us']:>12.0f}{r[k]['gbps']:>7.1f}{100 * r[k]['gbps'] / r['read_gbps']:>5.0f}"
                        f"{r[k]['gate_up_us']:>7.0f}/{r[k]['down_us']:<5.0f}" for k in experts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
