"""The choices of one request: `n` jobs (one per choice, each in a slot of its own), their events merged in arrival
order, and per-token logprobs in the two shapes OpenAI's APIs use.

Choice i draws with seed + i, so a seeded request stays reproducible and its choices still differ. The choices share
the prompt: the first one's prefill leaves it in the prefix cache and the others restore it (an exact repeat costs a
restore, not a prefill)."""
from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import AsyncIterator

from ..format.tokenizer import Tokenizer
from .schema import Plan
from .worker import Job


def choice_plans(plan: Plan) -> list[Plan]:
    """The n one-choice plans of a request."""
    if plan.n == 1:
        return [plan]
    seed = plan.params.seed
    return [replace(plan, n=1, params=replace(plan.params, seed=None if seed is None else (seed + i) % 2**64))
            for i in range(plan.n)]


async def merged(jobs: list[Job]) -> AsyncIterator[tuple[int, str, object]]:
    """(choice, kind, payload) of every job's events as they arrive; ends once every job is done, or at the first
    error (which is yielded)."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, job: Job) -> None:
        while True:
            kind, payload = await job.events.get()
            await q.put((i, kind, payload))
            if kind in ("done", "error"):
                return
    tasks = [asyncio.ensure_future(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        left = len(jobs)
        while left:
            i, kind, payload = await q.get()
            yield i, kind, payload
            if kind == "error":
                return
            left -= kind == "done"
    finally:
        for t in tasks:
            t.cancel()


def _alt(tok: Tokenizer, t: int, lp: float) -> dict:
    return {"token": tok.decode([t]), "logprob": lp, "bytes": list(tok.token_bytes(t))}


def chat_logprobs(entries: list, tok: Tokenizer) -> dict:
    """Chat's shape: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]} of the
    sampler's entries (sampling.LogprobSampler)."""
    return {"content": [dict(_alt(tok, t, lp), top_logprobs=[_alt(tok, a, alp) for a, alp in alts])
                        for t, lp, alts in entries]}


def completion_logprobs(entries: list, tok: Tokenizer, offset: int = 0) -> dict:
    """The completions API's shape: tokens, token_logprobs, top_logprobs ({token: logprob}), text_offset (characters
    into the text, from `offset`)."""
    tokens = [tok.decode([t]) for t, _, _ in entries]
    offsets, at = [], offset
    for s in tokens:
        offsets.append(at)
        at += len(s)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{tok.decode([a]): alp for a, alp in alts} for _, _, alts in entries],
            "text_offset": offsets}
