"""One sequence's state in VRAM (GpuState): the GDN conv/SSM states and the KV cache, with the byte layouts of the
CPU state (NativeState.save_recurrent / read_kv), so `to_cpu` / `from_cpu` hand a sequence between the engines at
any position, and the snapshot cache (serve/cache.py) works on it unchanged."""
from __future__ import annotations

import numpy as np

from .. import gpu
from ..core import _native


class GpuState:
    """One sequence's state in VRAM: conv [n_gdn, K-1, conv_dim], SSM [n_gdn, H_v, d_k, d_v], K and V
    [n_attn, n_ctx, n_kv*hd], all f32 (the CPU state's layouts), and the position."""

    def __init__(self, gm, n_ctx: int):
        """gm: the GpuModel it belongs to; n_ctx: its positions."""
        hp = gm.hparams
        if n_ctx < 1:
            raise ValueError(f"n_ctx = {n_ctx}")
        self.gm, self.n_ctx, self._pos = gm, int(n_ctx), 0
        self.index, n_gdn, n_attn = [], 0, 0
        for r in hp.recurrent:
            self.index.append(n_gdn if r else n_attn)
            n_gdn, n_attn = n_gdn + bool(r), n_attn + (not r)
        self.n_gdn, self.n_attn = n_gdn, n_attn
        conv_dim = 2 * hp.ssm_n_group * hp.ssm_d_state + hp.ssm_d_inner
        self.conv_floats = (hp.ssm_conv_kernel - 1) * conv_dim
        self.ssm_floats = hp.ssm_d_inner * hp.ssm_d_state
        self.kvw = hp.n_head_kv * hp.head_dim
        self.conv = gpu.Buffer(4 * max(1, n_gdn * self.conv_floats), "GDN conv states")
        self.ssm = gpu.Buffer(4 * max(1, n_gdn * self.ssm_floats), "GDN SSM states")
        self.k = gpu.Buffer(4 * max(1, n_attn * self.n_ctx * self.kvw), "K cache")
        self.v = gpu.Buffer(4 * max(1, n_attn * self.n_ctx * self.kvw), "V cache")
        # int32 [token, pos, rope pos] of a planned decode step (rope pos = pos + rope_delta: M-RoPE after an image)
        self.io = gpu.Buffer(12, "decode token, position, rope position")
        self.rope_delta = 0     # as NativeState's: a text token at position i rotates at i + rope_delta
        self._plan, self._plan_gen = None, -1
        gm.scratch.rope_cs(self.n_ctx)
        self.reset()

    @property
    def pos(self) -> int:
        return self._pos

    def reset(self) -> None:
        _native.gpu_memset8(self.conv.ptr, 0, self.conv.nbytes)
        _native.gpu_memset8(self.ssm.ptr, 0, self.ssm.nbytes)
        self._pos = 0
        self.rope_delta = 0

    def conv_ptr(self, i: int) -> int:
        return self.conv.ptr + 4 * i * self.conv_floats

    def ssm_ptr(self, i: int) -> int:
        return self.ssm.ptr + 4 * i * self.ssm_floats

    def k_ptr(self, i: int) -> int:
        return self.k.ptr + 4 * i * self.n_ctx * self.kvw

    def v_ptr(self, i: int) -> int:
        return self.v.ptr + 4 * i * self.n_ctx * self.kvw

    # the NativeState interface of the snapshot cache (same byte layouts)
    def recurrent_nbytes(self) -> int:
        return 4 * self.n_gdn * (self.conv_floats + self.ssm_floats)

    def kv_nbytes(self, n: int) -> int:
        return 2 * self.n_attn * 4 * n * self.kvw

    def save_recurrent(self) -> bytes:
        """conv + SSM states of every GDN layer (all conv, then all SSM; f32 bytes)."""
        out = np.empty(self.recurrent_nbytes(), dtype=np.uint8)
        self.save_recurrent_into(out)
        return out.tobytes()

    def save_recurrent_into(self, out) -> None:
        """save_recurrent into a writable bytes-like (page-locked memory: the copy runs at the link's speed)."""
        gpu.synchronize()
        nc, ns = 4 * self.n_gdn * self.conv_floats, 4 * self.n_gdn * self.ssm_floats
        mv = memoryview(out).cast("B")
        if mv.nbytes < nc + ns:
            raise ValueError(f"recurrent state of {nc + ns} bytes into a {mv.nbytes}-byte buffer")
        if nc:
            self.conv.download(mv[:nc])
        if ns:
            self.ssm.download(mv[nc:nc + ns])

    def restore_recurrent(self, data: bytes, pos: int) -> None:
        nc, ns = 4 * self.n_gdn * self.conv_floats, 4 * self.n_gdn * self.ssm_floats
        if len(data) != nc + ns:
            raise ValueError(f"recurrent state of {len(data)} bytes, this model's is {nc + ns}")
        if not 0 <= pos <= self.n_ctx:
            raise ValueError(f"position {pos} outside the context of {self.n_ctx}")
        mv = memoryview(data).cast("B")
        if nc:
            self.conv.upload(mv[:nc])
        if ns:
            self.ssm.upload(mv[nc:])
        self._pos = int(pos)
        self.rope_delta = 0     # as le_state_restore_recurrent: the caller sets an image prefix's delta

    def _kv_rows(self, start: int, n: int) -> None:
        if start < 0 or n < 0 or start + n > self.n_ctx:
            raise ValueError(f"KV rows [{start}, {start + n}) outside the context of {self.n_ctx}")

    def read_kv(self, start: int, n: int) -> bytes:
        """KV rows [start, start+n) of every attention layer: [n_attn][K, V][n][row] f32 bytes."""
        out = np.empty(self.kv_nbytes(n), dtype=np.uint8)
        self.read_kv_into(start, n, out)
        return out.tobytes()

    def read_kv_into(self, start: int, n: int, out) -> None:
        """read_kv into a writable bytes-like of at least kv_nbytes(n)."""
        self._kv_rows(start, n)
        gpu.synchronize()
        rb = 4 * n * self.kvw
        mv = memoryview(out).cast("B")
        if mv.nbytes < 2 * self.n_attn * rb:
            raise ValueError(f"{2 * self.n_attn * rb} bytes of KV rows into a {mv.nbytes}-byte buffer")
        for a in range(self.n_attn):
            for j, base in enumerate((self.k_ptr(a), self.v_ptr(a))):
                if rb:
                    _native.gpu_copy_dtoh(mv[(2 * a + j) * rb:(2 * a + j + 1) * rb], base + 4 * start * self.kvw, rb)

    def write_kv(self, start: int, n: int, data: bytes) -> None:
        self._kv_rows(start, n)
        rb = 4 * n * self.kvw
        if len(data) != 2 * self.n_attn * rb:
            raise ValueError(f"KV data of {len(data)} bytes for {n} rows, expected {2 * self.n_attn * rb}")
        mv = memoryview(data).cast("B")
        for a in range(self.n_attn):
            for j, base in enumerate((self.k_ptr(a), self.v_ptr(a))):
                if rb:
                    _native.gpu_copy_htod(base + 4 * start * self.kvw, mv[(2 * a + j) * rb:(2 * a + j + 1) * rb], rb)

    def copy_from(self, other: "GpuState") -> None:
        self.restore_recurrent(other.save_recurrent(), other.pos)
        self.write_kv(0, other.pos, other.read_kv(0, other.pos))
        self.rope_delta = other.rope_delta

    # the handoff between engines, through one page-locked staging buffer of the model (GpuModel._handoff_buffer):
    # device <-> page-locked copies at the link's speed and one memcpy on the CPU side, instead of pageable copies
    # and Python bytes (SplitModel hands every GPU pass's state over both ways)
    def to_cpu(self, cpu_state) -> None:
        """Makes a CPU NativeState (of the same model) hold this sequence: prefill here, decode there."""
        self.to_cpu_rows(cpu_state, 0, self.pos)

    def to_cpu_rows(self, cpu_state, start: int, n: int) -> None:
        """The recurrent states, the position and KV rows [start, start + n) into a CPU NativeState (the rows a
        pass wrote: the CPU state holds the ones before)."""
        nr, nk = self.recurrent_nbytes(), self.kv_nbytes(n)
        stage = self.gm._handoff_buffer(max(nr, nk))
        if stage is None:                          # larger than the page-locked cap: pageable copies
            cpu_state.restore_recurrent(self.save_recurrent(), self.pos)
            cpu_state.write_kv(start, n, self.read_kv(start, n))
        else:
            self.save_recurrent_into(stage[:nr])
            cpu_state.restore_recurrent(stage[:nr], self.pos)
            if n:
                self.read_kv_into(start, n, stage[:nk])
                cpu_state.write_kv(start, n, stage[:nk])
        cpu_state.rope_delta = self.rope_delta

    def from_cpu(self, cpu_state) -> None:
        """Takes over a CPU NativeState's sequence."""
        pos = cpu_state.pos
        nr, nk = self.recurrent_nbytes(), self.kv_nbytes(pos)
        stage = self.gm._handoff_buffer(max(nr, nk))
        if stage is None:
            self.restore_recurrent(cpu_state.save_recurrent(), pos)
            self.write_kv(0, pos, cpu_state.read_kv(0, pos))
        else:
            cpu_state.save_recurrent_into(stage[:nr])
            self.restore_recurrent(stage[:nr], pos)
            if pos:
                cpu_state.read_kv_into(0, pos, stage[:nk])
                self.write_kv(0, pos, stage[:nk])
        self.rope_delta = cpu_state.rope_delta
