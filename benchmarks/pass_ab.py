"""One GPU-resident prefill pass, timed: the A/B tool for a kernel change (GPU machine).

    python benchmarks/pass_ab.py FILE --pp 512,2048[,8192] [--variant TIER:ARCH] [--reps 5] [--rounds 1] [--label L]

Times `GpuModel.forward` of one pass of each length (median of --reps after a warm-up; the state reset between
passes) and prints one JSON line per length: {"label", "variant", "pp", "ms", "runs", "logits"} (logits: a hash of
the last pass's last-token logits, for a change that must keep the bits). Two code versions are
compared by running this script once per version, alternated in one call (other PYTHONPATH / LE_PTX_DIR), so that
the card's clocks and neighbours are the same for both; `bench gpu` is the side-by-side with llama.cpp.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time

from legacy_engine import gpu
from legacy_engine.cpu.model import Model
from legacy_engine.gpu.model import GpuModel
from legacy_engine.gpu.options import GpuOptions
from legacy_engine.tools.bench import seeded_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--pp", default="512,2048", help="pass lengths, comma-separated")
    ap.add_argument("--variant", default=None, help="TIER:ARCH (e.g. dp4a:61) or TIER; default: the GPU's own")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1, help="repeat the whole set of lengths this many times")
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    gpu.init()
    tier, arch = None, None
    if a.variant:
        tier, _, arch_s = a.variant.partition(":")
        arch = int(arch_s) if arch_s else None
    pps = [int(p) for p in a.pp.split(",")]
    model = Model(a.file, pin=False)
    gm = GpuModel.resident(model, GpuOptions(tier=tier, arch=arch), n_ctx=max(pps) + 8)
    st = gm.new_state(max(pps) + 8)
    ids = seeded_tokens(max(pps), model.hparams.n_vocab)
    for _ in range(a.rounds):
        for pp in pps:
            runs = []
            for i in range(a.reps + 1):
                st.reset()
                gpu.synchronize()
                t0 = time.perf_counter()
                logits = gm.forward(st, ids[:pp])
                gpu.synchronize()
                if i:                       # the first is the warm-up
                    runs.append(1e3 * (time.perf_counter() - t0))
            print(json.dumps({"label": a.label, "variant": gm.k.name, "pp": pp, "ms": round(statistics.median(runs), 3),
                              "runs": [round(r, 3) for r in runs],
                              "logits": hashlib.sha256(logits.tobytes()).hexdigest()[:16]}), flush=True)
    gm.close()


if __name__ == "__main__":
    main()
