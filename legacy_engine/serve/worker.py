"""The worker: one thread that owns the engine and its one Session, and runs the queued Jobs one at a time, in
order of arrival (server.py's docstring tells how a request flows)."""
from __future__ import annotations

import asyncio
import queue
import threading
from collections import deque
from dataclasses import dataclass

from ..core.errors import Cancelled, ContextLengthError
from .sampling import Sampler
from .schema import APIError, Plan


def fresh_prefill(session, ids, cancel=None, images=None):
    """The default prefill seam: the whole prompt from an empty state (images: generate.PromptImages)."""
    session.reset()
    return session.prefill(ids, cancel=cancel, images=images)


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
        if plan.images:   # the cache keys the images' rows by their pixels' digests
            logits = self.prefill(sess, plan.ids, cancel=lambda: job.cancelled,
                                  images=self.engine.encode_images(plan.spans, plan.images))
        else:
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
