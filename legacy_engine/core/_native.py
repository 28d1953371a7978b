"""The only module that touches the cffi `lib` and `ffi` of the C core (legacy_engine._core).

Every wrapper is the same: borrow buffers (ffi.from_buffer), call, check the status,
raise. Shapes and dtypes are given in the docstrings.
"""
from __future__ import annotations

import numpy as np

from .errors import NativeError, UnavailableError

try:
    from .._core import ffi, lib
except ImportError as e:  # pragma: no cover - only when the package was not built
    raise UnavailableError(
        f"the native core legacy_engine._core is not built ({e}); run `pip install -e .` "
        "in the source tree (needs gcc and the Python headers)"
    ) from e

LE_OK = lib.LE_OK


def check(code: int, what: str) -> None:
    """Turns a C status code into a NativeError carrying the C core's last-error message."""
    if code != LE_OK:
        detail = ffi.string(lib.le_last_error()).decode("utf-8", "replace")
        name = ffi.string(lib.le_strerror(code)).decode()
        raise NativeError(code, f"{what}: {name}: {detail}")


INT_MAX = 2**31 - 1  # the C API's int


def c_int(value, what: str, lo: int = -INT_MAX - 1) -> int:
    """value as an int the C API takes (in [lo, INT_MAX]); ValueError naming `what` otherwise, instead of
    cffi's OverflowError."""
    v = int(value)
    if not lo <= v <= INT_MAX:
        raise ValueError(f"{what} = {v} is outside [{lo}, {INT_MAX}]")
    return v


def _struct_to_dict(cdata) -> dict:
    out = {}
    for field, _ in ffi.typeof(cdata[0]).fields:
        value = getattr(cdata[0], field)
        if isinstance(value, ffi.CData):  # char arrays
            value = ffi.string(value).decode("utf-8", "replace").strip()
        out[field] = value
    return out


# ---- capabilities -----------------------------------------------------------------

def cpu_info() -> dict:
    """CPU vendor, brand, and feature flags (CPUID masked by XGETBV)."""
    p = ffi.new("le_cpu_info *")
    check(lib.le_cpu_detect(p), "le_cpu_detect")
    return _struct_to_dict(p)


def numa_info() -> dict:
    p = ffi.new("le_numa_info *")
    check(lib.le_numa_detect(p), "le_numa_detect")
    return _struct_to_dict(p)


def gpu_info() -> dict:
    """{'available', 'driver_version', 'device_count', 'reason', 'devices': [...]}"""
    p = ffi.new("le_gpu_driver_info *")
    check(lib.le_gpu_detect(p), "le_gpu_detect")
    info = _struct_to_dict(p)
    devices = []
    for i in range(info["device_count"]):
        d = ffi.new("le_gpu_device_info *")
        check(lib.le_gpu_device(i, d), f"le_gpu_device({i})")
        devices.append(_struct_to_dict(d))
    info["devices"] = devices
    return info


# ---- quant types ------------------------------------------------------------------

def type_traits(qtype: int) -> dict:
    """The capability-table row of a ggml type id; UnavailableError if unsupported."""
    p = ffi.new("le_type_info *")
    code = lib.le_type_traits(int(qtype), p)
    if code == lib.LE_ERR_UNSUPPORTED:
        raise UnavailableError(f"ggml type id {qtype} is not supported by legacy_engine")
    check(code, "le_type_traits")
    return _struct_to_dict(p)


def dequantize_row(qtype: int, data, n: int) -> np.ndarray:
    """data: bytes-like holding n elements of `qtype` -> float32[n].

    UnavailableError for a type id the engine does not support; ValueError when n is
    negative or data is shorter than n elements; NativeError (from the C core) when n
    is not a multiple of the block size.
    """
    t = type_traits(qtype)
    n = int(n)
    if n < 0:
        raise ValueError(f"n = {n} is negative")
    src = ffi.from_buffer(data)
    need = n // t["block_size"] * t["type_size"]
    if len(src) < need:
        raise ValueError(f"{n} elements of {t['name']} need {need} bytes, the buffer has {len(src)}")
    out = np.empty(n, dtype=np.float32)
    check(lib.le_dequantize_row(int(qtype), src, ffi.from_buffer("float[]", out), n), "le_dequantize_row")
    return out


def quantize_row(qtype: int, x: np.ndarray) -> bytes:
    """x: float32[n] -> n elements of `qtype` as bytes.

    Quantisers exist for f32, f16, bf16, q8_0, q8_1 and q8_K; other types raise
    NativeError (LE_ERR_UNSUPPORTED). ValueError when n is not a multiple of the block size.
    """
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    t = type_traits(qtype)
    n = x.size
    if n % t["block_size"]:
        raise ValueError(f"{n} elements is not a multiple of {t['name']}'s block size {t['block_size']}")
    out = bytearray(n // t["block_size"] * t["type_size"])
    check(lib.le_quantize_row(int(qtype), ffi.from_buffer("float[]", x), ffi.from_buffer(out), n),
          "le_quantize_row")
    return bytes(out)


# ---- model and state ----------------------------------------------------------------

HPARAM_FIELDS = ("n_layer", "n_embd", "n_vocab", "n_head", "n_head_kv", "head_dim", "n_rot", "rope_theta",
                 "rms_eps", "ssm_conv_kernel", "ssm_d_state", "ssm_n_group", "ssm_dt_rank", "ssm_d_inner",
                 "gdn_tiled", "n_ff", "n_expert", "n_expert_used", "n_ff_exp", "n_ff_shexp", "faults")
MAX_LAYERS = 512


def fault_bits(faults: dict) -> int:
    """Negative-control fault injection (tests only): names -> LE_FAULT_* bits.
    'gdn_grouped' is not a bit: it clears le_hparams.gdn_tiled (model.py)."""
    unknown = set(faults) - {"rope_interleaved", "no_topk_renorm", "gdn_grouped"}
    if unknown:
        raise ValueError(f"unknown faults {sorted(unknown)}")
    return ((lib.LE_FAULT_ROPE_INTERLEAVED if faults.get("rope_interleaved") else 0)
            | (lib.LE_FAULT_NO_TOPK_RENORM if faults.get("no_topk_renorm") else 0))


def weight_slot(name: str) -> int:
    """The C slot id of a weight, e.g. 'LE_W_SSM_A'."""
    return getattr(lib, name)


# le_model_profile's phases, in the C core's order (native/le_ops.h LE_PROF_*)
PROFILE_PHASES = ("embed_norm", "gdn_proj", "gdn_core", "gdn_out", "attn_proj", "attn_core", "attn_out",
                  "moe_router", "ffn_gate_up", "ffn_act", "ffn_down", "ffn_combine", "lm_head")


class NativeModel:
    """Owns an le_model; weights point into buffers the caller keeps alive (`self.keep`)."""

    def __init__(self, hp: dict, recurrent: list[bool], rope_sections, n_threads: int):
        if len(recurrent) > MAX_LAYERS:
            raise UnavailableError(f"{len(recurrent)} layers; this build handles at most {MAX_LAYERS}")
        c = ffi.new("le_hparams *")
        for k in HPARAM_FIELDS:
            setattr(c, k, hp[k])
        for i, s in enumerate(rope_sections):
            c.rope_sections[i] = s
        for i, r in enumerate(recurrent):
            c.recurrent[i] = int(r)
        p = ffi.new("le_model **")
        check(lib.le_model_create(c, n_threads, p), "le_model_create")
        self.ptr = ffi.gc(p[0], lib.le_model_free)
        self.keep = []
        self.n_layer = len(recurrent)
        self.n_embd = int(hp["n_embd"])

    def set_weight(self, layer: int, slot: str, data: np.ndarray, qtype: int, ne0: int, ne1: int, ne2: int = 1,
                   nb2: int = 0, byte_offset: int = 0, what: str = "") -> None:
        """data: the tensor's bytes (uint8 view into the map); byte_offset selects a row range."""
        buf = ffi.from_buffer(data)
        self.keep.append(buf)
        check(lib.le_model_set_weight(self.ptr, layer, weight_slot(slot), buf + byte_offset, qtype, ne0, ne1, ne2,
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
        return _struct_to_dict(out)

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
            want_logits: bool = True) -> np.ndarray | None:
    """tokens: int32[n] -> logits float32[n or 1, n_vocab] (None when want_logits is False)."""
    raw = np.asarray(tokens)
    if raw.size and (raw.dtype.kind not in "iu" or raw.min() < 0 or raw.max() > np.iinfo(np.int32).max):
        raise ValueError(f"token ids must be non-negative int32 integers, got dtype {raw.dtype}")
    toks = np.ascontiguousarray(raw, dtype=np.int32).reshape(-1)
    n = toks.size
    out = np.empty((n if all_logits else 1, n_vocab), dtype=np.float32) if want_logits else None
    lp = ffi.from_buffer("float[]", out) if want_logits else ffi.NULL
    check(lib.le_forward(model.ptr, state.ptr, ffi.from_buffer("int32_t[]", toks), n, lp, int(all_logits),
                         int(chunked)),
          "le_forward")
    return out


# ---- kernel tiers -------------------------------------------------------------------
# The integer dot products (W4A8 ...) of cpu_simd/ per instruction-set tier: select a
# tier (le_set_isa), ask which tier serves a type, and call one row's kernel. The tier
# is process-wide: tests that change it put it back.

ISA_NAMES = ("ref", "ssse3", "avx2", "avx512vnni")


def _isa_id(name: str) -> int:
    try:
        return ISA_NAMES.index(name)
    except ValueError:
        raise ValueError(f"unknown ISA tier {name!r}; one of {', '.join(ISA_NAMES)}") from None


def isa_supported(name: str) -> bool:
    """True if this CPU (CPUID and XGETBV) can run the kernels of tier `name`."""
    return bool(lib.le_isa_supported(_isa_id(name)))


def set_isa(name: str) -> None:
    """Selects tier `name` (each type falls back to the best lower tier that has a kernel).
    UnavailableError if this CPU cannot run it."""
    code = lib.le_set_isa(_isa_id(name))
    if code == lib.LE_ERR_UNAVAILABLE:
        detail = ffi.string(lib.le_last_error()).decode("utf-8", "replace")
        raise UnavailableError(f"ISA tier {name}: {detail}; pick one of "
                               f"{[n for n in ISA_NAMES if isa_supported(n)]}")
    check(code, f"le_set_isa({name})")


def get_isa() -> str:
    """The selected tier (the best the CPU has, or $LE_FORCE_ISA, unless set_isa changed it)."""
    return ISA_NAMES[lib.le_get_isa()]


def kernel_isa(qtype: int) -> str | None:
    """The tier whose kernel serves `qtype`'s dot product now; None if it has none."""
    i = lib.le_kernel_isa(int(qtype))
    return ISA_NAMES[i] if i >= 0 else None


def f32_isa() -> str:
    """The tier serving the f32 kernels of the decode step (GDN step, f32 dot)."""
    return ISA_NAMES[lib.le_f32_isa()]


def gdn_step(S: np.ndarray, q, k, v, decay: float, beta: float) -> np.ndarray:
    """One Gated DeltaNet head, one token, by the selected tier's kernel. S: float32[dk, dv], updated in
    place (must be C-contiguous float32); returns o: float32[dv]."""
    if S.dtype != np.float32 or not S.flags.c_contiguous or S.ndim != 2:
        raise ValueError("S must be a C-contiguous float32[dk, dv] array")
    dk, dv = S.shape
    q, k = (np.ascontiguousarray(a, dtype=np.float32).reshape(dk) for a in (q, k))
    v = np.ascontiguousarray(v, dtype=np.float32).reshape(dv)
    o = np.empty(dv, np.float32)
    fp = lambda a: ffi.from_buffer("float[]", a)  # noqa: E731
    check(lib.le_gdn_step(fp(S), fp(q), fp(k), fp(v), float(decay), float(beta), dk, dv, fp(o)), "le_gdn_step")
    return o


def dot_f32(a, b) -> float:
    """The selected tier's f32 dot product."""
    a = np.ascontiguousarray(a, dtype=np.float32).reshape(-1)
    b = np.ascontiguousarray(b, dtype=np.float32).reshape(-1)
    if a.size != b.size:
        raise ValueError(f"lengths differ: {a.size} vs {b.size}")
    out = ffi.new("float *")
    check(lib.le_dot_f32_k(ffi.from_buffer("float[]", a), ffi.from_buffer("float[]", b), a.size, out), "le_dot_f32_k")
    return out[0]


def _row_bytes(t: dict, n: int) -> int:
    if n < 0 or n % t["block_size"]:
        raise ValueError(f"n = {n} is not a non-negative multiple of {t['name']}'s block size {t['block_size']}")
    return n // t["block_size"] * t["type_size"]


def quantize_act(act_type: int, x: np.ndarray) -> bytes:
    """x: float32[n] -> the activation row in `act_type` (Q8_0/Q8_1/Q8_K) by the selected tier's quantiser."""
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = bytearray(_row_bytes(type_traits(act_type), x.size))
    check(lib.le_quantize_act(int(act_type), ffi.from_buffer("float[]", x), ffi.from_buffer(out), x.size),
          "le_quantize_act")
    return bytes(out)


def vec_dot(qtype: int, x, y, n: int) -> float:
    """x: n weights of `qtype` (bytes-like), y: n activations in its vec_dot_type -> the f32 dot product,
    by the selected tier's kernel."""
    t = type_traits(qtype)
    xb, yb = ffi.from_buffer(x), ffi.from_buffer(y)
    need_x, need_y = _row_bytes(t, int(n)), _row_bytes(type_traits(t["vec_dot_type"]), int(n))
    if len(xb) < need_x or len(yb) < need_y:
        raise ValueError(f"{n} elements need {need_x} weight bytes and {need_y} activation bytes; "
                         f"got {len(xb)} and {len(yb)}")
    out = ffi.new("float *")
    check(lib.le_vec_dot(int(qtype), int(n), xb, yb, out), "le_vec_dot")
    return out[0]


def vec_dot_rows(qtype: int, w, y, n: int, rows: int) -> np.ndarray:
    """w: `rows` consecutive rows of n weights of `qtype`, y: one activation row -> float32[rows]
    (a GEMV through le_vec_dot, one C call per row; for benchmarks and tests)."""
    t = type_traits(qtype)
    rb = _row_bytes(t, int(n))
    wb, yb = ffi.from_buffer(w), ffi.from_buffer(y)
    if len(wb) < rb * rows or len(yb) < _row_bytes(type_traits(t["vec_dot_type"]), int(n)):
        raise ValueError(f"{rows} rows of {n} {t['name']} weights need {rb * rows} bytes; got {len(wb)}")
    out = np.empty(rows, dtype=np.float32)
    op = ffi.from_buffer("float[]", out)
    base = ffi.cast("uint8_t *", wb)
    f, q = lib.le_vec_dot, int(qtype)
    for r in range(rows):
        code = f(q, n, base + r * rb, yb, op + r)
        if code != LE_OK:
            check(code, "le_vec_dot")
    return out


# ---- GPU
# The CUDA driver API of native/gpu.c (le_gpu.h). Device pointers are ints; modules, kernels,
# streams and events are cffi pointers owned by the caller (legacy_engine/gpu.py wraps them in
# objects that free themselves). No driver: UnavailableError; a driver failure: NativeError whose
# message names the call, the CUresult and the kernel; the VRAM budget: NativeError with
# code lib.LE_ERR_NO_MEMORY.

def _gpu_check(code: int, what: str) -> None:
    if code == lib.LE_ERR_UNAVAILABLE:
        detail = ffi.string(lib.le_last_error()).decode("utf-8", "replace")
        raise UnavailableError(f"{what}: {detail}")
    check(code, what)


def gpu_init(device: int = 0) -> None:
    """Opens `device` (its primary context) for this process; again with the same device is a no-op."""
    _gpu_check(lib.le_gpu_init(int(device)), f"le_gpu_init({device})")


def gpu_shutdown() -> None:
    _gpu_check(lib.le_gpu_shutdown(), "le_gpu_shutdown")


def gpu_current_device() -> int:
    """The open device, -1 when none."""
    return lib.le_gpu_current_device()


def gpu_synchronize() -> None:
    _gpu_check(lib.le_gpu_synchronize(), "le_gpu_synchronize")


def gpu_attribute(attribute: int) -> int:
    """cuDeviceGetAttribute of the open device (CUdevice_attribute id)."""
    p = ffi.new("int *")
    _gpu_check(lib.le_gpu_attribute(int(attribute), p), f"le_gpu_attribute({attribute})")
    return p[0]


def gpu_set_budget(nbytes: int | None) -> None:
    """VRAM budget in bytes for le_gpu_alloc; None (or < 0): no budget."""
    _gpu_check(lib.le_gpu_set_budget(-1 if nbytes is None else int(nbytes)), "le_gpu_set_budget")


def gpu_mem_stats() -> dict:
    """{'budget', 'used', 'peak', 'n_allocs', 'pinned', 'free_bytes', 'total_bytes'} in bytes."""
    p = ffi.new("le_gpu_mem_stats *")
    _gpu_check(lib.le_gpu_get_mem_stats(p), "le_gpu_get_mem_stats")
    return _struct_to_dict(p)


def gpu_alloc(nbytes: int, what: str = "buffer") -> int:
    """nbytes of device memory, accounted against the budget -> the device pointer."""
    p = ffi.new("uint64_t *")
    _gpu_check(lib.le_gpu_alloc(p, int(nbytes), what.encode()), f"le_gpu_alloc({what})")
    return int(p[0])


def gpu_free(dptr: int) -> None:
    _gpu_check(lib.le_gpu_free(int(dptr)), "le_gpu_free")


def gpu_memset8(dptr: int, value: int, nbytes: int) -> None:
    _gpu_check(lib.le_gpu_memset8(int(dptr), int(value), int(nbytes)), "le_gpu_memset8")


def _stream(stream):
    return ffi.NULL if stream is None else stream


def gpu_copy_htod(dptr: int, src, nbytes: int | None = None, stream=None) -> None:
    """Copies a bytes-like (numpy array, bytes, pinned buffer) to the device; async when `stream` is given."""
    buf = ffi.from_buffer(src)
    n = len(buf) if nbytes is None else int(nbytes)
    if n > len(buf):
        raise ValueError(f"copy of {n} bytes from a {len(buf)}-byte buffer")
    if stream is None:
        _gpu_check(lib.le_gpu_copy_htod(int(dptr), buf, n), "le_gpu_copy_htod")
    else:
        _gpu_check(lib.le_gpu_copy_htod_async(int(dptr), buf, n, stream), "le_gpu_copy_htod_async")


def gpu_copy_dtoh(dst, dptr: int, nbytes: int | None = None, stream=None) -> None:
    """Copies device memory into a writable bytes-like; async when `stream` is given."""
    buf = ffi.from_buffer(dst, require_writable=True)
    n = len(buf) if nbytes is None else int(nbytes)
    if n > len(buf):
        raise ValueError(f"copy of {n} bytes into a {len(buf)}-byte buffer")
    if stream is None:
        _gpu_check(lib.le_gpu_copy_dtoh(buf, int(dptr), n), "le_gpu_copy_dtoh")
    else:
        _gpu_check(lib.le_gpu_copy_dtoh_async(buf, int(dptr), n, stream), "le_gpu_copy_dtoh_async")


def gpu_copy_dtod(dst: int, src: int, nbytes: int, stream=None) -> None:
    if stream is None:
        _gpu_check(lib.le_gpu_copy_dtod(int(dst), int(src), int(nbytes)), "le_gpu_copy_dtod")
    else:
        _gpu_check(lib.le_gpu_copy_dtod_async(int(dst), int(src), int(nbytes), stream), "le_gpu_copy_dtod_async")


def host_address(buf) -> int:
    """The address of a bytes-like object's first byte (a numpy array, a memory map)."""
    return int(ffi.cast("uintptr_t", ffi.from_buffer(buf)))


def gpu_copy_htod_addr(dptr: int, host_addr: int, nbytes: int, stream) -> None:
    """Async copy of nbytes at a raw host address (inside memory registered with gpu_host_register) on `stream`."""
    _gpu_check(lib.le_gpu_copy_htod_async(int(dptr), ffi.cast("void *", host_addr), int(nbytes), stream),
               "le_gpu_copy_htod_async")


def gpu_host_register(host_addr: int, nbytes: int, read_only: bool) -> None:
    _gpu_check(lib.le_gpu_host_register(ffi.cast("void *", host_addr), int(nbytes), int(read_only)),
               "le_gpu_host_register")


def gpu_host_device_pointer(host_addr: int) -> int:
    """The device address of a host address inside page-locked memory (allocated or registered)."""
    out = ffi.new("uint64_t *")
    _gpu_check(lib.le_gpu_host_device_pointer(ffi.cast("void *", host_addr), out), "le_gpu_host_device_pointer")
    return int(out[0])


def gpu_host_unregister(host_addr: int) -> None:
    _gpu_check(lib.le_gpu_host_unregister(ffi.cast("void *", host_addr)), "le_gpu_host_unregister")


def gpu_host_alloc(nbytes: int):
    """Pinned host memory -> (pointer, writable cffi buffer of nbytes); free with gpu_host_free(pointer)."""
    p = ffi.new("void **")
    _gpu_check(lib.le_gpu_host_alloc(p, int(nbytes)), "le_gpu_host_alloc")
    return p[0], ffi.buffer(p[0], int(nbytes))


def gpu_host_free(ptr) -> None:
    _gpu_check(lib.le_gpu_host_free(ptr), "le_gpu_host_free")


def gpu_stream_create(ordered: bool = False):
    """ordered: the stream waits for earlier default-stream work and the default stream waits for it."""
    p = ffi.new("le_gpu_stream **")
    if ordered:
        _gpu_check(lib.le_gpu_stream_create_ordered(p), "le_gpu_stream_create_ordered")
    else:
        _gpu_check(lib.le_gpu_stream_create(p), "le_gpu_stream_create")
    return p[0]


def gpu_stream_destroy(stream) -> None:
    _gpu_check(lib.le_gpu_stream_destroy(stream), "le_gpu_stream_destroy")


def gpu_stream_synchronize(stream) -> None:
    _gpu_check(lib.le_gpu_stream_synchronize(_stream(stream)), "le_gpu_stream_synchronize")


def gpu_stream_query(stream) -> bool:
    """Whether every piece of work launched on `stream` so far has finished (does not wait)."""
    done = ffi.new("int *")
    _gpu_check(lib.le_gpu_stream_query(_stream(stream), done), "le_gpu_stream_query")
    return bool(done[0])


def gpu_stream_wait_event(stream, event) -> None:
    _gpu_check(lib.le_gpu_stream_wait_event(_stream(stream), event), "le_gpu_stream_wait_event")


def gpu_event_create():
    p = ffi.new("le_gpu_event **")
    _gpu_check(lib.le_gpu_event_create(p), "le_gpu_event_create")
    return p[0]


def gpu_event_destroy(event) -> None:
    _gpu_check(lib.le_gpu_event_destroy(event), "le_gpu_event_destroy")


def gpu_event_record(event, stream=None) -> None:
    _gpu_check(lib.le_gpu_event_record(event, _stream(stream)), "le_gpu_event_record")


def gpu_event_synchronize(event) -> None:
    _gpu_check(lib.le_gpu_event_synchronize(event), "le_gpu_event_synchronize")


def gpu_event_elapsed_ms(start, end) -> float:
    p = ffi.new("float *")
    _gpu_check(lib.le_gpu_event_elapsed(p, start, end), "le_gpu_event_elapsed")
    return float(p[0])


def gpu_module_load(image: bytes, name: str):
    """Loads PTX text or a cubin -> module pointer; a JIT failure's NativeError carries the JIT log."""
    p = ffi.new("le_gpu_module **")
    _gpu_check(lib.le_gpu_module_load(p, ffi.from_buffer(image), len(image), name.encode()),
               f"loading GPU module {name}")
    return p[0]


def gpu_module_log(module) -> str:
    return ffi.string(lib.le_gpu_module_log(module)).decode("utf-8", "replace")


def gpu_module_unload(module) -> None:
    _gpu_check(lib.le_gpu_module_unload(module), "le_gpu_module_unload")


def gpu_kernel_get(module, name: str):
    p = ffi.new("le_gpu_kernel **")
    _gpu_check(lib.le_gpu_kernel_get(p, module, name.encode()), f"le_gpu_kernel_get({name})")
    return p[0]


def gpu_kernel_info(kernel) -> dict:
    """{'num_regs', 'shared_bytes', 'local_bytes', 'max_threads', 'ptx_version', 'binary_version'}"""
    p = ffi.new("le_gpu_kernel_info *")
    _gpu_check(lib.le_gpu_kernel_info_get(kernel, p), "le_gpu_kernel_info_get")
    return _struct_to_dict(p)


# kernel argument kinds -> the C type a pointer to it is made of
_ARG_CTYPES = {"ptr": "uint64_t *", "i32": "int32_t *", "u32": "uint32_t *", "i64": "int64_t *", "f32": "float *"}


def gpu_launch(kernel, grid, block, args, shared_bytes: int = 0, stream=None) -> None:
    """grid, block: (x, y, z); args: [(kind, value)] with kind in ptr/i32/u32/i64/f32, in parameter order."""
    params, _keep = gpu_launch_args(args)     # _keep holds the values params points at until the call returns
    gx, gy, gz = grid
    bx, by, bz = block
    _gpu_check(lib.le_gpu_launch(kernel, gx, gy, gz, bx, by, bz, int(shared_bytes), _stream(stream), params),
               "le_gpu_launch")


def gpu_launch_args(args):
    """Kernel parameters prepared once for gpu_replay: [(kind, value)] -> (params, keep); `keep` owns the storage
    `params` points into and must live as long as the launch may be replayed."""
    keep = [ffi.new(_ARG_CTYPES[kind], value) for kind, value in args]
    params = ffi.new("void *[]", [ffi.cast("void *", k) for k in keep]) if keep else ffi.NULL
    return params, keep


def gpu_replay(launches, stream=None) -> None:
    """launches: [(kernel, grid, block, shared_bytes, stream, params)] with params from gpu_launch_args, launched in
    order (a decode step recorded once: legacy_engine.gpu.LaunchPlan); `stream` given: all of them on it."""
    launch = lib.le_gpu_launch
    for kernel, (gx, gy, gz), (bx, by, bz), shared, s, params in launches:
        rc = launch(kernel, gx, gy, gz, bx, by, bz, shared, _stream(s if stream is None else stream), params)
        if rc:
            _gpu_check(rc, "le_gpu_launch (replayed plan)")


def gpu_graphs_available() -> bool:
    return bool(lib.le_gpu_graphs_available())


def gpu_capture(launches, stream):
    """The launches (gpu_replay's form) captured on `stream` (not the default one) as an instantiated CUDA graph;
    nothing runs. On an error the capture is abandoned and the error raised."""
    _gpu_check(lib.le_gpu_capture_begin(stream), "le_gpu_capture_begin")
    try:
        gpu_replay(launches, stream)
    except BaseException:
        lib.le_gpu_capture_end(stream, ffi.NULL)
        raise
    p = ffi.new("le_gpu_graph **")
    _gpu_check(lib.le_gpu_capture_end(stream, p), "le_gpu_capture_end")
    return p[0]


def gpu_graph_launch(graph, stream) -> None:
    _gpu_check(lib.le_gpu_graph_launch(graph, stream), "le_gpu_graph_launch")


def gpu_graph_destroy(graph) -> None:
    _gpu_check(lib.le_gpu_graph_destroy(graph), "le_gpu_graph_destroy")


# ---- memory and NUMA ------------------------------------------------------------------
# native/memory.c + native/numa.c (le_memory.h): anonymous memory for weights (--no-mmap),
# madvise, NUMA policies through libnuma (dlopened). Without libnuma the NUMA calls raise
# UnavailableError saying what to install; a node that is not on this machine too.
# Addresses are taken from any buffer (numpy array, memmap, bytearray): a policy or advice
# covers the pages that hold it.

import contextlib  # noqa: E402  (this section's own import, kept with it)

NUMA_MODES = {"off": "LE_NUMA_OFF", "interleave": "LE_NUMA_INTERLEAVE", "node": "LE_NUMA_NODE"}
# the kernel's policy modes (linux/mempolicy.h) as mem_policy reports them
MPOL_NAMES = ("default", "preferred", "bind", "interleave", "local", "preferred_many", "weighted_interleave")


def _numa_check(code: int, what: str) -> None:
    """No libnuma, or a node this machine does not have: UnavailableError (the message without file:line)."""
    if code in (lib.LE_ERR_UNAVAILABLE, lib.LE_ERR_INVALID_ARG):
        detail = ffi.string(lib.le_last_error()).decode("utf-8", "replace")
        raise UnavailableError(f"{what}: {detail.split(': ', 1)[-1]}")
    check(code, what)


def _address(buf) -> tuple:
    """(void * cdata, nbytes) of a buffer; the cdata keeps `buf` alive while it lives."""
    b = ffi.from_buffer(buf)
    return ffi.cast("void *", b), len(b), b


class AnonMemory:
    """Anonymous memory from le_mem_alloc: 2 MiB aligned and sized, MADV_HUGEPAGE asked for.

    `array` is a writable uint8 view of the first `nbytes` bytes; the memory is unmapped when
    the last view of it (the array, slices of it, ffi buffers made from them) is gone.
    `hugepage`: the kernel accepted MADV_HUGEPAGE (`hugepage_errno` otherwise)."""

    def __init__(self, nbytes: int):
        r = ffi.new("le_mem_region *")
        check(lib.le_mem_alloc(int(nbytes), r), f"le_mem_alloc({nbytes})")
        size = int(r.size)
        owner = ffi.gc(r.ptr, lambda p: lib.le_mem_free(p, size), size=size)
        self.ptr, self.size, self.nbytes = owner, size, int(nbytes)
        self.hugepage, self.hugepage_errno = bool(r.advice.hugepage), int(r.advice.hugepage_errno)
        self.array = np.frombuffer(ffi.buffer(owner, size), dtype=np.uint8)[: self.nbytes]


def mem_alloc(nbytes: int) -> AnonMemory:
    return AnonMemory(nbytes)


def mem_advise(buf, hugepage: bool = False, willneed: bool = False) -> dict:
    """madvise(MADV_HUGEPAGE / MADV_WILLNEED) over buf's pages -> what the kernel answered:
    {'hugepage', 'hugepage_errno', 'willneed', 'willneed_errno'} (accepted is not honoured:
    /proc/self/smaps says whether huge pages back it)."""
    p, n, _keep = _address(buf)
    out = ffi.new("le_advice_result *")
    advice = (lib.LE_ADVISE_HUGEPAGE if hugepage else 0) | (lib.LE_ADVISE_WILLNEED if willneed else 0)
    check(lib.le_mem_advise(p, n, advice, out), "le_mem_advise")
    return _struct_to_dict(out)


def mem_prefault(buf) -> None:
    """Faults every page of buf in for reading (a file map: reads the file into the page cache)."""
    p, n, _keep = _address(buf)
    check(lib.le_mem_prefault(p, n), "le_mem_prefault")


def _numa_mode(mode: str) -> int:
    try:
        return getattr(lib, NUMA_MODES[mode])
    except KeyError:
        raise ValueError(f"unknown NUMA mode {mode!r}; one of {', '.join(NUMA_MODES)}") from None


def _policy_dict(p) -> dict:
    mode = p.mode & 0xFF  # the low bits; the kernel's mode flags (MPOL_F_STATIC_NODES ...) sit above
    nodes = [n for n in range(1024) if p.nodemask[n // 64] >> (n % 64) & 1]
    return {"mode": mode, "name": MPOL_NAMES[mode] if mode < len(MPOL_NAMES) else str(mode), "flags": p.mode & ~0xFF,
            "nodes": nodes}


def mem_set_numa(buf, mode: str, node: int = -1) -> None:
    """Sets the NUMA policy of buf's pages (mbind, moving pages already there): mode 'interleave'
    (every allowed memory node), 'node' (bind to `node`) or 'off' (the default policy)."""
    p, n, _keep = _address(buf)
    _numa_check(lib.le_mem_set_numa(p, n, _numa_mode(mode), int(node)),
                f"NUMA policy {mode}{':' + str(node) if mode == 'node' else ''}")


def mem_policy(buf) -> dict:
    """The policy of the mapping holding buf's first byte: {'mode', 'name', 'flags', 'nodes'}."""
    p, _n, _keep = _address(buf)
    out = ffi.new("le_mempolicy *")
    _numa_check(lib.le_mem_get_policy(p, out), "NUMA get_mempolicy")
    return _policy_dict(out)


def mem_page_nodes(buf, stride: int = 0, max_nodes: int = 1024) -> dict:
    """Where buf's pages are, sampling one every `stride` bytes (0: every page), without touching
    them: {'nodes': {node: pages}, 'absent': pages not in memory}."""
    p, n, _keep = _address(buf)
    counts = ffi.new("int[]", max_nodes)
    absent = ffi.new("int *")
    _numa_check(lib.le_mem_page_nodes(p, n, int(stride), counts, max_nodes, absent), "NUMA page query")
    return {"nodes": {i: counts[i] for i in range(max_nodes) if counts[i]}, "absent": absent[0]}


def numa_thread_policy() -> dict:
    out = ffi.new("le_mempolicy *")
    _numa_check(lib.le_numa_get_thread_policy(out), "NUMA thread policy")
    return _policy_dict(out)


@contextlib.contextmanager
def numa_thread_policy_set(mode: str, node: int = -1):
    """`with numa_thread_policy_set('interleave'):` the calling thread allocates new pages (page
    cache included) under this policy; its previous policy is put back on exit."""
    what = f"NUMA policy {mode}{':' + str(node) if mode == 'node' else ''}"
    saved = ffi.new("le_mempolicy *")
    _numa_check(lib.le_numa_get_thread_policy(saved), what)
    _numa_check(lib.le_numa_set_thread_policy(_numa_mode(mode), int(node)), what)
    try:
        yield
    finally:
        check(lib.le_numa_restore_thread_policy(saved), "le_numa_restore_thread_policy")


def _int_list(fn, what: str, cap: int = 4096) -> list[int]:
    out = ffi.new("int[]", cap)
    n = ffi.new("int *")
    _numa_check(fn(out, cap, n), what)
    return [out[i] for i in range(n[0])]


def numa_nodes() -> list[int]:
    """The memory nodes this process may allocate from."""
    return _int_list(lib.le_numa_nodes, "NUMA nodes", 1024)


def numa_cpus_of_node(node: int) -> list[int]:
    return _int_list(lambda o, c, n: lib.le_numa_cpus_of_node(int(node), o, c, n), f"NUMA CPUs of node {node}")


def numa_spread_cpus() -> list[int]:
    """Allowed CPUs dealt round-robin over the nodes (node 0's first, node 1's first, ...):
    pin worker i to element i to spread a thread pool evenly over the nodes."""
    return _int_list(lib.le_numa_spread_cpus, "NUMA spread CPUs")


def numa_set_library(name: str | None) -> None:
    """Test hook: the library NUMA calls load from now on (None: $LE_NUMA_LIB, else libnuma.so.1).
    A name that does not load simulates a machine without libnuma."""
    check(lib.le_numa_set_library(ffi.NULL if name is None else name.encode()), "le_numa_set_library")


# ---- sampler --------------------------------------------------------------------------------------------------------
# native/sample.c (le_sample.h): penalties, top-k, top-p, min-p, temperature and one draw over float32 logits in a few
# O(n_vocab) passes. NaN or +inf logits: NativeError (LE_ERR_FORMAT); -inf is a masked token.

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
        d = _struct_to_dict(self.info)
        d["path"] = [name for name, bit in SAMPLE_PATHS.items() if d["path"] & bit]
        d["isa"] = ISA_NAMES[d["isa"]]
        return d


def sample_isa() -> str:
    """The tier that runs the sampler's passes now (ref or avx2; follows set_isa)."""
    return ISA_NAMES[lib.le_sample_isa()]
