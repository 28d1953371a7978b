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
order their plans are ready. One worker thread owns the model and a Session per slot (--parallel): it takes jobs
in order, prefills through a seam, `prefill(session, ids, cancel) -> logits of the last token` (a fresh prefill, or
PrefixCache.prefill, which restores the longest prefix any earlier request left in the shared cache), samples,
decodes the running jobs together (one step, one token each) and sends text pieces back to the loop. A job that
arrives while a prompt runs starts inside it (worker.py): between its forward calls, and on the CPU engine between
two layers of the current call. A job whose client is gone is cancelled between prefill chunks or before
its next token; a job still queued is skipped. On SIGTERM (or SIGINT) the running job ends with an error (a
stream: an error event, then [DONE]) and queued ones get 503.

Control tokens (<|im_start|> …) come only from the chat template's own markup: user text (message contents, tool
calls, tools) that spells one is tokenized as text (chat.render_prompt), unless --special-in-user-text. A
/v1/completions prompt is the caller's whole prompt: its special tokens are parsed.

Errors use OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

This module is the ASGI app (routes, limits, timeouts, streaming) and its uvicorn glue. Beside it: schema.py (a
request body -> a Plan; APIError), origin.py (ORIGIN_POLICY), worker.py (the thread that owns the engine),
chat_output.py (reasoning, content, tool calls), metrics.py (/metrics). The command: tools/serve_cmd.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import json
import secrets
import socket
import time

from .. import __version__
from ..core.errors import UnavailableError
from ..format.chat import TemplateRenderer
from .chat_output import ChatOutput
from .choices import chat_logprobs, choice_plans, completion_logprobs, merged
from .metrics import render_metrics
from .origin import check_origin
from .schema import APIError, Plan, ServeConfig, parse_json, plan_chat, plan_completion
from .worker import Job, Worker

# starlette, uvicorn and h11 are imported where used: the web stack is optional (SERVE_DEPS), the engine and the other
# commands run without it.

SERVE_DEPS = "starlette>=0.37 uvicorn>=0.30"  # the server's only dependencies beyond the engine's


def _now() -> int:
    return int(time.time())


def _usage(starts: list[dict], dones: list[dict]) -> dict:
    """The request's usage: its prompt once (the cache counts of the first choice, which ran it), the tokens of every
    choice."""
    p, n = starts[0]["prompt_tokens"], sum(d["completion_tokens"] for d in dones)
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n,
            "prompt_tokens_details": {"cached_tokens": starts[0]["cached_tokens"]}}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


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
    """ASGI wrapper of a streamed response: however it ends (done, client gone, server stopping), its jobs are
    cancelled, so the worker moves on at their next token."""

    status_code = 200

    def __init__(self, response, jobs: list[Job]):
        self.response, self.jobs = response, jobs

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            for job in self.jobs:
                job.cancel()


class _App:
    """The endpoints, bound to one worker and config."""

    def __init__(self, worker: Worker, cfg: ServeConfig):
        self.worker, self.cfg, self.engine = worker, cfg, worker.engine
        self.created = _now()
        self.requests: dict[tuple[str, int], int] = {}
        self.fingerprint = f"legacy_engine-{__version__}"
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

    async def _start(self, plan: Plan, request) -> tuple[list[Job], list[dict]]:
        """Queues the request's choices (one job each); waits for their prefills (or the first error, which becomes
        this request's answer, the other choices cancelled)."""
        jobs = [Job(p, asyncio.get_running_loop()) for p in choice_plans(plan)]
        starts = []
        try:
            for job in jobs:
                self.worker.submit(job)
            for job in jobs:
                kind, payload = await _next_event(job, request)
                if kind == "error":
                    raise payload
                starts.append(payload)
        except BaseException:
            for job in jobs:
                job.cancel()
            raise
        return jobs, starts

    async def _collect(self, jobs: list[Job], request) -> list[tuple[list[str], list, dict]]:
        """Each choice's text pieces, logprob entries and "done" event. A client that disconnects meanwhile cancels
        the jobs, which then end at their next token."""
        out = [([], [], None) for _ in jobs]
        gone = asyncio.ensure_future(_disconnected(request))
        gone.add_done_callback(lambda _: [job.cancel() for job in jobs])
        try:
            async for i, kind, payload in merged(jobs):
                if kind == "text":
                    out[i][0].append(payload)
                elif kind == "logprobs":
                    out[i][1].extend(payload)
                elif kind == "done":
                    out[i] = (out[i][0], out[i][1], payload)
                else:
                    raise payload
            return out
        finally:
            gone.cancel()
            for job in jobs:
                job.cancel()  # a no-op once done

    def _stream(self, jobs: list[Job], chunks):
        from starlette.responses import StreamingResponse

        return _CancelOnExit(StreamingResponse(chunks, media_type="text/event-stream",
                                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}), jobs)

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
                             "queue": self.worker.queued, "running": self.worker.running,
                             "slots": self.worker.parallel},
                            status_code=200 if ok else 503)

    async def metrics(self, request):
        from starlette.responses import PlainTextResponse
        return PlainTextResponse(render_metrics(self.worker, self.requests),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def chat(self, request):
        from starlette.responses import JSONResponse
        raw = await self._body(request)
        plan = await asyncio.to_thread(lambda: plan_chat(parse_json(raw), self.engine, self.cfg, self.renderer.render))
        rid, created, tok = "chatcmpl-" + secrets.token_hex(12), _now(), self.engine.tokenizer
        jobs, starts = await self._start(plan, request)
        outs = [ChatOutput(plan.thinking, plan.tools) for _ in jobs]
        want_lp = plan.logprobs is not None
        if not plan.stream:
            choices, dones = [], []
            for i, (pieces, entries, done) in enumerate(await self._collect(jobs, request)):
                outs[i].push("".join(pieces))
                _, calls = outs[i].finish()
                message = {"role": "assistant", "content": outs[i].content or (None if calls else "")}
                if outs[i].reasoning:
                    message["reasoning_content"] = outs[i].reasoning
                if calls:
                    message["tool_calls"] = calls
                choices.append({"index": i, "message": message,
                                "logprobs": chat_logprobs(entries, tok) if want_lp else None,
                                "finish_reason": "tool_calls" if calls else done["finish_reason"]})
                dones.append(done)
            return JSONResponse({
                "id": rid, "object": "chat.completion", "created": created, "model": self.cfg.model_id,
                "system_fingerprint": self.fingerprint, "choices": choices, "usage": _usage(starts, dones)})

        def chunk(i: int, delta: dict, finish=None, entries=None) -> str:
            obj = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.cfg.model_id,
                   "system_fingerprint": self.fingerprint,
                   "choices": [{"index": i, "delta": delta, "finish_reason": finish,
                                "logprobs": chat_logprobs(entries, tok) if want_lp and entries else None}]}
            if plan.include_usage:
                obj["usage"] = None
            return _sse(obj)

        async def events():
            held = [[] for _ in jobs]       # logprob entries waiting for their text's chunk
            dones = []
            for i in range(len(jobs)):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for i, kind, payload in merged(jobs):
                if kind == "logprobs":
                    held[i].extend(payload)
                elif kind == "text" or kind == "done":
                    parts, calls = (outs[i].push(payload), None) if kind == "text" else outs[i].finish()
                    for part, text in parts:
                        yield chunk(i, {"reasoning_content" if part == "reasoning" else "content": text},
                                    entries=held[i])
                        held[i] = []
                    if kind == "done":
                        if calls:
                            yield chunk(i, {"tool_calls": [dict(c, index=k) for k, c in enumerate(calls)]})
                        yield chunk(i, {}, "tool_calls" if calls else payload["finish_reason"], entries=held[i])
                        dones.append(payload)
                else:
                    yield _sse(payload.body())
                    yield "data: [DONE]\n\n"
                    return
            if plan.include_usage:
                yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                            "model": self.cfg.model_id, "system_fingerprint": self.fingerprint,
                            "choices": [], "usage": _usage(starts, dones)})
            yield "data: [DONE]\n\n"
        return self._stream(jobs, events())

    async def completions(self, request):
        from starlette.responses import JSONResponse
        raw = await self._body(request)
        plan = await asyncio.to_thread(lambda: plan_completion(parse_json(raw), self.engine, self.cfg))
        rid, created, tok = "cmpl-" + secrets.token_hex(12), _now(), self.engine.tokenizer
        jobs, starts = await self._start(plan, request)
        want_lp = plan.logprobs is not None

        def choice(i: int, text: str, finish=None, entries=None, offset: int = 0) -> dict:
            return {"text": text, "index": i, "finish_reason": finish,
                    "logprobs": completion_logprobs(entries or [], tok, offset) if want_lp else None}

        def obj(choices: list, usage=None) -> dict:
            o = {"id": rid, "object": "text_completion", "created": created, "model": self.cfg.model_id,
                 "system_fingerprint": self.fingerprint, "choices": choices}
            if usage is not None or plan.include_usage:
                o["usage"] = usage
            return o

        if not plan.stream:
            res = await self._collect(jobs, request)
            return JSONResponse(obj([choice(i, "".join(p), d["finish_reason"], e) for i, (p, e, d) in enumerate(res)],
                                    _usage(starts, [d for _, _, d in res])))

        async def events():
            held, sent, dones = [[] for _ in jobs], [0] * len(jobs), []
            async for i, kind, payload in merged(jobs):
                if kind == "logprobs":
                    held[i].extend(payload)
                elif kind == "text":
                    yield _sse(obj([choice(i, payload, entries=held[i], offset=sent[i])]))
                    held[i], sent[i] = [], sent[i] + len(payload)
                elif kind == "done":
                    yield _sse(obj([choice(i, "", payload["finish_reason"], held[i], sent[i])]))
                    dones.append(payload)
                else:
                    yield _sse(payload.body())
                    yield "data: [DONE]\n\n"
                    return
            if plan.include_usage:
                yield _sse(dict(obj([]), usage=_usage(starts, dones)))
            yield "data: [DONE]\n\n"
        return self._stream(jobs, events())


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


def listen_socket(host: str, port: int):
    """A socket bound to (host, port), taken before the model loads: a port in use fails in a second, not after
    the load. uvicorn serves on it."""
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
