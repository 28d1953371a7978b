"""Token sampling: greedy, temperature, top-k, top-p, min-p, repetition / presence / frequency penalties, seeded.

The order follows llama.cpp's default chain: penalties; top-k, top-p and min-p on the T = 1 softmax of the
penalised logits, in the order "logit descending, id ascending"; the temperature over the tokens kept; a draw.
The C core does the work (native/sample.c, le_sample.h) in a few passes over the vocabulary, without sorting it;
the seed stays here: each sampled token takes one rng.random(), inverted over the kept tokens in id order."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..core import _native


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
        return self.draw(logits, self.next_u(), history)

    def next_u(self) -> float:
        """The uniform draw of the next token (0 when greedy: the seed's stream is not advanced)."""
        return 0.0 if self.greedy else self.rng.random()

    def draw(self, logits: np.ndarray, u: float, history: list[int] | None = None) -> int:
        """sample() with the draw u given (next_u())."""
        x = np.ascontiguousarray(logits, dtype=np.float32).reshape(-1)
        ids, counts = self.penalty_counts(history)
        return self.native.draw(x, u, ids, counts)

    def filters(self, n_vocab: int) -> tuple[int, float, float] | None:
        """(top_k, top_p, min_p) that bound the tokens a draw can keep without looking at the whole row (a GPU's
        candidates, cuda8/sample_cut.cu): greedy is top-k 1; with top-k its whole set (top-p is a fraction of its
        mass); None when nothing bounds them (temperature alone) and the whole row is needed."""
        p = self.params
        if self.greedy:
            return 1, 1.0, 0.0
        if 0 < p.top_k < n_vocab:
            return p.top_k, 1.0, 0.0
        if p.top_p >= 1.0 and p.min_p <= 0.0:
            return None
        return 0, p.top_p, p.min_p

    def draw_candidates(self, ids: np.ndarray, x: np.ndarray, n_vocab: int, total: float, rest_max: float,
                        u: float) -> int | None:
        """The token draw(row, u) gives, from the row's candidates (le_sample_cand: ids int32[n], their logits
        float32[n], the head of the row by logit; total: the row's sum of exp(x - max); rest_max: the largest logit
        left out); None when the kept set may reach past them. Not with penalties (they change the row)."""
        t = self.native.draw_candidates(ids, x, n_vocab, total, rest_max, u)
        return None if t < 0 else t

    def window_cut(self, ids: np.ndarray, x: np.ndarray, base: float, total: float,
                   max_logit: float) -> tuple[float, int] | None:
        """Top-p's (then min-p's) cut from the band of the row where it lies (le_sample_window_cut: ids / x the
        band's tokens, base the mass ranked before them, total the row's): (cut_logit, cut_id), the kept set being
        x > cut_logit or x == cut_logit and id <= cut_id; None when the target is not crossed in the band."""
        return self.native.window_cut(ids, x, base, total, max_logit)

    def probs(self, logits: np.ndarray, history: list[int] | None = None) -> np.ndarray:
        """The distribution sample() draws from: float64[n_vocab], zero outside the kept tokens, one-hot when
        greedy."""
        x = np.ascontiguousarray(logits, dtype=np.float32).reshape(-1)
        ids, counts = self.penalty_counts(history)
        return self.native.probs(x, ids, counts)


class LogprobSampler:
    """A sampler that also reports, for every token it draws, the token's log-probability under the model's own
    distribution (the log-softmax of the raw logits, before temperature, penalties, filters or a grammar's mask: what
    the model believes, whatever the draw's settings) and the `top` most likely tokens with theirs. `entries` collects
    (token, logprob, [(id, logprob), …]) until taken (take())."""

    needs_row = True     # the whole row is needed for its log-softmax: a GPU's candidate sampling cannot give it

    def __init__(self, inner, top: int):
        self.inner, self.top = inner, top
        self.entries: list[tuple[int, float, list[tuple[int, float]]]] = []

    @property
    def stopped(self) -> bool:
        return getattr(self.inner, "stopped", False)

    def sample(self, logits: np.ndarray, history: list[int] | None = None) -> int:
        t = self.inner.sample(logits, history)
        x = np.asarray(logits, dtype=np.float64).reshape(-1)
        lse = float(np.log(np.exp(x - x.max()).sum()) + x.max())
        alts = []
        if self.top:
            ids = np.argpartition(-x, self.top - 1)[:self.top]
            ids = ids[np.lexsort((ids, -x[ids]))]                 # by logit, lower id first on ties
            alts = [(int(i), float(x[i] - lse)) for i in ids]
        self.entries.append((int(t), float(x[t] - lse), alts))
        return t

    def take(self) -> list[tuple[int, float, list[tuple[int, float]]]]:
        out, self.entries = self.entries, []
        return out
