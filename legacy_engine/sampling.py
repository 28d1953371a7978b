"""Token sampling: greedy, temperature, top-k, top-p, min-p, repetition / presence / frequency penalties, seeded.

The order follows llama.cpp's default chain: penalties; top-k, top-p and min-p on the T = 1 softmax of the
penalised logits, in the order "logit descending, id ascending"; the temperature over the tokens kept; a draw.
The C core does the work (native/sample.c, le_sample.h) in a few passes over the vocabulary, without sorting it;
the seed stays here: each sampled token takes one rng.random(), inverted over the kept tokens in id order."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import _native


@dataclass
class SamplingParams:
    temperature: float = 0.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0                # 1 = off
    min_p: float = 0.0                # 0 = off
    repetition_penalty: float = 1.0   # 1 = off; > 1 discourages tokens already seen
    presence_penalty: float = 0.0     # subtracted once from seen tokens' logits
    frequency_penalty: float = 0.0    # subtracted per occurrence
    penalty_last_n: int = 64          # how many recent tokens the penalties look at
    seed: int | None = None

    def validate(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.penalty_last_n < 0:
            raise ValueError(f"penalty_last_n must be >= 0, got {self.penalty_last_n}")


class Sampler:
    """Draws tokens with `params` from float32 logits; one per sequence (the seed's stream is its own).

    model: a CPU engine (model.Model, or its NativeModel) whose thread pool runs the sampler's passes over the
    vocabulary: for a GPU engine its `cpu_model`, idle while the GPU decodes. The tokens are the same with or
    without it, for any thread count. Not while that model runs a forward on another thread (one pool, one job)."""

    def __init__(self, params: SamplingParams | None = None, model=None):
        self.params = p = params or SamplingParams()
        p.validate()
        self.rng = np.random.default_rng(p.seed)
        # 1 / T not finite (T = 1e-320): greedy, as T = 0 (the C core decides the same way)
        self.greedy = p.temperature == 0.0 or not math.isfinite(1.0 / p.temperature)
        self.penalised = p.penalty_last_n > 0 and (
            p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0)
        self.native = _native.NativeSampler(p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty,
                                            p.presence_penalty, p.frequency_penalty,
                                            model=getattr(model, "native", model))

    def penalty_counts(self, history: list[int] | None) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The distinct ids among the last penalty_last_n tokens of history and how often each occurs (int32),
        or (None, None) when no penalty applies."""
        if not history or not self.penalised:
            return None, None
        ids, counts = np.unique(np.asarray(history[-self.params.penalty_last_n:], dtype=np.int64),
                                return_counts=True)
        return ids.astype(np.int32), counts.astype(np.int32)

    def apply_penalties(self, logits: np.ndarray, history: list[int]) -> np.ndarray:
        """The penalised logits as numpy computes them (a copy; the input is not modified): the arithmetic the C
        sampler applies to the same tokens (tests/test_sampling.py holds the two to the bit)."""
        ids, counts = self.penalty_counts(history)
        if ids is None:
            return logits
        p = self.params
        out = logits.copy()
        sel = out[ids]
        if p.repetition_penalty != 1.0:  # CTRL-style: shrink positive logits, push negative ones down
            sel = np.where(sel > 0, sel / p.repetition_penalty, sel * p.repetition_penalty)
        sel = sel - counts.astype(np.int64) * p.frequency_penalty - p.presence_penalty
        out[ids] = sel
        return out

    def sample(self, logits: np.ndarray, history: list[int] | None = None) -> int:
        """logits: float32[n_vocab] -> a token id. Greedy (the argmax, lowest id on ties) draws nothing from the
        seed. NaN or +inf logits raise NativeError."""
        x = np.ascontiguousarray(logits, dtype=np.float32).reshape(-1)
        ids, counts = self.penalty_counts(history)
        return self.native.draw(x, 0.0 if self.greedy else self.rng.random(), ids, counts)

    def probs(self, logits: np.ndarray, history: list[int] | None = None) -> np.ndarray:
        """The distribution sample() draws from: float64[n_vocab], zero outside the kept tokens, one-hot when
        greedy."""
        x = np.ascontiguousarray(logits, dtype=np.float32).reshape(-1)
        ids, counts = self.penalty_counts(history)
        return self.native.probs(x, ids, counts)
