"""numpy transcription of cuda8/sample_cut.cu (the sampler's candidates chosen where the logits are): the bins, the
cut, the mode, the chosen tokens, the row's mass, the mass before the window and the largest logit left out (float64
masses where the kernels sum fixed-point ones: equal to 1.1e-7 of the row's mass; a cut may then differ by one bin
where the running mass meets top-p's target that closely). Used by test_sampling.py (le_sample_cand and
le_sample_window_cut on the CPU) and test_gpu.py (the kernels against it)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BINS, BINS_PER_NAT = 1024, 32      # cuda8/sample_cut.cu SAMPLE_BINS, SAMPLE_BINS_PER_NAT


@dataclass
class Cut:
    cut: int               # the cut bin
    mode: int              # 0: candidates (bins <= cut); 1: window (bin cut alone); -2: too many either way
    ids: np.ndarray        # the chosen tokens, ascending ids
    z: float               # sum over the row of exp(x - max)
    base: float            # mode 1: the mass of the bins before the window
    rest_max: float        # mode 0: the largest logit not chosen (-inf: none)
    want: float            # top_p * z
    cum_mass: np.ndarray   # the mass through each bin


def bins(x: np.ndarray) -> np.ndarray:
    """bin_i = floor((m - x_i) * 32) in float32 arithmetic, the last bin holding every d beyond."""
    x = np.asarray(x, np.float32)
    m = np.float32(x[np.isfinite(x)].max())
    with np.errstate(invalid="ignore", over="ignore"):
        d = (m - x).astype(np.float32) * np.float32(BINS_PER_NAT)
    return np.minimum(d, np.float32(BINS - 1)).astype(np.int64)


def min_p_bin(min_p: float) -> int:
    """gpu.Kernels.min_p_bin."""
    if not min_p > 0:
        return 0
    b = int(np.floor(-np.log(min_p) * BINS_PER_NAT)) + 1
    return b if b < BINS - 1 else 0


def sample_cut_ref(x: np.ndarray, top_k: int, top_p: float, min_p: float, cap: int | None = None,
                   allow_masked: bool = False) -> Cut | None:
    """The kernels' answer (cap None: no limit); None for a row the kernel refuses (a non-finite logit; -inf
    allowed with allow_masked, for the CPU side's tests: the kernel itself refuses it)."""
    x = np.asarray(x, np.float32)
    bad = np.isnan(x) | (x == np.inf) | ((not allow_masked) & (x == -np.inf))
    if bad.any() or not np.isfinite(x).any():
        return None
    cap = x.size if cap is None else cap
    b = bins(x)
    m = float(x[np.isfinite(x)].max())
    e = np.exp(x.astype(np.float64) - m)
    z = float(e.sum())
    counts = np.bincount(b, minlength=BINS)
    mass = np.bincount(b, weights=e, minlength=BINS)
    cum_c, cum_w = np.cumsum(counts), np.cumsum(mass)
    want = float(np.float32(top_p)) * z
    arange = np.arange(BINS)
    by_p = (top_p < 1) & (cum_w >= want)
    cut_p = int(np.argmax(by_p)) if by_p.any() else BINS - 1
    mpb = min_p_bin(min_p)
    hit = ((top_k > 0) & (cum_c >= top_k)) | by_p | ((mpb > 0) & (arange >= mpb))
    cut = int(np.argmax(hit)) if hit.any() else BINS - 1
    mode = 0
    if cum_c[cut] > cap:
        mode = 1 if cut == cut_p and top_k == 0 and counts[cut] <= cap else -2
    ids = np.flatnonzero(b == cut) if mode == 1 else np.flatnonzero(b <= cut) if mode == 0 else np.array([], int)
    rest = x[b > cut]
    return Cut(cut, mode, ids, z, float(cum_w[cut - 1]) if mode == 1 and cut > 0 else 0.0,
               float(rest.max()) if rest.size else float("-inf"), want, cum_w)
