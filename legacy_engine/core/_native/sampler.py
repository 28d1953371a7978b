"""The sampler: native/sample.c (le_sample.h).

Penalties, top-k, top-p, min-p, temperature and one draw over float32 logits in a few O(n_vocab) passes. NaN or
+inf logits: NativeError (LE_ERR_FORMAT); -inf is a masked token.
"""
from __future__ import annotations

import numpy as np

from ._lib import c_int, check, ffi, lib, struct_to_dict
from .isa import ISA_NAMES
from .model import NativeModel

SAMPLE_PATHS = {"greedy": 1, "list": 2, "band": 4, "fallback": 8, "all": 16, "pass": 32, "region": 64}  # info.path
SAMPLE_FORCE = {"all": 1, "miss_high": 2, "miss_low": 4}   # tests: run the paths an estimate rarely takes


class NativeSampler:
    """le_sample with its parameters, scratch buffer (allocated once per vocabulary size) and result kept across
    calls. pen_ids / pen_counts: int32[k], the distinct ids of the penalty window and how often each occurs.
    model: a NativeModel whose thread pool runs the passes over the vocabulary (le_sample_on; the same results for
    any thread count), None: the calling thread only."""

    def __init__(self, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                 repetition_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 force=(), model: "NativeModel | None" = None):
        flags = 0
        for f in force:
            flags |= SAMPLE_FORCE[f]
        self.params = ffi.new("le_sample_params *", {
            "temperature": float(temperature), "top_k": c_int(top_k, "top_k", 0), "top_p": float(top_p),
            "min_p": float(min_p), "repetition_penalty": float(repetition_penalty),
            "presence_penalty": float(presence_penalty), "frequency_penalty": float(frequency_penalty),
            "flags": flags})
        self.info = ffi.new("le_sample_info *")
        self.model = model   # kept alive with the sampler
        self._m = ffi.NULL if model is None else model.ptr
        self._token = ffi.new("int32_t *")
        self._n = 0
        self._cand_scratch = None

    def _args(self, logits: np.ndarray, pen_ids, pen_counts):
        if logits.dtype != np.float32 or logits.ndim != 1 or not logits.flags.c_contiguous:
            raise ValueError("logits: a contiguous float32[n_vocab] array")
        n = logits.size
        if n != self._n:
            self._scratch = np.empty(lib.le_sample_scratch_bytes(n), np.uint8)
            self._scratch_p, self._n = ffi.from_buffer(self._scratch, require_writable=True), n
        if pen_ids is None or len(pen_ids) == 0:
            return ffi.from_buffer("float[]", logits), n, ffi.NULL, ffi.NULL, 0
        ids = np.ascontiguousarray(pen_ids, dtype=np.int32)
        counts = np.ascontiguousarray(pen_counts, dtype=np.int32)
        if ids.shape != counts.shape or ids.ndim != 1:
            raise ValueError(f"pen_ids {ids.shape} and pen_counts {counts.shape}: one 1-D length")
        return (ffi.from_buffer("float[]", logits), n, ffi.from_buffer("int32_t[]", ids),
                ffi.from_buffer("int32_t[]", counts), ids.size)

    def draw(self, logits: np.ndarray, u: float, pen_ids=None, pen_counts=None) -> int:
        """logits: float32[n_vocab]; u: a uniform draw in [0, 1) -> the token (self.info: what was decided)."""
        lp, n, ip, cp, k = self._args(logits, pen_ids, pen_counts)
        check(lib.le_sample_on(self._m, lp, n, ip, cp, k, self.params, float(u), self._scratch_p,
                               self._scratch.size, self._token, self.info), "le_sample")
        return int(self._token[0])

    def draw_candidates(self, ids: np.ndarray, x: np.ndarray, n_vocab: int, total: float, rest_max: float,
                        u: float) -> int:
        """le_sample_cand: ids int32[n] / x float32[n], a head of the row of n_vocab logits -> the token, or -1 when
        the kept set may reach past them."""
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        x = np.ascontiguousarray(x, dtype=np.float32)
        if ids.ndim != 1 or ids.shape != x.shape:
            raise ValueError(f"candidates: ids {ids.shape} and x {x.shape}, one 1-D length")
        need = lib.le_sample_cand_scratch_bytes(ids.size)
        if self._cand_scratch is None or self._cand_scratch.size < need:
            self._cand_scratch = np.empty(max(need, 1), np.uint8)
            self._cand_scratch_p = ffi.from_buffer(self._cand_scratch, require_writable=True)
        check(lib.le_sample_cand(ffi.from_buffer("int32_t[]", ids), ffi.from_buffer("float[]", x), ids.size,
                                 c_int(n_vocab, "n_vocab", 1), float(total), float(rest_max),
                                 self.params, float(u), self._cand_scratch_p, self._cand_scratch.size, self._token,
                                 self.info), "le_sample_cand")
        return int(self._token[0])

    def window_cut(self, ids: np.ndarray, x: np.ndarray, base: float, total: float, max_logit: float):
        """le_sample_window_cut -> (cut_logit, cut_id), or None when top-p's target is not crossed in the window."""
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        x = np.ascontiguousarray(x, dtype=np.float32)
        if ids.ndim != 1 or ids.shape != x.shape or ids.size == 0:
            raise ValueError(f"window: ids {ids.shape} and x {x.shape}, one non-empty 1-D length")
        scratch = np.empty(8 * ids.size + 64, np.uint8)
        cx, cid, found = ffi.new("float *"), ffi.new("int32_t *"), ffi.new("int32_t *")
        check(lib.le_sample_window_cut(ffi.from_buffer("int32_t[]", ids), ffi.from_buffer("float[]", x), ids.size,
                                       float(base), float(total), float(max_logit), self.params,
                                       ffi.from_buffer(scratch, require_writable=True), scratch.size, cx, cid, found),
              "le_sample_window_cut")
        return (float(cx[0]), int(cid[0])) if found[0] else None

    def probs(self, logits: np.ndarray, pen_ids=None, pen_counts=None) -> np.ndarray:
        """The distribution draw() samples: float64[n_vocab], zero outside the kept set, one-hot when greedy."""
        lp, n, ip, cp, k = self._args(logits, pen_ids, pen_counts)
        out = np.empty(n, np.float64)
        check(lib.le_sample_probs_on(self._m, lp, n, ip, cp, k, self.params, self._scratch_p, self._scratch.size,
                                     ffi.from_buffer("double[]", out), self.info), "le_sample_probs")
        return out

    def last(self) -> dict:
        """The last call's le_sample_info: token, path (names), n_kept, cut_logit, cut_id, max_logit, isa."""
        d = struct_to_dict(self.info)
        d["path"] = [name for name, bit in SAMPLE_PATHS.items() if d["path"] & bit]
        d["isa"] = ISA_NAMES[d["isa"]]
        return d


def sample_isa() -> str:
    """The tier that runs the sampler's passes now (ref or avx2; follows set_isa)."""
    return ISA_NAMES[lib.le_sample_isa()]
