"""What a GPU decode step's kernel count costs (GPU machine): one token of the resident model as its CUDA graph replays
it (N launches) against a graph of N launches of a one-element kernel (add_f32 on 4 floats: the per-node floor,
launch and gap with no work), per kernel variant. The step less the floor is the kernels' work; the floor's share is
what running the step as fewer kernels can win at most (issue 26's fused decode).

    python benchmarks/decode_graph_floor.py FILE [--variants dp4a:90,kepler:90] [--reps 300]

Prints one JSON line per variant: {"variant", "launches", "graph", "step_us", "floor_us", "floor_share"}; the
median of --reps replays, each timed by events around it on the default stream.
"""
from __future__ import annotations

import argparse
import json

from legacy_engine import gpu
from legacy_engine.cpu.model import Model
from legacy_engine.gpu.model import GpuModel
from legacy_engine.gpu.options import GpuOptions
from legacy_engine.tools.bench import seeded_tokens


def decode_step(model: Model, variant: str) -> tuple[GpuModel, object]:
    """The resident model on variant TIER[:ARCH] and a state past a short prompt and three decode tokens: its step's
    LaunchPlan recorded and replayed (st._plan), its io and scratch as a decode token has them -> (gm, st)."""
    tier, _, arch_s = variant.partition(":")
    gm = GpuModel.resident(model, GpuOptions(tier=tier, arch=int(arch_s) if arch_s else None), n_ctx=64)
    st = gm.new_state(64)
    gm.forward(st, seeded_tokens(8, model.hparams.n_vocab))
    for t in range(3):
        gm.forward(st, [100 + t])
    return gm, st


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--variants", default="dp4a", help="TIER[:ARCH], comma-separated (default: dp4a, the card's arch)")
    ap.add_argument("--reps", type=int, default=300)
    a = ap.parse_args()
    gpu.init()
    model = Model(a.file, pin=False)
    for v in a.variants.split(","):
        gm, st = decode_step(model, v)
        plan = st._plan
        n = len(plan)
        step = 1e3 * gpu.median_ms(plan.replay, a.reps)
        with gpu.Buffer(64) as b:
            with gpu.record() as launches:
                for _ in range(n):
                    gm.k.add(b, b, b, 4)
            floor_plan = gpu.LaunchPlan(launches, graph=plan.graph)
            floor = 1e3 * gpu.median_ms(floor_plan.replay, a.reps)
            del floor_plan
        print(json.dumps({"variant": gm.k.name, "launches": n, "graph": plan.graph, "step_us": round(step, 1),
                          "floor_us": round(floor, 1), "floor_share": round(floor / step, 3)}), flush=True)
        gm.close()


if __name__ == "__main__":
    main()
