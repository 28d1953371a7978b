"""`legacy-engine bench serve --long-prompt N`: what a short request waits while a long prompt prefills (issue 24's
TTFT target), ours beside llama-server; tools/bench_serve.py's docstring says what is measured."""
from __future__ import annotations

import os
import random
import secrets
import tempfile
import threading
import time

from ..format.gguf_file import GGUFFile
from ..format.tokenizer import Tokenizer
from .bench_serve import (LoadConfig, Request, _f, _pcts, _q, engines, header, one_token_words, redacted,
                          run_request, serving)

LONG_HEAD_START_S = 1.0   # the long request is admitted and prefilling before the probes start
PROBE = dict(words=32, max_tokens=4)
PROBE_GAP_S = 0.5         # each loaded probe waits uniform [0, this) first: longer than our forward calls (~0.2 s)
WARM_PROBES = 4           # probe-sized requests run and dropped before the idle ones: a server's first requests
                          # run slower (822, 497, 367, 325, 304 ms in a row on the 2-core box); idle is the steady state


def bench_long_prompt(cfg: LoadConfig, long_len: int, probes: int, log=print) -> dict:
    """Short requests' TTFT idle and while a long prompt prefills (the module docstring), per engine."""
    cfg.check(load=False)
    if long_len < 1 or probes < 1:
        raise ValueError(f"--long-prompt and --probes must be >= 1, got {long_len} and {probes}")
    if long_len + 8 > cfg.ctx:
        raise ValueError(f"--long-prompt {long_len} does not fit --ctx {cfg.ctx}; raise --ctx")
    words = one_token_words(Tokenizer.from_metadata(GGUFFile(cfg.model).metadata))
    rng = random.Random(cfg.seed + 1)

    def text(n: int) -> str:
        return "".join(" " + rng.choice(words) for _ in range(n))

    long_req = Request(-1, text(long_len), long_len, 4, False, cfg.seed)
    idle_reqs = [Request(i, text(PROBE["words"]), PROBE["words"], PROBE["max_tokens"], False, i) for i in range(probes)]
    busy_reqs = [Request(i, text(PROBE["words"]), PROBE["words"], PROBE["max_tokens"], False, i) for i in range(probes)]
    warm_reqs = [Request(-2 - i, text(PROBE["words"]), PROBE["words"], PROBE["max_tokens"], False, i)
                 for i in range(WARM_PROBES)]
    gaps = [rng.uniform(0.0, PROBE_GAP_S) for _ in range(probes)]    # the same pauses for every engine
    api_key = secrets.token_hex(16)
    engine_list, binary = engines(cfg, api_key)
    res = dict(config=dict(model=cfg.model, long_prompt=long_len, probes=probes, probe=PROBE, parallel=cfg.slots,
                           threads=cfg.n_threads, ctx=cfg.ctx, head_start_s=LONG_HEAD_START_S,
                           probe_gaps_s=gaps),
               **header(binary), runs=[])
    with tempfile.TemporaryDirectory(prefix="le-bench-serve-") as logs:
        for name, command in engine_list:
            with serving(name, command, logs, api_key, words, log, "bench serve --long-prompt") as (srv, port, cmd):
                warm = [run_request(port, r, api_key) for r in warm_reqs]
                idle = [run_request(port, r, api_key) for r in idle_reqs]
                box: dict = {}
                t0 = time.perf_counter()
                th = threading.Thread(target=lambda: box.update(rec=run_request(port, long_req, api_key)), daemon=True)
                th.start()
                time.sleep(LONG_HEAD_START_S)
                busy = []
                for r, gap in zip(busy_reqs, gaps):
                    time.sleep(gap)
                    rec = run_request(port, r, api_key)
                    rec["sent_after_s"] = rec["t_send"] - t0
                    busy.append(rec)
                th.join()
                code = srv.stop()
            long_rec = box.get("rec", {})
            long_ttft = long_rec.get("ttft_s")
            during = [r["ttft_s"] for r in busy if not r["error"] and r["ttft_s"] is not None
                      and (long_ttft is None or r["sent_after_s"] < long_ttft)]
            idle_t = [r["ttft_s"] for r in idle if not r["error"] and r["ttft_s"] is not None]
            run = dict(engine=name, command=redacted(cmd), server_exit=code, idle_ttft_ms=_pcts(idle_t),
                       during_ttft_ms=_pcts(during), n_during=len(during), long_ttft_s=long_ttft,
                       long_error=long_rec.get("error"), errors=sum(1 for r in idle + busy if r["error"]),
                       records=dict(warm=warm, idle=idle, busy=busy, long=long_rec))
            run["ratio_p95_during_p50_idle"] = _q(run["during_ttft_ms"]["p95"], run["idle_ttft_ms"]["p50"])
            log(f"bench serve --long-prompt: {name}: idle TTFT p50 {_f(run['idle_ttft_ms']['p50'], '.0f')} ms, "
                f"during p95 {_f(run['during_ttft_ms']['p95'], '.0f')} ms ({len(during)} probes), long TTFT "
                f"{_f(long_ttft, '.1f')} s")
            res["runs"].append(run)
    return res


def long_table(res: dict) -> str:
    c = res["config"]
    lines = [f"{os.path.basename(c['model'])}: short requests ({c['probe']['words']}-token prompts, "
             f"{c['probe']['max_tokens']} tokens out) idle and while a {c['long_prompt']}-token prompt prefills; "
             f"--parallel {c['parallel']}, {c['threads']} threads; {res['machine']['cpu']}, "
             f"{res['machine']['cores']} cores",
             "engine  idle TTFT p50 / p95 ms  during p50 / p95 ms (probes)  p95 during / p50 idle  long TTFT s"]
    for r in res["runs"]:
        i, d = r["idle_ttft_ms"], r["during_ttft_ms"]
        lines.append(f"{r['engine']:<9} {_f(i['p50'], '.0f')} / {_f(i['p95'], '.0f')}  "
                     f"{_f(d['p50'], '.0f')} / {_f(d['p95'], '.0f')} ({r['n_during']})  "
                     f"x{_f(r['ratio_p95_during_p50_idle'], '.2f')}  {_f(r['long_ttft_s'], '.1f')}")
    return "\n".join(lines)
