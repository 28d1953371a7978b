"""`legacy-engine bench WHAT MODEL`: the command line of the benchmarks (bench.py's docstring says what each
measures): decode and cache (bench.py), gpu (bench_gpu.py), split (bench_split.py), shared (bench_shared.py),
vision (bench_vision.py), serve (bench_serve.py, bench_serve_long.py; its flags bench_serve_cmd.py)."""
from __future__ import annotations

import argparse
import json
import sys

from . import bench, bench_gpu, bench_serve_cmd, bench_shared, bench_split, bench_vision
from .flags import load_flags


def main(argv=None) -> int:
    doc = bench.__doc__
    top = argparse.ArgumentParser(prog="legacy-engine bench", description=doc.split("\n\n")[0])
    sub = top.add_subparsers(dest="what", required=True, metavar="WHAT")
    dp = sub.add_parser("decode", help="prefill/decode tok/s per CPU tier next to llama.cpp, %% of the roofline",
                        description=doc[doc.index("bench decode —"):doc.index("bench cache —")],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    dp.add_argument("model", help="a Qwen3.5/3.6 GGUF file")
    dp.add_argument("--threads", default=None, metavar="N[,N...]",
                    help="CPU threads for both engines; several (--threads 2,1) give one block of rows each "
                         "(all cores)")
    dp.add_argument("--pp", type=int, default=64, help="prompt tokens of the prefill test, 0 skips it (64)")
    dp.add_argument("--tg", type=int, default=32, help="decoded tokens of the decode test, 0 skips it (32)")
    dp.add_argument("--reps", type=int, default=3, help="timed runs after one warm-up; the median counts (3)")
    dp.add_argument("--isa", default="chosen", metavar="chosen|all|none|TIER,...",
                    help="CPU tiers to force (ref, ssse3, avx2, avx512vnni; f32 = integer kernels off); chosen: the "
                         "one `info` chooses; all: every tier this CPU runs (chosen)")
    dp.add_argument("--llama", default="auto", metavar="auto|off|PATH",
                    help="llama.cpp beside ours: auto = llama-cpp-python if importable; PATH = a llama-bench binary")
    dp.add_argument("--bandwidth", default="auto", metavar="GBPS|auto",
                    help="read bandwidth for the roofline; auto measures it at each thread count (auto)")
    dp.add_argument("--seed", type=int, default=0, help="seed of the random token ids (0)")
    dp.add_argument("--json", action="store_true", help="print the result as JSON instead of the table")
    dp.add_argument("--profile", action="store_true",
                    help="also print where a decoded token's time goes, per phase (always in --json)")
    dp.add_argument("--sample", default=bench.SAMPLE_DEFAULT, metavar="KEY=V,...|off",
                    help="also decode as generation does, greedy and sampled with these settings (temp, top_k, "
                         f"top_p, min_p, repeat_penalty, presence_penalty, frequency_penalty, seed); off: skip "
                         f"({bench.SAMPLE_DEFAULT})")
    load_flags(dp)
    ap = sub.add_parser("cache", help="time to first token with the prefix cache (cold, repeat, follow-up, shared)")
    ap.add_argument("model", help="a Qwen3.5/3.6 GGUF file")
    ap.add_argument("--lengths", type=int, nargs="+", default=[947],   # the demo model: 49 s on 2 busy cores
                    help="prompt lengths (947: about a minute on 2 cores; each 4096 adds minutes)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (all cores)")
    ap.add_argument("--grid", type=int, default=256, help="snapshot grid in tokens, a multiple of 64 (256)")
    ap.add_argument("--disk", metavar="DIR", default=None, help="also measure the disk tier in a temp dir under DIR")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    bench_gpu.add_parser(sub)
    bench_split.add_parser(sub)
    bench_shared.add_parser(sub)
    bench_vision.add_parser(sub)
    bench_serve_cmd.add_parser(sub)
    args = top.parse_args(argv)
    if args.what == "gpu":
        return bench_gpu.main(args)
    if args.what == "shared":
        return bench_shared.main(args)
    if args.what == "vision":
        return bench_vision.main(args)
    if args.what == "serve":
        return bench_serve_cmd.main(args)
    if args.what == "split":
        return bench_split.main(args)
    if args.what == "decode":
        return _main_decode(args, top)
    return _main_cache(args)


def _main_decode(args, parser) -> int:
    try:
        threads = [int(t) for t in args.threads.split(",")] if args.threads else [None]
    except ValueError:
        parser.error(f"decode: --threads takes N or N,N,..., not {args.threads!r}")
    if args.pp < 0 or args.tg < 0 or args.reps < 1 or any(t is not None and t < 1 for t in threads):
        parser.error("decode: --pp/--tg must be >= 0, --reps and --threads >= 1")
    bw = args.bandwidth
    if bw not in ("auto", None):
        try:
            bw = float(bw)
        except ValueError:
            parser.error(f"decode: --bandwidth takes GB/s or auto, not {bw!r}")
    try:
        sample = bench.parse_sample(args.sample)
    except ValueError as e:
        parser.error(f"decode: {e}")
    res = bench.bench_decode(args.model, threads, args.pp, args.tg, args.reps, bench.parse_isas(args.isa),
                             args.llama, bw, args.seed, log=lambda s: print(s, file=sys.stderr, flush=True),
                             sample=sample, load_opts=dict(mmap=args.mmap, numa=args.numa, pin=args.pin,
                                                           check_tensors=args.check_tensors))
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        bench.print_decode(res, profile=args.profile)
    return 0


def _main_cache(args) -> int:
    res = bench.bench_cache(args.model, args.lengths, args.threads, args.grid, disk_dir=args.disk,
                            log=lambda s: print(s, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print(f"{res['model']}, {res['threads']} threads: snapshot {res['snapshot_bytes'] / 2**20:.2f} MiB, "
              f"KV {res['kv_bytes_per_token'] / 1024:.1f} KiB/token")
        for L in args.lengths:
            r = res[f"L{L}"]
            line = (f"L={L}: TTFT plain {r['plain_s']:.3f} s, cold {r['cold_s']:.3f} s (capture "
                    f"{r['capture_s'] * 1e3:.1f} ms), repeat {r['repeat_s']:.3f} s "
                    f"(reused {r['repeat_reused']}, restore {r['restore_s'] * 1e3:.1f} ms), +{bench.APPEND} "
                    f"{r['follow_s']:.3f} s (reused {r['follow_reused']})")
            if "shared_s" in r:
                line += f", shared {bench.SHARED} {r['shared_s']:.3f} s (reused {r['shared_reused']})"
            line += f"; RAM {r['ram_bytes'] / 2**20:.1f} MiB = {r['ram_bytes_per_token'] / 1024:.1f} KiB/token"
            if "repeat_disk_s" in r:
                line += (f"; disk {r['disk_bytes'] / 2**20:.1f} MiB (capture + write "
                         f"{r['capture_disk_s'] * 1e3:.0f} ms), repeat after restart {r['repeat_disk_s']:.3f} s "
                         f"(restore {r['restore_disk_s'] * 1e3:.1f} ms)")
            print(line)
            bad = [k for k, v in r.items() if k.endswith("_equal") and not v]
            if bad:
                print(f"  NOT bit-identical: {bad}")
    return 0
