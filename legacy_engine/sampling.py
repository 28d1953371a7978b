"""Token sampling: greedy, temperature, top-k, top-p, min-p, repetition / presence /
frequency penalties, seeded. The order follows llama.cpp's default chain: penalties,
top-k, top-p, min-p, temperature, then a draw."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
    def __init__(self, params: SamplingParams | None = None):
        self.params = params or SamplingParams()
        self.params.validate()
        self.rng = np.random.default_rng(self.params.seed)

    def apply_penalties(self, logits: np.ndarray, history: list[int]) -> np.ndarray:
        p = self.params
        if not history or p.penalty_last_n == 0 or (
                p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0):
            return logits
        recent = np.asarray(history[-p.penalty_last_n:], dtype=np.int64)
        ids, counts = np.unique(recent, return_counts=True)
        out = logits.copy()
        sel = out[ids]
        if p.repetition_penalty != 1.0:  # CTRL-style: shrink positive logits, push negative ones down
            sel = np.where(sel > 0, sel / p.repetition_penalty, sel * p.repetition_penalty)
        sel = sel - counts * p.frequency_penalty - p.presence_penalty
        out[ids] = sel
        return out

    def sample(self, logits: np.ndarray, history: list[int] | None = None) -> int:
        """logits: float32[n_vocab] -> a token id."""
        p = self.params
        x = self.apply_penalties(np.asarray(logits, dtype=np.float32), history or [])
        if p.temperature == 0.0:
            return int(np.argmax(x))
        ids = np.argsort(-x, kind="stable")
        if p.top_k > 0:
            ids = ids[:p.top_k]
        z = x[ids].astype(np.float64)
        probs = np.exp(z - z[0])
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            ids, z = ids[:keep], z[:keep]
            probs = probs[:keep] / probs[:keep].sum()
        if p.min_p > 0.0:
            keep = probs >= p.min_p * probs[0]
            ids, z = ids[keep], z[keep]
        z = z / p.temperature
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        return int(ids[self.rng.choice(len(ids), p=probs)])
