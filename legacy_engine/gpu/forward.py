"""The forward ops of a GPU model (GpuModel's part, a mixin): the layer ops of a pass of several tokens and of a
decode step, op for op as native/model.c:

  x = token_embd[tokens]                         get_rows
  per layer:  h = RMSNorm(x) * attn_norm         rmsnorm
              GDN:  qkv, z, beta, alpha = W h    matmuls; conv1d_silu; gdn_l2norm_qk; gdn_gates;
                                                 gdn_chunked (several tokens; gdn_recurrent for one, or
                                                 chunked=False); gdn_gated_rmsnorm; W_out
              attention: q|gate, k, v = W h      matmuls (k, v straight into the KV cache rows);
                                                 qk_norm_rope; attention_decode / _prefill; W_o
              x += y;  h = RMSNorm(x) * post_norm
              FFN: dense SwiGLU, or MoE          router matmul; moe_route; gemv_ids gate/up; swiglu;
                                                 gemv_ids down; shared expert; moe_combine
              x += y
  logits = W_out RMSNorm(x) * output_norm        rmsnorm; matmul (downloaded)

Matmuls: one token (decode) -> GEMV; with int8 (default on the dp4a tier) the activations are quantised to Q8_1
once per input and the quantised weights run gemv_dp4a (W4A8/W8A8), f32 weights gemv_f32_f32; several tokens
(prefill) -> gemm_dp4a on the same Q8_1 activations (int8_prefill, default = int8), else gemm_f32 (dequantise into
shared memory, f32 accumulate). MoE experts run as (token, expert) GEMVs indexed on the GPU by the router's ids (no
host round trip), or in a pass of several tokens sorted by expert as grouped GEMMs; a hybrid decode step's MoE
block is split between the GPU and the CPU through the hybrid channel (_ffn_hybrid).

The host class provides hparams, k (Kernels), the precision flags (int8, int8_prefill, mma, attn_mma, gdn_mma),
sort_pairs, grouped, the placement's (stream, cpu_experts, pinned, decode_extras, link_experts, early_experts), graphs,
route_counts and its rooms: res (Residency), scratch (Scratch), hy (HybridChannel)."""
from __future__ import annotations

import functools
import time

import numpy as np

from .. import gpu
from ..core import _native
from .hybrid import HYBRID_WAIT_CYCLES, LOOKAHEAD_PRED
from .kernels import GDN_CHUNKED_TIERS
from .layout import gdn_chunk_work
from .matmul import MULTI_MATS
from .residency import _W
from .state import GpuState


class ForwardOps:
    def _ffn_rows(self, i: int, n: int) -> int:
        """Rows layer i's FFN runs on in a pass of n tokens (the last layer's: _forward_chunk's _last_rows)."""
        return self._last_rows if i == self.hparams.n_layer - 1 and self._last_rows is not None else n

    def _ids_buf(self, ids: int, pairs: int) -> np.ndarray:
        """The router's expert ids of this pass, on the host (waits for the routing)."""
        out = np.empty(pairs, dtype=np.int32)
        t0 = time.perf_counter()
        _native.gpu_copy_dtoh(out, ids, 4 * pairs)
        self.res.stream_stats["ids_wait_s"] += time.perf_counter() - t0
        return out

    def _route_counts_dev(self, i: int) -> int:
        """Device address of layer i's int32 routing counts [n_expert] (moe_sort adds to them; _flush_counts moves
        them into route_counts when the pass is done)."""
        hp = self.hparams
        if self._counts_dev is None:
            self._counts_dev = self.scratch.buf("route_counts", 4 * hp.n_layer * hp.n_expert)
            _native.gpu_memset8(self._counts_dev.ptr, 0, 4 * hp.n_layer * hp.n_expert)
        self._counts_layers.add(i)
        return self._counts_dev.ptr + 4 * i * hp.n_expert

    def _flush_counts(self) -> None:
        """The pass's device routing counts into route_counts (after the pass: the download waits for it)."""
        if not self._counts_layers:
            return
        hp = self.hparams
        c = self._counts_dev.download(dtype=np.int32, count=hp.n_layer * hp.n_expert).reshape(hp.n_layer, hp.n_expert)
        for i in sorted(self._counts_layers):
            self.route_counts.setdefault(i, np.zeros(hp.n_expert, dtype=np.int64))[:] += c[i]
        _native.gpu_memset8(self._counts_dev.ptr, 0, 4 * hp.n_layer * hp.n_expert)
        self._counts_layers = set()

    def profile(self, on: bool = True) -> None:
        """Times the GPU's work per phase of passes with more than one token (events between phases; adds a
        little host work per layer): read with profile_report(); and each prefill GEMM (events around it): read
        with profile_gemms(). Decode plans are not profiled."""
        self._prof = {} if on else None
        self._prof_marks: list = []
        self._prof_gemms: dict = {}
        self._gemm_marks: list = []
        self.k.gemm_log = [] if on else None

    def _mark(self, phase: str) -> None:
        """Ends `phase` (the GPU work launched since the previous mark) when profiling."""
        if self._prof is None or self.scratch.tag == "d":
            return
        e = gpu.Event()
        e.record()
        self._prof_marks.append((phase, e))
        self._gemm_marks.extend((phase, g) for g in self.k.gemm_log)
        self.k.gemm_log.clear()

    def profile_report(self) -> dict:
        """{phase: GPU seconds} summed since profile() (the first mark of each pass starts its clock)."""
        if self._prof is None:
            return {}
        marks, prev = self._prof_marks, None
        for phase, e in marks:
            if prev is not None and phase != "embed":
                self._prof[phase] = self._prof.get(phase, 0.0) + prev.elapsed_ms(e) / 1e3
            prev = e
        self._prof_marks = marks[-1:] if marks else []
        return dict(self._prof)

    def profile_gemms(self) -> dict:
        """{(phase, GEMM kernel module): [GPU seconds, operations (2 per weight per token), launches]} of the
        prefill GEMMs since profile(); each GEMM counts in the phase its pass marked next."""
        if self._prof is None:
            return {}
        for phase, (mod, ops, e0, e1) in self._gemm_marks:
            acc = self._prof_gemms.setdefault((phase, mod), [0.0, 0, 0])
            acc[0] += e0.elapsed_ms(e1) / 1e3
            acc[1] += ops
            acc[2] += 1
        self._gemm_marks = []
        return {k: list(v) for k, v in self._prof_gemms.items()}

    def _mm(self, w: _W, x: int, y: int, n: int, xq: int | None = None) -> None:
        """y[n, w.nrows] = x[n, w.ncols] W^T. xq: x already quantised to Q8_1 (n rows; from add_rmsnorm, _hq)."""
        k = self.k
        if n > 1 and self.int8_prefill and w.qtype != gpu.F32:
            if xq is None:
                xq = self._q8_1(x, n * w.ncols, self._xq_name(n))
            (k.gemm_mma if self.mma else k.gemm_dp4a)(w.qtype, w.ptr, xq, y, w.nrows, w.ncols, n)
        elif n > 1:
            k.gemm_f32(w.qtype, w.ptr, x, y, w.nrows, w.ncols, n)
        elif self.int8 and w.qtype != gpu.F32:
            if xq is None:
                xq = self._q8_1(x, w.ncols, self._xq_name(n))
            k.gemv_dp4a(w.qtype, w.ptr, xq, y, w.nrows, w.ncols)
        else:
            k.gemv_f32(w.qtype, w.ptr, x, y, w.nrows, w.ncols)

    def _mm_many(self, ws: list, x: int, ys: list, n: int, xq: int | None = None) -> None:
        """_mm of several matrices on the same input x (ys: their outputs). One token: those of one type and width
        as one GEMV launch each GEMV_MAX_MATS (their blocks one after another: GDN's qkv, z, beta and alpha; a
        decode token is a chain of dependent launches, each mostly latency). A pass of several tokens on the int8
        GEMMs runs those of one type as gemm_multi launches (MULTI_MATS at most each; a lone one by _mm): a layer's
        narrow projections share the wide one's waves."""
        if n == 1:
            same: dict[tuple, list] = {}
            for w, y in zip(ws, ys):
                same.setdefault((w.qtype, w.ncols), []).append((w, y))
            for group in same.values():
                for i in range(0, len(group), gpu.GEMV_MAX_MATS):
                    self._gemv_mats(group[i:i + gpu.GEMV_MAX_MATS], x, xq)
            return
        if not (self.int8_prefill and self.k.many_regs):
            for w, y in zip(ws, ys):
                self._mm(w, x, y, n, xq)
            return
        groups: dict[int, list] = {}
        for w, y in zip(ws, ys):
            groups.setdefault(w.qtype, []).append((w, y))
        for qtype, group in groups.items():
            if qtype == gpu.F32 or len(group) == 1:
                for w, y in group:
                    self._mm(w, x, y, n, xq)
                continue
            if xq is None:
                xq = self._q8_1(x, n * group[0][0].ncols, self._xq_name(n))
            for i in range(0, len(group), MULTI_MATS):
                self.k.gemm_multi(qtype, [(w.ptr, y, w.nrows) for w, y in group[i:i + MULTI_MATS]], xq,
                                  group[0][0].ncols, n, self.mma)

    def _gemv_mats(self, group: list, x: int, xq: int | None) -> None:
        """One token through [(w, y)] of one type and width (at most GEMV_MAX_MATS) in one GEMV launch."""
        (w, y), more = group[0], [(wm.ptr, ym, wm.nrows) for wm, ym in group[1:]]
        if more and sum(-(-wm.nrows // gpu.GEMV_ROWS) for wm, _ in group) > gpu.MAX_GRID:
            for wm, ym in group:           # more blocks than one launch's grid: apart, each grid-strided
                self._mm(wm, x, ym, 1, xq)
        elif not more:
            self._mm(w, x, y, 1, xq)
        elif self._int8_for(w, 1):
            if xq is None:
                xq = self._q8_1(x, w.ncols, self._xq_name(1))
            self.k.gemv_dp4a(w.qtype, w.ptr, xq, y, w.nrows, w.ncols, more=more)
        else:
            self.k.gemv_f32(w.qtype, w.ptr, x, y, w.nrows, w.ncols, more=more)

    def _int8_for(self, w: _W, n: int) -> bool:
        """Whether _mm runs w on int8 activations (Q8_1) for a pass of n tokens."""
        return w.qtype != gpu.F32 and (self.int8_prefill if n > 1 else self.int8)

    def _swiglu(self, w_down: _W, g: int, u: int, n_el: int, n: int) -> int | None:
        """SiLU(g) * u of n_el elements (n tokens) for the down projection w_down: where it runs int8, straight into
        Q8_1 (swiglu_q8_1: the same bits as swiglu then quantize, one launch) -> that buffer; else into g -> None."""
        if not self._int8_for(w_down, n):
            self.k.swiglu(g, u, g, n_el)
            return None
        xq = self.scratch.buf(self._xq_name(n), n_el // 32 * gpu.Q8_1_BYTES).ptr
        self.k.swiglu_q8_1(g, u, xq, n_el)
        return xq

    def _hq(self, n: int) -> int | None:
        """The buffer add_rmsnorm writes the normed h [n, E] into as Q8_1, for the int8 GEMVs (one token) or GEMMs
        (several, int8_prefill) that read h; None on the f32 paths. A name of its own: _mm's "xq" (the other
        inputs' Q8_1) must not overwrite it while a block still reads h (the hybrid's pinned experts after the
        shared expert's down)."""
        if not (self.int8_prefill if n > 1 else self.int8):
            return None
        return self.scratch.buf("hq", n * self.hparams.n_embd // 32 * gpu.Q8_1_BYTES).ptr

    @staticmethod
    def _xq_name(n: int) -> str:
        """The scratch buffer of a matmul input's Q8_1: "xq_mm" in a pass of several tokens, "xq" in a decode step
        (their sizes differ; a step's planned launches keep their buffer)."""
        return "xq_mm" if n > 1 else "xq"

    def _q8_1(self, x: int, n_el: int, name: str) -> int:
        """x[n_el] f32 (rows of a multiple of 32) quantised to Q8_1 in scratch buffer `name` -> its address."""
        xq = self.scratch.buf(name, n_el // 32 * gpu.Q8_1_BYTES).ptr
        self.k.quantize_q8_1(x, xq, n_el)
        return xq

    def _gdn(self, L: dict, h: int, hq, n: int, st: "GpuState", si: int, y: int, chunked: bool = True) -> None:
        """chunked: a pass of several tokens runs the chunked form (cuda8/gdn_chunked.cu) on the tiers where it is the
        faster (GDN_CHUNKED_TIERS), else token by token."""
        hp, k = self.hparams, self.k
        self.scratch.arena_open("gdn")
        Hk, Hv, dk = hp.ssm_n_group, hp.ssm_dt_rank, hp.ssm_d_state
        dv = hp.ssm_d_inner // Hv
        conv_dim = 2 * Hk * dk + hp.ssm_d_inner
        qkv = self.scratch.buf("qkv", 4 * n * conv_dim).ptr
        u = self.scratch.buf("u", 4 * n * conv_dim).ptr
        z = self.scratch.buf("z", 4 * n * hp.ssm_d_inner).ptr
        o = self.scratch.buf("o", 4 * n * hp.ssm_d_inner).ptr
        beta = self.scratch.buf("beta", 4 * n * Hv).ptr
        g = self.scratch.buf("g", 4 * n * Hv).ptr
        self._mm_many([L["attn_qkv"], L["attn_gate"], L["ssm_beta"], L["ssm_alpha"]], h, [qkv, z, beta, g], n, hq)
        if n == 1 and dk <= gpu.CONV_THREADS:      # a decode step: conv, its state and the q/k norms in one launch
            k.conv1d_step_l2norm(qkv, L["ssm_conv1d"], st.conv_ptr(si), u, conv_dim, hp.ssm_conv_kernel, Hk, dk)
        else:
            k.conv1d_silu(qkv, L["ssm_conv1d"], st.conv_ptr(si), u, n, conv_dim, hp.ssm_conv_kernel)
            k.gdn_l2norm_qk(u, n, conv_dim, Hk, dk)
        tiled = not self._faults.get("gdn_grouped")
        if n > 1:          # a long recurrence: the gates in a launch of their own (on its serial path they cost more)
            k.gdn_gates(beta, g, L["ssm_dt"], L["ssm_a"], n, Hv)
        if n > 1 and chunked and k.tier in GDN_CHUNKED_TIERS:
            work = tuple(self.scratch.buf(name, nbytes).ptr for name, nbytes in gdn_chunk_work(hp, n).items())
            k.gdn_chunked(u, g, beta, st.ssm_ptr(si), o, n, Hk, Hv, dk, dv, work, tiled=tiled, mma=self.gdn_mma)
        else:
            k.gdn_recurrent(u, g, beta, st.ssm_ptr(si), o, n, Hk, Hv, dk, dv, tiled=tiled,
                            dt_bias=L["ssm_dt"] if n == 1 else None, ssm_a=L["ssm_a"] if n == 1 else None)
        # a decode step's norm also writes o's Q8_1 where the out projection runs int8 (no quantize launch of its
        # own; in a 2048-token pass the fused form took 5 ms more than quantize_q8_1's launch, H200)
        oq = self.scratch.buf("oq", hp.ssm_d_inner // 32 * gpu.Q8_1_BYTES).ptr if n == 1 and self._int8_for(L["ssm_out"], n) \
            else None
        k.gdn_gated_rmsnorm(o, z, L["ssm_norm"], o, n * Hv, dv, hp.rms_eps, yq=oq)
        self._mm(L["ssm_out"], o, y, n, oq)

    def _row_q8(self, hq, s: int) -> int | None:
        """Row s of a Q8_1 buffer of h's rows (None stays None)."""
        return None if hq is None else hq + s * (self.hparams.n_embd // 32 * gpu.Q8_1_BYTES)

    def _gdn_seqs(self, L: dict, h: int, hq, states: list, si_of, y: int) -> None:
        """A decode step of B sequences (row s of h is states[s]'s token): the projections over the B rows, the
        conv and the recurrence per sequence in its own state (the one-token launches _gdn runs), the norm and
        the out projection over the B rows."""
        hp, k, B = self.hparams, self.k, len(states)
        self.scratch.arena_open("gdn")
        Hk, Hv, dk = hp.ssm_n_group, hp.ssm_dt_rank, hp.ssm_d_state
        dv, di = hp.ssm_d_inner // Hv, hp.ssm_d_inner
        conv_dim = 2 * Hk * dk + di
        qkv = self.scratch.buf("qkv", 4 * B * conv_dim).ptr
        u = self.scratch.buf("u", 4 * B * conv_dim).ptr
        z = self.scratch.buf("z", 4 * B * di).ptr
        o = self.scratch.buf("o", 4 * B * di).ptr
        beta = self.scratch.buf("beta", 4 * B * Hv).ptr
        g = self.scratch.buf("g", 4 * B * Hv).ptr
        self._mm_many([L["attn_qkv"], L["attn_gate"], L["ssm_beta"], L["ssm_alpha"]], h, [qkv, z, beta, g], B, hq)
        fused = dk <= gpu.CONV_THREADS      # each sequence's conv, state and q/k norms in one launch
        for s, st in enumerate(states):
            x_s, u_s = qkv + 4 * s * conv_dim, u + 4 * s * conv_dim
            if fused:
                k.conv1d_step_l2norm(x_s, L["ssm_conv1d"], st.conv_ptr(si_of(st)), u_s, conv_dim, hp.ssm_conv_kernel,
                                     Hk, dk)
            else:
                k.conv1d_silu(x_s, L["ssm_conv1d"], st.conv_ptr(si_of(st)), u_s, 1, conv_dim, hp.ssm_conv_kernel)
        if not fused:
            k.gdn_l2norm_qk(u, B, conv_dim, Hk, dk)
        for s, st in enumerate(states):
            k.gdn_recurrent(u + 4 * s * conv_dim, g + 4 * s * Hv, beta + 4 * s * Hv, st.ssm_ptr(si_of(st)),
                            o + 4 * s * di, 1, Hk, Hv, dk, dv, tiled=not self._faults.get("gdn_grouped"),
                            dt_bias=L["ssm_dt"], ssm_a=L["ssm_a"])
        k.gdn_gated_rmsnorm(o, z, L["ssm_norm"], o, B * Hv, dv, hp.rms_eps)
        self._mm(L["ssm_out"], o, y, B)

    def _attention_seqs(self, L: dict, h: int, hq, states: list, si_of, y: int) -> None:
        """A decode step of B sequences: q over the B rows; per sequence its k, v (into its cache row), the norm and
        rope at its own position, and attention over its own keys; the output projection over the B rows."""
        hp, k, B = self.hparams, self.k, len(states)
        self.scratch.arena_open("attention")
        hd, nh, nkv, E = hp.head_dim, hp.n_head, hp.n_head_kv, hp.n_embd
        qw, kvw = nh * 2 * hd, nkv * hd
        qg = self.scratch.buf("qg", 4 * B * qw).ptr
        o = self.scratch.buf("ao", 4 * B * nh * hd).ptr
        self._mm(L["attn_q"], h, qg, B, hq)
        part = self.scratch.buf("attn_part", k.attn_partials_bytes(nh, hd, gpu.ATTN_MAX_SPLIT)).ptr
        for s, st in enumerate(states):
            si, pos = si_of(st), st.pos
            kc, vc = st.k_ptr(si), st.v_ptr(si)
            kn, vn = kc + 4 * pos * kvw, vc + 4 * pos * kvw
            xs, xq = h + 4 * s * E, self._row_q8(hq, s)
            self._mm(L["attn_k"], xs, kn, 1, xq)
            self._mm(L["attn_v"], xs, vn, 1, xq)
            cs = self.scratch.rope_cs(st.n_ctx).ptr + 4 * (pos + st.rope_delta) * hp.n_rot
            q = qg + 4 * s * qw
            k.qk_norm_rope(q, L["attn_q_norm"], cs, 1, nh, 2 * hd, qw, hd, hp.n_rot, hp.rms_eps)
            k.qk_norm_rope(kn, L["attn_k_norm"], cs, 1, nkv, hd, kvw, hd, hp.n_rot, hp.rms_eps)
            n_split, _ = k.attn_splits(pos + 1)
            k.attention_decode(q, kc, vc, o + 4 * s * nh * hd, part, pos + 1, nh, nkv, hd, n_split=n_split)
        self._mm(L["attn_output"], o, y, B)

    def _attention_planned(self, L: dict, h: int, hq, st: "GpuState", si: int, y: int) -> None:
        """One token whose position is the device int st.io[1] (its rope position st.io[2]): every argument
        independent of the position."""
        hp, k = self.hparams, self.k
        hd, nh, nkv = hp.head_dim, hp.n_head, hp.n_head_kv
        qw, kvw = nh * 2 * hd, nkv * hd
        qg = self.scratch.buf("qg", 4 * qw).ptr
        o = self.scratch.buf("ao", 4 * nh * hd).ptr
        kb, vb = self.scratch.buf("kb", 4 * kvw).ptr, self.scratch.buf("vb", 4 * kvw).ptr
        kc, vc, pos_dev = st.k_ptr(si), st.v_ptr(si), st.io.ptr + 4
        self._mm_many([L["attn_q"], L["attn_k"], L["attn_v"]], h, [qg, kb, vb], 1, hq)
        cs, rope_dev = self.scratch.rope_cs(st.n_ctx).ptr, st.io.ptr + 8
        k.qk_norm_rope(qg, L["attn_q_norm"], cs, 1, nh, 2 * hd, qw, hd, hp.n_rot, hp.rms_eps, pos_dev=rope_dev)
        k.qk_norm_rope(kb, L["attn_k_norm"], cs, 1, nkv, hd, kvw, hd, hp.n_rot, hp.rms_eps, pos_dev=rope_dev)
        k.kv_store(kb, vb, kc, vc, pos_dev, kvw)
        n_split = k.attn_splits(st.n_ctx)[0]
        part = self.scratch.buf("attn_part", k.attn_partials_bytes(nh, hd, gpu.ATTN_MAX_SPLIT)).ptr
        k.attention_decode(qg, kc, vc, o, part, st.n_ctx, nh, nkv, hd, n_split=n_split, pos_dev=pos_dev)
        self._mm(L["attn_output"], o, y, 1)

    def _attention(self, L: dict, h: int, hq, n: int, st: "GpuState", si: int, y: int) -> None:
        hp, k = self.hparams, self.k
        self.scratch.arena_open("attention")
        hd, nh, nkv = hp.head_dim, hp.n_head, hp.n_head_kv
        qw, kvw, pos = nh * 2 * hd, nkv * hd, st.pos
        qg = self.scratch.buf("qg", 4 * n * qw).ptr
        o = self.scratch.buf("ao", 4 * n * nh * hd).ptr
        kc, vc = st.k_ptr(si), st.v_ptr(si)
        kn, vn = kc + 4 * pos * kvw, vc + 4 * pos * kvw   # this batch's cache rows
        self._mm_many([L["attn_q"], L["attn_k"], L["attn_v"]], h, [qg, kn, vn], n, hq)
        cs = self._rope_cs          # this pass's rope rows [n, n_rot/2, 2] (GpuModel._pass_rope)
        k.qk_norm_rope(qg, L["attn_q_norm"], cs, n, nh, 2 * hd, qw, hd, hp.n_rot, hp.rms_eps)
        k.qk_norm_rope(kn, L["attn_k_norm"], cs, n, nkv, hd, kvw, hd, hp.n_rot, hp.rms_eps)
        if n == 1:
            n_split, _ = k.attn_splits(pos + 1)
            part = self.scratch.buf("attn_part", k.attn_partials_bytes(nh, hd, n_split)).ptr
            k.attention_decode(qg, kc, vc, o, part, pos + 1, nh, nkv, hd, n_split=n_split)
        else:
            planes = self.scratch.buf("attn_planes", k.attn_planes_bytes(pos + n, nkv, hd)) if self.attn_mma else None
            k.attention_prefill(qg, kc, vc, o, n, pos, nh, nkv, hd, mma=self.attn_mma, planes=planes)
        self._mm(L["attn_output"], o, y, n)

    def _ffn(self, L: dict, h: int, hq, n: int, y: int) -> None:
        hp, k = self.hparams, self.k
        E = hp.n_embd
        if not hp.n_expert:
            ff = hp.n_ff
            self.scratch.arena_open("ffn")
            g = self.scratch.buf("ffg", 4 * n * ff).ptr
            u = self.scratch.buf("ffu", 4 * n * ff).ptr
            self._mm_many([L["ffn_gate"], L["ffn_up"]], h, [g, u], n, hq)
            self._mm(L["ffn_down"], g, y, n, self._swiglu(L["ffn_down"], g, u, n * ff, n))
            return
        if n == 1 and self.cpu_experts and self.scratch.tag == "d":      # a decode step (not a pass's last row)
            return self._ffn_hybrid(L, h, hq, y)
        ne, kk, ff = hp.n_expert, hp.n_expert_used, hp.n_ff_exp
        pairs = n * kk
        self.scratch.arena_open("moe")
        logits = self.scratch.buf("router", 4 * n * ne).ptr
        ids = self.scratch.buf("ids", 4 * pairs).ptr
        wts = self.scratch.buf("wts", 4 * pairs).ptr
        g = self.scratch.buf("eg", 4 * pairs * ff).ptr
        u = self.scratch.buf("eu", 4 * pairs * ff).ptr
        sort = n > 1 and self.sort_pairs
        yd = None if sort else self.scratch.buf("ed", 4 * pairs * E).ptr     # sorted: the outputs stay in xg (pinv)
        shg = self._router(L, h, hq, n, logits)
        k.moe_route(logits, ids, wts, n, ne, kk)
        base, used, dev_sort = self._experts_in_vram(L, ids, n, sort)
        x_tok, xg, eids, x_group = h, h, ids, kk
        if dev_sort:
            n_tiles = gpu.Kernels.sort_tiles_max(pairs, ne, self._group_tile(L))
            mb = self.scratch.buf("pair_meta", 4 * (3 * pairs + 3 * n_tiles))
            eids, ptok, pinv, ptiles = mb.ptr, mb.ptr + 4 * pairs, mb.ptr + 8 * pairs, mb.ptr + 12 * pairs
            k.moe_sort(ids, pairs, kk, ne, eids, ptok, pinv, ptiles, n_tiles, self._route_counts_dev(L["index"]),
                       tile=self._group_tile(L))
        elif sort:
            # pairs in expert order: the GEMV blocks of one expert run together and share its weights in L2.
            # x rows gathered per pair; moe_combine reads the outputs in that order (pinv)
            order = np.argsort(used, kind="stable").astype(np.int32)
            inv = np.empty_like(order)
            inv[order] = np.arange(pairs, dtype=np.int32)
            tiles = (gpu.Kernels.expert_tiles(used[order], self._group_tile(L)) if self.grouped
                     else np.zeros((0, 3), np.int32))
            meta = np.concatenate([used[order], order // kk, inv, tiles.reshape(-1)]).astype(np.int32)
            mb = self.scratch.buf("pair_meta", 4 * (3 * pairs + 3 * len(tiles)))
            mb.upload(meta)
            eids, ptok, pinv, ptiles = mb.ptr, mb.ptr + 4 * pairs, mb.ptr + 8 * pairs, mb.ptr + 12 * pairs
            n_tiles = len(tiles)
        if sort:       # x rows gathered per sorted pair (Q8_1 from hq where the grouped int8 GEMMs read them)
            xg = self.scratch.buf("xg", 4 * pairs * E).ptr
            xq = self._gather_hq(L, hq, ptok, pairs)
            if xq is None:
                k.get_rows(gpu.F32, h, ptok, xg, pairs, E)
            x_tok, x_group = xg, 1
        if sort and self.grouped:
            self._grouped_experts(L, base, xg, g, u, pairs, ptiles, n_tiles, xq)   # output in xg (sorted)
        else:
            addr = {w: base + L[w].ptr for w in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
            self._pair_gemvs(L, addr, x_tok, hq if not sort else None, g, u, xg if sort else yd, eids, pairs,
                             x_group)
        self._mark("routed experts")
        if self.stream:
            self.res.release(L["index"])
            self.res.stream_stats["layers"] += 1
        if sort:       # the outputs in expert order: the combine reads pair (t, s) from row pinv[t*k + s] of xg
            self._shared_and_combine(L, h, hq, n, xg, wts, y, rows=pinv, shg=shg)
        else:
            self._shared_and_combine(L, h, hq, n, yd, wts, y, shg=shg)

    def _experts_in_vram(self, L: dict, ids: int, n: int, sort: bool) -> tuple[int, np.ndarray | None, bool]:
        """Layer L's routed experts for a pass of n tokens routed to `ids` (device int32 [n * k]) -> (the address
        their tensors' offsets count from: 0 resident, the staging slot streamed; the ids on the host where it read
        them, else None; whether the grouped GEMMs' work list is made on the GPU: moe_sort)."""
        hp = self.hparams
        ne, i, pairs = hp.n_expert, L["index"], n * hp.n_expert_used
        # the grouped GEMMs' work list made on the GPU (moe_sort): no host wait, where the host needs no ids
        # (resident experts, or all of the layer staged because the pass routes to most of them)
        dev_sort = sort and self.grouped and ne <= gpu.MOE_SORT_MAX_E and (not self.stream or self.res.stages_all(n))
        # a pass's last row (the last layer's FFN: _forward_chunk): its experts fetched by the GPU, no host wait
        fetch = self.stream and n == 1 and self.scratch.tag == "p" and self.res.can_fetch(i)
        used = None
        if (self.stream or sort) and not dev_sort and not fetch:
            self._mark("ffn rest")
            used = self._ids_buf(ids, pairs)
            c = self.route_counts.setdefault(i, np.zeros(ne, dtype=np.int64))
            c += np.bincount(used, minlength=ne)[:ne]
        if not self.stream:
            return 0, used, dev_sort
        base = (self.res.fetch(i, ids, hp.n_expert_used) if fetch else
                self.res.stage(i, range(ne) if dev_sort else np.unique(used)))
        self._mark("waiting for expert copies")
        nxt = self.res.next_moe(i)
        self.res.prefetch_all(nxt, self._ffn_rows(nxt, n))   # the next layer's copy overlaps this layer's experts
        return base, used, dev_sort

    def _ffn_hybrid(self, L: dict, h: int, hq, y: int) -> None:
        """One token's MoE block split between the GPU and the CPU (cpu_experts), exchanged through the channel
        (HybridLayout, page-locked host memory both sides read and write): hybrid_publish puts h and the routing in
        layer i's slot and makes hy_meta [kk gids (index in the pin store, -1: not pinned) | kk lids (the experts
        fetched over the link, link_experts of them) | kk lslots (their place in hy_link) | 2kk + 1 weights]; the GPU
        fetches the link experts (hybrid_fetch), runs the shared, pinned (rows 1..kk of hy_rows [2kk + 1, E]) and
        link experts (rows kk+1..2kk) while the CPU runs the others (le_hybrid_serve); hybrid_wait brings the CPU's
        weighted sum into row 0 (weight 1); one moe_combine adds them and the shared expert. No host step: a token
        is one launch sequence."""
        hp, k = self.hparams, self.k
        E, kk, ne, ff = hp.n_embd, hp.n_expert_used, hp.n_expert, hp.n_ff_exp
        i = L["index"]
        pinned = bool(self.pinned.get(i))
        hy = self.hy.channel()
        chan, slot = hy["ptr"], hy["ptr"] + 4 * hy["layout"].slot_offset(i)
        link, n_early = self.link_experts, self.early_experts
        meta = self.scratch.buf("hy_meta", 4 * (7 * kk + 1)).ptr
        fresh = f"{self.scratch.tag}:hy_rows" not in self.scratch.bufs
        rows = self.scratch.buf("hy_rows", 4 * (2 * kk + 1) * E).ptr
        if fresh:      # rows a layer does not compute (no pins here, no link experts) stay zero, at weight 0
            _native.gpu_memset8(rows, 0, 4 * (2 * kk + 1) * E)
        ids = self.scratch.buf("hy_ids", 4 * kk).ptr
        wts = self.scratch.buf("hy_wts", 4 * kk).ptr
        logits = self.scratch.buf("router", 4 * ne).ptr
        shg = self._router(L, h, hq, 1, logits)
        k.moe_route(logits, ids, wts, 1, ne, kk)
        la = hy["lookahead"]
        parity = int(np.searchsorted(hy["layers"], i)) % 2        # the early buffer's half this layer uses
        extra = i in self.decode_extras
        k.hybrid_publish(h, ids, wts, hy["pin_idx"].ptr + 4 * i * ne if pinned else None, link, meta, slot, chan,
                         E, kk, pred=la["pred"] + 4 * gpu.HY_PRED_MAX * i if la and i in la["from"].values() else None,
                         n_early=n_early, extra_idx=hy["extra_idx"].ptr + 4 * i * ne if extra else None)
        if la and i in la["from"]:    # the next MoE layer's experts predicted from this h (the CPU prefetches them)
            j = la["from"][i]
            k.hybrid_predict(self.layers[j]["ffn_gate_inp"].ptr, h, la["scales"] + 4 * E * i, la["logits"], ne, E)
            k.hybrid_predict_publish(la["logits"], ne, min(LOOKAHEAD_PRED, ne), hy["pin_idx"].ptr + 4 * j * ne
                                     if self.pinned.get(j) else None, la["pred"] + 4 * gpu.HY_PRED_MAX * j,
                                     chan + 4 * hy["layout"].slot_offset(j), chan, E, kk)
        names = L["exp_tensor"]
        staged, tensors = self.hy.staging(i)
        if link:           # the link experts' weights into VRAM first (a copy kernel: the link's full rate)
            k.hybrid_fetch(meta + 12 * kk, meta + 8 * kk, kk, tensors)
        if n_early:        # the early experts the layer routes to: from the CPU's early buffer into staging slots
            ea = self.hy.early_regions()
            k.hybrid_fetch(meta + 16 * kk, meta + 8 * kk, kk,
                           [(ea[parity][name], staged[name], eb) for (_src, _dst, eb), name
                            in zip(tensors, self.res.stage_names[i])])
        # queued before the wait, so the GPU computes these while the CPU runs its experts
        sh, shg = self._shared_expert(L, h, hq, 1, shg)
        g = self.scratch.buf("eg", 4 * kk * ff).ptr
        u = self.scratch.buf("eu", 4 * kk * ff).ptr
        if pinned:         # rows 1..kk: the pinned experts (gids: index in the pin store)
            store = self.res.pin_store[i].ptr
            addr = {w: store + self.res.pin_off[names[w]] + L[w].ptr - self.res.stage_offset[names[w]]
                    for w in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
            self._pair_gemvs(L, addr, h, hq, g, u, rows + 4 * E, meta, kk, kk)
        if link or n_early or extra:  # rows kk+1..2kk: early, fetched and extra experts (lslots: their staging slot)
            addr = {w: staged[names[w]] + L[w].ptr - self.res.stage_offset[names[w]]
                    for w in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
            self._pair_gemvs(L, addr, h, hq, g, u, rows + 4 * (1 + kk) * E, meta + 8 * kk, kk, kk)
        k.hybrid_wait(slot, chan, rows, E, kk, HYBRID_WAIT_CYCLES)
        n_rows = 1 + kk * (2 if link or n_early or extra else 1 if pinned else 0)
        k.moe_combine(rows, meta + 20 * kk, sh, shg, y, 1, n_rows, E)
        if self.graphs:
            self.hy.serve([i])     # the recording pass (a replay is one graph launch, then every layer is served)
        else:
            gpu.host_step(functools.partial(self.hy.serve, [i]))   # replayed after this layer's launches

    def _pair_gemvs(self, L: dict, addr: dict, x_rows: int, xq, g: int, u: int, out: int, eids: int, pairs: int,
                    x_group: int) -> None:
        """Routed experts as one GEMV per (token, expert) pair: pair p reads row p // x_group of x_rows [*, E]
        (xq: those rows already in Q8_1, the one-token decode case), writes out [pairs, E]; g, u [pairs, ff].
        addr: {gate_exps, up_exps, down_exps: device address of expert 0 of that matrix} (eids index from there;
        < 0: the pair is skipped, its row zero)."""
        hp, k = self.hparams, self.k
        E, ff = hp.n_embd, hp.n_ff_exp
        int8 = self.int8 and L["ffn_gate_exps"].qtype != gpu.F32
        x, xs = x_rows, E
        if int8:
            x, xs = xq, E // 32
            if x is None:         # several rows: quantise each (tokens, or gathered pairs)
                x = self._q8_1(x_rows, pairs // x_group * E, "xq_tok")
        wg, wu = L["ffn_gate_exps"], L["ffn_up_exps"]
        if (wg.qtype, wg.nrows, wg.ncols, wg.expert_bytes) == (wu.qtype, wu.nrows, wu.ncols, wu.expert_bytes):
            k.gemv_ids(wg.qtype, addr["ffn_gate_exps"], x, g, wg.nrows, wg.ncols, eids, pairs, wg.expert_bytes, x_group,
                       xs, int8=int8, W2=addr["ffn_up_exps"], y2=u)       # gate and up in one launch
        else:
            for w, a, o in ((wg, addr["ffn_gate_exps"], g), (wu, addr["ffn_up_exps"], u)):
                k.gemv_ids(w.qtype, a, x, o, w.nrows, w.ncols, eids, pairs, w.expert_bytes, x_group, xs, int8=int8)
        w = L["ffn_down_exps"]
        int8d = self.int8 and w.qtype != gpu.F32
        xd, xds = g, ff
        if int8d:          # SiLU(g) * u straight into Q8_1: one launch, the bits of swiglu then quantize_q8_1
            xd, xds = self.scratch.buf("xq_down", pairs * ff // 32 * gpu.Q8_1_BYTES).ptr, ff // 32
            k.swiglu_q8_1(g, u, xd, pairs * ff)
        else:
            k.swiglu(g, u, g, pairs * ff)
        k.gemv_ids(w.qtype, addr["ffn_down_exps"], xd, out, w.nrows, w.ncols, eids, pairs, w.expert_bytes, 1, xds,
                   int8=int8d)

    def _shared_and_combine(self, L: dict, h: int, hq, n: int, yd: int, wts: int, y: int, rows=None,
                            shg: int | None = None) -> None:
        """y[n, E] = the routed experts' outputs yd [n*k, E] (pair (t, s) in row t*k + s, or rows[t*k + s])
        weighted by wts, plus the gated shared expert (shg: its gate logit, made with the router)."""
        sh, shg = self._shared_expert(L, h, hq, n, shg)
        self.k.moe_combine(yd, wts, sh, shg, y, n, self.hparams.n_expert_used, self.hparams.n_embd, rows=rows)

    def _router(self, L: dict, h: int, hq, n: int, logits: int) -> int | None:
        """The router's logits [n, n_expert] of h into `logits`. One token: the shared expert's gate logit in the
        same GEMV launch where its matrix has the router's type and width -> its address (shg), else None."""
        hp, w = self.hparams, L["ffn_gate_inp"]
        ws = L.get("ffn_gate_inp_shexp")
        if n == 1 and hp.n_ff_shexp and ws is not None and (ws.qtype, ws.ncols) == (w.qtype, w.ncols):
            shg = self.scratch.buf("shg", 4).ptr
            self._mm_many([w, ws], h, [logits, shg], 1, hq)
            return shg
        self._mm(w, h, logits, n, hq)
        return None

    def _shared_expert(self, L: dict, h: int, hq, n: int, shg: int | None = None) -> tuple:
        """The shared expert's output sh [n, E] and gate logit shg [n] (device addresses; shg given: made
        already, by _router), or (None, None)."""
        hp = self.hparams
        E = hp.n_embd
        sh = None
        if hp.n_ff_shexp:
            fs = hp.n_ff_shexp
            sg = self.scratch.buf("sg", 4 * n * fs).ptr
            su = self.scratch.buf("su", 4 * n * fs).ptr
            sh = self.scratch.buf("sh", 4 * n * E).ptr
            self._mm_many([L["ffn_gate_shexp"], L["ffn_up_shexp"]], h, [sg, su], n, hq)
            self._mm(L["ffn_down_shexp"], sg, sh, n, self._swiglu(L["ffn_down_shexp"], sg, su, n * fs, n))
            if shg is None:
                shg = self.scratch.buf("shg", 4 * n).ptr
                self._mm(L["ffn_gate_inp_shexp"], h, shg, n, hq)
        return sh, shg

    def _group_tile(self, L: dict) -> int:
        """Pairs per tile of layer L's grouped expert GEMMs (their work list is cut to it): gemm_mma's 64 where all
        three expert matrices run on it, else 32."""
        mma = self.mma and all(L[w].qtype != gpu.F32 for w in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
        return gpu.Kernels.group_tile(self.int8_prefill, mma)

    def _gather_hq(self, L: dict, hq, ptok: int, pairs: int) -> int | None:
        """The grouped int8 GEMMs' input: the Q8_1 rows of h (hq) gathered per sorted pair into "xq_tok" (the same
        bits as quantising the gathered f32 rows: no f32 gather, no quantise pass) -> its address, or None where
        the experts read f32 rows (not grouped, f32 weights, no hq, rows not in 16-byte words)."""
        rb = self.hparams.n_embd // 32 * gpu.Q8_1_BYTES
        if not (self.grouped and self.int8_prefill and L["ffn_gate_exps"].qtype != gpu.F32 and hq is not None
                and rb % 16 == 0):
            return None
        xq = self.scratch.buf("xq_tok", pairs * rb).ptr
        self.k.get_rows_raw(hq, ptok, xq, pairs, rb)
        return xq

    def _grouped_experts(self, L: dict, base: int, xg: int, g: int, u: int, pairs: int, tiles: int,
                         n_tiles: int, xq: int | None = None) -> None:
        """Routed experts as grouped GEMMs over the pairs sorted by expert: xg [pairs, E] gathered rows in (or
        xq, their Q8_1 rows gathered already: _gather_hq), the down projection's output in xg [pairs, E] (sorted
        order); g, u [pairs, ff] scratch."""
        k, ff, E = self.k, self.hparams.n_ff_exp, self.hparams.n_embd
        int8 = self.int8_prefill and L["ffn_gate_exps"].qtype != gpu.F32
        mma = self._group_tile(L) == gpu.GEMM_MMA_TT        # then every matrix here is int8
        x = xg
        if int8:       # one Q8_1 copy of the gathered rows for gate and up
            x = xq if xq is not None else self._q8_1(xg, pairs * E, "xq_tok")
        for wname, out in (("ffn_gate_exps", g), ("ffn_up_exps", u)):
            w = L[wname]
            k.gemm_ids(w.qtype, base + w.ptr, x, out, w.nrows, w.ncols, tiles, n_tiles, w.expert_bytes, pairs,
                       int8=int8, mma=mma)
        k.swiglu(g, u, g, pairs * ff)
        w = L["ffn_down_exps"]
        int8d = self.int8_prefill and w.qtype != gpu.F32
        xd = g
        if int8d:
            xd = self._q8_1(g, pairs * ff, "xq_down")
        k.gemm_ids(w.qtype, base + w.ptr, xd, xg, w.nrows, w.ncols, tiles, n_tiles, w.expert_bytes, pairs,
                   int8=int8d, mma=mma)
