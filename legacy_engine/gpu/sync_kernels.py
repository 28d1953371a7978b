"""The launchers of the device-side synchronisation (cuda8/hybrid_sync.cu: the hybrid decode's host channel;
cuda8/grid_sync.cu: the grid-wide barrier of a fused decode step and its measurements): a part of Kernels
(kernels.py), as MatmulLaunchers is. Each checks its arguments, then launches on `stream` (default stream when None)
without waiting."""
from __future__ import annotations

from .launch import (GRID_SYNC_THREADS, HY_EARLY_MAX, HY_PRED_MAX, HYBRID_FETCH_BLOCKS, HYBRID_PRED_E, HYBRID_THREADS,
                     MOE_MAX_K, _need, _ptr)
from .runtime import Stream

# Blocks of GRID_SYNC_THREADS an SM that every tier holds at once (Fermi: 8 blocks, 1536 threads an SM): the most
# grid_sync's launches take, so that every block of the grid is resident (le_grid_sync waits for all of them)
GRID_SYNC_PER_SM = 8


class SyncLaunchers:
    """The synchronisation ops of Kernels. Needs the host class's modules and sm_count."""

    def hybrid_publish(self, h, ids, w, pin_idx, n_link: int, meta, slot: int, chan: int, E: int, k: int,
                       pred=None, n_early: int = 0, extra_idx=None, stream: Stream | None = None) -> None:
        """The hybrid decode's routing into the host channel (cuda8/hybrid_sync.cu): h [E], ids/w [k] (moe_route)
        into `slot`, READY = chan's SEQ; meta [k gids | k lids | k lslots | k fids | k eids | 2k + 1 weights]
        (device) from pin_idx [n_expert] (None: nothing pinned), n_link (n_link experts neither pinned nor early are
        the GPU's, fetched over the link into staging slots 0..n_link-1: hybrid_fetch with fids): the first in slot
        order, or with pred (device int32 [HY_PRED_MAX], hybrid_predict_publish's) the ones predicted last; and the
        early experts (n_early > 0: those the CPU copied into its early buffer, flagged in the slot in time; eids
        their place there, to be copied into staging slots n_link..: hybrid_fetch with eids); extra_idx [n_expert]
        (None: none) the decode extras' places (experts not pinned that the staging holds between prefills: slots
        n_link + n_early + place; -1 elsewhere).
        slot, chan: device-visible addresses of page-locked host memory (le_hybrid.h)."""
        if (not 0 < k <= min(MOE_MAX_K, HYBRID_THREADS) or E <= 0 or not 0 <= n_link <= k
                or not 0 <= n_early <= HY_EARLY_MAX):
            raise ValueError(f"hybrid_publish: E = {E}, k = {k}, n_link = {n_link}, n_early = {n_early}")
        _need(h, 4 * E, "hybrid_publish h")
        _need(meta, 4 * (7 * k + 1), "hybrid_publish meta")
        self.modules["hybrid_sync"].kernel("hybrid_publish_f32").launch(
            (1, 1, 1), (HYBRID_THREADS, 1, 1),
            [("ptr", _ptr(h)), ("ptr", _ptr(ids)), ("ptr", _ptr(w)), ("ptr", _ptr(pin_idx)), ("ptr", _ptr(extra_idx)),
             ("i32", n_link),
             ("ptr", _ptr(pred)), ("i32", n_early), ("ptr", _ptr(meta)), ("ptr", int(slot)), ("ptr", int(chan)),
             ("i32", E), ("i32", k)], stream=stream)

    def hybrid_predict(self, R, h, s, logits, ne: int, E: int, stream: Stream | None = None) -> None:
        """The lookahead's router (cuda8/hybrid_sync.cu): logits [ne] = R [ne, E] (f32) @ (h * s), h and s [E]."""
        if ne <= 0 or E <= 0:
            raise ValueError(f"hybrid_predict: ne = {ne}, E = {E}")
        _need(R, 4 * ne * E, "hybrid_predict R")
        _need(logits, 4 * ne, "hybrid_predict logits")
        warps = HYBRID_THREADS // 32
        self.modules["hybrid_sync"].kernel("hybrid_predict_f32").launch(
            (-(-ne // warps), 1, 1), (HYBRID_THREADS, 1, 1),
            [("ptr", _ptr(R)), ("ptr", _ptr(h)), ("ptr", _ptr(s)), ("ptr", _ptr(logits)), ("i32", ne), ("i32", E)],
            stream=stream)

    def hybrid_predict_publish(self, logits, ne: int, n_pred: int, pin_idx, pred, slot: int, chan: int, E: int,
                               k: int, stream: Stream | None = None) -> None:
        """The n_pred largest logits' experts (largest first; -1 where pin_idx [ne] >= 0, None: nothing pinned)
        into pred (device int32 [HY_PRED_MAX], the rest -1) and `slot`'s PRED, then PRED_READY = chan's SEQ."""
        if not 0 < ne <= HYBRID_PRED_E or not 0 < n_pred <= HY_PRED_MAX or E <= 0 or k <= 0:
            raise ValueError(f"hybrid_predict_publish: ne = {ne} (<= {HYBRID_PRED_E}), n_pred = {n_pred} "
                             f"(<= {HY_PRED_MAX}), E = {E}, k = {k}")
        _need(logits, 4 * ne, "hybrid_predict_publish logits")
        _need(pred, 4 * HY_PRED_MAX, "hybrid_predict_publish pred")
        self.modules["hybrid_sync"].kernel("hybrid_predict_publish_i32").launch(
            (1, 1, 1), (HYBRID_THREADS, 1, 1),
            [("ptr", _ptr(logits)), ("i32", ne), ("i32", n_pred), ("ptr", _ptr(pin_idx)), ("ptr", _ptr(pred)),
             ("ptr", int(slot)), ("ptr", int(chan)), ("i32", E), ("i32", k)], stream=stream)

    def hybrid_fetch(self, lids, lslots, k: int, tensors, stream: Stream | None = None) -> None:
        """Copies the experts lids[s] >= 0 (device int32 [k]) of up to three tensors, [(src, dst, expert bytes)]
        (src: device-visible host memory or VRAM, dst: VRAM, all multiples of 16 bytes), from src + id * eb to
        dst + lslots[s] * eb, with a copy kernel (cuda8/hybrid_sync.cu)."""
        if not 0 < len(tensors) <= 3 or not 0 < k <= MOE_MAX_K:
            raise ValueError(f"hybrid_fetch: {len(tensors)} tensors, k = {k}")
        args = []
        for src, dst, eb in list(tensors) + [(0, 0, 0)] * (3 - len(tensors)):
            if eb and (eb % 16 or int(src) % 16 or _ptr(dst) % 16):
                raise ValueError(f"hybrid_fetch: expert bytes {eb} and addresses must be multiples of 16")
            args += [("ptr", int(src)), ("ptr", _ptr(dst)), ("i64", int(eb))]
        self.modules["hybrid_sync"].kernel("hybrid_fetch_u8").launch(
            (HYBRID_FETCH_BLOCKS, k, 3), (HYBRID_THREADS, 1, 1),
            [("ptr", _ptr(lids)), ("ptr", _ptr(lslots)), ("i32", k)] + args, stream=stream)

    def hybrid_wait(self, slot: int, chan: int, row, E: int, k: int, max_cycles: int,
                    stream: Stream | None = None) -> None:
        """Waits (on the GPU) until the CPU marks `slot` DONE for chan's SEQ, then row [E] (device) = its ROW; NaN
        after max_cycles clock cycles without it."""
        if E <= 0 or E % 4 or k <= 0 or max_cycles <= 0:
            raise ValueError(f"hybrid_wait: E = {E} (a multiple of 4: 16-byte words), k = {k}, max_cycles = "
                             f"{max_cycles}")
        _need(row, 4 * E, "hybrid_wait row")
        self.modules["hybrid_sync"].kernel("hybrid_wait_f32").launch(
            (1, 1, 1), (HYBRID_THREADS, 1, 1),
            [("ptr", int(slot)), ("ptr", int(chan)), ("ptr", _ptr(row)), ("i32", E), ("i32", k),
             ("i64", int(max_cycles))], stream=stream)

    def _grid_sync_launch(self, kernel: str, bar, n_blocks: int, args: list, bad: str,
                          stream: Stream | None) -> None:
        """The grid_sync kernels' common part: n_blocks co-resident blocks (at most GRID_SYNC_PER_SM an SM; the
        caller's other arguments valid unless `bad` says why not), bar: uint32 [2]; bar then args."""
        most = GRID_SYNC_PER_SM * self.sm_count
        if not 0 < n_blocks <= most or bad:
            raise ValueError(f"{kernel}: {n_blocks} blocks (1…{most})" + (f", {bad}" if bad else ""))
        _need(bar, 8, f"{kernel} bar")
        self.modules["grid_sync"].kernel(kernel).launch(
            (n_blocks, 1, 1), (GRID_SYNC_THREADS, 1, 1), [("ptr", _ptr(bar))] + args, stream=stream)

    def grid_sync_check(self, bar, cells, n_blocks: int, rounds: int, stream: Stream | None = None) -> None:
        """le_grid_sync under test (cuda8/grid_sync.cu): n_blocks blocks (all co-resident: the caller's care) meet
        `rounds` times; bar: uint32 [2] zero, cells: uint32 [n_blocks + 1] zero; afterwards cells[:n] == rounds and
        cells[n] counts the blocks that saw another's count stale past a barrier (0 when every barrier held)."""
        _need(cells, 4 * (n_blocks + 1), "grid_sync_check cells")
        self._grid_sync_launch("grid_sync_check_u32", bar, n_blocks, [("ptr", _ptr(cells)), ("i32", rounds)],
                               "" if rounds > 0 else f"rounds = {rounds}", stream)

    def grid_sync_time(self, bar, n_blocks: int, rounds: int, stream: Stream | None = None) -> None:
        """`rounds` grid barriers of n_blocks co-resident blocks and nothing else (bar: uint32 [2], zero)."""
        self._grid_sync_launch("grid_sync_time_u32", bar, n_blocks, [("i32", rounds)],
                               "" if rounds > 0 else f"rounds = {rounds}", stream)

    def grid_sync_stream(self, bar, src, n16: int, phases: int, sink, n_blocks: int, ahead: bool = False,
                         stream: Stream | None = None) -> None:
        """`phases` phases each reading its own n16 x 16 bytes of src over n_blocks co-resident blocks, a grid barrier
        after each (cuda8/grid_sync.cu): a fused step's weight stream without its arithmetic; ahead: the next phase's
        first GRID_SYNC_AHEAD uint4 a thread loaded before each barrier."""
        bad = "" if phases > 0 and n16 > 0 else f"phases = {phases}, n16 = {n16}"
        if not bad:
            _need(src, 16 * n16 * phases, "grid_sync_stream src")
            _need(sink, 4, "grid_sync_stream sink")
        self._grid_sync_launch("grid_sync_stream_ahead_u32" if ahead else "grid_sync_stream_u32", bar, n_blocks,
                               [("ptr", _ptr(src)), ("i64", n16), ("i32", phases), ("ptr", _ptr(sink))], bad, stream)
