"""OpenAI-compatible HTTP server: `legacy-engine serve MODEL`.

    GET  /v1/models              the one model served (its id: --alias, else the file name without .gguf)
    POST /v1/chat/completions    chat through the model's own template; SSE streaming; Qwen tool calls;
                                 <think>…</think> returned as reasoning_content
    POST /v1/completions         raw text (or token ids) in, text out
    GET  /health                 {"status": "ok", …}; 503 once the worker has died
    GET  /metrics                Prometheus text: requests, tokens, prefill/decode speed, cache, queue

How a request flows. The HTTP side is starlette on uvicorn (one asyncio loop). A connection must send a whole
request head within --read-timeout of opening (or of its last answer), and its body within --read-timeout too,
at most ServeConfig.max_reading bodies at a time: 408 otherwise, so slow or silent sockets do not pile up. A
handler checks Host and Origin (ORIGIN_POLICY) and the key, reads the body (bounded by --max-body, JSON only),
then hands it to a thread: JSON parsing, validation, the chat template (rendered in a child process that is
stopped when it runs too long: chat.TemplateRenderer) and tokenization (without the GIL) never run on the loop,
so /health and every stream keep flowing. A bad request is answered 4xx; good ones enter one FIFO queue in the
order their plans are ready. One worker thread owns the model and one Session: it takes jobs in order, prefills
through a seam, `prefill(session, ids, cancel) -> logits of the last token` (a fresh prefill, or
PrefixCache.prefill, which restores the longest prefix any earlier request left in the shared cache), samples,
and sends text pieces back to the loop. A job whose client is gone is cancelled between prefill chunks or before
its next token; a job still queued is skipped. On SIGTERM (or SIGINT) the running job ends with an error (a
stream: an error event, then [DONE]) and queued ones get 503.

Control tokens (<|im_start|> …) come only from the chat template's own markup: user text (message contents, tool
calls, tools) that spells one is tokenized as text (chat.render_prompt), unless --special-in-user-text. A
/v1/completions prompt is the caller's whole prompt: its special tokens are parsed.

Errors use OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import argparse
import asyncio
import errno
import hmac
import ipaddress
import json
import os
import queue
import re
import secrets
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from ..format.chat import TemplateRaised, TemplateRenderer, render_chat
from ..core.errors import Cancelled, ContextLengthError, TemplateRenderError, UnavailableError

if TYPE_CHECKING:
    from .sampling import SamplingParams

# numpy (through .sampling) and the web stack are imported where used: `legacy-engine --help` stays instant.

SERVE_DEPS = "starlette>=0.37 uvicorn>=0.30"  # the server's only dependencies beyond the engine's
LOOPBACK = ("localhost", "127.0.0.1", "::1")
ORIGIN_POLICY = (
    "Requests must name this server in Host: localhost, 127.0.0.1, [::1], an IP address or the --host value "
    "(any port); a browser's Origin must be this server's own (http://localhost:PORT ...). So a web page cannot "
    "drive a keyless local server, neither cross-site nor by DNS rebinding: 403 otherwise. --allow-origin NAME "
    "(repeatable) adds a server name (a host, as in Host) or a web origin (scheme://host[:port], also answered "
    "with CORS headers); '*' allows any. POST bodies must be Content-Type: application/json (415 otherwise).")


# ------------------------------------------------------------------------------------------------ errors

class APIError(Exception):
    """An answer in OpenAI's error format: HTTP status + {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# ------------------------------------------------------------------------------------------------ request fields

_JSON_TYPE = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array",
              dict: "an object", type(None): "null"}
NUMBER, INTEGER = (int, float), (int,)


def _field(body: dict, name: str, kinds: tuple, default=None, ok=None, rule: str = ""):
    """body[name] checked against JSON kinds (bool is never a number) and a range; None/absent -> default."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        want = " or ".join(_JSON_TYPE[k] for k in kinds if k is not float or int not in kinds)
        raise _bad(f"'{name}' must be {want}, got {_JSON_TYPE.get(type(v), type(v).__name__)}", name,
                   "invalid_type")
    if ok is not None and not ok(v):
        raise _bad(f"'{name}' = {v!r} is out of range: it must be {rule}", name)
    return v


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _bad("'stop' must be a string or an array of strings", "stop", "invalid_type")
    if len(stop) > 16:
        raise _bad(f"'stop' holds {len(stop)} strings; at most 16 are allowed", "stop")
    return [s for s in stop if s]


def _sampling(body: dict, defaults: SamplingParams | None) -> SamplingParams:
    """OpenAI's sampling fields plus the usual local-server extensions (top_k, min_p, repetition_penalty)."""
    from .sampling import SamplingParams

    defaults = defaults or SamplingParams(temperature=1.0)
    top_k = _field(body, "top_k", INTEGER, defaults.top_k, lambda v: v >= -1, ">= 0 (0 or -1: off)")
    seed = _field(body, "seed", INTEGER)
    return SamplingParams(
        temperature=float(_field(body, "temperature", NUMBER, defaults.temperature, lambda v: 0 <= v <= 2,
                                 "in [0, 2]")),
        top_p=float(_field(body, "top_p", NUMBER, defaults.top_p, lambda v: 0 < v <= 1, "in (0, 1]")),
        top_k=max(top_k, 0),
        min_p=float(_field(body, "min_p", NUMBER, defaults.min_p, lambda v: 0 <= v <= 1, "in [0, 1]")),
        presence_penalty=float(_field(body, "presence_penalty", NUMBER, 0.0, lambda v: -2 <= v <= 2, "in [-2, 2]")),
        frequency_penalty=float(_field(body, "frequency_penalty", NUMBER, 0.0, lambda v: -2 <= v <= 2,
                                       "in [-2, 2]")),
        repetition_penalty=float(_field(body, "repetition_penalty", NUMBER, 1.0, lambda v: 0 < v <= 10,
                                        "in (0, 10]")),
        seed=None if seed is None else seed % 2**64)  # numpy seeds are unsigned


def _unsupported(body: dict, chat: bool) -> None:
    """Fields whose non-default values this server cannot honour: refused rather than ignored."""
    if _field(body, "n", INTEGER, 1) != 1:
        raise _bad("only n = 1 is supported: send one request per choice", "n", "unsupported_value")
    if chat and _field(body, "logprobs", (bool,), False) or not chat and _field(body, "logprobs", INTEGER) is not None:
        raise _bad("logprobs are not supported by this server", "logprobs", "unsupported_value")
    if _field(body, "logit_bias", (dict,), {}):
        raise _bad("logit_bias is not supported by this server", "logit_bias", "unsupported_value")
    fmt = _field(body, "response_format", (dict,))
    if fmt is not None and fmt.get("type", "text") != "text":
        raise _bad("only response_format {'type': 'text'} is supported", "response_format", "unsupported_value")
    if not chat:
        if _field(body, "echo", (bool,), False):
            raise _bad("echo is not supported by this server", "echo", "unsupported_value")
        if _field(body, "best_of", INTEGER, 1) != 1:
            raise _bad("only best_of = 1 is supported", "best_of", "unsupported_value")
        if _field(body, "suffix", (str,)):
            raise _bad("suffix (fill-in-the-middle) is not supported by this server", "suffix", "unsupported_value")


@dataclass
class ServeConfig:
    """What the HTTP side needs to know beyond the worker. Defaults are the `serve` flags' defaults."""
    model_id: str
    api_key: str | None = None
    max_body: int = 4 << 20               # bytes of request body
    max_tokens: int | None = None         # cap on (and default of) a request's max_tokens; None: the context
    defaults: SamplingParams | None = None  # for fields a request leaves out; None: OpenAI's (temperature 1)
    enable_thinking: bool = True          # for chat requests that do not set chat_template_kwargs
    host: str = "127.0.0.1"               # --host: a name requests may give in Host (ORIGIN_POLICY)
    port: int | None = None               # --port: of this server's own origin; None: any
    allow_origins: tuple = ()             # --allow-origin: more server names and web origins; '*': any
    read_timeout: float = 30.0            # seconds for a request head, and for its body
    max_reading: int = 64                 # request bodies read at once; more wait (within read_timeout)
    special_in_user_text: bool = False    # parse control tokens in user text (the old, unsafe behaviour)
    render_seconds: float = 10.0          # a chat template render that takes longer is stopped


@dataclass
class Plan:
    """A validated request, ready to queue."""
    ids: list[int]
    max_tokens: int
    params: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    thinking: bool = False               # the prompt leaves a <think> block open: output starts in reasoning
    tools: list | None = None            # parse <tool_call> output against these


def _options(body: dict, cfg: ServeConfig, chat: bool) -> dict:
    """The generation fields of a request, checked before any prompt work."""
    mt = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    stream = _field(body, "stream", (bool,), False)
    opts = _field(body, "stream_options", (dict,), {})
    return dict(max_tokens=_field(body, mt, INTEGER, None, lambda v: v >= 1, ">= 1"),
                params=_sampling(body, cfg.defaults), stop=_stop_strings(body), stream=stream,
                include_usage=stream and _field(opts, "include_usage", (bool,), False))


def _fit(ids: list[int], opts: dict, cfg: ServeConfig, n_ctx: int, param: str) -> dict:
    """opts with the prompt, its length checked and max_tokens clipped to what the context has left (generation
    then ends with "length" at the context's edge)."""
    if len(ids) >= n_ctx:
        raise APIError(400, f"the prompt is {len(ids)} tokens; this server's context is {n_ctx} tokens and must "
                            f"keep room for at least one generated token (restart it with a larger --ctx, or "
                            f"shorten the prompt)", param=param, code="context_length_exceeded")
    limits = (opts["max_tokens"], cfg.max_tokens, n_ctx - len(ids))
    return dict(opts, ids=ids, max_tokens=min(x for x in limits if x is not None))


def _check_model(body: dict, cfg: ServeConfig) -> None:
    model = _field(body, "model", (str,), cfg.model_id)
    if model != cfg.model_id:
        raise APIError(404, f"the model '{model}' does not exist here; this server serves '{cfg.model_id}' "
                            f"(GET /v1/models)", param="model", code="model_not_found")


def _check_tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise _bad("'tools' must be an array of {'type': 'function', 'function': {...}}", "tools", "invalid_type")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type", "function") != "function" or not isinstance(fn.get("name"), str):
            raise _bad(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': …, 'parameters': …}}}}",
                       "tools", "invalid_type")
        if not isinstance(fn.get("parameters", {}), dict):
            raise _bad(f"tools[{i}].function.parameters must be a JSON schema object", "tools", "invalid_type")
    return tools


def plan_chat(body: dict, engine, cfg: ServeConfig, render=None) -> Plan:
    """Validates a /v1/chat/completions body and renders + tokenizes its prompt. render: render_chat (default) or
    a TemplateRenderer's render. Blocks: the server calls it in a thread."""
    _check_model(body, cfg)
    _unsupported(body, chat=True)
    opts = _options(body, cfg, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array of {'role': …, 'content': …}", "messages",
                   "invalid_type" if not isinstance(messages, list) else "invalid_value")
    for i, m in enumerate(messages):
        parts = m.get("content") if isinstance(m, dict) else None
        if isinstance(parts, list) and any(not isinstance(p, dict) or p.get("type", "text") != "text" for p in parts):
            raise _bad(f"messages[{i}].content: only text parts are supported (this server has no vision path)",
                       "messages", "unsupported_value")
    tools = body.get("tools") or None
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise _bad("tool_choice must be 'auto' or 'none' (forcing a call is not supported)", "tool_choice",
                   "unsupported_value")
    if tools is not None:
        tools = None if choice == "none" else _check_tools(tools)
    kwargs = _field(body, "chat_template_kwargs", (dict,), {})
    unknown = set(kwargs) - {"enable_thinking"}
    if unknown:
        raise _bad(f"chat_template_kwargs: only 'enable_thinking' is supported, got {sorted(unknown)}",
                   "chat_template_kwargs", "unsupported_value")
    thinking = _field(kwargs, "enable_thinking", (bool,), cfg.enable_thinking)
    try:
        prompt, literal = engine.chat_text(messages, enable_thinking=thinking, tools=tools,
                                           special_in_user_text=cfg.special_in_user_text, render=render or render_chat)
    except TemplateRaised as e:  # the template refused these messages
        raise _bad(str(e), "messages") from None
    except TemplateRenderError as e:  # the template itself failed: the server's fault, not the request's
        raise APIError(500, str(e), "server_error", code="template_error") from None
    except ValueError as e:
        raise _bad(str(e), "messages") from None
    ids = engine.tokenizer.encode_prompt(prompt, literal)
    return Plan(**_fit(ids, opts, cfg, engine.n_ctx, "messages"), thinking=prompt.rstrip().endswith("<think>"),
                tools=tools)


def plan_completion(body: dict, engine, cfg: ServeConfig) -> Plan:
    """Validates a /v1/completions body: prompt = a string, or token ids (or a one-element array of either)."""
    _check_model(body, cfg)
    _unsupported(body, chat=False)
    opts = _options(body, cfg, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    n_vocab = engine.model.hparams.n_vocab  # what Session accepts
    if isinstance(prompt, str):
        ids = engine.tokenizer.encode_prompt(prompt)  # the caller's whole prompt: special tokens are parsed
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        if not all(0 <= t < n_vocab for t in prompt):
            raise _bad(f"'prompt' holds a token id outside [0, {n_vocab})", "prompt")
        ids = list(prompt)
    else:
        raise _bad("'prompt' must be a string or an array of token ids (one prompt per request)", "prompt",
                   "invalid_type")
    if not ids:
        raise _bad("'prompt' is empty: nothing to continue", "prompt")
    return Plan(**_fit(ids, opts, cfg, engine.n_ctx, "prompt"))


# ------------------------------------------------------------------------------------------------ output parsing

_CALL_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*\Z", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


def _param_value(raw: str, schema) -> object:
    """A <parameter> value: the text itself for string (or unknown) types, else its JSON value if it parses."""
    v = raw.removeprefix("\n").removesuffix("\n")  # the format puts the value on its own lines
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind in (None, "string"):
        return v
    try:
        return json.loads(v)
    except ValueError:
        return v


def _one_call(inner: str, schemas: dict) -> dict | None:
    """{'name', 'arguments' (a JSON string)} from one <tool_call> body, XML-ish or JSON; None if malformed."""
    m = _FUNCTION.match(inner)
    if m:
        name = m.group(1).strip()
        props = schemas.get(name, {})
        args = {p.group(1).strip(): _param_value(p.group(2), props.get(p.group(1).strip()))
                for p in _PARAMETER.finditer(m.group(2))}
        return {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}
    try:
        obj = json.loads(inner)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def parse_tool_calls(text: str, tools: list | None) -> tuple[str, list[dict]]:
    """Splits assistant text into (content, OpenAI tool_calls). Each <tool_call> block holds either Qwen3.5's
    <function=NAME><parameter=P>VALUE</parameter></function> or JSON {"name", "arguments"}; a final block may
    lack </tool_call> (generation stopped at EOS). Values are typed by the tool's JSON schema. Blocks that do
    not parse stay in the content. Without tools nothing is parsed."""
    if not tools:
        return text, []
    schemas = {}
    for t in tools:
        fn = t.get("function", {})
        schemas[fn.get("name")] = (fn.get("parameters") or {}).get("properties") or {}
    calls, kept, last = [], [], 0
    for m in _CALL_BLOCK.finditer(text):
        call = _one_call(m.group(1).strip(), schemas)
        if call is None:
            continue
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append({"id": "call_" + secrets.token_hex(12), "type": "function", "function": call})
    kept.append(text[last:])
    return "".join(kept).strip(), calls


class ChatOutput:
    """Splits assistant text, as it streams, into reasoning, content and tool calls.

    push(text) -> [("reasoning" | "content", piece), …] ready to send; finish() -> (the last pieces,
    tool_calls). Reasoning runs until </think> (from the start when the prompt left <think> open, or when the
    output opens one); with tools, content stops at the first <tool_call> and the rest is parsed at the end.
    Like the template, each part is trimmed: leading whitespace is dropped and trailing whitespace waits until
    more text follows. The pieces joined equal the non-streamed split, however the text is cut."""

    def __init__(self, thinking: bool, tools: list | None = None):
        self.mode = "reasoning" if thinking else "content"
        self.tools = tools
        self.buf = ""               # text of the current mode not yet sent
        self.started = False        # the current mode has sent text (leading whitespace is gone)
        self.any_content = False    # content may still open with <think>
        self.parts: dict[str, list[str]] = {"reasoning": [], "content": []}

    def _markers(self) -> tuple[str, ...]:
        if self.mode == "reasoning":
            return ("</think>",)
        return ("<tool_call>",) if self.tools else ()

    def _send(self, out: list, text: str) -> None:
        if not self.started:
            text = text.lstrip()
        if text:
            self.started = True
            self.any_content |= self.mode == "content"
            self.parts[self.mode].append(text)
            out.append((self.mode, text))

    def _switch(self, mode: str, rest: str) -> None:
        self.mode, self.buf, self.started = mode, rest, False

    def push(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self.buf += text
        while self.mode != "tools":
            if self.mode == "content" and not self.any_content:
                head = self.buf.lstrip()
                if head.startswith("<think>"):
                    self._switch("reasoning", head[len("<think>"):])
                    continue
                if head and "<think>".startswith(head):  # may still become <think>
                    break
            hits = [(i, m) for m in self._markers() if (i := self.buf.find(m)) >= 0]
            if hits:
                i, m = min(hits)
                self._send(out, self.buf[:i].rstrip())
                self._switch("content" if m == "</think>" else "tools", self.buf[i + len(m):])
                continue
            end = len(self.buf)
            for m in self._markers():  # hold a suffix that may start a marker
                k = next((k for k in range(min(len(m) - 1, end), 0, -1) if self.buf.endswith(m[:k])), 0)
                end = min(end, len(self.buf) - k)
            end = len(self.buf[:end].rstrip())
            self._send(out, self.buf[:end])
            self.buf = self.buf[end:]
            break
        return out

    def finish(self) -> tuple[list[tuple[str, str]], list[dict]]:
        out: list[tuple[str, str]] = []
        calls: list[dict] = []
        if self.mode == "tools":
            rest, calls = parse_tool_calls("<tool_call>" + self.buf, self.tools)
            self.mode, self.started = "content", self.any_content
            if rest:
                self._send(out, ("\n\n" if self.any_content else "") + rest)
        else:
            self._send(out, self.buf.rstrip())
        self.buf = ""
        return out, calls

    @property
    def reasoning(self) -> str:
        return "".join(self.parts["reasoning"])

    @property
    def content(self) -> str:
        return "".join(self.parts["content"])


# ------------------------------------------------------------------------------------------------ worker

def fresh_prefill(session, ids, cancel=None):
    """The default prefill seam: the whole prompt from an empty state."""
    session.reset()
    return session.prefill(ids, cancel=cancel)


class Job:
    """One request's generation: what to run, and the channel its events go back on to the asyncio loop.
    Events: ("start", {prompt_tokens, cached_tokens}), ("text", piece)…, then ("done", {finish_reason,
    completion_tokens}) or ("error", APIError)."""

    def __init__(self, plan: Plan, loop: asyncio.AbstractEventLoop):
        self.plan = plan
        self.seq = -1                       # arrival number, set by Worker.submit
        self.events: asyncio.Queue = asyncio.Queue()
        self._loop = loop
        self._cancel = threading.Event()
        self.error: APIError | None = None  # why it was cancelled, when its client still listens (a shutdown)

    def cancel(self, error: APIError | None = None) -> None:
        if error is not None and not self._cancel.is_set():
            self.error = error
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def send(self, kind: str, payload=None) -> None:
        """From the worker thread."""
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel()


@dataclass
class Counters:
    prompt_tokens: int = 0        # tokens of accepted prompts
    cached_tokens: int = 0        # of those, restored from the prefix cache
    completion_tokens: int = 0
    prefill_tokens: int = 0       # tokens actually run through prefill
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    jobs_done: int = 0
    jobs_cancelled: int = 0
    jobs_failed: int = 0


class Worker:
    """Runs every job on one thread, one at a time, in the order submitted (FIFO).

    prefill(session, ids, cancel) -> float32[n_vocab] is the seam through which the prompt is run: by default a
    fresh prefill, with `cache` the PrefixCache's (shared by every request); it asks cancel() between chunks and
    raises Cancelled when the job was cancelled. make_sampler(params) -> an object with
    sample(logits, history) -> id: a seam for tests that need scripted output. max_queue bounds the jobs
    waiting (not counting the one running)."""

    def __init__(self, engine, cache=None, prefill=None, max_queue: int = 256):
        self.engine = engine
        self.cache = cache
        self.session = engine.session()
        self.prefill = prefill or (cache.prefill if cache is not None else fresh_prefill)
        from .sampling import Sampler

        cpu = getattr(engine, "cpu_model", None)   # its pool runs the sampler's passes (idle between forwards)
        self.make_sampler = lambda params: Sampler(params, model=cpu)
        self.max_queue = max_queue
        self.counters = Counters()
        self.log: deque = deque(maxlen=4096)  # (seq, finish_reason, prompt_tokens, completion_tokens), in order run
        self.current: Job | None = None
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._seq = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="legacy-engine-worker", daemon=True)

    # ---- the HTTP side's interface

    def start(self) -> None:
        if not self._thread.is_alive() and not self._stopping:
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._stopping:
                raise _shutting_down()
            if self._queue.qsize() >= self.max_queue:
                raise APIError(503, f"the queue is full ({self.max_queue} requests waiting); retry later",
                               "server_error", code="queue_full")
            job.seq, self._seq = self._seq, self._seq + 1
            self._queue.put(job)

    def stop(self) -> None:
        """Refuses new jobs, cancels the running one and every queued one: each gets a 503 shutting_down (a stream:
        an error event), and the thread ends after them."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            if self.current is not None:
                self.current.cancel(_shutting_down())
            self._queue.put(None)

    def close(self, timeout: float = 10.0) -> None:
        """stop(), then waits for the thread."""
        self.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the thread

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                break
            if self._stopping:
                job.cancel(_shutting_down())
            if job.cancelled:  # its client left while it waited, or the server is stopping
                self.log.append((job.seq, "cancelled", len(job.plan.ids), 0))
                self.counters.jobs_cancelled += 1
                job.send("error", job.error or APIError(503, "the request was cancelled before it ran",
                                                        "server_error", code="cancelled"))
                continue
            self.current = job
            if self._stopping:  # stop() came between the two checks above
                job.cancel(_shutting_down())
            try:
                self._execute(job)
            except Cancelled:  # between prefill chunks: its client left, or the server is stopping
                self.counters.jobs_cancelled += 1
                self.log.append((job.seq, "cancelled", len(job.plan.ids), 0))
                job.send("error", job.error or APIError(499, "the client closed the connection",
                                                        code="client_closed_request"))
            except Exception as e:  # the worker outlives any one request
                if isinstance(e, ContextLengthError):
                    err = APIError(400, str(e), code="context_length_exceeded")
                else:
                    err = APIError(500, f"generation failed: {type(e).__name__}: {e}", "server_error")
                self.counters.jobs_failed += 1
                self.log.append((job.seq, "error", len(job.plan.ids), 0))
                job.send("error", err)
            finally:
                self.current = None

    def _execute(self, job: Job) -> None:
        plan, sess, tok, c = job.plan, self.session, self.engine.tokenizer, self.counters
        t = sess.timings
        p0, ps0, d0, ds0 = t.prefill_tokens, t.prefill_s, t.decode_tokens, t.decode_s
        logits = self.prefill(sess, plan.ids, cancel=lambda: job.cancelled)
        cached = max(0, len(plan.ids) - (t.prefill_tokens - p0))  # the cache counts only what it ran
        job.send("start", {"prompt_tokens": len(plan.ids), "cached_tokens": cached})
        sampler = self.make_sampler(plan.params)
        decoder = tok.stream()
        hold = max((len(s) for s in plan.stop), default=1) - 1  # chars that may still start a stop string
        pending, n, finish, cut_by_stop, token = "", 0, "length", False, None
        while n < plan.max_tokens:
            if job.cancelled:
                finish = "cancelled"
                break
            # the first token from the prompt's logits, the next ones from a decode step (max_tokens fits the
            # context: the plan checked it)
            token = sampler.sample(logits, sess.tokens) if token is None else sess.decode_next(token, sampler)
            n += 1
            if token in tok.eos_ids:
                finish = "stop"
                break
            pending += decoder.push(token)
            cut = min((pending.find(s) for s in plan.stop if s in pending), default=-1)
            if cut >= 0:
                pending, finish, cut_by_stop = pending[:cut], "stop", True
                break
            if len(pending) > hold:
                job.send("text", pending[:len(pending) - hold])
                pending = pending[len(pending) - hold:]
        if not cut_by_stop:
            pending += decoder.flush()
        if pending and finish != "cancelled":
            job.send("text", pending)
        c.prompt_tokens += len(plan.ids)
        c.cached_tokens += cached
        c.completion_tokens += n
        c.prefill_tokens += t.prefill_tokens - p0
        c.prefill_s += t.prefill_s - ps0
        c.decode_tokens += t.decode_tokens - d0
        c.decode_s += t.decode_s - ds0
        c.jobs_cancelled += finish == "cancelled"
        c.jobs_done += finish != "cancelled"
        self.log.append((job.seq, finish, len(plan.ids), n))
        if finish == "cancelled" and job.error is not None:  # the server is stopping; the client still listens
            job.send("error", job.error)
        else:
            job.send("done", {"finish_reason": finish, "completion_tokens": n})


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", "server_error", code="shutting_down")


# ------------------------------------------------------------------------------------------------ metrics

def render_metrics(worker: Worker, requests: dict) -> str:
    """Prometheus text exposition (version 0.0.4)."""
    c = worker.counters
    lines: list[str] = []

    def metric(name: str, kind: str, help: str, samples) -> None:
        lines.extend([f"# HELP legacy_engine_{name} {help}", f"# TYPE legacy_engine_{name} {kind}"])
        for labels, value in (samples if isinstance(samples, list) else [("", samples)]):
            lines.append(f"legacy_engine_{name}{labels} {value:g}" if isinstance(value, float)
                         else f"legacy_engine_{name}{labels} {value}")

    metric("requests_total", "counter", "HTTP requests answered, by endpoint and status code.",
           [(f'{{endpoint="{e}",code="{s}"}}', n) for (e, s), n in sorted(requests.items())] or [("", 0)])
    metric("prompt_tokens_total", "counter", "Prompt tokens of the requests run (tokens in).", c.prompt_tokens)
    metric("completion_tokens_total", "counter", "Tokens generated (tokens out).", c.completion_tokens)
    metric("cached_prompt_tokens_total", "counter", "Prompt tokens restored from the prefix cache.", c.cached_tokens)
    metric("prefill_tokens_total", "counter", "Prompt tokens run through the model.", c.prefill_tokens)
    metric("prefill_seconds_total", "counter", "Seconds spent in prefill (cache restores included).",
           float(c.prefill_s))
    metric("decode_tokens_total", "counter", "Tokens run through single-token decode.", c.decode_tokens)
    metric("decode_seconds_total", "counter", "Seconds spent in decode.", float(c.decode_s))
    metric("prefill_tokens_per_second", "gauge", "Prefill speed since start (prefill tokens / seconds).",
           float(c.prefill_tokens / c.prefill_s if c.prefill_s else 0.0))
    metric("decode_tokens_per_second", "gauge", "Decode speed since start (decode tokens / seconds).",
           float(c.decode_tokens / c.decode_s if c.decode_s else 0.0))
    stats = worker.cache.stats if worker.cache is not None else {}
    metric("cache_hits_total", "counter", "Prefills that restored a cached prefix.", stats.get("hits", 0))
    metric("cache_misses_total", "counter", "Prefills that found no cached prefix.", stats.get("misses", 0))
    metric("cache_ram_bytes", "gauge", "Bytes the prefix cache holds in RAM.", stats.get("ram_bytes", 0))
    metric("cache_disk_bytes", "gauge", "Bytes of the prefix cache's disk files.", stats.get("disk_bytes", 0))
    metric("cache_disk_rejected_total", "counter", "Prefix-cache disk files refused: bad ones (deleted) and other "
           "models' (left alone).", stats.get("disk_rejected", 0))
    metric("jobs_total", "counter", "Generations by outcome.",
           [('{outcome="done"}', c.jobs_done), ('{outcome="cancelled"}', c.jobs_cancelled),
            ('{outcome="failed"}', c.jobs_failed)])
    metric("queue_length", "gauge", "Requests waiting for the worker.", worker.queued)
    metric("requests_running", "gauge", "Requests being generated (0 or 1).", int(worker.current is not None))
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ HTTP

def _now() -> int:
    return int(time.time())


def _usage(start: dict, done: dict) -> dict:
    p, n = start["prompt_tokens"], done["completion_tokens"]
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n,
            "prompt_tokens_details": {"cached_tokens": start["cached_tokens"]}}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json(raw: bytes) -> dict:
    """A request body -> its JSON object; 400 for anything else, a lone UTF-16 surrogate ("\\ud800") included:
    JSON allows the escape, but no text holds it (it would fail later, in encode)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from e
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw):  # rare (clients that escape non-BMP text): only then the full check
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "the body holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its "
                                "pair): not text", code="invalid_json") from None
    return body


def _hostname(netloc: str) -> str:
    """'Example.com:8080' -> 'example.com', '[::1]:80' -> '::1'; '' when it is not a plain host[:port]."""
    if "@" in netloc or "/" in netloc:
        return ""
    if netloc.count(":") > 1 and not netloc.startswith("["):  # a bare IPv6 address (--host ::)
        return netloc.lower()
    try:
        return urlsplit("//" + netloc).hostname or ""
    except ValueError:
        return ""


def _origin(value: str) -> tuple | None:
    """'HTTP://Host:80' -> ('http', 'host', 80): an origin compared as browsers do; None if it is not one."""
    try:
        u = urlsplit(value)
        return (u.scheme, u.hostname, u.port or {"http": 80, "https": 443}.get(u.scheme)) if u.hostname else None
    except ValueError:
        return None


def check_origin(headers, cfg: ServeConfig) -> None:
    """ORIGIN_POLICY: 403 unless Host names this server and Origin (sent by browsers) is its own or allowed."""
    allow = cfg.allow_origins
    if "*" in allow:
        return
    names = ({*LOOPBACK, _hostname(cfg.host)} | {_hostname(v) for v in allow if "://" not in v}) - {""}
    host = headers.get("host")
    if host is not None:
        name = _hostname(host)
        try:
            ipaddress.ip_address(name)  # an address, not a name: DNS rebinding needs a name
        except ValueError:
            if name not in names:
                raise APIError(403, f"the Host header names {host!r}, not this server: use localhost, 127.0.0.1 "
                                    f"or its --host; to serve under that name restart with --allow-origin "
                                    f"{name or host} (a guard against DNS rebinding)", code="forbidden_host")
    origin = headers.get("origin")
    if origin is not None:
        o = _origin(origin)
        own = o is not None and o[0] in ("http", "https") and o[1] in names and cfg.port in (None, o[2])
        if not own and (o is None or o not in {_origin(v) for v in allow if "://" in v}):
            raise APIError(403, f"requests from web pages at {origin} are refused (a guard against cross-site use "
                                f"of this server): restart with --allow-origin {origin} to allow that site",
                           code="forbidden_origin")


async def _next_event(job: Job, request) -> tuple[str, object]:
    """The job's next event. A client that disconnects meanwhile cancels the job; the answer (499, nginx's
    "client closed request") goes nowhere but into the metrics."""
    get = asyncio.ensure_future(job.events.get())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not get.done():
        get.cancel()
        job.cancel()
        raise APIError(499, "the client closed the connection", code="client_closed_request")
    return get.result()


async def _disconnected(request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _CancelOnExit:
    """ASGI wrapper of a streamed response: however it ends (done, client gone, server stopping), the job is
    cancelled, so the worker moves on at its next token."""

    status_code = 200

    def __init__(self, response, job: Job):
        self.response, self.job = response, job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.job.cancel()


class _App:
    """The endpoints, bound to one worker and config."""

    def __init__(self, worker: Worker, cfg: ServeConfig):
        self.worker, self.cfg, self.engine = worker, cfg, worker.engine
        self.created = _now()
        self.requests: dict[tuple[str, int], int] = {}
        self.fingerprint = f"legacy_engine-{__import__('legacy_engine').__version__}"
        self.renderer = TemplateRenderer(cfg.render_seconds)
        self._reading = asyncio.Semaphore(cfg.max_reading)  # bodies being read

    # ---- plumbing

    def _authorize(self, request) -> None:
        key = self.cfg.api_key
        if key is None:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>' with the key the "
                                "server was started with (--api-key)", code="invalid_api_key")

    def endpoint(self, name: str, fn, auth: bool = True):
        from starlette.responses import JSONResponse

        async def handle(request):
            try:
                check_origin(request.headers, self.cfg)
                if auth:
                    self._authorize(request)
                response = await fn(request)
            except APIError as e:
                headers = {"Retry-After": "1"} if e.code in ("queue_full", "server_busy") else {}
                if e.status == 408:  # the rest of the body may still come: this connection is done
                    headers["Connection"] = "close"
                response = JSONResponse(e.body(), status_code=e.status, headers=headers)
            key = (name, response.status_code)
            self.requests[key] = self.requests.get(key, 0) + 1
            return response
        return handle

    async def _body(self, request) -> bytes:
        """The request body: at most cfg.max_body bytes (413), all of it within cfg.read_timeout (408), read while
        fewer than cfg.max_reading others are (else it waits, within the same deadline; then 503), and JSON (415)."""
        cfg, loop = self.cfg, asyncio.get_running_loop()
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > cfg.max_body):
            raise APIError(413, f"the request body is {size} bytes; this server accepts at most {cfg.max_body} "
                                f"(--max-body)", code="request_too_large")
        deadline = loop.time() + cfg.read_timeout
        try:
            await asyncio.wait_for(self._reading.acquire(), cfg.read_timeout)
        except asyncio.TimeoutError:
            raise APIError(503, f"{cfg.max_reading} requests are sending their bodies already; retry later",
                           "server_error", code="server_busy") from None
        try:
            chunks, n, more = [], 0, True
            while more:
                try:
                    message = await asyncio.wait_for(request.receive(), max(deadline - loop.time(), 0))
                except asyncio.TimeoutError:
                    raise APIError(408, f"the request body did not arrive within {cfg.read_timeout:g} s "
                                        f"(--read-timeout)", code="request_timeout") from None
                if message["type"] == "http.disconnect":
                    raise APIError(499, "the client closed the connection", code="client_closed_request")
                chunks.append(message.get("body", b""))
                n += len(chunks[-1])
                if n > cfg.max_body:
                    raise APIError(413, f"the request body exceeds {cfg.max_body} bytes (--max-body)",
                                   code="request_too_large")
                more = message.get("more_body", False)
        finally:
            self._reading.release()
        ctype = request.headers.get("content-type", "")
        if ctype.split(";")[0].strip().lower() != "application/json":  # forms and text/plain are what pages send
            raise APIError(415, f"the body must be sent as Content-Type: application/json, not "
                                f"{ctype or 'without a type'}", code="unsupported_media_type")
        return b"".join(chunks)

    async def _start(self, plan: Plan, request) -> tuple[Job, dict]:
        """Queues the plan; waits for its prefill (or its error, which becomes this request's answer)."""
        job = Job(plan, asyncio.get_running_loop())
        self.worker.submit(job)
        try:
            kind, payload = await _next_event(job, request)
        except BaseException:
            job.cancel()
            raise
        if kind == "error":
            raise payload
        return job, payload

    async def _collect(self, job: Job, request) -> tuple[list[str], dict]:
        """The job's text and its "done" event. A client that disconnects meanwhile cancels the job, which then
        ends at its next token."""
        pieces = []
        gone = asyncio.ensure_future(_disconnected(request))
        gone.add_done_callback(lambda _: job.cancel())
        try:
            while True:
                kind, payload = await job.events.get()
                if kind == "text":
                    pieces.append(payload)
                elif kind == "done":
                    return pieces, payload
                else:
                    raise payload
        finally:
            gone.cancel()
            job.cancel()  # a no-op once done

    def _stream(self, job: Job, chunks):
        from starlette.responses import StreamingResponse

        return _CancelOnExit(StreamingResponse(chunks, media_type="text/event-stream",
                                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}), job)

    # ---- endpoints

    async def models(self, request):
        from starlette.responses import JSONResponse
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request):
        from starlette.responses import JSONResponse
        if request.path_params["model"] != self.cfg.model_id:
            raise APIError(404, f"the model '{request.path_params['model']}' does not exist here",
                           param="model", code="model_not_found")
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self.cfg.model_id, "object": "model", "created": self.created, "owned_by": "legacy_engine",
                "context_length": self.engine.n_ctx}

    async def health(self, request):
        from starlette.responses import JSONResponse
        ok = self.worker.alive
        return JSONResponse({"status": "ok" if ok else "error", "model": self.cfg.model_id,
                             "queue": self.worker.queued, "running": self.worker.current is not None},
                            status_code=200 if ok else 503)

    async def metrics(self, request):
        from starlette.responses import PlainTextResponse
        return PlainTextResponse(render_metrics(self.worker, self.requests),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def chat(self, request):
        from starlette.responses import JSONResponse
        raw = await self._body(request)
        plan = await asyncio.to_thread(lambda: plan_chat(parse_json(raw), self.engine, self.cfg, self.renderer.render))
        rid, created = "chatcmpl-" + secrets.token_hex(12), _now()
        job, start = await self._start(plan, request)
        out = ChatOutput(plan.thinking, plan.tools)
        if not plan.stream:
            pieces, done = await self._collect(job, request)
            out.push("".join(pieces))
            _, calls = out.finish()
            message = {"role": "assistant", "content": out.content or (None if calls else "")}
            if out.reasoning:
                message["reasoning_content"] = out.reasoning
            if calls:
                message["tool_calls"] = calls
            return JSONResponse({
                "id": rid, "object": "chat.completion", "created": created, "model": self.cfg.model_id,
                "system_fingerprint": self.fingerprint,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": "tool_calls" if calls else done["finish_reason"]}],
                "usage": _usage(start, done)})

        def chunk(delta: dict, finish=None) -> str:
            obj = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.cfg.model_id,
                   "system_fingerprint": self.fingerprint,
                   "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
            if plan.include_usage:
                obj["usage"] = None
            return _sse(obj)

        def deltas(parts) -> list[str]:
            return [chunk({"reasoning_content" if kind == "reasoning" else "content": text}) for kind, text in parts]

        async def events():
            yield chunk({"role": "assistant", "content": ""})
            while True:
                kind, payload = await job.events.get()
                if kind == "text":
                    for s in deltas(out.push(payload)):
                        yield s
                elif kind == "done":
                    parts, calls = out.finish()
                    for s in deltas(parts):
                        yield s
                    if calls:
                        yield chunk({"tool_calls": [dict(c, index=i) for i, c in enumerate(calls)]})
                    yield chunk({}, "tool_calls" if calls else payload["finish_reason"])
                    if plan.include_usage:
                        yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                    "model": self.cfg.model_id, "system_fingerprint": self.fingerprint,
                                    "choices": [], "usage": _usage(start, payload)})
                    yield "data: [DONE]\n\n"
                    return
                else:
                    yield _sse(payload.body())
                    yield "data: [DONE]\n\n"
                    return
        return self._stream(job, events())

    async def completions(self, request):
        from starlette.responses import JSONResponse
        raw = await self._body(request)
        plan = await asyncio.to_thread(lambda: plan_completion(parse_json(raw), self.engine, self.cfg))
        rid, created = "cmpl-" + secrets.token_hex(12), _now()
        job, start = await self._start(plan, request)

        def obj(text: str, finish=None, usage=None) -> dict:
            o = {"id": rid, "object": "text_completion", "created": created, "model": self.cfg.model_id,
                 "system_fingerprint": self.fingerprint,
                 "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}
            if usage is not None or plan.include_usage:
                o["usage"] = usage
            return o

        if not plan.stream:
            pieces, done = await self._collect(job, request)
            return JSONResponse(obj("".join(pieces), done["finish_reason"], _usage(start, done)))

        async def events():
            while True:
                kind, payload = await job.events.get()
                if kind == "text":
                    yield _sse(obj(payload))
                elif kind == "done":
                    yield _sse(obj("", payload["finish_reason"]))
                    if plan.include_usage:
                        yield _sse(dict(obj(""), choices=[], usage=_usage(start, payload)))
                    yield "data: [DONE]\n\n"
                    return
                else:
                    yield _sse(payload.body())
                    yield "data: [DONE]\n\n"
                    return
        return self._stream(job, events())


def create_app(worker: Worker, cfg: ServeConfig):
    """The starlette ASGI app. Its lifespan starts the worker and the template renderer, and closes them
    (cancelling what runs) at shutdown. Serve it with uvicorn_config(app, ...)."""
    try:
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.middleware import Middleware
        from starlette.middleware.cors import CORSMiddleware
        from starlette.responses import JSONResponse
        from starlette.routing import Route
    except ImportError as e:
        raise UnavailableError(f"the server needs starlette and uvicorn: pip install {SERVE_DEPS} ({e})") from e
    import contextlib

    app = _App(worker, cfg)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        worker.start()
        await asyncio.to_thread(app.renderer.start)
        try:
            yield
        finally:
            await asyncio.to_thread(worker.close)
            await asyncio.to_thread(app.renderer.close)

    async def http_error(request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                     code=code).body(), status_code=exc.status_code)

    async def internal_error(request, exc: Exception):
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").body(),
                            status_code=500)

    routes = [
        Route("/v1/models", app.endpoint("models", app.models), methods=["GET"]),
        Route("/v1/models/{model:path}", app.endpoint("models", app.model), methods=["GET"]),
        Route("/v1/chat/completions", app.endpoint("chat", app.chat), methods=["POST"]),
        Route("/v1/completions", app.endpoint("completions", app.completions), methods=["POST"]),
        Route("/health", app.endpoint("health", app.health, auth=False), methods=["GET"]),
        Route("/metrics", app.endpoint("metrics", app.metrics), methods=["GET"]),
    ]
    web = [v for v in cfg.allow_origins if v == "*" or "://" in v]  # origins of pages that may call it: CORS
    middleware = [Middleware(CORSMiddleware, allow_origins=web, allow_methods=["GET", "POST"],
                             allow_headers=["*"])] if web else []
    star = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                     exception_handlers={HTTPException: http_error, Exception: internal_error})
    star.state.api = app
    return star


def uvicorn_config(app, **kw):
    """uvicorn.Config for create_app's `app`, with a deadline on request heads (cfg.read_timeout)."""
    import uvicorn

    return uvicorn.Config(app, http=_timed_h11(app.state.api.cfg.read_timeout), **kw)


def _timed_h11(timeout: float):
    """uvicorn's h11 protocol with a deadline on request heads: a connection that has not sent a whole request head
    `timeout` seconds after it opened, or after its last answer, gets 408 and is closed. uvicorn has no such timer:
    a client that sends nothing, or a header a byte at a time, would hold its socket forever."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    body = json.dumps(APIError(408, f"no whole request head within {timeout:g} s (--read-timeout)",
                               code="request_timeout").body()).encode()
    answer = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(body), body))

    class TimedH11(H11Protocol):
        head_timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the head is in
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:  # waits for the next head
                self._arm()

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self.head_timer = self.loop.call_later(timeout, self._expire)

        def _disarm(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def _expire(self) -> None:
            self.head_timer = None
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self.transport.write(answer)  # raw: h11 cannot answer a request it has not seen
                self.transport.close()

    return TimedH11


def stopping_server(config, worker: Worker):
    """A uvicorn.Server that, on SIGTERM or SIGINT, stops the worker at once (Worker.stop: the running request ends
    with a 503, a stream with an error event and [DONE], queued ones get 503) instead of waiting for them."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            try:  # a signal handler may not take the worker's lock: the loop calls stop() next
                asyncio.get_running_loop().call_soon_threadsafe(worker.stop)
            except RuntimeError:
                worker.stop()
            super().handle_exit(sig, frame)

    return Server(config)


# ------------------------------------------------------------------------------------------------ command line

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
    from ..tools.cli import gpu_flags, load_flags
    load_flags(s)
    gpu_flags(s)  # --no-mmap, --numa
    s.add_argument("--max-body", type=_size, default=4 << 20, metavar="BYTES",
                   help="largest request body; larger ones get 413 (default 4M)")
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
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default info: one line per request)")
    s.set_defaults(func=cmd_serve)
    return s


def build_server(args):
    """(app, worker) from parsed `serve` flags: loads the model and makes the cache."""
    from .generate import Engine
    from .sampling import SamplingParams

    defaults = SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    defaults.validate()
    from ..tools.cli import engine_kwargs
    engine = Engine(args.model, **engine_kwargs(args))
    cache = None
    if args.cache_ram > 0 or args.cache_dir:
        from .cache import PrefixCache

        cache = PrefixCache.for_model(engine.model, ram_bytes=args.cache_ram, disk_dir=args.cache_dir,
                                      disk_bytes=args.cache_disk)
    worker = Worker(engine, cache=cache, max_queue=args.max_queue)
    name = args.alias or os.path.basename(args.model).removesuffix(".gguf")
    cfg = ServeConfig(model_id=name, api_key=args.api_key or None, max_body=args.max_body,
                      max_tokens=args.max_tokens, defaults=defaults, enable_thinking=not args.no_think,
                      host=args.host, port=args.port, allow_origins=tuple(args.allow_origin),
                      read_timeout=args.read_timeout, special_in_user_text=args.special_in_user_text)
    return create_app(worker, cfg), worker


def listen_socket(host: str, port: int):
    """A socket bound to (host, port), taken before the model loads: a port in use fails in a second, not after
    the load. uvicorn serves on it."""
    import socket

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise UnavailableError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn: a restart reuses the port at once
        sock.bind(addr)
    except OSError as e:
        sock.close()
        hint = "; another server runs there: pick another --port" if e.errno == errno.EADDRINUSE else ""
        raise UnavailableError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None
    return sock


def cmd_serve(args) -> int:
    try:
        import uvicorn
    except ImportError as e:
        raise UnavailableError(f"`serve` needs starlette and uvicorn: pip install {SERVE_DEPS}") from e
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"legacy-engine serve: warning: listening on {args.host} without --api-key: anyone who can reach "
              f"this port can use the model", file=sys.stderr)
    if args.gpu:
        from ..tools.cli import check_gpu
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
    config = uvicorn_config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    try:
        stopping_server(config, worker).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it shut down on: that is the normal way to stop
        print("legacy-engine serve: stopped", file=sys.stderr)
    finally:
        worker.close()
    return 0
