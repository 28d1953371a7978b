"""GPU mode: a model's forward pass on the GPU (cuda8/ kernels), its weights where a Placement puts them.

`GpuModel(model, placement, options)` uploads the weights of a loaded `Model` (its GGUF file's tensors, as they are
stored) where `placement` says (placement.py: all resident, or the routed experts streamed from host RAM with some
pinned in VRAM, and the hybrid decode's settings; `GpuModel.resident(model, options)` for everything in VRAM) and
runs the same forward pass as native/model.c, op for op, with the kernels of one tier (`options`: GpuOptions).

The model is composed of rooms of one responsibility each:
  residency.py  Residency: the weights and experts in VRAM, the host map, pins, staging, the streamed copies
  scratch.py    Scratch: named scratch buffers, the block arena of a pass, the rope table
  forward.py    ForwardOps: the layer ops of a pass and of a decode step (the docstring there shows the pass)
  hybrid.py     HybridChannel: the hybrid decode's exchange with the CPU, its device tables and decode extras
  state.py      GpuState: one sequence's states and KV cache in VRAM, in the CPU state's byte layouts
and this file composes them: the passes (forward, the decode plans), the routing counts, close, describe.

Types without a GPU kernel (e.g. Q5_0, Q2_K, F16) are dequantised to f32 at upload and listed in `converted`
(`legacy-engine run --gpu` prints them): more VRAM, same values, never silent.
Decode steps replay a LaunchPlan (runtime.py): the launches of the first step are recorded with every argument
fixed; the token and its position live in a device buffer (st.io) that the kernels read (rope, the KV store,
attention), so the next steps only upload 8 bytes, replay, and download the logits. Where the driver has CUDA
graphs (and the tier is not fermi) the plan is captured once as a graph: a token is then one cuGraphLaunch.
Between requests the planner may re-choose the pinned experts from the routing counted since (plan.planner.repin,
through the serve layer): `apply` takes the new Placement.
"""
from __future__ import annotations

import numpy as np

from .. import gpu
from ..core import _native
from ..core.errors import PlanningError, UnavailableError
from ..cpu.model import DEFAULT_CTX, check_logits
from .forward import ForwardOps
from .hybrid import LOOKAHEAD_PRED, HybridChannel, HybridLayout
from .kernels import GDN_CHUNKED_TIERS
from .layout import f32_routers
from .options import GpuOptions, default_tier
from .placement import Placement, place, resident_chunk
from .residency import Residency
from .sample import DeviceSampler
from .scratch import Scratch, rope_rows, rope_table
from .state import GpuState

# what other modules import from here (the rooms' names they knew as gpu.model's)
__all__ = ["GpuModel", "GpuOptions", "GpuState", "HybridLayout", "Placement", "default_tier", "model_faults",
           "rope_table"]
HANDOFF_PINNED_MAX = 1 << 30   # page-locked staging of a GPU <-> CPU state handoff up to 1 GiB (past it: pageable)


class GpuModel(ForwardOps):
    def __init__(self, model, placement: Placement, options: GpuOptions | None = None):
        """model: a loaded Model (its file's tensors are uploaded; the CPU model stays usable); placement: where
        everything lives (plan.planner.gpu_placement, or placement.place; its budget is held by the driver layer
        while the model lives); options: how it runs (GpuOptions, default: the GPU's own tier and defaults)."""
        options = options or GpuOptions()
        self._open(model, options)
        self._configure(placement, options)
        self._load(options.progress)
        self._start(options)

    @classmethod
    def resident(cls, model, options: GpuOptions | None = None, n_ctx: int = 4096, chunk: int | None = None,
                 vram: int | None = None) -> "GpuModel":
        """Everything of `model` in VRAM: passes of up to `chunk` tokens (None: placement.resident_chunk, the
        longest that fits), states of up to n_ctx positions (the scratch for Q8_1 activations where the options run
        int8 matmuls on this device), under `vram` bytes when given."""
        options = options or GpuOptions()
        gpu.init()
        int8 = any(options.precision(gpu.device_arch()))
        chunk = resident_chunk(model.file, vram, n_ctx, int8) if chunk is None else chunk
        return cls(model, place(model.file, budget=vram, n_ctx=n_ctx, chunk=chunk, int8=int8), options)

    # ------------------------------------------------------------------ construction, in steps

    def _open(self, model, options: GpuOptions) -> None:
        """The device, the tier's kernels and the precision of the matmuls."""
        hp = self.hparams = model.hparams
        if hp.arch == "qwen3next":
            raise UnavailableError("the GPU forward pass runs qwen35 and qwen35moe files (not qwen3next)")
        dev = gpu.init()
        self.device = dev
        dev_arch = gpu.device_arch()
        self.tier = options.tier or default_tier(dev_arch)
        self.k = gpu.Kernels(self.tier, dev_arch if options.arch is None else options.arch, options.toolchain)
        self.int8, self.int8_prefill = options.precision(dev_arch)
        if options.mma and not (self.int8_prefill and self.k.has_mma):
            raise UnavailableError(f"mma: the int8 tensor-core GEMM needs int8 prefill and the dp4a tier at "
                                   f"compute_{gpu.MMA_ARCH}+, not {self.k.name} "
                                   f"(int8 prefill {'on' if self.int8_prefill else 'off'})")
        self.mma = self.int8_prefill and self.k.has_mma if options.mma is None else bool(options.mma)
        # the attention prefill's products on the f16 tensor cores at f32 grade (attn_prefill_mma_f32), with the GEMMs'
        # switch: a card whose tensor cores are throttled turns both off; head sizes a multiple of 16 (Qwen3.5: 256)
        attn_ok = self.k.has_mma and (all(hp.recurrent) or hp.head_dim % 16 == 0)
        if options.mma and not attn_ok:
            raise UnavailableError(f"mma: the tensor-core attention needs a head size that is a multiple of 16, not "
                                   f"{hp.head_dim}")
        self.attn_mma = attn_ok if options.mma is None else bool(options.mma)
        # the chunked GDN scan's products on tf32 tensor cores at f32 grade (gdn_chunk_scan_tf32, sm_80+), under the
        # same switch, where the shapes allow (Qwen3.5: dk 128)
        self.gdn_mma = options.mma is not False and self.k.gdn_scan_tf32(
            hp.ssm_d_state, 2 * hp.ssm_n_group * hp.ssm_d_state + hp.ssm_d_inner)
        self.model = model
        self.file = model.file
        self._faults = model_faults(model)

    def _configure(self, placement: Placement, options: GpuOptions) -> None:
        """The placement taken as it is (it fits its budget: the planner checked); the options that need it."""
        if any(n not in self.file.tensors for n in placement.residency):
            raise ValueError("the placement names tensors this model's file does not have (made for another file)")
        if (self.int8 or self.int8_prefill) and not placement.int8:
            raise ValueError("the placement's scratch was planned without Q8_1 activations, and this model runs int8 "
                             "matmuls (place it with int8=True, or run with int8=False)")
        # the lookahead as place() checks the early experts (both predict the next layer's routing)
        if options.lookahead and not placement.cpu_experts:
            raise ValueError("lookahead is a setting of the hybrid decode (cpu_experts=True)")
        if options.lookahead and not f32_routers(self.file):
            raise UnavailableError("lookahead: the next layer's routing is predicted with f32 routers only; this "
                                   "file's are quantised")
        self.placement = placement
        self.lookahead = bool(options.lookahead)
        self.lookahead_why = "" if self.lookahead else "off (measured no faster: LOOKAHEAD_PRED's note)"
        self.budget = placement.budget
        self.simulate_link = options.simulate_link
        self.sort_pairs = bool(options.sort_pairs)
        self.grouped = bool(options.grouped_experts) and self.sort_pairs
        self.save_routing = options.save_routing
        # routing statistics, counted where the host reads the routing anyway (streamed or sorted passes);
        # flush_routing hands them to save_routing (the planner's statistics, which choose the pins)
        self.route_counts: dict[int, np.ndarray] = {}
        self._counts_dev, self._counts_layers = None, set()     # moe_sort's device counts (_route_counts_dev)
        self._repin_base: dict = {}      # route_counts when the pins were last chosen (recent_routes' baseline)
        self.repins = 0
        self._handoff = None                                     # page-locked staging of GpuState's handoff
        self._prof = None
        self._last_rows = None     # rows of a pass the last layer's FFN runs on (_forward_chunk; None: all)

    def _load(self, progress) -> None:
        """The budget held by the driver layer, then everything into VRAM (a failed load leaves no budget)."""
        if self.budget is not None:
            gpu.set_budget(gpu.mem_stats()["used"] + self.budget)
        self.res = Residency(self.file, self.placement, self.k, self.simulate_link)
        try:
            self.res.load(progress)
        except BaseException:
            if self.budget is not None:
                gpu.set_budget(None)          # a failed load leaves no budget (nor memory) behind
            raise
        self.layers, self.embd, self.head, self.out_norm = self.res.layers, self.res.embd, self.res.head, \
            self.res.out_norm

    def _start(self, options: GpuOptions) -> None:
        """Scratch, the hybrid channel, the decode plans and graphs."""
        self.scratch = Scratch(self.hparams, self.int8 or self.int8_prefill)
        self._sampler: DeviceSampler | None = None   # sample_next's buffers, made on first use
        # a streamed step syncs with the host to stage its experts: not replayable; a hybrid step's host work is
        # made of host steps, which a plan replays between its segments
        self.plan = options.plan and (not self.stream or self.cpu_experts)
        self.hy = HybridChannel(self)
        graphs = options.graphs
        have = gpu.graphs_available()
        if graphs and not have:
            raise UnavailableError("CUDA graphs requested but the driver lacks them (needs CUDA 11.4+)")
        if graphs is None:
            graphs = have and self.tier != "fermi"
            self.graphs_why = ("off: the fermi tier (a Fermi driver has no graphs)" if self.tier == "fermi" else
                               "on" if have else "off: the driver lacks them (needs CUDA 11.4+)")
        else:
            self.graphs_why = "on (asked)" if graphs else "off (asked)"
        self.graphs = bool(graphs) and self.plan
        if graphs and not self.plan:
            self.graphs_why = "off: needs the launch plan (plan=False)"

    # ------------------------------------------------------------------ the placement's facts

    stream = property(lambda self: self.placement.stream, doc="the routed experts stream from host RAM")
    cpu_experts = property(lambda self: self.placement.cpu_experts, doc="the hybrid decode")
    chunk = property(lambda self: self.placement.chunk, doc="tokens per pass")
    logit_rows = property(lambda self: self.placement.logit_rows, doc="all_logits runs the head in such pieces")
    n_ctx_plan = property(lambda self: self.placement.n_ctx, doc="the longest state the budget was planned for")
    footprint = property(lambda self: self.placement.footprint)
    pinned = property(lambda self: self.placement.pinned)
    decode_extras = property(lambda self: self.placement.decode_extras)
    link_experts = property(lambda self: self.placement.link_experts)
    early_experts = property(lambda self: self.placement.early_experts)
    # the residency's report (describe, `run --gpu`, the benches)
    converted = property(lambda self: self.res.converted, doc="'name (TYPE)' of tensors dequantised at upload")
    vram_bytes = property(lambda self: self.res.vram_bytes)
    embd_where = property(lambda self: self.res.embd_where)
    host_pinned_why = property(lambda self: self.res.host_pinned_why)

    def stream_report(self) -> dict:
        """The streamed experts' copies so far (Residency.stream_report)."""
        return self.res.stream_report()

    # ------------------------------------------------------------------ repin: the planner's new placement

    def recent_routes(self) -> dict:
        """The routing counted since the pins were last chosen ({layer: counts per expert}): what the planner's
        repin reads."""
        self.hy.flush()
        base = self._repin_base
        return {i: np.maximum(c - base.get(i, 0), 0) for i, c in self.route_counts.items()}

    def apply(self, placement: Placement) -> None:
        """A new placement of this model from the planner (plan.planner.repin: other pinned experts, the decode
        extras around them; the rest as it was): the pins uploaded in place of the old ones, the decode extras
        copied again at the next decode step, the hybrid tables updated, decode plans recorded again."""
        old = self.placement
        same = ("decode", "budget", "n_ctx", "chunk", "int8", "residency", "offsets", "link_experts", "early_experts")
        if any(getattr(old, f) != getattr(placement, f) for f in same):
            raise ValueError("apply: a placement differing in more than its pins and decode extras (make a new "
                             "GpuModel for it)")
        self.res.apply(placement)
        self.placement = placement
        if old.decode_extras:
            self.hy.extras_off()
        if self.hy.ch is not None:
            self.hy.ch["pin_idx"].upload(self.res.pin_table())
        self._repin_base = {i: c.copy() for i, c in self.route_counts.items()}
        self.repins += 1
        self.scratch.gen += 1                # the decode plans name the old stores: recorded again

    # ------------------------------------------------------------------ passes

    def new_state(self, n_ctx: int | None = None) -> GpuState:
        n_ctx = n_ctx or DEFAULT_CTX
        if self.budget is not None and n_ctx > self.n_ctx_plan:
            raise PlanningError(f"a state of {n_ctx} positions: this model's VRAM budget was planned for "
                                f"{self.n_ctx_plan} (place the model with n_ctx={n_ctx})")
        return GpuState(self, n_ctx)

    def forward(self, state: "GpuState", tokens, all_logits: bool = False, chunked: bool = True,
                want_logits: bool = True, embd: np.ndarray | None = None,
                positions: np.ndarray | None = None) -> np.ndarray | None:
        """tokens: int[n] at positions state.pos.. -> logits float32[n or 1, n_vocab] (as Model.forward;
        chunked: passes of several tokens run the GDN in its chunked form (cuda8/gdn_chunked.cu, chunks of 64 counted
        from each pass's first token, as the CPU's) on the tiers where it is the faster (GDN_CHUNKED_TIERS; describe()
        says), False token by token (gdn_recurrent)).
        embd, positions (images): rows [n, n_embd] for the tokens marked -1, M-RoPE positions [n, 3]."""
        ids, embd, positions = self._check_pass(state, tokens, embd, positions)
        if ids.size == 1 and self.plan and positions is None and embd is None:
            return self._decode(state, int(ids[0]), want_logits)
        outs = []
        for c0 in range(0, ids.size, self.chunk):
            part = ids[c0:c0 + self.chunk]
            last = c0 + self.chunk >= ids.size
            rows = None if positions is None else (None if embd is None else embd[c0:c0 + self.chunk],
                                                   positions[c0:c0 + self.chunk])
            if part.size == 1 and self.plan and rows is None:
                # a last chunk of one token is the decode plan's step (an unplanned one-token pass would allocate
                # decode buffers of its own, and the plan be recorded again at the next token)
                out = self._decode(state, int(part[0]), want_logits and (all_logits or last))
                if out is not None:
                    outs.append(out)
                continue
            out = self._forward_chunk(state, part, all_logits if want_logits else False,
                                      want_logits and (all_logits or last), rows=rows, chunked=chunked)
            if out is not None:
                outs.append(out)
        if not want_logits:
            return None
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    can_batch = property(lambda self: not (self.stream or self.cpu_experts),
                         doc="forward_batch runs here (the resident model; not the split's streamed or hybrid forms)")
    # The server does not batch on the GPU yet: the batched pass is launched op by op from Python (no launch plan or
    # CUDA graph), so B sequences take longer than B graph-replayed steps below ~16 (H200, 0.8B Q8_0: 135 tok/s at
    # B=2 against 611 alone; benchmarks/results/batch_decode_gpu_2026-11-28.md).
    serve_batched = False

    def forward_batch(self, states: list, tokens, chunked: bool = True) -> np.ndarray:
        """One decode step of several sequences: states[s] (distinct GpuStates of this model) takes tokens[s] (an
        id, or Model.forward_batch's one-id list; `chunked` is accepted for that interface) ->
        logits float32[B, n_vocab], row s what states[s] would get from forward alone (within the quantised gate:
        the projections run as B-row GEMMs). The GPU-resident model only (UnavailableError for the split's
        streamed or hybrid forms); ValueError, every state unchanged, for bad input."""
        if not self.can_batch:
            raise UnavailableError("batched decode runs on the GPU-resident model; the split's streamed and "
                                       "hybrid forms decode one sequence a pass")
        try:
            ids = np.array([int(np.asarray(t).reshape(-1)[0]) if np.asarray(t).size == 1 else -1 for t in tokens])
        except (TypeError, ValueError):
            raise ValueError("tokens: one id per state") from None
        B, hp = len(states), self.hparams
        if B == 0 or ids.shape != (B,) or ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= hp.n_vocab:
            raise ValueError(f"tokens: one id in [0, {hp.n_vocab}) per state ({B} states)")
        if len({id(s) for s in states}) != B:
            raise ValueError("a state appears twice in one batch")
        for st in states:
            if not isinstance(st, GpuState) or st.gm is not self:
                raise ValueError("state belongs to another model (make it with this GpuModel's new_state)")
            if st.pos + 1 > st.n_ctx or not 0 <= st.pos + st.rope_delta < st.n_ctx:
                raise ValueError(f"a state at position {st.pos} (rope {st.pos + st.rope_delta}) has no room in its "
                                 f"context of {st.n_ctx}")
        if B == 1:
            return self.forward(states[0], ids)
        return self._forward_seqs(states, ids.astype(np.int32))

    def _forward_seqs(self, states: list, ids: np.ndarray) -> np.ndarray:
        hp, k, B, E = self.hparams, self.k, len(states), self.hparams.n_embd
        self.scratch.tag = "p"
        self.scratch.arena_reserve(B)
        for st in states:                          # the rope table covers every state's position
            self.scratch.rope_cs(st.n_ctx)
        idb = self.scratch.buf("tokens", 4 * B)
        idb.upload(ids)
        x = self.scratch.buf("x", 4 * B * E).ptr
        h = self.scratch.buf("h", 4 * B * E).ptr
        y = self.scratch.buf("y", 4 * B * E).ptr
        k.get_rows(self.embd.qtype, self.embd.ptr, idb.ptr, x, B, E)

        def mixer(i: int, L: dict, hq) -> None:
            si_of = lambda st: st.index[i]   # noqa: E731
            (self._gdn_seqs if hp.recurrent[i] else self._attention_seqs)(L, h, hq, states, si_of, y)
        self._last_rows = B                                 # every sequence's row has its logits read
        self._layers(x, h, y, B, mixer)
        for st in states:
            st._pos += 1
        outs = []
        for r0 in range(0, B, self.logit_rows):
            n_out = min(self.logit_rows, B - r0)
            k.rmsnorm(x + 4 * r0 * E, self.out_norm, h, E, n_out, hp.rms_eps)
            logits = self.scratch.buf("logits", 4 * n_out * hp.n_vocab)
            self._mm(self.head, h, logits.ptr, n_out)
            outs.append(logits.download(dtype=np.float32, count=n_out * hp.n_vocab).reshape(n_out, hp.n_vocab))
        self._flush_counts()
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    def _check_pass(self, state, tokens, embd, positions):
        """-> (ids int32 [n], embd f32 [n, E] or None, positions int32 [n, 3] or None), checked as the C core checks
        them (le_forward_embd); a pass with embd always carries positions (text ones where none were given)."""
        hp = self.hparams
        ids = np.asarray(tokens)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError("tokens: a non-empty 1-D sequence of ids")
        lo = -1 if embd is not None else 0
        if ids.dtype.kind not in "iu" or ids.min() < lo or ids.max() >= hp.n_vocab:
            raise ValueError(f"token ids must be integers in [{lo}, {hp.n_vocab})")
        if not isinstance(state, GpuState) or state.gm is not self:
            raise ValueError("state belongs to another model (make it with this GpuModel's new_state)")
        if state.pos + ids.size > state.n_ctx:
            raise ValueError(f"{ids.size} tokens at position {state.pos} exceed the context of {state.n_ctx}")
        if embd is not None:
            embd = np.ascontiguousarray(embd, dtype=np.float32)
            if embd.shape != (ids.size, hp.n_embd):
                raise ValueError(f"embd {embd.shape}: expected [{ids.size}, {hp.n_embd}]")
            if positions is None:
                positions = state.pos + state.rope_delta + np.arange(ids.size)[:, None].repeat(3, 1)
        if positions is not None:
            positions = np.ascontiguousarray(positions, dtype=np.int32)
            if positions.shape != (ids.size, 3) or positions.min() < 0:
                raise ValueError(f"positions {positions.shape}: expected [{ids.size}, 3] rope positions >= 0")
            text = state.pos + state.rope_delta + np.arange(ids.size)
            if ids.min() >= 0 and (positions == text[:, None]).all():   # text rows where text goes: a plain pass
                embd = positions = None                                  # (the decode plan's, for one token)
        return ids.astype(np.int32), embd, positions

    def _pass_rope(self, st: "GpuState", n: int, positions: np.ndarray | None) -> int:
        """Device address of a pass's rope rows [n, n_rot/2, 2]: rows of the table (text at pos + rope delta), or
        for M-RoPE positions the pass's own rows, computed on the host as the table is (scratch.rope_rows)."""
        hp = self.hparams
        p = st.pos + st.rope_delta
        if positions is None and 0 <= p and p + n <= st.n_ctx:
            return self.scratch.rope_cs(st.n_ctx).ptr + 4 * p * hp.n_rot
        if positions is None:
            positions = p + np.arange(n)[:, None].repeat(3, 1)
        buf = self.scratch.buf("rope_rows", 4 * n * hp.n_rot)
        gpu.synchronize()                  # the previous pass may still read the buffer
        buf.upload(rope_rows(hp, positions))
        return buf.ptr

    def _embed_rows(self, ids: np.ndarray, embd: np.ndarray, x: int) -> None:
        """x [n, E] <- the token embeddings of ids, with embd's rows where ids is -1 (an image's merged patches):
        built on the host (the embedding rows dequantised from the file) and uploaded."""
        E, t = self.hparams.n_embd, self.file.tensors["token_embd.weight"]
        raw = np.frombuffer(memoryview(self.file.gguf.data("token_embd.weight")).cast("B"), dtype=np.uint8)
        rb = t.n_bytes // self.hparams.n_vocab
        rows = embd.copy()
        for r in np.flatnonzero(ids >= 0):
            rows[r] = _native.dequantize_row(t.type, raw[ids[r] * rb:(ids[r] + 1) * rb], E)
        gpu.synchronize()
        _native.gpu_copy_htod(x, rows, rows.nbytes)

    def sample_next(self, state: "GpuState", token: int, sampler, history: list[int] | None) -> int:
        """forward(state, [token]), then `sampler`'s draw from its logits -> the next token; history: the tokens
        seen, token included (the penalties' window). A planned decode step leaves its logits in VRAM and the
        draw's candidates are chosen there (gpu.sample.DeviceSampler: the same token as Sampler.sample on the
        downloaded row, for the same seed)."""
        if not self.plan:
            out = self.forward(state, [token])
            check_logits(out, state.pos - 1)
            return sampler.sample(out[0], history)
        self.forward(state, [token], want_logits=False)
        if self._sampler is None:
            self._sampler = DeviceSampler(self.k, self.hparams.n_vocab)
        return self._sampler.sample(self.scratch.bufs["d:logits"], sampler, history, state.pos - 1)

    def _decode(self, st: "GpuState", token: int, want: bool) -> np.ndarray | None:
        """One token through the state's LaunchPlan (recorded on the first call, and again when a buffer it
        names has moved)."""
        hp = self.hparams
        if self.decode_extras:
            self.hy.extras_step()
        rope = st.pos + st.rope_delta
        if not 0 <= rope < st.n_ctx:
            raise ValueError(f"rope position {rope} (position {st.pos} + delta {st.rope_delta}) outside the rope "
                             f"table of {st.n_ctx}")
        st.io.upload(np.array([token, st.pos, rope], dtype=np.int32))
        if st._plan is None or st._plan_gen != self.scratch.gen:
            st._plan = None
            with gpu.record() as launches:
                self._forward_chunk(st, None, False, True, planned=True)
            st._plan, st._plan_gen = gpu.LaunchPlan(launches, graph=self.graphs), self.scratch.gen
        else:
            serve_all = self.cpu_experts and self.graphs     # else the plan's host steps serve layer by layer
            if self.cpu_experts:
                self.hy.next()
            try:
                st._plan.replay()
            except BaseException:
                if serve_all:
                    self.hy.release_all()
                raise
            if serve_all:
                self.hy.serve_all()      # each layer as the GPU publishes its routing
            st._pos += 1
        logits = self.scratch.bufs["d:logits"]
        out = logits.download(dtype=np.float32, count=hp.n_vocab).reshape(1, hp.n_vocab)
        return out if want else None

    def _forward_chunk(self, st: "GpuState", ids: np.ndarray | None, all_logits: bool, want: bool,
                       planned: bool = False, rows: tuple | None = None, chunked: bool = True) -> np.ndarray | None:
        """ids [n] from the host; planned: one token whose id and position are already in st.io (the decode
        plan's form: no argument depends on them); rows: (embd [n, E] or None, positions [n, 3]) of an image
        pass."""
        hp, k = self.hparams, self.k
        n, E = (1 if planned else ids.size), hp.n_embd
        self.scratch.tag = "d" if n == 1 else "p"
        if n > 1:
            self.scratch.arena_reserve(n)
            if self.decode_extras:
                self.hy.extras_off()
        if n == 1 and self.cpu_experts:
            self.hy.next()
        embd, positions = rows if rows is not None else (None, None)
        if planned:
            idb = st.io
        else:
            idb = self.scratch.buf("tokens", 4 * n)
            idb.upload(np.maximum(ids, 0))
            self._rope_cs = self._pass_rope(st, n, positions)
        x = self.scratch.buf("x", 4 * n * E).ptr
        h = self.scratch.buf("h", 4 * n * E).ptr
        y = self.scratch.buf("y", 4 * n * E).ptr
        # the last layer's states take every row, its FFN only the rows the head reads (none when no logits are
        # wanted): the residual stream's other rows end there (a 2048-token pass of the 35B-A3B streams its last
        # layer's experts for one token, not all 256)
        self._last_rows = n if all_logits or n == 1 else int(want)
        if self.stream:
            first = self.res.next_moe(-1)
            self.res.prefetch_all(first, self._ffn_rows(first, n))
        if embd is not None:
            self._embed_rows(ids, embd, x)
        else:
            k.get_rows(self.embd.qtype, self.embd.ptr, idb.ptr, x, n, E)
        self._mark("embed")

        def mixer(i: int, L: dict, hq) -> None:
            si = st.index[i]
            if hp.recurrent[i]:
                self._gdn(L, h, hq, n, st, si, y, chunked)
                self._mark("gdn")
            elif planned:
                self._attention_planned(L, h, hq, st, si, y)
            else:
                self._attention(L, h, hq, n, st, si, y)
                self._mark("attention")
        self._layers(x, h, y, n, mixer)
        st._pos += n
        if positions is not None:        # the next text position: one past the largest used (le_forward_embd)
            st.rope_delta = int(positions.max()) + 1 - st.pos
        if not want:
            gpu.synchronize()
            self._flush_counts()
            return None
        self._mark("ffn rest")
        first = 0 if all_logits else n - 1
        outs = []
        for r0 in range(first, n, self.logit_rows):        # the head in pieces of logit_rows rows (scratch bound)
            n_out = min(self.logit_rows, n - r0)
            k.rmsnorm(x + 4 * r0 * E, self.out_norm, h, E, n_out, hp.rms_eps)
            logits = self.scratch.buf("logits", 4 * n_out * hp.n_vocab)
            self._mm(self.head, h, logits.ptr, n_out)
            if planned:
                return None                       # _decode downloads
            outs.append(logits.download(dtype=np.float32, count=n_out * hp.n_vocab).reshape(n_out, hp.n_vocab))
        self._mark("head")
        self._flush_counts()
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    def _layers(self, x: int, h: int, y: int, n: int, mixer) -> None:
        """Every layer over the residual stream x [n, E]: mixer(i, L, hq) runs layer i's attention or GDN from h
        (x's rows normed; hq their Q8_1 on the int8 paths) into y; then its FFN between the residual adds, the last
        layer's on rows n - r … n - 1 of x only (r = _last_rows: the rows the head reads; 0: none), through rows
        0 … r - 1 of h and y."""
        hp, k, E = self.hparams, self.k, self.hparams.n_embd
        last = len(self.layers) - 1
        hq = self._hq(n)        # h's Q8_1 (int8 paths): each add_rmsnorm writes it with h
        k.add_rmsnorm(x, None, self.layers[0]["attn_norm"], h, hq, E, n, hp.rms_eps)
        for i, L in enumerate(self.layers):
            mixer(i, L, hq)
            if i < last:
                k.add_rmsnorm(x, y, L["post_attention_norm"], h, hq, E, n, hp.rms_eps)   # residual add, norm, Q8_1
                self._ffn(L, h, hq, n, y)
                k.add_rmsnorm(x, y, self.layers[i + 1]["attn_norm"], h, hq, E, n, hp.rms_eps)
            elif (r := self._last_rows):
                xr, hqr = x + 4 * (n - r) * E, (hq if r == n else self._hq(r))
                k.add_rmsnorm(xr, y + 4 * (n - r) * E, L["post_attention_norm"], h, hqr, E, r, hp.rms_eps)
                self._ffn(L, h, hqr, r, y)
                k.add(xr, y, xr, r * E)
            self._mark("ffn rest")
        self._last_rows = None

    def _handoff_buffer(self, nbytes: int):
        """A uint8 view of >= nbytes of page-locked host memory for GpuState's handoff (grown as needed, freed by
        close), or None above HANDOFF_PINNED_MAX (the caller copies through pageable memory then)."""
        if nbytes > HANDOFF_PINNED_MAX:
            return None
        if self._handoff is None or self._handoff.nbytes < nbytes:
            if self._handoff is not None:
                self._handoff.free()
            self._handoff = None
            self._handoff = gpu.PinnedBuffer(max(nbytes, 1 << 20))
        return self._handoff.array

    def close(self) -> None:
        """Frees the weights, staging and scratch in VRAM now (states keep their own buffers), unlocks the host
        weight map, lifts the budget this model set."""
        gpu.synchronize()
        self.res.close()
        self.scratch.close()
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None
        self._counts_dev, self._counts_layers = None, set()
        if self._handoff is not None:
            self._handoff.free()
            self._handoff = None
        self.hy.close()
        if self.budget is not None:
            gpu.set_budget(None)
            self.budget = None
        self.flush_routing()

    @property
    def hybrid_stats(self) -> dict:
        """The hybrid decode so far: MoE layer steps, experts run on the CPU, seconds in them (cpu_s) and waiting
        for the GPU's routing (read_s)."""
        self.hy.flush()
        return self.hy.stats

    def flush_routing(self) -> None:
        """Hands the routing counts gathered so far to save_routing (the planner's statistics of the file, from which
        the next placement pins the hottest experts) and clears them; close() calls it, and the Engine at exit."""
        self.hy.flush()
        if self.route_counts and self.save_routing:
            try:
                self.save_routing(self.route_counts)
            except OSError:
                pass                      # statistics are advice: an unwritable cache costs only better pins
        self.route_counts = {}
        self._repin_base = {}

    def describe(self) -> str:
        conv = f"; dequantised to f32 at upload: {len(self.converted)} tensors" if self.converted else ""
        streamed = ""
        if self.stream:
            n_pin = sum(len(v) for v in self.pinned.values())
            by = ("the copy kernel" if self.res.pin_copy_kernel and len(self.res.pin_lists) == len(self.res.pin_store)
                  else "cuMemcpyDtoD")
            streamed = (f"; routed experts streamed from host RAM ({self.host_pinned_why}), {n_pin} of "
                        f"{self.hparams.n_expert * len(self.res.stage_layout)} pinned in VRAM (into the prefill's "
                        f"staging by {by})")
            if self.cpu_experts:
                n_x = sum(len(v) for v in self.decode_extras.values())
                streamed += (f"; hybrid decode ({n_x} more experts in VRAM for the decode: kept in the staging "
                             "between prefills, copied back after each" if n_x else
                             "; hybrid decode (no experts kept in the staging between prefills")
                streamed += (f"; {self.link_experts} experts per layer fetched over the link, the "
                             f"rest not pinned on the CPU; {self.early_experts} of the next layer's likeliest copied "
                             "early; lookahead "
                             + (f"on: the next layer's {LOOKAHEAD_PRED} likeliest experts prefetched by the CPU)"
                                if self.lookahead else self.lookahead_why + ")"))
        budget = f" (budget {self.budget / 2**30:.2f} GiB: {self.footprint.describe()})" if self.budget else ""
        kind = lambda on: "int8 DP4A" if on else "f32"   # noqa: E731
        gemm = "int8 tensor-core (mma)" if self.mma else kind(self.int8_prefill)
        attn = "f16 hi/lo tensor-core (mma, f32 grade)" if self.attn_mma else "f32 FMA"
        embd = ("; token embedding read from host memory over the link ("
                + ("the page-locked map" if self.res.host is not None else "a page-locked copy") + ")"
                if self.embd_where == "host" else "")
        gdn = (("chunked, its scan on tf32 tensor cores (f32 grade)" if self.gdn_mma else "chunked")
               if self.k.tier in GDN_CHUNKED_TIERS else "token by token (the chunked form is slower here)")
        return (f"GPU {self.device['name']} ({self.k.name} kernels, {kind(self.int8)} decode GEMVs, "
                f"{gemm} prefill GEMMs, {attn} prefill attention, GDN prefill {gdn}), weights "
                f"{self.vram_bytes / 2**30:.2f} GiB in "
                f"VRAM{budget}{streamed}{embd}; decode CUDA graphs {self.graphs_why}{conv}")


def model_faults(model) -> dict:
    """The negative-control faults the CPU model was made with (tests only); those the GPU path knows:
    gdn_grouped (v-head j reads k-head j / (H_v/H_k) instead of j % H_k)."""
    faults = dict(model.faults)
    unknown = set(faults) - {"gdn_grouped"}
    if unknown:
        raise ValueError(f"the GPU forward pass cannot inject {sorted(unknown)}")
    return faults
