"""`legacy-engine bench serve`'s command line: the load (tools/bench_serve.py) or, with --long-prompt, the short
requests during a long prefill (tools/bench_serve_long.py)."""
from __future__ import annotations

import json
import sys

from ..core.errors import UnavailableError
from .bench_serve import __doc__ as SERVE_DOC
from .bench_serve import LoadConfig, bench_serve, parse_dist, table
from .bench_serve_long import bench_long_prompt, long_table
from .llama_server import build_llama_server


# ---- the command -------------------------------------------------------------------------------------------------

def add_parser(sub) -> None:
    """Registers `bench serve` (tools/bench_cmd.py)."""
    p = sub.add_parser("serve", help="concurrent streamed requests against our server, and llama-server's",
                       description=SERVE_DOC.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="a Qwen3.5/3.6 GGUF file (optional with --build-llama-server)")
    p.add_argument("--clients", default="1,8", metavar="C[,C...]",
                   help="concurrent clients, closed loop; one run (a fresh server) per count (1,8)")
    p.add_argument("--requests", type=int, default=24, metavar="R", help="requests per run (24)")
    p.add_argument("--prompt-len", default="uniform:64-256", metavar="DIST",
                   help="prompt tokens per request: fixed:N or uniform:A-B, seeded (uniform:64-256)")
    p.add_argument("--max-tokens", default="fixed:64", metavar="DIST",
                   help="max_tokens per request, fixed:N or uniform:A-B (fixed:64)")
    p.add_argument("--shared-prefix", type=float, default=0.5, metavar="FRAC",
                   help="fraction of the requests whose prompt starts with one common system prompt (0.5)")
    p.add_argument("--prefix-len", type=int, default=256, metavar="N",
                   help="tokens of that system prompt, before the request's own --prompt-len (256)")
    p.add_argument("--parallel", "-np", type=int, default=None, metavar="N",
                   help="server slots, both servers (the largest --clients)")
    p.add_argument("--threads", "-t", type=int, default=None, metavar="T", help="CPU threads, both servers (all cores)")
    p.add_argument("--ctx", "-c", type=int, default=4096, metavar="C",
                   help="context per slot: ours --ctx C, llama-server -c C*N (4096)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts, lengths and request seeds (0)")
    p.add_argument("--llama", nargs="?", const="", default=None, metavar="PATH",
                   help="also run llama.cpp's llama-server: PATH, else llama-server on PATH, else the one "
                        "--build-llama-server built")
    p.add_argument("--build-llama-server", action="store_true",
                   help="build llama-server from the llama-cpp-python sdist's llama.cpp into the package cache "
                        "(needs cmake and a C++ compiler; about 20 minutes on 2 cores), then run the bench if "
                        "MODEL is given (with --llama)")
    p.add_argument("--long-prompt", type=int, default=None, metavar="N",
                   help="instead of the load: short requests' TTFT idle and while an N-token prompt prefills "
                        "(raise --ctx above N)")
    p.add_argument("--probes", type=int, default=8, metavar="K",
                   help="short requests per phase with --long-prompt (8)")
    p.add_argument("--json", metavar="FILE", default=None,
                   help="also write everything (config, every request's times, summaries, ratios) to FILE")


def main(args) -> int:
    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    if args.build_llama_server:
        build_llama_server(log=log)
        if args.model is None:
            return 0
        if args.llama is None:
            args.llama = ""
    if args.model is None:
        print("legacy-engine bench serve: MODEL is required (unless --build-llama-server)", file=sys.stderr)
        return 2
    try:
        cfg = LoadConfig(model=args.model, clients=tuple(int(c) for c in args.clients.split(",")),
                         requests=args.requests, prompt_len=parse_dist(args.prompt_len, "--prompt-len"),
                         max_tokens=parse_dist(args.max_tokens, "--max-tokens"), shared_prefix=args.shared_prefix,
                         prefix_len=args.prefix_len, parallel=args.parallel, threads=args.threads, ctx=args.ctx,
                         seed=args.seed, llama=args.llama)
        cfg.check(load=args.long_prompt is None)
    except ValueError as e:
        print(f"legacy-engine bench serve: {e}", file=sys.stderr)
        return 2
    try:
        if args.long_prompt is not None:
            res = bench_long_prompt(cfg, args.long_prompt, args.probes, log=log)
        else:
            res = bench_serve(cfg, log=log)
    except ValueError as e:
        print(f"legacy-engine bench serve: {e}", file=sys.stderr)
        return 2
    except UnavailableError as e:
        print(f"legacy-engine bench serve: {e}", file=sys.stderr)
        return 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    print(long_table(res) if args.long_prompt is not None else table(res))
    return 0
