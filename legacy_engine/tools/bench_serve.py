"""`legacy-engine bench serve`: our server under a load of concurrent streamed requests, beside llama.cpp's
llama-server on the same file (issue 24).

    legacy-engine bench serve MODEL.gguf [--clients 1,8] [--requests 24] [--prompt-len uniform:64-256]
                                         [--max-tokens fixed:64] [--shared-prefix 0.5] [--prefix-len 256]
                                         [--parallel N] [--threads T] [--ctx 4096] [--seed 0] [--llama [PATH]]
                                         [--json FILE]
    legacy-engine bench serve --build-llama-server      (tools/llama_server.py: llama-server from source)

The servers, each a child process started afresh for every --clients count (so no run inherits another's prefix
cache; at each count ours, then llama-server's), polled on /health until ready, sent one short warm-up request,
loaded, then stopped (SIGTERM):
  ours        python -m legacy_engine serve MODEL --port P --parallel N --threads T --ctx C --api-key K
  llama.cpp   llama-server -m MODEL --parallel N -t T -c C·N --port P --api-key K
              (llama-server splits -c between its slots: each gets C tokens, as each of ours does)

The load: R requests, fixed by --seed whatever the engine or client count, sent by C clients in a closed loop (a
client sends its next request when its last one has ended). Each is a streamed /v1/completions request: a text
prompt, temperature 0, max_tokens from --max-tokens, stream_options.include_usage. Prompts are words that are one
token each in the model's vocabulary (checked with its tokenizer), so a prompt of --prompt-len n is n tokens for
both servers; a fraction --shared-prefix of the requests (seeded) start with one common system prompt of
--prefix-len tokens before their own n (it exercises the prefix caches). The weights of a made model are random,
so a generation rarely ends early at an end-of-text token; nothing forces it to go on (`ignore_eos` is not
OpenAI's), and tok/s counts the completion tokens each server reports in its usage (the streamed chunks when a
server reports none).

Per request: TTFT (send → the first chunk with text), the gaps between text chunks (inter-token latency: each
chunk is one token for both servers, except where a token ends inside a UTF-8 character and its text waits for
the next; chunks/token in the table shows how close), the end-to-end time, the tokens. Per run: output tok/s and
requests/s over the run's wall time (the first send to the last answer), TTFT and ITL p50/p95/p99 (linear
interpolation between order statistics), TPOT (a request's decode time per token after its first, the mean). The
JSON keeps every request's record and the 1-minute load average before and after each run (a busy machine shows).

`--long-prompt N` measures instead what a short request waits while a long prompt prefills (issue 24's TTFT
target): per engine, one fresh server; K short requests (--probes, 32-token prompts, 4 tokens out) one after
another on the idle server, then one request with an N-token prompt and, LONG_HEAD_START_S after it was sent, K
other short requests one after another while it runs, each after a seeded pause of 0 to PROBE_GAP_S (a request
arrives at a moment of its own, not in step with the server: sent back to back, each would arrive just after the
decode step that ended the one before, i.e. just as the long prompt's next forward call starts, its worst case). Reported: the short requests' TTFT idle (p50, p95) and
during the long prefill (p50, p95, counting only those sent before the long request's first token), the ratio
p95 during / p50 idle, and the long request's own TTFT. The texts differ between the idle and the loaded probes
(no prefix-cache hit between them).
"""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import platform
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Iterable, Iterator

from .. import __version__
from ..core.errors import EngineError
from ..format.gguf_file import GGUFFile
from ..format.tokenizer import Tokenizer
from .llama_server import find_llama_server

START_TIMEOUT_S = 900.0     # a server's load, until /health answers 200
REQUEST_TIMEOUT_S = 900.0   # the longest wait for one read of a streamed answer
STOP_TIMEOUT_S = 30.0       # SIGTERM, then SIGKILL
WARMUP = dict(words=8, max_tokens=4)
PERCENTILES = (50, 95, 99)


# ---- distributions -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Dist:
    """A length distribution: "fixed:N" (always N) or "uniform:A-B" (integers A..B, both included, seeded)."""
    lo: int
    hi: int

    def sample(self, rng: random.Random) -> int:
        return self.lo if self.lo == self.hi else rng.randint(self.lo, self.hi)

    def __str__(self) -> str:
        return f"fixed:{self.lo}" if self.lo == self.hi else f"uniform:{self.lo}-{self.hi}"


def parse_dist(spec: str, what: str = "length") -> Dist:
    """'fixed:64' or 'uniform:64-256' -> Dist; ValueError naming `what` and the forms accepted otherwise."""
    forms = f"{what} takes fixed:N or uniform:A-B (integers >= 1, A <= B), not {spec!r}"
    m = re.fullmatch(r"\s*(fixed|uniform):\s*(\d+)(?:\s*-\s*(\d+))?\s*", spec)
    if not m or (m.group(1) == "fixed") != (m.group(3) is None):
        raise ValueError(forms)
    lo = int(m.group(2))
    hi = int(m.group(3)) if m.group(3) is not None else lo
    if lo < 1 or hi < lo:
        raise ValueError(forms)
    return Dist(lo, hi)


# ---- statistics --------------------------------------------------------------------------------------------------

def percentile(values: Iterable[float], p: float) -> float | None:
    """The p-th percentile (0..100), linear between the order statistics (numpy's default); None when empty."""
    xs = sorted(values)
    if not xs:
        return None
    if not 0 <= p <= 100:
        raise ValueError(f"percentile takes p in [0, 100], got {p}")
    k = (len(xs) - 1) * p / 100
    i = int(k)
    return xs[i] if i + 1 >= len(xs) else xs[i] + (xs[i + 1] - xs[i]) * (k - i)


def _pcts(values: list[float], scale: float = 1e3) -> dict:
    return {f"p{p}": (None if (v := percentile(values, p)) is None else v * scale) for p in PERCENTILES}


# ---- server-sent events ------------------------------------------------------------------------------------------

def sse_data(lines: Iterable[bytes]) -> Iterator[str]:
    """The data of each event of a text/event-stream, given its lines (bytes, with or without line ends): "data:"
    lines joined by newlines, an event ending at a blank line (or the stream's end); comments (":...") and other
    fields skipped. Stops after "[DONE]" (OpenAI's end of stream), which is not yielded."""
    data: list[str] = []
    for raw in lines:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                text = "\n".join(data)
                data = []
                if text == "[DONE]":
                    return
                yield text
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data and (text := "\n".join(data)) != "[DONE]":
        yield text


# ---- the requests ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LoadConfig:
    """Everything a `bench serve` run depends on (the module docstring says what each does)."""
    model: str
    clients: tuple[int, ...] = (1, 8)
    requests: int = 24
    prompt_len: Dist = Dist(64, 256)
    max_tokens: Dist = Dist(64, 64)
    shared_prefix: float = 0.5
    prefix_len: int = 256
    parallel: int | None = None        # None: the largest client count
    threads: int | None = None         # None: every core
    ctx: int = 4096
    seed: int = 0
    llama: str | None = None           # None: ours only; "": llama-server found (llama_server.find_llama_server)

    @property
    def slots(self) -> int:
        return self.parallel or max(self.clients)

    @property
    def n_threads(self) -> int:
        return self.threads or os.cpu_count() or 1

    def check(self, load: bool = True) -> None:
        """ValueError naming the flag; load=False: only what --long-prompt uses (not the load's distributions)."""
        if not self.clients or min(self.clients) < 1:
            raise ValueError(f"--clients takes counts >= 1, got {self.clients}")
        for name, v in (("--requests", self.requests), ("--prefix-len", self.prefix_len), ("--ctx", self.ctx),
                        ("--parallel", self.slots), ("--threads", self.n_threads)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if not load:
            return
        if not 0.0 <= self.shared_prefix <= 1.0:
            raise ValueError(f"--shared-prefix is a fraction of the requests in [0, 1], got {self.shared_prefix}")
        longest = (self.prefix_len if self.shared_prefix > 0 else 0) + self.prompt_len.hi + self.max_tokens.hi
        if longest > self.ctx:
            raise ValueError(f"the longest request ({longest} tokens: prefix + prompt + answer) does not fit "
                             f"--ctx {self.ctx}; raise --ctx or shorten the distributions")


@dataclass(frozen=True)
class Request:
    index: int
    prompt: str
    prompt_tokens: int      # as built: one token per word
    max_tokens: int
    shared: bool            # starts with the common system prompt
    seed: int


def one_token_words(tok: Tokenizer, limit: int = 2000) -> list[str]:
    """Lower-case words w (3-9 letters) whose " w" is one token of this vocabulary (encoded to check), in id
    order: text made of them is exactly one token per word for any tokenizer of the same vocabulary."""
    words = []
    for i, t in enumerate(tok.tokens):
        if re.fullmatch("\u0120[a-z]{3,9}", t) and tok.encode(" " + t[1:], special=False, add_bos=False) == [i]:
            words.append(t[1:])
            if len(words) == limit:
                break
    if len(words) < 100:
        raise EngineError(f"this vocabulary has only {len(words)} one-token words; bench serve builds its prompts "
                          f"from them and needs 100")
    return words


def make_requests(words: list[str], cfg: LoadConfig) -> list[Request]:
    """The run's requests, fixed by cfg.seed (the same for every engine and client count)."""
    rng = random.Random(cfg.seed)

    def text(n: int) -> str:
        return "".join(" " + rng.choice(words) for _ in range(n))

    system = text(cfg.prefix_len)
    out = []
    for i in range(cfg.requests):
        n, mt, shared = cfg.prompt_len.sample(rng), cfg.max_tokens.sample(rng), rng.random() < cfg.shared_prefix
        body = text(n)
        out.append(Request(i, system + body if shared else body, n + (cfg.prefix_len if shared else 0), mt,
                           shared, cfg.seed * 100_003 + i))
    return out


# ---- one streamed request ----------------------------------------------------------------------------------------

def _body(req: Request) -> bytes:
    return json.dumps({"prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0, "seed": req.seed,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()


def run_request(port: int, req: Request, api_key: str) -> dict:
    """Sends req to the server on this port (127.0.0.1) and reads its stream: a record with the times (seconds,
    from before the connection is made), the tokens and the usage, or with "error" set. One connection per request:
    llama-server's closes a kept-alive connection between streamed answers, and a new one on the loopback costs
    well under a millisecond."""
    rec = dict(index=req.index, shared=req.shared, prompt_tokens_sent=req.prompt_tokens, max_tokens=req.max_tokens,
               error=None, ttft_s=None, e2e_s=None, itl_s=[], chunks=0, completion_tokens=None, prompt_tokens=None,
               cached_tokens=None, finish_reason=None, text="")
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"}
    t0 = time.perf_counter()
    rec["t_send"] = t0
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request("POST", "/v1/completions", _body(req), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            rec["error"] = f"HTTP {resp.status}: {resp.read()[:300].decode('utf-8', 'replace')}"
            return rec
        last = None
        pieces = []
        for data in sse_data(resp):
            now = time.perf_counter()
            obj = json.loads(data)
            if "error" in obj:
                rec["error"] = f"error event: {json.dumps(obj['error'])[:300]}"
                break
            for ch in obj.get("choices") or ():
                if ch.get("text"):
                    pieces.append(ch["text"])
                    rec["chunks"] += 1
                    if last is None:
                        rec["ttft_s"] = now - t0
                    else:
                        rec["itl_s"].append(now - last)
                    last = now
                if ch.get("finish_reason"):
                    rec["finish_reason"] = ch["finish_reason"]
            if usage := obj.get("usage"):
                rec["completion_tokens"] = usage.get("completion_tokens")
                rec["prompt_tokens"] = usage.get("prompt_tokens")
                rec["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        resp.read()                                     # the rest of the body
        rec["e2e_s"] = time.perf_counter() - t0
        rec["t_last"] = last
        rec["text"] = "".join(pieces)
        if rec["completion_tokens"] is None and rec["error"] is None:
            rec["completion_tokens"], rec["tokens_from"] = rec["chunks"], "chunks"
    except (OSError, http.client.HTTPException, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return rec


def run_load(port: int, api_key: str, requests: list[Request], clients: int) -> tuple[list[dict], float]:
    """The requests from `clients` closed-loop clients (threads): (records in request order, wall seconds)."""
    todo = iter(requests)
    lock = threading.Lock()
    records: list[dict] = []
    start = threading.Barrier(clients + 1)

    def client() -> None:
        start.wait()
        while True:
            with lock:
                req = next(todo, None)
            if req is None:
                break
            rec = run_request(port, req, api_key)
            with lock:
                records.append(rec)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    ends = [r["t_send"] + r["e2e_s"] for r in records if r["e2e_s"] is not None]
    wall = (max(ends) if ends else time.perf_counter()) - t0
    for r in records:
        r["t_send"] -= t0
        if r.get("t_last") is not None:
            r["t_last"] -= t0
    return sorted(records, key=lambda r: r["index"]), wall


def summarize(records: list[dict], wall_s: float) -> dict:
    """A run's aggregate numbers (milliseconds for latencies)."""
    ok = [r for r in records if not r["error"]]
    tokens = sum(r["completion_tokens"] or 0 for r in ok)
    chunks = sum(r["chunks"] for r in ok)
    tpot = [(r["e2e_s"] - r["ttft_s"]) / (r["completion_tokens"] - 1) for r in ok
            if r["ttft_s"] is not None and (r["completion_tokens"] or 0) > 1]
    ttft_shared = [r["ttft_s"] for r in ok if r["shared"] and r["ttft_s"] is not None]
    ttft_other = [r["ttft_s"] for r in ok if not r["shared"] and r["ttft_s"] is not None]
    return dict(
        requests=len(records), errors=len(records) - len(ok), wall_s=wall_s,
        completion_tokens=tokens, prompt_tokens=sum(r["prompt_tokens"] or r["prompt_tokens_sent"] for r in ok),
        cached_tokens=sum(r["cached_tokens"] or 0 for r in ok),
        output_tok_s=tokens / wall_s if wall_s > 0 else None,
        requests_s=len(ok) / wall_s if wall_s > 0 else None,
        ttft_ms=_pcts([r["ttft_s"] for r in ok if r["ttft_s"] is not None]),
        ttft_shared_ms=_pcts(ttft_shared), ttft_other_ms=_pcts(ttft_other),
        itl_ms=_pcts([g for r in ok for g in r["itl_s"]]),
        tpot_ms_mean=sum(tpot) / len(tpot) * 1e3 if tpot else None,
        e2e_ms=_pcts([r["e2e_s"] for r in ok]),
        chunks_per_token=chunks / tokens if tokens else None,
        tokens_from="usage" if all("tokens_from" not in r for r in ok) else "chunks (a server sent no usage)")


# ---- the servers -------------------------------------------------------------------------------------------------

def redacted(cmd: list[str]) -> list[str]:
    """cmd with the value of --api-key shown as KEY (logs and the JSON)."""
    return [("KEY" if i > 0 and cmd[i - 1] == "--api-key" else c) for i, c in enumerate(cmd)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def our_command(cfg: LoadConfig, port: int, api_key: str) -> list[str]:
    return [sys.executable, "-m", "legacy_engine", "serve", cfg.model, "--port", str(port), "--parallel",
            str(cfg.slots), "--threads", str(cfg.n_threads), "--ctx", str(cfg.ctx), "--api-key", api_key,
            "--log-level", "warning"]


def llama_command(binary: str, cfg: LoadConfig, port: int, api_key: str) -> list[str]:
    return [binary, "-m", cfg.model, "--parallel", str(cfg.slots), "-t", str(cfg.n_threads), "-c",
            str(cfg.ctx * cfg.slots), "--host", "127.0.0.1", "--port", str(port), "--api-key", api_key]


class ServerProcess:
    """A server child process, its output in a log file; `with` starts it and waits for /health, and stops it."""

    def __init__(self, name: str, cmd: list[str], port: int, log_dir: str):
        self.name, self.cmd, self.port = name, cmd, port
        self.log_path = os.path.join(log_dir, f"{name.replace(' ', '_').replace('.', '')}-{port}.log")
        self.proc: subprocess.Popen | None = None
        self.load_s: float | None = None

    def log_tail(self, n: int = 3000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def __enter__(self) -> "ServerProcess":
        t0 = time.perf_counter()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            while True:
                if self.proc.poll() is not None:
                    raise EngineError(f"{self.name} exited ({self.proc.returncode}) before it was ready: "
                                      f"{' '.join(redacted(self.cmd))}\n{self.log_tail()}")
                if time.perf_counter() - t0 > START_TIMEOUT_S:
                    raise EngineError(f"{self.name} was not ready after {START_TIMEOUT_S:.0f} s; see "
                                      f"{self.log_path}")
                if self._healthy():
                    break
                time.sleep(0.25)
        except BaseException:
            self.stop()
            raise
        self.load_s = time.perf_counter() - t0
        return self

    def _healthy(self) -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", "/health")
            r = conn.getresponse()
            r.read()
            return r.status == 200
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __exit__(self, *exc) -> None:
        self.stop()


def _warm_up(port: int, api_key: str, words: list[str]) -> None:
    req = Request(-1, "".join(" " + w for w in words[-WARMUP["words"]:]), WARMUP["words"], WARMUP["max_tokens"],
                  False, 0)
    rec = run_request(port, req, api_key)
    if rec["error"]:
        raise EngineError(f"the warm-up request failed: {rec['error']}")


def _llama_version(binary: str) -> str:
    try:
        r = subprocess.run([binary, "--version"], capture_output=True, encoding="utf-8", errors="replace",
                           timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith(("version", "built with"))]
    return "; ".join(lines) or "unknown"


def _our_banner(server: ServerProcess) -> str:
    return "; ".join(ln.removeprefix("legacy-engine serve: ") for ln in server.log_tail(20000).splitlines()
                     if "slot(s)" in ln)


# ---- the benchmark -----------------------------------------------------------------------------------------------

def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def engines(cfg: LoadConfig, api_key: str) -> tuple[list[tuple[str, object]], str | None]:
    """([(name, port -> command)], llama-server's path or None): ours, then llama-server where cfg.llama is set."""
    binary = find_llama_server(cfg.llama or None) if cfg.llama is not None else None
    out = [("ours", lambda port: our_command(cfg, port, api_key))]
    if binary:
        out.append(("llama.cpp", lambda port: llama_command(binary, cfg, port, api_key)))
    return out, binary


def header(binary: str | None) -> dict:
    """The machine and the versions, for a result dict."""
    return dict(machine=dict(cpu=_cpu_name(), cores=os.cpu_count(), python=platform.python_version()),
                versions=dict(legacy_engine=__version__, llama_server=_llama_version(binary) if binary else None))


@contextlib.contextmanager
def serving(name: str, command, logs: str, api_key: str, words: list[str], log, what: str):
    """One engine's server on a free port, started and warmed up: yields (server, port, command)."""
    port = free_port()
    cmd = command(port)
    log(f"{what}: {name}: starting {' '.join(redacted(cmd))}")
    with ServerProcess(name, cmd, port, logs) as srv:
        _warm_up(port, api_key, words)
        yield srv, port, cmd


def bench_serve(cfg: LoadConfig, log=print) -> dict:
    """Runs the load (the module docstring) against ours and, with cfg.llama set, llama-server; the result dict."""
    cfg.check()
    tok = Tokenizer.from_metadata(GGUFFile(cfg.model).metadata)
    words = one_token_words(tok)
    requests = make_requests(words, cfg)
    api_key = secrets.token_hex(16)
    engine_list, binary = engines(cfg, api_key)
    res = dict(config=dict(asdict(cfg), prompt_len=str(cfg.prompt_len), max_tokens=str(cfg.max_tokens),
                           parallel=cfg.slots, threads=cfg.n_threads),
               **header(binary),
               requests=[dict(index=r.index, prompt_tokens=r.prompt_tokens, max_tokens=r.max_tokens,
                              shared=r.shared) for r in requests],
               runs=[], notes=[])
    with tempfile.TemporaryDirectory(prefix="le-bench-serve-") as logs:
        for clients in cfg.clients:                     # the engines side by side in time: a busy machine's
            for name, command in engine_list:           # other work weighs on both alike
                with serving(name, command, logs, api_key, words, log, f"bench serve, {clients} client(s)") as (
                        srv, port, cmd):
                    log(f"bench serve: {name} ready in {srv.load_s:.1f} s; {len(requests)} requests ...")
                    load_before = os.getloadavg()
                    records, wall = run_load(port, api_key, requests, clients)
                    load_after = os.getloadavg()
                    banner = _our_banner(srv) if name == "ours" else None
                    code = srv.stop()
                s = summarize(records, wall)
                log(f"bench serve: {name}, {clients} client(s): {_f(s['output_tok_s'], '.2f')} tok/s, "
                    f"{s['errors']} error(s), exit {code}")
                res["runs"].append(dict(engine=name, clients=clients, load_s=srv.load_s, server_exit=code,
                                        loadavg_1m=(load_before[0], load_after[0]),
                                        command=redacted(cmd), banner=banner,
                                        summary=s, records=records))
    res["ratios"] = ratios(res["runs"])
    return res


def _q(a, b):
    return a / b if a is not None and b else None


def ratios(runs: list[dict]) -> list[dict]:
    """ours / llama.cpp per client count: tok/s and req/s (> 1: ours faster), TTFT and ITL p50 (< 1: ours
    faster)."""
    out = []
    by = {(r["engine"], r["clients"]): r["summary"] for r in runs}
    for (engine, clients), ours in by.items():
        theirs = by.get(("llama.cpp", clients))
        if engine != "ours" or theirs is None:
            continue
        out.append(dict(clients=clients, output_tok_s=_q(ours["output_tok_s"], theirs["output_tok_s"]),
                        requests_s=_q(ours["requests_s"], theirs["requests_s"]),
                        ttft_p50=_q(ours["ttft_ms"]["p50"], theirs["ttft_ms"]["p50"]),
                        itl_p50=_q(ours["itl_ms"]["p50"], theirs["itl_ms"]["p50"])))
    return out


def _f(v, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def table(res: dict) -> str:
    """The result as text: one row per (engine, clients), then the ratios."""
    c = res["config"]
    head = (f"{os.path.basename(c['model'])}: {c['requests']} requests, prompt {c['prompt_len']} tokens (a "
            f"{c['prefix_len']}-token system prompt before it on {c['shared_prefix']:.0%}), max_tokens "
            f"{c['max_tokens']}, --parallel {c['parallel']}, {c['threads']} threads, ctx {c['ctx']}/slot; "
            f"{res['machine']['cpu']}, {res['machine']['cores']} cores")
    cols = ("engine", "clients", "tok/s", "req/s", "TTFT p50", "p95", "p99", "ITL p50", "p95", "p99",
            "TPOT", "tokens", "chunks/tok", "cached", "err")
    rows = []
    for r in res["runs"]:
        s = r["summary"]
        rows.append((r["engine"], str(r["clients"]), _f(s["output_tok_s"], ".2f"), _f(s["requests_s"], ".3f"),
                     *(_f(s["ttft_ms"][f"p{p}"], ".0f") for p in PERCENTILES),
                     *(_f(s["itl_ms"][f"p{p}"], ".0f") for p in PERCENTILES),
                     _f(s["tpot_ms_mean"], ".0f"), str(s["completion_tokens"]), _f(s["chunks_per_token"], ".2f"),
                     f"{s['cached_tokens'] / max(s['prompt_tokens'], 1):.0%}", str(s["errors"])))
    widths = [max(len(x) for x in col) for col in zip(cols, *rows)]
    lines = [head, "latencies in ms; cached: the prompt tokens the server reported taken from its cache",
             "  ".join(h.rjust(w) for h, w in zip(cols, widths))]
    lines += ["  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in rows]
    for q in res["ratios"]:
        lines.append(f"ours/llama.cpp at {q['clients']} client(s): tok/s x{_f(q['output_tok_s'], '.2f')}, "
                     f"req/s x{_f(q['requests_s'], '.2f')}, TTFT p50 x{_f(q['ttft_p50'], '.2f')}, "
                     f"ITL p50 x{_f(q['itl_p50'], '.2f')}")
    for r in res["runs"]:
        if r.get("banner"):
            lines.append(f"ours at {r['clients']} client(s): {r['banner']}")
            break
    return "\n".join(lines)
