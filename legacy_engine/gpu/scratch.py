"""A GPU model's scratch in VRAM: named buffers of two sets ("d": a decode step's, which its launch plan names; "p": a
pass's), the block arena that a pass's blocks share (layout.block_scratch, arena_bytes), the rope table. `gen` counts
the moves of a buffer a plan may name: plans recorded before a move are stale."""
from __future__ import annotations

import numpy as np

from .layout import ARENA_ALIGN, ARENA_NAMES, align_up, arena_bytes
from .runtime import Buffer, BufferView, synchronize


def rope_rows(hp, positions: np.ndarray) -> np.ndarray:
    """[n, n_rot/2, 2] f32 (cos, sin) of rope positions [n, 3] (t, h, w) per frequency slot, as native/rope.c
    computes them: inv_freq = theta^(-2i/n_rot) and the angle in f64, IMRoPE's component per slot (slot i takes
    component i % 3 where its section covers it, else 0; without sections every slot takes t), then cos/sin
    rounded to f32."""
    half = hp.n_rot // 2
    i = np.arange(half)
    inv_freq = np.power(np.float64(np.float32(hp.rope_theta)), -2.0 * i / hp.n_rot)
    s = hp.rope_sections
    if sum(s) > 0:
        sec = i % 3
        covered = ((sec == 0) & (i < 3 * s[0])) | ((sec == 1) & (i < 3 * s[1])) | ((sec == 2) & (i < 3 * s[2]))
    else:
        sec, covered = np.zeros(half, dtype=np.int64), np.ones(half, dtype=bool)
    pos = np.asarray(positions, dtype=np.float64)[:, sec]          # [n, half]: each slot's component
    ang = np.where(covered[None, :], pos, 0.0) * inv_freq[None, :]
    return np.ascontiguousarray(np.stack([np.cos(ang), np.sin(ang)], axis=-1), dtype=np.float32)


def rope_table(hp, n_ctx: int) -> np.ndarray:
    """[n_ctx, n_rot/2, 2]: rope_rows of the text positions 0 .. n_ctx - 1 (t = h = w = pos)."""
    return rope_rows(hp, np.repeat(np.arange(n_ctx)[:, None], 3, axis=1))


class Scratch:
    """hp: the model's hparams; int8: its passes quantise activations to Q8_1 (the arena's buffers for them)."""

    def __init__(self, hp, int8: bool):
        self.hparams, self.int8 = hp, int8
        self.bufs: dict[str, Buffer] = {}      # "set:name" -> buffer
        self.tag = "p"            # scratch set: "d" decode (one token, named by plans), "p" prefill
        self.gen = 0              # bumped when a decode buffer or the rope table moves: plans recorded before are stale
        self._retired: list[Buffer] = []
        self._arena: Buffer | None = None      # a pass's block buffers (arena_reserve, _arena_buf)
        self._arena_block, self._arena_at = None, 0
        self._rope_n = 0
        self._rope: Buffer | None = None

    def buf(self, name: str, nbytes: int) -> Buffer:
        """Scratch buffer `name` of the current set (self.tag) of >= nbytes: a pass of several tokens takes its
        blocks' buffers (layout.ARENA_NAMES) from the block arena (arena_open), the others have one each."""
        if self.tag == "p" and name in ARENA_NAMES:
            return self._arena_buf(name, nbytes)
        key = f"{self.tag}:{name}"
        b = self.bufs.get(key)
        if b is None or b.nbytes < nbytes:
            if b is not None:
                # a decode buffer outgrown while a plan is being recorded is still named by the launches
                # recorded before: it stays allocated (small; decode sizes settle after the first step)
                (self._retired.append if self.tag == "d" else lambda b: b.free())(b)
            b = self.bufs[key] = Buffer(max(nbytes, 256), f"scratch {key}")
            if self.tag == "d":
                self.gen += 1
        return b

    def arena_reserve(self, n: int) -> None:
        """The block arena for passes of n tokens (layout.arena_bytes: the largest block's buffers), grown before
        the pass launches anything (a pass never grows it: its blocks' buffers would move under queued work)."""
        need = arena_bytes(self.hparams, n, self.int8)     # as the footprint counts it
        if self._arena is None or self._arena.nbytes < need:
            if self._arena is not None:
                synchronize()           # the last pass's blocks are done with it
                self._arena.free()
                self._arena = None
            self._arena = Buffer(max(need, 256), "scratch p:block arena")
        self._arena_block, self._arena_at = None, 0

    def arena_open(self, block: str) -> None:
        """A pass's block (layout.block_scratch) starts: its buffers take the arena from its start (the last
        block's are dead: it wrote y, which lives outside)."""
        if self.tag == "p":
            self._arena_block, self._arena_at = block, 0

    def _arena_buf(self, name: str, nbytes: int) -> BufferView:
        block = ARENA_NAMES[name]
        if self._arena is None or block != self._arena_block:
            raise RuntimeError(f"scratch {name!r} of the {block} block asked for inside block {self._arena_block!r}"
                               " (gpu.forward: arena_open at the block's start)")
        at = self._arena_at
        if at + nbytes > self._arena.nbytes:
            raise RuntimeError(f"the {block} block's scratch outgrew its arena at {name!r} ({at + nbytes} > "
                               f"{self._arena.nbytes} bytes): layout.block_scratch misses a buffer")
        self._arena_at = at + align_up(nbytes, ARENA_ALIGN)
        return BufferView(self._arena, at, nbytes, f"scratch p:{name}")

    def rope_cs(self, n_ctx: int) -> Buffer:
        """The rope table of at least n_ctx positions (grown: gen moves on)."""
        if self._rope is None or self._rope_n < n_ctx:
            if self._rope is not None:
                self._rope.free()
            self._rope = Buffer.from_array(rope_table(self.hparams, n_ctx), "rope table")
            self._rope_n = n_ctx
            self.gen += 1
        return self._rope

    def close(self) -> None:
        """Frees every buffer now (the model's close())."""
        for b in [self._arena] + list(self.bufs.values()) + self._retired + [self._rope]:
            if b is not None:
                b.free()
        self.bufs, self._retired, self._rope, self._arena = {}, [], None, None
