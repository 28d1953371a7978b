"""`legacy-engine bench`: measurements the issues ask for, run from one command.

    legacy-engine bench cache MODEL.gguf [--lengths 947 4096] [--threads N] [--disk DIR] [--json]

bench cache — the prefix cache (legacy_engine/cache.py): time to first token with and without reused prefixes.

Per prompt length L (synthetic seeded ids), with a fresh PrefixCache (grid 256, pages of 64 tokens):
  plain     Session.prefill of the L tokens, no cache (the baseline)
  cold      cache.prefill of the L tokens, nothing cached (baseline + snapshot capture)
  repeat    the same L tokens again (an exact repeat: restores the end-of-prompt entry, runs nothing)
  follow    L + 50 appended tokens (a follow-up turn)
  shared    the first 900 tokens, then L - 900 other tokens (restores the largest snapshot <= 900)
  capture   the part of `cold` spent taking snapshots and pages (and writing them with --disk)
  restore   the restore part of `repeat`: recurrent state + KV pages written into the session (+ from disk
            with --disk: a new PrefixCache on the same directory, as after a restart)
and the sizes: bytes of one snapshot (all GDN layers), KV bytes per token (all attention layers), and the RAM the
cache holds per cached token after the L-token prompt. TTFT = the prefill call that returns the first logits
(sampling excluded). Every cached answer is checked against the plain one (np.array_equal).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

from .cache import PrefixCache, Sizes, model_fingerprint
from .generate import Engine

SHARED = 900
APPEND = 50


def _ids(seed: int, n: int, n_vocab: int) -> list[int]:
    return np.random.default_rng([7, seed, n]).integers(0, min(n_vocab, 150_000), n).tolist()


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def bench_cache(model_path: str, lengths=(947, 4096), n_threads: int | None = None, grid: int = 256,
                page: int = 64, disk_dir: str | None = None, log=None) -> dict:
    """Runs the measurements of the module docstring; returns {"model", "threads", "L<n>": {...}, ...}.
    Times in seconds, sizes in bytes."""
    n_ctx = max(lengths) + APPEND + page
    eng = Engine(model_path, n_threads=n_threads, n_ctx=n_ctx)
    fp = model_fingerprint(eng.model)
    sizes = Sizes.of(eng.model, page)
    out = dict(model=os.path.basename(model_path), threads=eng.model.n_threads, grid=grid, page=page,
               snapshot_bytes=sizes.snapshot, kv_bytes_per_token=sizes.page // page)
    n_vocab = eng.model.hparams.n_vocab
    eng.session().prefill(_ids(0, page, n_vocab))  # warm-up: fault the mapped weights in before timing
    for L in lengths:
        ids = _ids(1, L, n_vocab)
        follow = ids + _ids(2, APPEND, n_vocab)
        shared = ids[:SHARED] + _ids(3, L - SHARED, n_vocab) if L > SHARED else None
        r: dict = {}

        def check(name, logits, prompt):
            ref = eng.session().prefill(prompt) if prompt is not ids else plain_logits
            r[f"{name}_equal"] = bool(np.array_equal(logits, ref))

        plain_logits, r["plain_s"] = _timed(eng.session().prefill, ids)
        cache, sess = PrefixCache(fp, grid=grid, page=page), eng.session()
        logits, r["cold_s"] = _timed(cache.prefill, sess, ids)
        check("cold", logits, ids)
        r["capture_s"] = cache.last["capture_s"]
        r["ram_bytes"] = cache.stats["ram_bytes"]
        r["ram_bytes_per_token"] = cache.stats["ram_bytes"] / L
        r["snapshots"], r["pages"] = cache.stats["snapshots"], cache.stats["pages"]
        logits, r["repeat_s"] = _timed(cache.prefill, sess, ids)
        check("repeat", logits, ids)
        r["repeat_reused"], r["restore_s"] = cache.last["reused"], cache.last["restore_s"]
        logits, r["follow_s"] = _timed(cache.prefill, sess, follow)
        r["follow_reused"] = cache.last["reused"]
        check("follow", logits, follow)
        if shared is not None:
            logits, r["shared_s"] = _timed(cache.prefill, sess, shared)
            r["shared_reused"] = cache.last["reused"]
            check("shared", logits, shared)
        if disk_dir is not None:
            with tempfile.TemporaryDirectory(dir=disk_dir) as d:
                writer = PrefixCache(fp, grid=grid, page=page, disk_dir=d)
                _, r["cold_disk_s"] = _timed(writer.prefill, eng.session(), ids)
                r["capture_disk_s"] = writer.last["capture_s"]
                r["disk_bytes"] = writer.stats["disk_bytes"]
                reader = PrefixCache(fp, grid=grid, page=page, disk_dir=d)   # as after a restart
                logits, r["repeat_disk_s"] = _timed(reader.prefill, eng.session(), ids)
                r["restore_disk_s"] = reader.last["restore_s"]
                check("repeat_disk", logits, ids)
        out[f"L{L}"] = r
        if log:
            log(f"L={L}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    return out


def main(argv=None) -> int:
    top = argparse.ArgumentParser(prog="legacy-engine bench", description=__doc__.split("\n\n")[0])
    sub = top.add_subparsers(dest="what", required=True, metavar="WHAT")
    ap = sub.add_parser("cache", help="time to first token with the prefix cache (cold, repeat, follow-up, shared)")
    ap.add_argument("model", help="a Qwen3.5/3.6 GGUF file")
    ap.add_argument("--lengths", type=int, nargs="+", default=[947, 4096], help="prompt lengths (947 4096)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (all cores)")
    ap.add_argument("--grid", type=int, default=256, help="snapshot grid in tokens, a multiple of 64 (256)")
    ap.add_argument("--disk", metavar="DIR", default=None, help="also measure the disk tier in a temp dir under DIR")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = top.parse_args(argv)
    res = bench_cache(args.model, args.lengths, args.threads, args.grid, disk_dir=args.disk,
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
                    f"(reused {r['repeat_reused']}, restore {r['restore_s'] * 1e3:.1f} ms), +{APPEND} "
                    f"{r['follow_s']:.3f} s (reused {r['follow_reused']})")
            if "shared_s" in r:
                line += f", shared {SHARED} {r['shared_s']:.3f} s (reused {r['shared_reused']})"
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
