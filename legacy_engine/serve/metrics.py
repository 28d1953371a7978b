"""GET /metrics: the worker's counters and the prefix cache's stats as Prometheus text."""
from __future__ import annotations

from .worker import Worker


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
    metric("decode_tokens_total", "counter", "Tokens run through decode steps (every sequence of a step).",
           c.decode_tokens)
    metric("decode_seconds_total", "counter", "Seconds spent in decode steps (wall time: a step's sequences share "
           "it).", float(c.decode_s))
    metric("prefill_tokens_per_second", "gauge", "Prefill speed since start (prefill tokens / seconds).",
           float(c.prefill_tokens / c.prefill_s if c.prefill_s else 0.0))
    metric("decode_tokens_per_second", "gauge", "Aggregate decode speed since start (decode tokens / seconds).",
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
    metric("requests_running", "gauge", "Requests being generated (prompt or decode).", worker.running)
    metric("slots", "gauge", "Generations the worker runs at once (--parallel).", worker.parallel)
    metric("slots_used", "gauge", "Slots holding a generation in decode.", len(worker.slots))
    sizes = list(worker.batch_sizes)
    metric("decode_batch_size", "gauge", "Sequences per decode step, mean of the last 256 steps.",
           float(sum(sizes) / len(sizes)) if sizes else 0.0)
    metric("decode_steps_total", "counter", "Decode steps run (each advances every running sequence).",
           c.decode_steps)
    return "\n".join(lines) + "\n"
