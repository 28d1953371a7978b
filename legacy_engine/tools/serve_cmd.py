"""`legacy-engine serve MODEL`: the command's flags, and the engine, prefix cache, worker and app they make, served
by uvicorn (legacy_engine.serve.server)."""
from __future__ import annotations

import argparse
import os
import re
import sys

from .. import gpu
from ..core.errors import UnavailableError
from ..plan.slots import DEFAULT_PARALLEL, SlotPlan, serve_slots
from ..serve.cache import PrefixCache
from ..serve.generate import Engine, batched_decode_mode
from ..serve.origin import ORIGIN_POLICY
from ..serve.sampling import SamplingParams
from ..serve.schema import ServeConfig
from ..serve.server import SERVE_DEPS, create_app, listen_socket, stopping_server, uvicorn_config
from ..serve.worker import Worker
from .flags import check_gpu, engine_kwargs, gpu_flags, load_flags


def _size(text: str) -> int:
    """'512M', '4G', '1048576' -> bytes (K/M/G/T are powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size such as 4096, 512M or 2G, got {text!r}")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " "))


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return n


def add_serve_parser(sub) -> argparse.ArgumentParser:
    """Registers `serve` on an argparse subparsers object (legacy_engine.tools.cli)."""
    s = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server for MODEL",
        description="Serve MODEL over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
                    "/v1/models, /health, /metrics). Requests run one at a time, in order of arrival; a prefix "
                    "cache lets requests that share a beginning skip it. " + ORIGIN_POLICY + " Control tokens "
                    "(<|im_start|> ...) in chat messages and tools are tokenized as text; a /v1/completions "
                    f"prompt's are parsed (it is the caller's whole prompt). Needs: pip install {SERVE_DEPS}")
    s.add_argument("model", help="a Qwen3.5/3.6 GGUF file")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 opens it to the "
                        "network, so set --api-key)")
    s.add_argument("--port", type=int, default=8080, help="TCP port (default 8080)")
    s.add_argument("--allow-origin", action="append", default=[], metavar="NAME",
                   help="repeatable: a name this server is reached by (a host, e.g. gpu-box.lan) or a web origin "
                        "that may call it (e.g. https://app.example.com, answered with CORS headers); '*' allows "
                        "any (default: localhost, 127.0.0.1, [::1], IP addresses and --host only)")
    s.add_argument("--api-key", default=os.environ.get("LEGACY_ENGINE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(default: $LEGACY_ENGINE_API_KEY; unset: no key)")
    s.add_argument("--alias", default=None, help="the model id clients send (default: the file name without .gguf)")
    s.add_argument("-c", "--ctx", type=_positive, default=4096,
                   help="context length in tokens: prompt + generated (default 4096)")
    s.add_argument("-t", "--threads", type=_positive, default=None, help="CPU threads (default: all cores)")
    load_flags(s)
    gpu_flags(s)  # --no-mmap, --numa
    s.add_argument("--max-body", type=_size, default=4 << 20, metavar="BYTES",
                   help="largest request body; larger ones get 413 (default 4M)")
    s.add_argument("--parallel", "-np", type=_positive, default=None, metavar="N",
                   help="generations run at once, their decode steps batched (default: the planner's: up to "
                        f"{DEFAULT_PARALLEL} where the engine batches and their states fit in a quarter of the "
                        "free memory; 1 where it decodes one sequence per pass)")
    s.add_argument("--max-queue", type=_positive, default=256, metavar="N",
                   help="requests allowed to wait for the model; more get 503 queue_full (default 256)")
    s.add_argument("--max-tokens", type=_positive, default=None, metavar="N",
                   help="cap on a request's max_tokens, and its default (default: what the context has left)")
    s.add_argument("--temp", type=float, default=1.0,
                   help="temperature for requests that give none (default 1.0, as OpenAI's API)")
    s.add_argument("--top-k", type=int, default=0, help="top_k for requests that give none (default 0 = off)")
    s.add_argument("--top-p", type=float, default=1.0, help="top_p for requests that give none (default 1 = off)")
    s.add_argument("--min-p", type=float, default=0.0, help="min_p for requests that give none (default 0 = off)")
    s.add_argument("--no-think", action="store_true",
                   help="chat requests that do not set chat_template_kwargs.enable_thinking get it false")
    s.add_argument("--special-in-user-text", action="store_true",
                   help="parse control tokens (<|im_start|> ...) written in chat messages and tools, as servers "
                        "once did: a user can then open a turn of any role. Default: they are text")
    s.add_argument("--read-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a request's head, and then its body, must each arrive within SECONDS; else 408 and the "
                        "connection is closed (default 30)")
    s.add_argument("--cache-ram", type=_size, default=2 << 30, metavar="BYTES",
                   help="RAM for the prefix cache shared by all requests; 0 turns it off (default 2G)")
    s.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="also keep prefix snapshots on disk in DIR (write-through; reused after a restart)")
    s.add_argument("--cache-disk", type=_size, default=None, metavar="BYTES",
                   help="disk budget of --cache-dir: the most recently used snapshots stay, each with the pages "
                        "it needs (default: unbounded)")
    s.add_argument("--mmproj", default=None, metavar="FILE",
                   help="the model's vision projector (llama.cpp's mmproj GGUF): chat messages may then hold "
                        "image_url parts with data: URLs (raise --max-body for large images)")
    s.add_argument("--allow-file-images", dest="image_dir", default=None, metavar="DIR",
                   help="also accept file:// image URLs of files under DIR (default: refused; no URL is ever "
                        "fetched from the network)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default info: one line per request)")
    s.set_defaults(func=cmd_serve)
    return s


def _slots(engine) -> SlotPlan:
    batched, avail = batched_decode_mode(engine).startswith("batched"), None
    if batched and getattr(engine, "gpu", None) is not None and engine.model is engine.gpu:   # states in VRAM
        st = gpu.mem_stats()
        avail = max(0, st["budget"] - st["used"]) if st["budget"] > 0 else st["free_bytes"]
    return serve_slots(engine.model.hparams, engine.n_ctx, batched, available=avail)


def build_server(args):
    """(app, worker) from parsed `serve` flags: loads the model and makes the cache."""
    defaults = SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    defaults.validate()
    engine = Engine(args.model, **engine_kwargs(args))
    cache = None
    if args.cache_ram > 0 or args.cache_dir:
        cache = PrefixCache.for_model(engine.model, ram_bytes=args.cache_ram, disk_dir=args.cache_dir,
                                      disk_bytes=args.cache_disk)
    worker = Worker(engine, cache=cache, max_queue=args.max_queue, parallel=args.parallel or _slots(engine).n)
    name = args.alias or os.path.basename(args.model).removesuffix(".gguf")
    cfg = ServeConfig(model_id=name, api_key=args.api_key or None, max_body=args.max_body,
                      max_tokens=args.max_tokens, defaults=defaults, enable_thinking=not args.no_think,
                      host=args.host, port=args.port, allow_origins=tuple(args.allow_origin),
                      read_timeout=args.read_timeout, special_in_user_text=args.special_in_user_text,
                      image_dir=args.image_dir)
    return create_app(worker, cfg), worker


def cmd_serve(args) -> int:
    try:  # the web stack is optional (SERVE_DEPS): said before anything loads
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UnavailableError(f"`serve` needs starlette and uvicorn: pip install {SERVE_DEPS}") from e
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"legacy-engine serve: warning: listening on {args.host} without --api-key: anyone who can reach "
              f"this port can use the model", file=sys.stderr)
    if args.gpu:
        check_gpu()                                 # no GPU, or a port in use: said before the model loads
    sock = listen_socket(args.host, args.port)
    try:
        app, worker = build_server(args)
    except BaseException:
        sock.close()
        raise
    model_id = app.state.api.cfg.model_id
    print(f"legacy-engine serve: {model_id} (context {worker.engine.n_ctx}, cache "
          f"{'on' if worker.cache is not None else 'off'}) at http://{args.host}:{args.port}/v1", file=sys.stderr)
    why = "--parallel" if args.parallel else f"the planner: {_slots(worker.engine).why}"
    print(f"legacy-engine serve: {worker.parallel} slot(s) ({why}); decode {batched_decode_mode(worker.engine)}",
          file=sys.stderr)
    config = uvicorn_config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    try:
        stopping_server(config, worker).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it shut down on: that is the normal way to stop
        print("legacy-engine serve: stopped", file=sys.stderr)
    finally:
        worker.close()
    return 0
