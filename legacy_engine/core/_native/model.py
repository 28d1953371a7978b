"""The model and its sequence states in the C core (le_model, le_state) and the forward pass over them."""
from __future__ import annotations

import numpy as np

from ..errors import ContextLengthError, NativeError, UnavailableError
from ._lib import INT_MAX, c_int, check, ffi, lib, struct_to_dict
from .schema import MAX_LAYERS, hparams_struct




def fault_bits(faults: dict) -> int:
    """Negative-control fault injection (tests only): names -> LE_FAULT_* bits.
    'gdn_grouped' is not a bit: it clears le_hparams.gdn_tiled (model.py)."""
    unknown = set(faults) - {"rope_interleaved", "no_topk_renorm", "gdn_grouped"}
    if unknown:
        raise ValueError(f"unknown faults {sorted(unknown)}")
    return ((lib.LE_FAULT_ROPE_INTERLEAVED if faults.get("rope_interleaved") else 0)
            | (lib.LE_FAULT_NO_TOPK_RENORM if faults.get("no_topk_renorm") else 0))


class _Yield:
    """What le_model_set_yield's context handle points at: the hook, its flag, the errors it raised."""

    def __init__(self, hook):
        self.hook = hook
        self.flag = ffi.new("int32_t *")
        self.errors: list[BaseException] = []

    def wake(self) -> None:
        """Any thread: the running single-sequence pass calls the hook after its current layer."""
        self.flag[0] = 1


@ffi.def_extern()
def le_yield_to_python(ctx):
    """The C core's yield hook (between two layers of a pass, on the pass's thread): a hook that raises has its
    exception kept and raised by forward() once the pass is over (it cannot cross the C frames)."""
    y = ffi.from_handle(ctx)
    y.flag[0] = 0
    try:
        y.hook()
    except BaseException as e:  # noqa: BLE001 - kept, raised after the pass
        y.errors.append(e)


# le_model_profile's phases, in the C core's order (native/le_ops.h LE_PROF_*)
PROFILE_PHASES = ("embed_norm", "gdn_proj", "gdn_core", "gdn_out", "attn_proj", "attn_core", "attn_out",
                  "moe_router", "ffn_gate_up", "ffn_act", "ffn_down", "ffn_combine", "lm_head")


class NativeModel:
    """Owns an le_model; weights point into buffers the caller keeps alive (`self.keep`)."""

    def __init__(self, hp: dict, recurrent: list[bool], rope_sections, n_threads: int):
        if len(recurrent) > MAX_LAYERS:
            raise UnavailableError(f"{len(recurrent)} layers; this build handles at most {MAX_LAYERS}")
        c = hparams_struct(hp, recurrent, rope_sections)
        p = ffi.new("le_model **")
        check(lib.le_model_create(c, n_threads, p), "le_model_create")
        self.ptr = ffi.gc(p[0], lib.le_model_free)
        self.keep = []
        self._yield = self._yield_handle = None
        self.n_layer = len(recurrent)
        self.n_embd = int(hp["n_embd"])

    def set_weight(self, layer: int, slot: int, data: np.ndarray, qtype: int, ne0: int, ne1: int, ne2: int = 1,
                   nb2: int = 0, byte_offset: int = 0, what: str = "") -> None:
        """slot: an le_weight_slot (the schema's); data: the tensor's bytes (uint8 view into the map); byte_offset
        selects a row range."""
        buf = ffi.from_buffer(data)
        self.keep.append(buf)
        check(lib.le_model_set_weight(self.ptr, layer, slot, buf + byte_offset, qtype, ne0, ne1, ne2,
                                      nb2), f"setting {what or slot}")

    def finalize(self) -> None:
        check(lib.le_model_finalize(self.ptr), "le_model_finalize")

    def set_int8(self, on: bool) -> None:
        """True: quantised weights use the integer kernels (W4A8 ...); False: dequantise + f32."""
        check(lib.le_model_set_int8(self.ptr, int(on)), "le_model_set_int8")

    def moe_routed(self, layer: int, x: np.ndarray, ids: np.ndarray, wts: np.ndarray,
                   out: np.ndarray | None = None) -> np.ndarray:
        """out[E] = sum over ids[j] >= 0 of wts[j] * expert ids[j] of `layer` applied to x[E] (f32; the hybrid
        decode's CPU half: the routed experts the GPU does not hold). ids int32, wts f32, both [n_sel]."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        wts = np.ascontiguousarray(wts, dtype=np.float32)
        if ids.shape != wts.shape or ids.ndim != 1:
            raise ValueError(f"ids {ids.shape} and wts {wts.shape}: one 1-D length")
        if x.size != self.n_embd:  # the C core reads n_embd floats of x and writes as many to out
            raise ValueError(f"x has {x.size} elements, the model's n_embd is {self.n_embd}")
        if out is None:
            out = np.empty(x.size, dtype=np.float32)
        elif out.dtype != np.float32 or out.size != x.size or not out.flags.c_contiguous:
            raise ValueError("out: a contiguous float32 array the size of x")
        check(lib.le_moe_routed(self.ptr, c_int(layer, "layer"), ffi.from_buffer("float[]", x), ids.size,
                                ffi.from_buffer("int32_t[]", ids), ffi.from_buffer("float[]", wts),
                                ffi.from_buffer("float[]", out)), "le_moe_routed")
        return out

    def set_yield(self, hook) -> _Yield | None:
        """hook(): called between the layers of a single-sequence pass (forward()) once wake() was called on the
        returned object, from any thread (le_model_set_yield: the hook may run passes of other states, never of the
        pausing one). None turns it off."""
        if hook is None:
            check(lib.le_model_set_yield(self.ptr, ffi.NULL, ffi.NULL, ffi.NULL), "le_model_set_yield")
            self._yield = self._yield_handle = None
            return None
        y = _Yield(hook)
        handle = ffi.new_handle(y)
        check(lib.le_model_set_yield(self.ptr, y.flag, lib.le_yield_to_python, handle), "le_model_set_yield")
        self._yield, self._yield_handle = y, handle   # both alive as long as the C model points at them
        return y

    @property
    def yields(self) -> int:
        """Calls of the yield hook so far."""
        return lib.le_model_yields(self.ptr)

    @property
    def scratch_growths(self) -> int:
        """Times moe_routed's scratch (the model's) was allocated: once per layer with a larger plan, at most."""
        return lib.le_model_scratch_growths(self.ptr)

    @property
    def batch_growths(self) -> int:
        """Times forward_seqs' scratch (the model's) was allocated: a pass with more tokens or a longer context than
        any before grows it, a batched decode step after the first of its size never does."""
        return lib.le_model_batch_growths(self.ptr)

    def _chan(self, chan):
        if isinstance(chan, np.ndarray):
            if chan.dtype != np.int32 or not chan.flags.c_contiguous or not chan.flags.writeable:
                raise ValueError("chan: a writable contiguous int32 array")
            return ffi.from_buffer("int32_t[]", chan)
        return ffi.cast("int32_t *", chan)

    def hybrid_serve(self, chan, seq: int, layers: np.ndarray, counts: np.ndarray | None = None,
                     timeout_s: float = 60.0, stats: np.ndarray | None = None, prefetch_bytes: int = 0,
                     early: dict | None = None) -> None:
        """The hybrid decode's CPU side for token `seq`: serves slots `layers` (int32, in order) of `chan` (a cffi
        pointer to page-locked memory the GPU shares, or an int32 numpy array; layout le_hybrid.h) as they become
        READY (le_hybrid_serve). counts: int64 [n_layer, n_expert] routing counts added to; stats: float64 [LE_HY_STATS]
        (wait s, expert s, experts, layers, prefetch s, experts prefetched, of those run on the CPU, bytes
        prefetched, experts copied early, of those in time, of those routed to, the experts' jobs' start lag s and
        slowest-thread tail s) added to; prefetch_bytes > 0: the
        lookahead (prefetch a layer's predicted experts, up to this many bytes, while its routing is not there);
        early: {n_early, stream (a gpu stream handle), dst uint64 [n_layer * 3], eb int64 [n_layer * 3],
        parity_stride}: the early experts (le_hybrid_early). NativeError (timed out) when a layer's routing does not come
        in timeout_s; every slot not served is then released (the GPU's waits end)."""
        lay = np.ascontiguousarray(layers, dtype=np.int32)
        cnt = ffi.NULL
        if counts is not None:
            if counts.dtype != np.int64 or not counts.flags.c_contiguous:
                raise ValueError("counts: a contiguous int64 array")
            cnt = ffi.from_buffer("int64_t[]", counts)
        if stats is not None and (stats.dtype != np.float64 or stats.size < lib.LE_HY_STATS
                                  or not stats.flags.c_contiguous):
            raise ValueError(f"stats: a contiguous float64 array of {lib.LE_HY_STATS}")
        st = ffi.NULL if stats is None else ffi.from_buffer("double[]", stats)
        ea = ffi.NULL
        if early is not None and early["n_early"] > 0:
            dst = np.ascontiguousarray(early["dst"], dtype=np.uint64)
            eb = np.ascontiguousarray(early["eb"], dtype=np.int64)
            if dst.size != 3 * self.n_layer or eb.size != dst.size:
                raise ValueError("early: dst and eb hold 3 entries per layer")
            keep = (ffi.from_buffer("uint64_t[]", dst), ffi.from_buffer("int64_t[]", eb))
            ea = ffi.new("le_hybrid_early *", {"n_early": int(early["n_early"]), "stream": early["stream"],
                                               "dst": keep[0], "eb": keep[1],
                                               "parity_stride": int(early["parity_stride"])})
        check(lib.le_hybrid_serve(self.ptr, self._chan(chan), int(seq) & 0x7FFFFFFF,
                                  ffi.from_buffer("int32_t[]", lay), lay.size, cnt, float(timeout_s),
                                  max(0, int(prefetch_bytes)), ea, st),
              "le_hybrid_serve")

    def hybrid_release(self, chan, seq: int, layers: np.ndarray) -> None:
        """DONE = seq in slots `layers` (le_hybrid_release): the GPU's waits of token seq end unserved."""
        lay = np.ascontiguousarray(layers, dtype=np.int32)
        check(lib.le_hybrid_release(self.ptr, self._chan(chan), int(seq) & 0x7FFFFFFF,
                                    ffi.from_buffer("int32_t[]", lay), lay.size), "le_hybrid_release")

    def pin_threads(self, cpus: list[int]) -> None:
        """Worker i (1..n-1) -> cpus[i % len(cpus)]; thread 0 (the caller) stays unpinned."""
        arr = ffi.new("int[]", [int(c) for c in cpus])
        check(lib.le_model_pin_threads(self.ptr, arr, len(cpus)), "le_model_pin_threads")

    def pinned_cpus(self, n_threads: int) -> list[int]:
        return [lib.le_model_pinned_cpu(self.ptr, i) for i in range(n_threads)]

    def pool_stats(self) -> dict:
        """The thread pool's counters (le_pool_stats): jobs, joined, missed, worker_sleeps, caller_sleeps, yields,
        stolen, spin_us."""
        out = ffi.new("le_pool_stats *")
        check(lib.le_model_pool_stats(self.ptr, out), "le_model_pool_stats")
        return struct_to_dict(out)

    def pool_hold(self, thread: int, hold: int) -> None:
        """Test hook (le_model_pool_hold) for worker `thread` until released (0): 1 keeps it out of every job (a
        thread the scheduler does not run), 2 makes it sleep 20 ms inside each job it joins (one that lost its CPU
        there)."""
        check(lib.le_model_pool_hold(self.ptr, int(thread), int(hold)), "le_model_pool_hold")

    def set_profile(self, on: bool) -> None:
        """On: le_forward accumulates wall time per phase (reset by turning it on)."""
        check(lib.le_model_set_profile(self.ptr, int(on)), "le_model_set_profile")

    def profile(self) -> dict[str, float]:
        """Seconds per phase since set_profile(True) (PROFILE_PHASES order)."""
        out = ffi.new("double[]", len(PROFILE_PHASES))
        n = lib.le_model_profile(self.ptr, out, len(PROFILE_PHASES))
        if n != len(PROFILE_PHASES):
            raise NativeError(n, f"the C core reports {n} profile phases, this module knows {len(PROFILE_PHASES)}")
        return {name: out[i] for i, name in enumerate(PROFILE_PHASES)}


class NativeState:
    """Owns an le_state of a NativeModel."""

    def __init__(self, model: NativeModel, n_ctx: int):
        p = ffi.new("le_state **")
        check(lib.le_state_create(model.ptr, c_int(n_ctx, "n_ctx"), p), "le_state_create")
        self.model = model  # keeps the model alive while the state lives
        self.ptr = ffi.gc(p[0], lib.le_state_free)

    @property
    def pos(self) -> int:
        return lib.le_state_pos(self.ptr)

    @property
    def n_ctx(self) -> int:
        return lib.le_state_n_ctx(self.ptr)

    @property
    def rope_delta(self) -> int:
        """M-RoPE: a text token at sequence position i rotates at i + rope_delta (nonzero after an image)."""
        return lib.le_state_rope_delta(self.ptr)

    @rope_delta.setter
    def rope_delta(self, delta: int) -> None:
        check(lib.le_state_set_rope_delta(self.ptr, c_int(delta, "rope_delta")), "le_state_set_rope_delta")

    @property
    def scratch_growths(self) -> int:
        """Times the forward pass's scratch (the state's) was allocated: a longer pass than before grows it, a
        decode step after the first never does."""
        return lib.le_state_scratch_growths(self.ptr)

    @property
    def scratch_bytes(self) -> int:
        return lib.le_state_scratch_bytes(self.ptr)

    def reset(self) -> None:
        lib.le_state_reset(self.ptr)

    def save(self) -> bytes:
        n = lib.le_state_nbytes(self.ptr)
        out = bytearray(n)
        check(lib.le_state_save(self.ptr, ffi.from_buffer(out), n), "le_state_save")
        return bytes(out)

    def restore(self, data: bytes) -> None:
        check(lib.le_state_restore(self.ptr, ffi.from_buffer(data), len(data)), "le_state_restore")

    def copy_from(self, other: "NativeState") -> None:
        check(lib.le_state_copy(self.ptr, other.ptr), "le_state_copy")

    # pieces for the snapshot cache (legacy_engine/cache.py)
    def save_recurrent(self) -> bytes:
        """conv + SSM states of every GDN layer at the current position (f32 bytes)."""
        out = bytearray(self.recurrent_nbytes())
        self.save_recurrent_into(out)
        return bytes(out)

    def recurrent_nbytes(self) -> int:
        return int(lib.le_state_recurrent_nbytes(self.ptr))

    def save_recurrent_into(self, out) -> None:
        """save_recurrent into a writable bytes-like of at least recurrent_nbytes() (e.g. page-locked memory)."""
        n = self.recurrent_nbytes()
        buf = ffi.from_buffer(out, require_writable=True)
        if len(buf) < n:
            raise ValueError(f"recurrent state of {n} bytes into a {len(buf)}-byte buffer")
        check(lib.le_state_save_recurrent(self.ptr, buf, n), "le_state_save_recurrent")

    def restore_recurrent(self, data: bytes, pos: int) -> None:
        """Sets the recurrent states and the position; KV rows [0, pos) are written with write_kv."""
        check(lib.le_state_restore_recurrent(self.ptr, ffi.from_buffer(data), len(data), pos),
              "le_state_restore_recurrent")

    def read_kv(self, start: int, n: int) -> bytes:
        """KV rows [start, start+n) of every attention layer, [n_attn][K,V][n][row] f32 bytes."""
        out = bytearray(self.kv_nbytes(n))
        self.read_kv_into(start, n, out)
        return bytes(out)

    def kv_nbytes(self, n: int) -> int:
        return int(lib.le_state_kv_nbytes(self.ptr, c_int(n, "KV rows", 0)))

    def read_kv_into(self, start: int, n: int, out) -> None:
        """read_kv into a writable bytes-like of at least kv_nbytes(n)."""
        nb = self.kv_nbytes(n)
        buf = ffi.from_buffer(out, require_writable=True)
        if len(buf) < nb:
            raise ValueError(f"{nb} bytes of KV rows into a {len(buf)}-byte buffer")
        check(lib.le_state_read_kv(self.ptr, c_int(start, "KV start"), n, buf, nb), "le_state_read_kv")

    def write_kv(self, start: int, n: int, data: bytes) -> None:
        check(lib.le_state_write_kv(self.ptr, c_int(start, "KV start"), c_int(n, "KV rows"), ffi.from_buffer(data),
                                    len(data)), "le_state_write_kv")


def forward(model: NativeModel, state: NativeState, tokens, n_vocab: int, all_logits: bool, chunked: bool,
            want_logits: bool = True, embd: np.ndarray | None = None,
            positions: np.ndarray | None = None) -> np.ndarray | None:
    """tokens: int32[n] -> logits float32[n or 1, n_vocab] (None when want_logits is False).
    embd: None, or float32 [n, n_embd] whose row t is the input where tokens[t] is -1 (an image's merged patches);
    positions: None (text: sequence position + the state's rope delta), or int32 [n, 3] M-RoPE positions (t, h, w)."""
    raw = np.asarray(tokens)
    lo = -1 if embd is not None else 0
    if raw.size and (raw.dtype.kind not in "iu" or raw.min() < lo or raw.max() > np.iinfo(np.int32).max):
        what = "non-negative int32 integers" if lo == 0 else "int32 integers >= -1 (-1: a row of embd)"
        raise ValueError(f"token ids must be {what}, got dtype {raw.dtype}")
    toks = np.ascontiguousarray(raw, dtype=np.int32).reshape(-1)
    n = toks.size
    e = p = ffi.NULL
    if embd is not None:
        embd = np.ascontiguousarray(embd, dtype=np.float32)
        if embd.ndim != 2 or embd.shape[0] != n or embd.shape[1] != model.n_embd:
            raise ValueError(f"embd {embd.shape}: expected [{n}, {model.n_embd}]")
        e = ffi.from_buffer("float[]", embd)
    if positions is not None:
        positions = np.ascontiguousarray(positions, dtype=np.int32)
        if positions.shape != (n, 3):
            raise ValueError(f"positions {positions.shape}: expected [{n}, 3]")
        p = ffi.from_buffer("int32_t[]", positions)
    out = np.empty((n if all_logits else 1, n_vocab), dtype=np.float32) if want_logits else None
    lp = ffi.from_buffer("float[]", out) if want_logits else ffi.NULL
    check(lib.le_forward_embd(model.ptr, state.ptr, ffi.from_buffer("int32_t[]", toks), e, p, n, lp,
                              int(all_logits), int(chunked)),
          "le_forward")
    if model._yield is not None and model._yield.errors:   # the pass completed; its yield hook did not
        raise model._yield.errors.pop(0)
    return out


def forward_seqs(model: NativeModel, states: list[NativeState], token_lists, n_vocab: int,
                 chunked: bool = True) -> np.ndarray:
    """One pass advancing several sequences (le_forward_seqs): states[s] runs token_lists[s] (int[n_s], n_s >= 1)
    at its positions. -> logits float32[n_seq, n_vocab], each sequence's last token's; each row and each state after
    the pass are bit for bit what forward(states[s], token_lists[s], chunked=chunked) gives. ValueError for an
    empty batch, an empty sequence, a state twice or of another model, bad token ids; ContextLengthError when a
    sequence does not fit its state's context. Nothing runs (no state advances) when any check fails."""
    states = list(states)
    token_lists = list(token_lists)
    if not states:
        raise ValueError("forward_seqs: no sequences")
    if len(token_lists) != len(states):
        raise ValueError(f"forward_seqs: {len(states)} states but {len(token_lists)} token lists")
    seen: dict[int, int] = {}
    rows = []
    for s, (st, toks) in enumerate(zip(states, token_lists)):
        if not isinstance(st, NativeState) or st.model is not model:
            raise ValueError(f"sequence {s}: its state belongs to another model")
        if id(st) in seen:
            raise ValueError(f"sequences {seen[id(st)]} and {s} share one state (each needs its own)")
        seen[id(st)] = s
        raw = np.asarray(toks)
        if raw.size == 0:
            raise ValueError(f"sequence {s}: no tokens (each sequence runs at least one)")
        if raw.dtype.kind not in "iu" or raw.min() < 0 or raw.max() >= n_vocab:
            raise ValueError(f"sequence {s}: token ids must be integers in [0, {n_vocab}), got dtype {raw.dtype} "
                             f"in [{raw.min()}, {raw.max()}]")
        if raw.size > st.n_ctx - st.pos:
            raise ContextLengthError(f"sequence {s}: {raw.size} tokens at position {st.pos} exceed its context of "
                                     f"{st.n_ctx} tokens")
        rows.append(np.ascontiguousarray(raw, dtype=np.int32).reshape(-1))
    toks = np.concatenate(rows)
    n_tok = np.array([r.size for r in rows], dtype=np.int32)
    if toks.size > INT_MAX // 4:
        raise ValueError(f"forward_seqs: {toks.size} tokens in one pass")
    out = np.empty((len(states), n_vocab), dtype=np.float32)
    ptrs = ffi.new("le_state *[]", [st.ptr for st in states])
    check(lib.le_forward_seqs(model.ptr, ptrs, len(states), ffi.from_buffer("int32_t[]", toks),
                              ffi.from_buffer("int32_t[]", n_tok), ffi.from_buffer("float[]", out), int(chunked)),
          "le_forward_seqs")
    return out
