"""Where a stream-split prefill's wall time goes: the state handoff CPU -> GPU, the GPU pass, the handoff back.

    python benchmarks/bench_split_handoff.py MODEL.gguf [--vram 6GiB] [--prompt 2048] [--reps 3] [--pageable]

SplitModel.forward (the `stream` strategy) runs a prompt on the GPU between two handoffs: GpuState.from_cpu (the CPU
state's GDN states and KV rows so far, up to the GPU) and GpuState.to_cpu_rows (the states and the pass's KV rows
back). This times each piece of that sequence with the SplitModel's own calls on a streamed GpuModel, per rep after
one warm-up: from_cpu, forward, to_cpu_rows, and their sum against the pass's wall time. --pageable runs the
handoff through the Python-bytes path (save_recurrent / read_kv ...) instead of the page-locked staging, for the
comparison. Bytes moved per direction are printed beside (recurrent states + KV rows).
GPU machine only.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np


def main(argv=None) -> int:
    from legacy_engine import gpu
    import functools

    from legacy_engine.plan.planner import parse_size, save_routing
    from legacy_engine.gpu.model import GpuModel, GpuOptions
    from legacy_engine.gpu.placement import place
    from legacy_engine.cpu.model import Model
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--vram", default="6GiB", help="VRAM budget (6GiB)")
    p.add_argument("--prompt", type=int, default=2048, help="tokens per pass (2048)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--pageable", action="store_true", help="hand over through Python bytes (the old path)")
    a = p.parse_args(argv)
    ok, why = gpu.available()
    if not ok:
        print(f"no GPU: {why}")
        return 1
    m = Model(a.model, pin=False)
    n_ctx = a.prompt + 16
    opts = GpuOptions(save_routing=functools.partial(save_routing, m))
    pl = place(m.file, budget=parse_size(a.vram), n_ctx=n_ctx, chunk=min(a.prompt, 2048),
               int8=any(opts.precision(gpu.device_arch())), stream=True)
    gm = GpuModel(m, pl, opts)
    try:
        ids = np.random.default_rng(0).integers(0, m.hparams.n_vocab, a.prompt).astype(np.int32)
        st, gst = m.new_state(n_ctx), gm.new_state(n_ctx)
        rows = []
        for rep in range(a.reps + 1):
            st.reset()
            gst.reset()
            t0 = time.perf_counter()
            if a.pageable:
                gst.restore_recurrent(st.save_recurrent(), st.pos)
            else:
                gst.from_cpu(st)
            t1 = time.perf_counter()
            gm.forward(gst, ids)
            t2 = time.perf_counter()
            if a.pageable:
                st.restore_recurrent(gst.save_recurrent(), gst.pos)
                st.write_kv(0, a.prompt, gst.read_kv(0, a.prompt))
            else:
                gst.to_cpu_rows(st, 0, a.prompt)
            t3 = time.perf_counter()
            if rep:
                rows.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
        med = [statistics.median(r[i] for r in rows) for i in range(4)]
        nb = gst.recurrent_nbytes() + gst.kv_nbytes(a.prompt)
        print(f"{a.model}: {a.prompt} tokens, {'pageable bytes' if a.pageable else 'page-locked staging'}; "
              f"median of {a.reps}")
        print(f"  from_cpu {med[0] * 1e3:8.1f} ms   ({gst.recurrent_nbytes() / 1e6:.0f} MB up)")
        print(f"  forward  {med[1] * 1e3:8.1f} ms   ({a.prompt / med[1]:.0f} tok/s)")
        print(f"  to_cpu   {med[2] * 1e3:8.1f} ms   ({nb / 1e6:.0f} MB down, {nb / med[2] / 1e9:.2f} GB/s)")
        print(f"  pass     {med[3] * 1e3:8.1f} ms   ({a.prompt / med[3]:.0f} tok/s with the handoff)")
    finally:
        gm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
