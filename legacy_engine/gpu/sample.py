"""Sampling where the logits are: the GPU chooses the sampler's candidates (cuda8/sample_cut.cu) and only they
cross the link (a few kilobytes instead of the 1 MB row of a 248k vocabulary); le_sample_cand (native/sample.c)
draws from them the token le_sample would draw from the whole row with the same u. When top-p keeps more tokens
than may cross (a flat row), only the bin its cut lies in crosses, le_sample_window_cut finds the cut there and the
GPU draws (sample_draw): again le_sample's token for that u, to the rounding of a float exp.

The whole row is downloaded instead, and sampled as on the CPU, when
- the penalties apply (they change logits the GPU has not seen),
- nothing bounds the kept set (temperature alone),
- the kept set is larger than CAP and not top-p's (top-k above CAP, min-p on a flat row), or top-p's bin is,
- a logit is not finite (then check_logits names the position),
- le_sample_cand / le_sample_window_cut cannot prove the kept set from what crossed (a rounding at a bin's edge),
- the temperature is so low that 1/T overflows a float (le_sample's double path).
`stats` counts the three outcomes (`legacy-engine bench gpu` prints them)."""
from __future__ import annotations

import numpy as np

from .. import gpu
from ..cpu.model import check_logits

CAP = 16384      # candidates that may cross the link: 128 KB, ~10 us of PCIe, ~0.1 ms to sort on the host
FIRST = 1024     # candidates read with the head in one copy (the usual case: top-k 40, top-p of a peaked row)
FIX = float(2 ** gpu.SAMPLE_FIX_BITS)   # the kernels' fixed-point masses


class DeviceSampler:
    """The device buffers of sample_cut / sample_draw (work: zeroed once, left zeroed by each call; out: head + CAP
    pairs; bsum: the draw's block sums) and their launches, recorded once per row buffer and filters and replayed
    (a Python launch costs ~30 us, a replayed one ~1 us)."""

    def __init__(self, kernels: gpu.Kernels, n_vocab: int):
        self.k, self.n_vocab = kernels, n_vocab
        self.cap = min(CAP, n_vocab)
        self.work = gpu.Buffer.from_array(np.zeros(gpu.SAMPLE_WORK_BYTES, np.uint8), "sampler work")
        self.out = gpu.Buffer(gpu.SAMPLE_HEAD.itemsize + 8 * self.cap, "sampler candidates")
        self.bsum = gpu.Buffer(8 * gpu.Kernels.draw_blocks(n_vocab), "sampler block sums")
        self.stats = {"candidates": 0, "window": 0, "row": 0}
        self._plans: dict = {}

    def _run(self, key, launch) -> None:
        """launch() now: recorded the first time for `key`, replayed after (the buffers it names stay put)."""
        plan = self._plans.get(key)
        if plan is not None:
            plan.replay()
            return
        if len(self._plans) >= 16:      # a long-running server's parameter sets: keep the recent ones
            self._plans.clear()
        with gpu.record() as launches:
            launch()
        self._plans[key] = gpu.LaunchPlan(launches)

    def close(self) -> None:
        self._plans = {}
        for b in (self.work, self.out, self.bsum):
            b.free()

    def sample(self, logits: gpu.Buffer, sampler, history: list[int] | None, pos: int) -> int:
        """The next token from the row logits[n_vocab] (f32, on the device, at position pos) under `sampler`
        (sampling.Sampler: its params, its seed's next u, its le_sample_cand)."""
        u = sampler.next_u()
        f = None if sampler.penalty_counts(history)[0] is not None else sampler.filters(self.n_vocab)
        if f is not None:
            t = self._from_device(logits, sampler, f, u)
            if t is not None:
                return t
        self.stats["row"] += 1
        row = logits.download(dtype=np.float32, count=self.n_vocab)
        check_logits(row[None], pos)
        return sampler.draw(row, u, history)

    def _from_device(self, logits: gpu.Buffer, sampler, f: tuple[int, float, float], u: float) -> int | None:
        top_k, top_p, min_p = f
        self._run(("cut", logits.ptr, f), lambda: self.k.sample_cut(logits, self.work, self.out, self.n_vocab, top_k,
                                                                    top_p, min_p, self.cap))
        hb = gpu.SAMPLE_HEAD.itemsize
        raw = self.out.download(dtype=np.uint8, count=hb + 8 * min(FIRST, self.cap))
        head = raw[:hb].view(gpu.SAMPLE_HEAD)[0]
        n = int(head["n_cand"])
        if n <= 0:            # -1: a non-finite logit, -2: more than cap
            return None
        if n > FIRST:
            raw = self.out.download(dtype=np.uint8, count=hb + 8 * n)
        pairs = raw[hb:hb + 8 * n].view(np.int32).reshape(n, 2)
        ids, x = pairs[:, 0], pairs[:, 1].view(np.float32)
        if int(head["mode"]) == 1:
            return self._window(logits, sampler, head, ids, x, u)
        key = int(head["rest_key"])
        rest_max = -np.inf if key == -2**31 else float(
            np.array([key if key >= 0 else key ^ 0x7fffffff], np.int32).view(np.float32)[0])
        t = sampler.draw_candidates(ids, x, self.n_vocab, int(head["z"]) / FIX, rest_max, u)
        if t is not None:
            self.stats["candidates"] += 1
        return t

    def _window(self, logits: gpu.Buffer, sampler, head, ids: np.ndarray, x: np.ndarray, u: float) -> int | None:
        inv_t = 1.0 / sampler.params.temperature
        if not inv_t <= 2.0 ** 64:      # a float product would lose the argument: le_sample's double path
            return None
        cut = sampler.window_cut(ids, x, int(head["base"]) / FIX, int(head["z"]) / FIX, float(head["m"]))
        if cut is None:
            return None
        self.k.set_draw(self.out, inv_t, cut[0], cut[1], u)
        self._run(("draw", logits.ptr), lambda: self.k.sample_draw(logits, self.out, self.bsum, self.n_vocab))
        t = int(self.out.download(dtype=np.uint8, count=gpu.SAMPLE_HEAD.itemsize).view(gpu.SAMPLE_HEAD)[0]["token"])
        self.stats["window"] += 1
        return t
