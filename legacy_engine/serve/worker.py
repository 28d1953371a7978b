"""The worker: one thread that owns the engine and its sessions (one per slot), and runs the queued Jobs in order of
arrival, up to `parallel` at once, their decode steps batched (server.py's docstring tells how a request flows)."""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from ..core.errors import Cancelled, ContextLengthError
from .generate import PREFILL_BATCH, PREFILL_CALL_S, PREFILL_SHARED, batched_decode
from .grammar import ConstrainedSampler
from .sampling import LogprobSampler, Sampler
from .schema import APIError, Plan


def fresh_prefill(session, ids, cancel=None, images=None, step=None):
    """The default prefill seam: the whole prompt from an empty state (images: generate.PromptImages; step:
    Session.prefill's)."""
    session.reset()
    return session.prefill(ids, cancel=cancel, images=images, step=step)


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
    decode_steps: int = 0
    jobs_done: int = 0
    jobs_cancelled: int = 0
    jobs_failed: int = 0


class Slot:
    """One running generation: its job, its session (a state of its own), the sampler and the text stream; `token`
    is the last sampled token, not yet run through the model."""

    def __init__(self, job: Job, session, sampler, tokenizer):
        self.job, self.session, self.sampler, self.tok = job, session, sampler, tokenizer
        self.decoder = tokenizer.stream()
        self.hold = max((len(s) for s in job.plan.stop), default=1) - 1   # chars that may still start a stop string
        self.pending, self.n, self.finish, self.cut_by_stop = "", 0, None, False
        self.token: int | None = None
        self.cached = 0

    def push(self, token: int) -> None:
        """A sampled token: counted, streamed (held back while it may start a stop string), finish set when the
        generation ends with it."""
        plan, self.token = self.job.plan, token
        self.n += 1
        entries = self.sampler.take() if isinstance(self.sampler, LogprobSampler) else None
        if token in self.tok.eos_ids:
            self.finish = "stop"
            return
        if entries:     # ahead of the token's text (the end-of-generation token has none, as its text)
            self.job.send("logprobs", entries)
        self.pending += self.decoder.push(token)
        cut = min((self.pending.find(s) for s in plan.stop if s in self.pending), default=-1)
        if cut >= 0:
            self.pending, self.finish, self.cut_by_stop = self.pending[:cut], "stop", True
            return
        if len(self.pending) > self.hold:
            self.job.send("text", self.pending[:len(self.pending) - self.hold])
            self.pending = self.pending[len(self.pending) - self.hold:]
        if getattr(self.sampler, "stopped", False):     # response_format's document is complete
            self.finish = "stop"
        elif self.n >= plan.max_tokens:   # max_tokens fits the context: the plan checked it
            self.finish = "length"


class Worker:
    """Runs the jobs on one thread, up to `parallel` at once (each in a slot of its own: a session, a state), taken
    in the order submitted (FIFO).

    A step decodes one token of every running job together (batch_decode: the engine reads each weight once for
    all of them where it can). A new job's prompt is run by prefill(session, ids, cancel) -> float32[n_vocab], the
    seam through which prompts run: by default a fresh prefill, with `cache` the PrefixCache's (shared by every
    slot). Between the prompt's chunks (each cancel() call) the running jobs take one decode step, so a long prompt
    does not stall them, and waiting jobs start (their prompts run inside it); where the engine has a yield hook (the
    CPU engine: Model.set_yield) a job submitted during a call starts between two of its layers (_between_layers).
    cancel() raises Cancelled when that job was cancelled. make_sampler(params) -> an object
    with sample(logits, history) -> id: a seam for tests that need scripted output. max_queue bounds the jobs
    waiting (not counting the running ones)."""

    def __init__(self, engine, cache=None, prefill=None, max_queue: int = 256, parallel: int = 1):
        if parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel}")
        self.engine = engine
        self.cache = cache
        self.parallel = parallel
        self.sessions = [engine.session() for _ in range(parallel)]
        self.session = self.sessions[0]
        self.prefill = prefill or (cache.prefill if cache is not None else fresh_prefill)
        cpu = getattr(engine, "cpu_model", None)   # its pool runs the sampler's passes (idle between forwards)
        self.make_sampler = lambda params: Sampler(params, model=cpu)
        self.batched = batched_decode(engine)
        self.max_queue = max_queue
        self.counters = Counters()
        self.log: deque = deque(maxlen=4096)  # (seq, finish_reason, prompt_tokens, completion_tokens), in order ended
        self.admitted: deque = deque(maxlen=4096)     # job seqs in the order their prompts started
        self.slots: list[Slot] = []           # running generations, in order admitted
        self.admitting: list = []             # (job, session) of the prompts running now (a short one inside a long)
        self.batch_sizes: deque = deque(maxlen=256)   # sequences of each recent decode step
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._seq = 0
        self._stopping = False
        self._yield = None          # the engine's yield hook (set while the thread runs, where the engine has one)
        self._yield_ok = False      # the thread is inside a top-level prompt's forward call: the hook may admit
        self._hook_s = 0.0          # seconds spent in the hook's admissions (inside other prompts' forward calls)
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

    @property
    def running(self) -> int:
        """Jobs admitted and not ended (prefilling or decoding)."""
        return len(self.slots) + len(self.admitting)

    @property
    def current(self) -> Job | None:
        """A running job (the oldest), or None when idle."""
        if self.admitting:
            return self.admitting[0][0]
        return self.slots[0].job if self.slots else None

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._stopping:
                raise _shutting_down()
            if self._queue.qsize() >= self.max_queue:
                raise APIError(503, f"the queue is full ({self.max_queue} requests waiting); retry later",
                               "server_error", code="queue_full")
            job.seq, self._seq = self._seq, self._seq + 1
            self._queue.put(job)
            if self._yield is not None:
                self._yield.wake()

    def stop(self) -> None:
        """Refuses new jobs, cancels the running ones and every queued one: each gets a 503 shutting_down (a stream:
        an error event), and the thread ends after them."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            for job in self._running_jobs():
                job.cancel(_shutting_down())
            self._queue.put(None)

    def close(self, timeout: float = 10.0) -> None:
        """stop(), then waits for the thread."""
        self.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the thread

    def _running_jobs(self) -> list[Job]:
        jobs = [s.job for s in self.slots]
        return jobs + [job for job, _ in self.admitting]

    def _run(self) -> None:
        model = self.engine.model
        can_yield = hasattr(model, "set_yield")      # the CPU engine's calls can yield between layers
        self._yield = model.set_yield(self._between_layers) if can_yield else None
        try:
            self._loop()
        finally:
            if can_yield:
                model.clear_yield(self._yield)
            self._yield = None

    def _loop(self) -> None:
        ended = False
        while not ended or self.slots:
            if not ended and len(self.slots) < self.parallel:
                try:    # wait for work only when nothing runs
                    job = self._queue.get(block=not self.slots)
                except queue.Empty:
                    job = False
                if job is None:
                    ended = True
                elif job:
                    self._admit(job, self._free_session())
                    continue    # fill every free slot before the next step
            self._step()

    def _free_session(self):
        """A session no slot and no running prompt holds, or None."""
        used = {id(s.session) for s in self.slots} | {id(sess) for _, sess in self.admitting}
        return next((s for s in self.sessions if id(s) not in used), None)

    def _admit_waiting(self) -> None:
        """Between a long prompt's chunks: the jobs waiting while a session is free start now (their prompts run to
        the end inside this one's; FIFO still: they are taken in order), so a short request does not wait for a long
        prompt to finish."""
        while (session := self._free_session()) is not None:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is None:       # stop(): the sentinel goes back for _run
                self._queue.put(None)
                return
            self._admit(job, session, nested=True)

    def _between_layers(self) -> None:
        """The engine's yield hook, woken by submit(): between two layers of a top-level prompt's forward call, the
        waiting jobs start (_admit_waiting), so a short request waits for one layer of a long prompt's call, not the
        whole call. Anywhere else (a decode step, a nested prompt, between calls) it does nothing: the job waits for
        the next call boundary or the loop."""
        if not self._yield_ok:
            return
        self._yield_ok = False
        t0 = time.perf_counter()
        try:
            self._admit_waiting()
        finally:
            self._hook_s += time.perf_counter() - t0
            self._yield_ok = True

    def _prefill_step(self) -> int:
        """A prompt's next forward call: the multiple of PREFILL_SHARED tokens that the prompts served so far say
        takes about PREFILL_CALL_S (PREFILL_SHARED at least, PREFILL_BATCH at most): the running jobs step between
        calls, and a request that arrives starts at the next call (between two layers where the engine yields), so
        calls are short even on an idle server. The rate counts each prompt's own calls (_admit)."""
        c = self.counters
        rate = c.prefill_tokens / c.prefill_s if c.prefill_s > 0 else 0.0
        fits = int(rate * PREFILL_CALL_S) // PREFILL_SHARED * PREFILL_SHARED
        return max(PREFILL_SHARED, min(PREFILL_BATCH, fits))

    def _end(self, job: Job, finish: str, prompt: int, n: int, err: APIError | None = None) -> None:
        self.log.append((job.seq, finish, prompt, n))
        if err is not None:
            job.send("error", err)

    def _admit(self, job: Job, session, nested: bool = False) -> None:
        """Runs the job's prompt in `session` (between its chunks the running jobs step and, unless nested in
        another's, waiting jobs start), samples its first token and gives it a slot; a job cancelled before or during
        its prompt ends here."""
        if self._stopping:
            job.cancel(_shutting_down())
        if job.cancelled:   # its client left while it waited, or the server is stopping
            self.counters.jobs_cancelled += 1
            self._end(job, "cancelled", len(job.plan.ids), 0, job.error or APIError(
                503, "the request was cancelled before it ran", "server_error", code="cancelled"))
            return
        plan, c = job.plan, self.counters
        self.admitted.append(job.seq)
        t = session.timings
        p0, ps0, h0 = t.prefill_tokens, t.prefill_s, self._hook_s
        inner = [0.0]       # seconds of other work inside this prompt's prefill (steps, prompts admitted inside it)
        self.admitting.append((job, session))
        if self._stopping:   # stop() came between the two checks above
            job.cancel(_shutting_down())

        def between_chunks() -> bool:
            self._yield_ok = False      # the decode steps' passes are not this prompt's
            t0 = time.perf_counter()
            if self.slots:
                self._step()
            if not nested:
                self._admit_waiting()
                self._yield_ok = True
            inner[0] += time.perf_counter() - t0
            return job.cancelled
        try:
            kw = {"images": self.engine.encode_images(plan.spans, plan.images)} if plan.images else {}
            self._yield_ok = not nested
            logits = self.prefill(session, plan.ids, cancel=between_chunks, step=self._prefill_step, **kw)
            sampler = self.make_sampler(plan.params)
            if plan.grammar is not None:   # response_format: the document after the reasoning, if any
                sampler = ConstrainedSampler(sampler, self.engine.tokenizer, self.engine.model.hparams.n_vocab,
                                             plan.grammar, armed=not plan.thinking)
            if plan.logprobs is not None:  # outermost: it reports the model's row, not the masked one
                sampler = LogprobSampler(sampler, plan.logprobs)
            slot = Slot(job, session, sampler, self.engine.tokenizer)
            slot.cached = max(0, len(plan.ids) - (t.prefill_tokens - p0))  # the cache counts only what it ran
            job.send("start", {"prompt_tokens": len(plan.ids), "cached_tokens": slot.cached})
            if job.cancelled:
                slot.finish = "cancelled"
            else:
                slot.push(slot.sampler.sample(logits, session.tokens))
        except Cancelled:   # between prompt chunks: its client left, or the server is stopping
            c.jobs_cancelled += 1
            self._end(job, "cancelled", len(plan.ids), 0, job.error or APIError(
                499, "the client closed the connection", code="client_closed_request"))
            return
        except Exception as e:  # the worker outlives any one request
            self._fail(job, e)
            return
        finally:
            if not nested:
                self._yield_ok = False
            self.admitting.remove((job, session))
            c.prefill_tokens += t.prefill_tokens - p0
            # its own forward calls only: the prefill's clock also ran through the work done inside it
            c.prefill_s += max(0.0, t.prefill_s - ps0 - inner[0] - (self._hook_s - h0))
        self.slots.append(slot)
        if slot.finish is not None:
            self._retire(slot)

    def _fail(self, job: Job, e: Exception) -> None:
        if isinstance(e, ContextLengthError):
            err = APIError(400, str(e), code="context_length_exceeded")
        else:
            err = APIError(500, f"generation failed: {type(e).__name__}: {e}", "server_error")
        self.counters.jobs_failed += 1
        self._end(job, "error", len(job.plan.ids), 0, err)

    def _step(self) -> None:
        """One decode step of every running job that goes on (the cancelled ones end first)."""
        for s in [s for s in self.slots if s.job.cancelled]:
            s.finish = "cancelled"
            self._retire(s)
        if not self.slots:
            return
        slots = list(self.slots)
        t0 = time.perf_counter()
        try:
            nxt = self.batched([s.session for s in slots], [s.token for s in slots], [s.sampler for s in slots])
        except Exception as e:   # the step's jobs fail together; their sessions are reset by Session
            for s in slots:
                self.slots.remove(s)
                self._fail(s.job, e)
            return
        self.counters.decode_tokens += len(slots)
        self.counters.decode_steps += 1
        self.counters.decode_s += time.perf_counter() - t0
        self.batch_sizes.append(len(slots))
        for s, token in zip(slots, nxt):
            s.push(token)
            if s.finish is not None:
                self._retire(s)

    def _retire(self, slot: Slot) -> None:
        """A slot whose generation ended: the rest of its text, its counts, its last event; the slot is free."""
        self.slots.remove(slot)
        job, plan, c = slot.job, slot.job.plan, self.counters
        if not slot.cut_by_stop:
            slot.pending += slot.decoder.flush()
        if slot.pending and slot.finish != "cancelled":
            job.send("text", slot.pending)
        c.prompt_tokens += len(plan.ids)
        c.cached_tokens += slot.cached
        c.completion_tokens += slot.n
        c.jobs_cancelled += slot.finish == "cancelled"
        c.jobs_done += slot.finish != "cancelled"
        self.log.append((job.seq, slot.finish, len(plan.ids), slot.n))
        if slot.finish == "cancelled" and job.error is not None:  # the server is stopping; the client still listens
            job.send("error", job.error)
        else:
            job.send("done", {"finish_reason": slot.finish, "completion_tokens": slot.n})


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", "server_error", code="shutting_down")
