"""Prefill and decode speed of legacy_engine against llama.cpp on the same GGUF and the same threads.

A thin wrapper over `legacy-engine bench decode` (legacy_engine/bench.py, whose docstring says what is timed and
how bytes per token and the roofline are counted), kept for its older flags:

    python benchmarks/compare_llamacpp.py MODEL.gguf [--threads 2] [--pp 64] [--tg 16] [--reps 1]
                                          [--bandwidth GBPS] [--json OUT.json] [--also-f32] [--no-llama | --no-ours]

It times our default tier (plus integer kernels off with --also-f32) and llama.cpp through llama-cpp-python;
`bench decode` does the same for every tier (--isa) and can run a llama-bench binary (--llama PATH).
Without --bandwidth no roofline is reported (`bench decode` measures it by default).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from a checkout without installing

from legacy_engine.core import _native  # noqa: E402
from legacy_engine.tools.bench import bench_decode, print_decode  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="GGUF file (qwen35 / qwen35moe)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="threads for both engines")
    ap.add_argument("--pp", type=int, default=64, help="prompt tokens of the prefill test (0: skip)")
    ap.add_argument("--tg", type=int, default=16, help="decoded tokens of the decode test (0: skip)")
    ap.add_argument("--reps", type=int, default=1, help="timed runs after the warm-up; the median counts")
    ap.add_argument("--bandwidth", type=float, default=None, metavar="GBPS",
                    help="measured read bandwidth (benchmarks/bandwidth.py) to report decode as %% of")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--also-f32", action="store_true",
                    help="also time legacy_engine with its integer kernels off (f32 on dequantised rows)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--no-llama", action="store_true", help="only legacy_engine")
    g.add_argument("--no-ours", action="store_true", help="only llama.cpp")
    args = ap.parse_args(argv)

    isas = [] if args.no_ours else [_native.get_isa()] + (["f32"] if args.also_f32 else [])
    res = bench_decode(args.model, [args.threads], args.pp, args.tg, args.reps, isas,
                       "off" if args.no_llama else "auto", args.bandwidth, args.seed,
                       log=lambda s: print(s, file=sys.stderr, flush=True))
    print_decode(res)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
