"""Batched decode on the CPU (le_forward_seqs, Model.forward_batch): aggregate tok/s of B sequences advanced by one
pass a step, each weight row read once for all B, against B = 1.

    python benchmarks/bench_batch_decode.py MODEL.gguf [--threads 2] [--batches 1,2,4,8,16] [--tg 16] [--prompt 64]
                                            [--reps 3] [--isa avx512vnni|...|f32] [--json]
    python -m pytest benchmarks/bench_batch_decode.py --benchmark-enable       # tiny-moe, pytest-benchmark

The measurement is legacy_engine.tools.bench.bench_batch_decode (what `legacy-engine bench decode` can report):
per B, B states each prefilled alone with `--prompt` seeded tokens of its own (different tokens: the sequences
route to different experts, as real ones do; identical ones would share every expert and flatter the batch), then
`--tg` batched steps; tok/s = B x tg / median time of --reps runs, `best` from the fastest run; the batch sizes take
turns round by round (after a warm-up round), so other work on the machine slows them alike. `ratio` = tok/s over
B = 1's; `alone` = the same steps of one sequence through Model.forward (le_forward), in the same rounds. Under the
table, each B's C-core phase milliseconds per step (le_model_profile): where a weight phase (projections, experts,
LM head) stops being bandwidth-bound and grows with B (the integer kernels' compute per token), and the per-sequence
phases (GDN recurrence, attention over each sequence's keys), which grow with B by nature. Numbers from a machine
other work is using are not worth much: the load average before and after is printed.
Results: benchmarks/results/batch_decode_cpu_2026-11-28.md.
"""
from __future__ import annotations

import argparse
import json
import time

import pytest

# the phases printed under the table (le_model_profile's names), in pass order
PHASES = ("gdn_proj", "gdn_core", "gdn_out", "attn_proj", "attn_core", "attn_out", "moe_router", "ffn_gate_up",
          "ffn_down", "lm_head")


def table(res: dict) -> str:
    lines = [f"{res['model']}: threads {res['threads']}, tier {res['isa']}, prompt {res['prompt']}, tg {res['tg']}, "
             f"median of {res['reps']}; kernels " + ", ".join(f"{k} {v}" for k, v in res["kernels"].items()),
             f"load average {res['load_avg_before']:.2f} before, {res['load_avg_after']:.2f} after"
             + (f"; GPU: {res['gpu']}" if res.get("gpu") else ""),
             f"alone (Model.forward, one sequence): {res['alone_tok_s']:.2f} tok/s", "",
             f"{'B':>4}{'tok/s':>10}{'range':>18}{'ms/step':>10}{'ratio':>8}{'best':>10}{'ratio':>8}"]
    for r in res["rows"]:
        lo, hi = r["tok_s_range"]
        ratio = f"{r['ratio_to_b1']:.2f}" if r["ratio_to_b1"] else "-"
        best = f"{r['best_ratio_to_b1']:.2f}" if r["best_ratio_to_b1"] else "-"
        lines.append(f"{r['batch']:>4}{r['tok_s']:>10.2f}{f'{lo:.2f}..{hi:.2f}':>18}{r['step_ms']:>10.1f}{ratio:>8}"
                     f"{r['best_tok_s']:>10.2f}{best:>8}")
    lines += ["", "ms per step by phase (le_model_profile):", f"{'B':>4}" + "".join(f"{p:>12}" for p in PHASES)]
    for r in res["rows"]:
        lines.append(f"{r['batch']:>4}" + "".join(f"{r['profile_ms'].get(p, 0.0):>12.2f}" for p in PHASES))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--threads", type=int, default=2, help="threads (2)")
    p.add_argument("--batches", default="1,2,4,8,16", help="batch sizes, comma-separated (1,2,4,8,16)")
    p.add_argument("--tg", type=int, default=16, help="batched decode steps per run (16)")
    p.add_argument("--prompt", type=int, default=64, help="tokens each sequence is prefilled with (64)")
    p.add_argument("--reps", type=int, default=3, help="timed runs after one warm-up (3)")
    p.add_argument("--isa", default=None, help="force a tier (ref, ssse3, avx2, avx512vnni) or f32 (integer kernels "
                                                "off); default: the best this CPU runs")
    p.add_argument("--gpu", default=None, metavar="TIER",
                   help="the GPU-resident model instead (fermi, kepler, dp4a or auto): GpuModel.forward_batch")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    a = p.parse_args(argv)
    from legacy_engine.tools.bench import bench_batch_decode
    t0 = time.perf_counter()
    res = bench_batch_decode(a.model, a.threads, [int(b) for b in a.batches.split(",")], a.tg, a.prompt, a.reps,
                             a.isa, gpu_tier=a.gpu)
    res["wall_s"] = time.perf_counter() - t0
    print(json.dumps(res, indent=1) if a.json else table(res))
    return 0


# ------------------------------------------------------------------------------------------------ pytest-benchmark

@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from legacy_engine.tools.make_model import make_model
    return make_model("tiny-moe", str(tmp_path_factory.mktemp("bench_batch") / "tiny-moe.gguf"), layers=4,
                      progress=False)


@pytest.mark.cpu
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_batch_decode(benchmark, tiny_moe, batch):
    """B sequences, 4 batched steps a round; extra_info: aggregate tok/s and the ratio to one sequence alone."""
    from legacy_engine.tools.bench import bench_batch_decode
    res = benchmark.pedantic(bench_batch_decode, args=(tiny_moe, 2, [batch], 4, 16, 1), rounds=1, iterations=1)
    row = res["rows"][0]
    assert row["batch"] == batch and row["tok_s"] > 0
    benchmark.extra_info.update(batch=batch, tok_per_s=row["tok_s"], alone_tok_per_s=res["alone_tok_s"],
                                ratio_to_alone=row["tok_s"] / res["alone_tok_s"])


if __name__ == "__main__":
    raise SystemExit(main())
