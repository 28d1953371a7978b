"""The matmul launchers of a kernel variant (cuda8/gemv_*.cu, gemm_*.cu): the decode GEMVs (f32 activations or
int8 on Q8_1), the prefill GEMMs (f32, dp4a, tensor-core mma) and the MoE forms indexed by expert ids (gemv_ids,
the grouped gemm_ids). A part of Kernels (kernels.py), which holds the modules and the layer ops."""
from __future__ import annotations

import numpy as np

from ..core.errors import UnavailableError
from .launch import (F32, GEMM_MMA_TT, GEMM_ROWS, GEMM_THREADS, GEMM_TT, GEMV_MAX_MATS, GEMV_ROWS, GEMV_THREADS,
                     GPU_TYPES, MAX_GRID, MAX_PAIRS, Q8_1_BYTES, _aligned16, _need, _ptr)
from .runtime import Event, Stream
from .toolchain import MMA_ARCH


# gemm_mma's 32-token form (staged a step ahead, one block an SM) where the 64-token grid has at most this many blocks
# an SM; the 64-token form (two blocks an SM, synchronous staging) above
MMA32_BLOCKS_PER_SM = 1
MULTI_MATS = 4      # matrices a gemm_multi launch takes (the kernels' W0..W3)


class MatmulLaunchers:
    """The matmuls of Kernels: each checks its weights (_weights), activations and outputs, then launches on
    `stream` (default stream when None) without waiting. Needs the host class's modules, name, has_mma and _grid.
    gemm_log: None, or a list each prefill GEMM appends (kernel module, operations, start and end events) to:
    the profile of GpuModel.profile (2 operations per weight per token, the peak kernels' count)."""

    gemm_log: list | None = None

    def _gemm_timed(self, mod: str, ops: int, stream, launch) -> None:
        """launch(), between two events on `stream` into gemm_log when it is a list."""
        if self.gemm_log is None:
            launch()
            return
        e0, e1 = Event(), Event()
        e0.record(stream)
        launch()
        e1.record(stream)
        self.gemm_log.append((mod, ops, e0, e1))

    def _weights(self, qtype: int, W, nrows: int, ncols: int, what: str) -> str:
        if qtype == F32:
            if ncols <= 0 or ncols % 32:
                raise ValueError(f"{what}: ncols = {ncols} of f32 weights is not a positive multiple of 32")
            if _ptr(W) % 16:
                raise ValueError(f"{what}: f32 weights must be 16-byte aligned")
            _need(W, 4 * nrows * ncols, f"{what} W")
            return "f32"
        if qtype not in GPU_TYPES:
            raise UnavailableError(f"{what}: no GPU kernel for ggml type {qtype}; GPU types: "
                                   + ", ".join(v[0] for v in GPU_TYPES.values()))
        suffix, bs, ts = GPU_TYPES[qtype]
        if ncols <= 0 or ncols % bs:
            raise ValueError(f"{what}: ncols = {ncols} is not a positive multiple of {suffix}'s block size {bs}")
        if _ptr(W) % 4:
            raise ValueError(f"{what}: weights must be 4-byte aligned")
        _need(W, nrows * (ncols // bs) * ts, f"{what} W")
        return suffix

    def gemv_f32(self, qtype: int, W, x, y, nrows: int, ncols: int, more=(), stream: Stream | None = None) -> None:
        """y[nrows] = W[nrows, ncols] (ggml type `qtype`) x[ncols] f32; more: up to GEMV_MAX_MATS - 1 further
        (W_m, y_m, nrows_m) of the same type and width on the same x, in the same launch."""
        suffix = self._weights(qtype, W, nrows, ncols, "gemv_f32")
        if _ptr(x) % 16:
            raise ValueError("gemv_f32: x must be 16-byte aligned (it is read as float4)")
        _need(x, 4 * ncols, "gemv_f32 x")
        _need(y, 4 * nrows, "gemv_f32 y")
        blocks, mats = self._mats(qtype, W, y, nrows, ncols, more, "gemv_f32")
        self.modules["gemv_f32"].kernel(f"gemv_f32_{suffix}").launch(
            (blocks, 1, 1), (GEMV_THREADS, 1, 1),
            [("ptr", _ptr(W)), ("ptr", _ptr(x)), ("ptr", _ptr(y)), ("i32", nrows), ("i32", ncols)] + mats,
            stream=stream)

    def _mats(self, qtype: int, W, y, nrows: int, ncols: int, more, what: str) -> tuple[int, list]:
        """A dense GEMV's further matrices (quants.cuh LE_GEMV_MATS), each checked as the first: -> (grid.x: their
        blocks one after another, or one matrix's grid-strided grid; the kernel's arguments (W_m - W bytes, y_m - y
        floats, rows) for m = 1 … 3, zeros where unused)."""
        more = list(more)
        if len(more) >= GEMV_MAX_MATS:
            raise ValueError(f"{what}: {1 + len(more)} matrices in one launch (at most {GEMV_MAX_MATS})")
        blocks = -(-nrows // GEMV_ROWS)
        if not more:
            return self._grid(blocks), [("i64", 0), ("i64", 0), ("i32", 0)] * (GEMV_MAX_MATS - 1)
        args = []
        for m, (Wm, ym, nm) in enumerate(more, 1):
            nm = int(nm)
            if nm <= 0:
                raise ValueError(f"{what}: matrix {m} has {nm} rows")
            dw, dy = self._offsets(qtype, W, y, Wm, ym, nm, ncols, nm, what, f"y_{m}")
            args += [("i64", dw), ("i64", dy), ("i32", nm)]
            blocks += -(-nm // GEMV_ROWS)
        if blocks > MAX_GRID:
            raise ValueError(f"{what}: {blocks} blocks for {1 + len(more)} matrices in one launch (at most "
                             f"{MAX_GRID}: launch them apart)")
        args += [("i64", 0), ("i64", 0), ("i32", 0)] * (GEMV_MAX_MATS - 1 - len(more))
        return blocks, args

    def _second(self, qtype: int, W, y, W2, y2, nrows: int, ncols: int, out_rows: int,
                what: str) -> tuple[int, int, int]:
        """A GEMV's second matrix (grid.z = 2), checked as the first: -> (Z, W2 - W in bytes, y2 - y in floats);
        (1, 0, 0) without."""
        if W2 is None and y2 is None:
            return 1, 0, 0
        if W2 is None or y2 is None:
            raise ValueError(f"{what}: a second matrix needs both W2 and y2")
        return (2,) + self._offsets(qtype, W, y, W2, y2, nrows, ncols, out_rows, what, "y2")

    def _offsets(self, qtype: int, W, y, Wm, ym, nrows: int, ncols: int, out_rows: int, what: str,
                 label: str) -> tuple[int, int]:
        """A further matrix Wm [nrows, ncols] of W's type into ym [out_rows] of one launch, checked as the first:
        -> (Wm - W in bytes, ym - y in floats)."""
        self._weights(qtype, Wm, nrows, ncols, what)
        _need(ym, 4 * out_rows, f"{what} {label}")
        dy = _ptr(ym) - _ptr(y)
        if dy % 4:
            raise ValueError(f"{what}: {label} - y = {dy} bytes is not a whole number of floats")
        return _ptr(Wm) - _ptr(W), dy // 4

    def gemv_ids(self, qtype: int, W, x, y, nrows: int, ncols: int, ids, n_pairs: int, expert_bytes: int,
                 x_group: int, x_stride: int, int8: bool = False, n_experts: int | None = None, W2=None, y2=None,
                 stream: Stream | None = None) -> None:
        """The MoE GEMV: for pair p < n_pairs, y[p, :nrows] = W_e x_p with e = ids[p] (int32, device), W_e at
        W + e * expert_bytes ([nrows, ncols] each), x_p = x + (p // x_group) * x_stride (floats; with int8:
        block_q8_1 of quantize_q8_1, x_stride in blocks). The ids are not read back: the caller makes them
        (moe_route) < n_experts. ids[p] < 0 skips pair p and zeroes its row (the hybrid decode's CPU experts).
        W2, y2: a second matrix of the same shape and type (expert e at W2 + e * expert_bytes: a SwiGLU's up
        beside its gate) into y2 [n_pairs, nrows] in the same launch."""
        what = "gemv_dp4a_ids" if int8 else "gemv_f32_ids"
        suffix = self._weights(qtype, W, nrows, ncols, what)
        if int8 and qtype == F32:
            raise ValueError(f"{what}: f32 weights have no int8 path")
        if not 0 < n_pairs <= MAX_PAIRS or x_group <= 0 or x_stride < 0:
            raise ValueError(f"{what}: n_pairs = {n_pairs} (1…{MAX_PAIRS}), x_group = {x_group}, x_stride = {x_stride}")
        if not int8 and (x_stride % 4 or _ptr(x) % 16):
            raise ValueError(f"{what}: x and x_stride must keep rows 16-byte aligned")
        if n_experts is not None:
            _need(W, n_experts * expert_bytes, f"{what} W")
        _need(ids, 4 * n_pairs, f"{what} ids")
        _need(y, 4 * nrows * n_pairs, f"{what} y")
        z, w_z, y_z = self._second(qtype, W, y, W2, y2, nrows, ncols, nrows * n_pairs, what)
        mod = "gemv_dp4a" if int8 else "gemv_f32"
        self.modules[mod].kernel(f"{mod}_{suffix}_ids").launch(
            (self._grid(-(-nrows // GEMV_ROWS)), n_pairs, z), (GEMV_THREADS, 1, 1),
            [("ptr", _ptr(W)), ("ptr", _ptr(x)), ("ptr", _ptr(y)), ("i32", nrows), ("i32", ncols), ("ptr", _ptr(ids)),
             ("i64", int(expert_bytes)), ("i32", x_group), ("i32", x_stride), ("i64", w_z), ("i64", y_z)],
            stream=stream)

    def gemv_dp4a(self, qtype: int, W, xq, y, nrows: int, ncols: int, more=(), stream: Stream | None = None) -> None:
        """y[nrows] = W[nrows, ncols] xq, xq: [ncols/32] block_q8_1 from quantize_q8_1; more: up to
        GEMV_MAX_MATS - 1 further (W_m, y_m, nrows_m) of the same type and width on the same xq, in the same
        launch."""
        if qtype == F32:
            raise ValueError("gemv_dp4a: f32 weights have no int8 path (use gemv_f32)")
        suffix = self._weights(qtype, W, nrows, ncols, "gemv_dp4a")
        _need(xq, ncols // 32 * Q8_1_BYTES, "gemv_dp4a xq")
        _need(y, 4 * nrows, "gemv_dp4a y")
        blocks, mats = self._mats(qtype, W, y, nrows, ncols, more, "gemv_dp4a")
        self.modules["gemv_dp4a"].kernel(f"gemv_dp4a_{suffix}").launch(
            (blocks, 1, 1), (GEMV_THREADS, 1, 1),
            [("ptr", _ptr(W)), ("ptr", _ptr(xq)), ("ptr", _ptr(y)), ("i32", nrows), ("i32", ncols)] + mats,
            stream=stream)

    def gemm_f32(self, qtype: int, W, X, Y, nrows: int, ncols: int, ntok: int, stream: Stream | None = None) -> None:
        """Y[ntok, nrows] = X[ntok, ncols] f32 times W[nrows, ncols]^T."""
        _need(X, 4 * ncols * ntok, "gemm_f32 X")
        _aligned16(X, "gemm_f32 X")
        self._gemm("gemm_f32", qtype, W, X, Y, nrows, ncols, ntok, stream)

    def gemm_dp4a(self, qtype: int, W, xq, Y, nrows: int, ncols: int, ntok: int, stream: Stream | None = None) -> None:
        """Y[ntok, nrows] = xq[ntok, ncols/32] (block_q8_1 rows from one quantize_q8_1 of the [ntok, ncols] f32
        activations) times W[nrows, ncols]^T, in int8 (W4A8/W8A8)."""
        self._gemm_q8("gemm_dp4a", qtype, W, xq, Y, nrows, ncols, ntok, stream, GEMM_TT)

    def gemm_mma(self, qtype: int, W, xq, Y, nrows: int, ncols: int, ntok: int, stream: Stream | None = None,
                 tt: int | None = None) -> None:
        """gemm_dp4a on tensor cores (same arguments, same bits); only where has_mma (dp4a tier, sm_75+). tt: tokens
        a block, GEMM_MMA_TT (64) or GEMM_TT (32: gemm_mma32_*); default 32 where the 64-token grid has at most
        MMA32_BLOCKS_PER_SM blocks an SM (a short pass's narrow projections), else 64."""
        if not self.has_mma:
            raise UnavailableError(f"gemm_mma: the {self.name} kernels have no int8 mma (the dp4a tier at "
                                   f"compute_{MMA_ARCH}+ has)")
        tt, kname = self._mma_form(-(-nrows // GEMM_ROWS), ntok, tt, "gemm_mma")
        self._gemm_q8("gemm_mma", qtype, W, xq, Y, nrows, ncols, ntok, stream, tt, kname)

    def _mma_form(self, row_tiles: int, ntok: int, tt: int | None, what: str) -> tuple[int, str]:
        """gemm_mma's token form for a launch of row_tiles row tiles -> (tokens a block, kernel name prefix): tt, or
        by default 32 (gemm_mma32_*) where the 64-token grid has at most MMA32_BLOCKS_PER_SM blocks an SM, else 64."""
        if tt is None:
            blocks = row_tiles * -(-ntok // GEMM_MMA_TT)
            tt = GEMM_TT if blocks <= MMA32_BLOCKS_PER_SM * self.sm_count else GEMM_MMA_TT
        if tt not in (GEMM_TT, GEMM_MMA_TT):
            raise ValueError(f"{what}: tt = {tt}, not {GEMM_TT} or {GEMM_MMA_TT}")
        return tt, "gemm_mma32" if tt == GEMM_TT else "gemm_mma"

    def gemm_multi(self, qtype: int, mats, xq, ncols: int, ntok: int, mma: bool, stream: Stream | None = None,
                   tt: int | None = None) -> None:
        """Up to MULTI_MATS int8 GEMMs of one type and width on the same xq in one launch (`name_multi`): mats is a
        list of (W, Y, nrows); each Y[ntok, nrows] gets the bits gemm_mma (mma) / gemm_dp4a gives it alone. A short
        pass's narrow matrices (the GDN's 16-row beta / alpha, attention's K / V) share the launch's waves instead
        of each leaving most SMs idle. tt (mma only): as gemm_mma's, from the launch's total row tiles."""
        if not 1 <= len(mats) <= MULTI_MATS:
            raise ValueError(f"gemm_multi: {len(mats)} matrices, not 1…{MULTI_MATS}")
        if not self.many_regs or (mma and not self.has_mma):
            raise UnavailableError(f"gemm_multi: the {self.name} kernels have no {'int8 mma' if mma else 'multi'} "
                                   "form (toolchain.many_regs, has_mma)")
        if qtype == F32:
            raise ValueError("gemm_multi: f32 weights have no int8 path (use gemm_f32)")
        tiles = 0
        for W, Y, nrows in mats:
            suffix = self._weights(qtype, W, nrows, ncols, "gemm_multi")
            _need(Y, 4 * nrows * ntok, "gemm_multi Y")
            tiles += -(-nrows // GEMM_ROWS)
        if not 0 < tiles <= MAX_GRID:
            raise ValueError(f"gemm_multi: {tiles} row tiles outside 1…{MAX_GRID}")
        _need(xq, ntok * (ncols // 32) * Q8_1_BYTES, "gemm_multi xq")
        mod = "gemm_mma" if mma else "gemm_dp4a"
        tt, kname = self._mma_form(tiles, ntok, tt, "gemm_multi") if mma else (GEMM_TT, "gemm_dp4a")
        if not 0 < ntok <= tt * MAX_GRID:
            raise ValueError(f"gemm_multi: ntok = {ntok} outside 1…{tt * MAX_GRID}")
        pad = [(0, 0, 0)] * (MULTI_MATS - len(mats))
        ws, ys, ns = zip(*([(_ptr(W), _ptr(Y), n) for W, Y, n in mats] + pad))
        kern = self.modules[mod].kernel(f"{kname}_{suffix}_multi")
        ops = sum(2 * n * ncols * ntok for n in ns)
        self._gemm_timed(mod, ops, stream, lambda: kern.launch(
            (tiles, -(-ntok // tt), 1), (GEMM_THREADS, 1, 1),
            [*(("ptr", w) for w in ws), ("ptr", _ptr(xq)), *(("ptr", y) for y in ys), *(("i32", n) for n in ns),
             ("i32", ncols), ("i32", ntok)], stream=stream))

    def _gemm_q8(self, mod: str, qtype: int, W, xq, Y, nrows: int, ncols: int, ntok: int, stream, tt: int,
                 kname: str | None = None) -> None:
        """The int8 GEMMs' checks (quantised weights, xq of ntok Q8_1 rows), then their launch."""
        if qtype == F32:
            raise ValueError(f"{mod}: f32 weights have no int8 path (use gemm_f32)")
        _need(xq, ntok * (ncols // 32) * Q8_1_BYTES, f"{mod} xq")
        self._gemm(mod, qtype, W, xq, Y, nrows, ncols, ntok, stream, tt, kname)

    def _gemm(self, mod: str, qtype: int, W, X, Y, nrows: int, ncols: int, ntok: int, stream,
              tt: int = GEMM_TT, kname: str | None = None) -> None:
        """The launch the prefill GEMMs share (same arguments; tt tokens per block; the kernel kname_<type>, default
        mod_<type>); X is checked by the caller."""
        suffix = self._weights(qtype, W, nrows, ncols, mod)
        if not 0 < ntok <= tt * MAX_GRID:
            raise ValueError(f"{mod}: ntok = {ntok} outside 1…{tt * MAX_GRID}")
        _need(Y, 4 * nrows * ntok, f"{mod} Y")
        kern = self.modules[mod].kernel(f"{kname or mod}_{suffix}")
        self._gemm_timed(mod, 2 * nrows * ncols * ntok, stream, lambda: kern.launch(
            (self._grid(-(-nrows // GEMM_ROWS)), -(-ntok // tt), 1), (GEMM_THREADS, 1, 1),
            [("ptr", _ptr(W)), ("ptr", _ptr(X)), ("ptr", _ptr(Y)), ("i32", nrows), ("i32", ncols), ("i32", ntok)],
            stream=stream))

    @staticmethod
    def group_tile(int8: bool, mma: bool) -> int:
        """Pairs per tile of the grouped GEMM gemm_ids(int8, mma) runs: its work list (expert_tiles, moe_sort) must
        be cut with this tile."""
        return GEMM_MMA_TT if int8 and mma else GEMM_TT

    @staticmethod
    def expert_tiles(sorted_ids: np.ndarray, tile: int = GEMM_TT) -> np.ndarray:
        """int32 [n_tiles, 3] (expert, first pair, count <= tile) over pairs sorted by expert: each expert's
        run cut into tiles of `tile` pairs (gemm_ids' work list; group_tile)."""
        ids = np.asarray(sorted_ids)
        if ids.size and (np.diff(ids) < 0).any():
            raise ValueError("expert_tiles: the ids must be sorted")
        starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]]) if ids.size else np.zeros(0, dtype=np.int64)
        ends = np.r_[starts[1:], ids.size]
        out = [(int(ids[a]), p, min(tile, b - p)) for a, b in zip(starts, ends) for p in range(a, b, tile)]
        return np.asarray(out, dtype=np.int32).reshape(-1, 3)

    def gemm_ids(self, qtype: int, W, X, Y, nrows: int, ncols: int, tiles, n_tiles: int, expert_bytes: int,
                 n_pairs: int, stream: Stream | None = None, int8: bool = False, mma: bool = False) -> None:
        """The grouped expert GEMM: for each tile (e, p0, cnt) of `tiles` (device int32 [n_tiles, 3], from
        expert_tiles with tile = group_tile(int8, mma): 32 pairs, 64 for gemm_mma), Y[p0:p0+cnt] = X[p0:p0+cnt]
        W_e^T with W_e at W + e * expert_bytes; X [n_pairs, ncols] f32 rows sorted by expert, or with int8 their
        block_q8_1 rows [n_pairs, ncols/32] (gemm_dp4a_*_ids, or with mma too gemm_mma_*_ids); Y [n_pairs, nrows].
        The tiles live on the device (no check of their counts here): a longer tile than the kernel's leaves pairs
        uncomputed."""
        mod = ("gemm_mma" if mma else "gemm_dp4a") if int8 else "gemm_f32"
        what = f"{mod}_ids" if int8 else "gemm_ids"
        if mma and not (int8 and self.has_mma):
            raise UnavailableError(f"gemm_mma_ids: needs int8 and a variant with the int8 mma, not {self.name}")
        if int8 and qtype == F32:
            raise ValueError(f"{what}: f32 weights have no int8 path")
        suffix = self._weights(qtype, W, nrows, ncols, what)
        if not 0 < n_tiles <= MAX_GRID:
            raise ValueError(f"{what}: n_tiles = {n_tiles} outside 1…{MAX_GRID}")
        if int8:
            _need(X, n_pairs * (ncols // 32) * Q8_1_BYTES, f"{what} xq")
        else:
            _need(X, 4 * ncols * n_pairs, f"{what} X")
            _aligned16(X, f"{what} X")
        _need(Y, 4 * nrows * n_pairs, f"{what} Y")
        _need(tiles, 12 * n_tiles, f"{what} tiles")
        kern = self.modules[mod].kernel(f"{mod}_{suffix}_ids")
        self._gemm_timed(mod, 2 * nrows * ncols * n_pairs, stream, lambda: kern.launch(
            (self._grid(-(-nrows // GEMM_ROWS)), n_tiles, 1), (GEMM_THREADS, 1, 1),
            [("ptr", _ptr(W)), ("ptr", _ptr(X)), ("ptr", _ptr(Y)), ("i32", nrows), ("i32", ncols),
             ("ptr", _ptr(tiles)), ("i64", int(expert_bytes))], stream=stream))
