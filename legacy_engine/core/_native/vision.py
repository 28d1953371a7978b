"""The vision tower in the C core (le_vision.h): le_vision and the tower's ops for the differential tests."""
from __future__ import annotations

import numpy as np

from ..errors import NativeError
from ._lib import c_int, check, ffi, lib

# le_vision_slot, by the roles of format/mmproj.py (GLOBAL_TENSORS / BLOCK_TENSORS)
VISION_ROLES = ("patch_w0", "patch_w1", "patch_b", "pos_embd", "merger_norm_w", "merger_norm_b", "merger_fc1_w",
                "merger_fc1_b", "merger_fc2_w", "merger_fc2_b", "ln1_w", "ln1_b", "qkv_w", "qkv_b", "o_w", "o_b",
                "ln2_w", "ln2_b", "fc1_w", "fc1_b", "fc2_w", "fc2_b")
VISION_FAULTS = {"merger_gelu_tanh": "LE_VFAULT_MERGER_GELU_TANH", "ffn_gelu_erf": "LE_VFAULT_FFN_GELU_ERF",
                 "pos_nearest": "LE_VFAULT_POS_NEAREST", "rope_swap": "LE_VFAULT_ROPE_SWAP"}
_HP_FIELDS = ("depth", "hidden", "n_head", "ffn", "patch_size", "temporal_patch", "in_channels", "merge",
              "pos_side", "out_hidden", "eps", "rope_theta", "faults")
# le_vision_profile's phases, in the C core's order (le_vision.h)
VISION_PROFILE_PHASES = ("patch_embed", "layernorm", "qkv", "qkv_rope", "attention", "proj", "fc1", "gelu", "fc2",
                         "residual", "merger")


def vision_slot(role: str) -> int:
    """The le_vision_slot of an mmproj role ('qkv_w', 'patch_w1', ...)."""
    if role not in VISION_ROLES:
        raise ValueError(f"unknown vision role {role!r}")
    return getattr(lib, "LE_VW_" + role.upper())


def vision_fault_bits(faults: dict | None) -> int:
    """Negative-control fault injection (tests only): names -> LE_VFAULT_* bits."""
    faults = faults or {}
    unknown = set(faults) - set(VISION_FAULTS)
    if unknown:
        raise ValueError(f"unknown vision faults {sorted(unknown)}; known: {sorted(VISION_FAULTS)}")
    bits = 0
    for name, on in faults.items():
        bits |= getattr(lib, VISION_FAULTS[name]) if on else 0
    return bits


def _f32(a: np.ndarray, what: str, writable: bool = False) -> np.ndarray:
    if a.dtype != np.float32 or not a.flags.c_contiguous or (writable and not a.flags.writeable):
        raise ValueError(f"{what}: a {'writable ' if writable else ''}contiguous float32 array")
    return a


class NativeVision:
    """Owns an le_vision; weights point into buffers the caller keeps alive (`self.keep` holds the views)."""

    def __init__(self, hp: dict, n_threads: int):
        """hp: the le_vision_hparams fields (depth, hidden, n_head, ffn, patch_size, temporal_patch, in_channels,
        merge, pos_side, out_hidden, eps, rope_theta, faults)."""
        c = ffi.new("le_vision_hparams *")
        for f in _HP_FIELDS:
            setattr(c[0], f, hp.get(f, 0) if f == "faults" else hp[f])
        p = ffi.new("le_vision **")
        check(lib.le_vision_create(c, c_int(n_threads, "n_threads", 1), p), "le_vision_create")
        self.ptr = ffi.gc(p[0], lib.le_vision_free)
        self.keep = []
        self.out_hidden = int(hp["out_hidden"])
        self.merge = int(hp["merge"])

    def set_weight(self, block: int | None, role: str, data: np.ndarray, qtype: int, ne, what: str = "") -> None:
        """role: an mmproj role; block None for the global ones; data: the tensor's bytes (a uint8 view into the
        map, kept alive here); ne: its ggml shape (ne[0] fastest)."""
        buf = ffi.from_buffer(data)
        self.keep.append(buf)
        ne_c = ffi.new("int64_t[4]", [int(x) for x in ne] + [1] * (4 - len(ne)))
        check(lib.le_vision_set_weight(self.ptr, -1 if block is None else block, vision_slot(role), buf, qtype,
                                       ne_c, len(ne)), f"setting {what or role}")

    def finalize(self) -> None:
        check(lib.le_vision_finalize(self.ptr), "le_vision_finalize")

    def encode(self, patches: np.ndarray, grid_thw) -> np.ndarray:
        """patches float32 [t*h*w, C*T*P*P] in the processor's order; grid_thw (t, h, w) in patches ->
        float32 [t*h*w / merge², out_hidden]."""
        patches = _f32(patches, "patches")
        if patches.ndim != 2:
            raise ValueError(f"patches must be 2-D [n_patches, patch_len], got shape {patches.shape}")
        t, h, w = (c_int(x, "grid") for x in grid_thw)
        out = np.empty((patches.shape[0] // (self.merge * self.merge), self.out_hidden), dtype=np.float32)
        check(lib.le_vision_encode(self.ptr, ffi.from_buffer("float[]", patches), patches.shape[0], patches.shape[1],
                                   t, h, w, ffi.from_buffer("float[]", out), out.size), "le_vision_encode")
        return out

    def set_profile(self, on: bool) -> None:
        """On: le_vision_encode accumulates wall time per phase (reset by turning it on)."""
        check(lib.le_vision_set_profile(self.ptr, int(on)), "le_vision_set_profile")

    def profile(self) -> dict[str, float]:
        """Seconds per phase since set_profile(True) (VISION_PROFILE_PHASES order)."""
        out = ffi.new("double[]", len(VISION_PROFILE_PHASES))
        n = lib.le_vision_profile(self.ptr, out, len(VISION_PROFILE_PHASES))
        if n != len(VISION_PROFILE_PHASES):
            raise NativeError(n, f"the C core reports {n} vision phases, this module knows "
                                 f"{len(VISION_PROFILE_PHASES)}")
        return {name: out[i] for i, name in enumerate(VISION_PROFILE_PHASES)}

    @property
    def scratch_bytes(self) -> int:
        return lib.le_vision_scratch_bytes(self.ptr)

    @property
    def scratch_growths(self) -> int:
        return lib.le_vision_scratch_growths(self.ptr)


# ---- the tower's ops (tests) -------------------------------------------------------------------------------------
def vision_layernorm(x: np.ndarray, w: np.ndarray | None, b: np.ndarray | None, eps: float) -> np.ndarray:
    """le_layernorm_ref over the rows of x float32 [rows, n]; w, b float32 [n] or None."""
    x = _f32(np.ascontiguousarray(x), "x")
    rows, n = x.reshape(-1, x.shape[-1]).shape
    out = np.empty_like(x)
    ws = [ffi.NULL if a is None else ffi.from_buffer("float[]", _f32(np.ascontiguousarray(a), "w/b"))
          for a in (w, b)]
    if any(a is not None and a.size != n for a in (w, b)):
        raise ValueError("w and b must have the row's length")
    lib.le_layernorm_ref(ffi.from_buffer("float[]", x), ws[0], ws[1], rows, n, eps, ffi.from_buffer("float[]", out))
    return out


def vision_gelu(x: np.ndarray, form: str) -> np.ndarray:
    """le_gelu_tanh_ref (form 'tanh') or le_gelu_erf_ref ('erf') of float32 x."""
    fn = {"tanh": lib.le_gelu_tanh_ref, "erf": lib.le_gelu_erf_ref}[form]
    x = _f32(np.ascontiguousarray(x), "x")
    out = np.empty_like(x)
    fn(ffi.from_buffer("float[]", x), x.size, ffi.from_buffer("float[]", out))
    return out


def vision_rope(x: np.ndarray, pos: np.ndarray, n_head: int, theta: float, faults: dict | None = None) -> np.ndarray:
    """le_vision_op_rope on a copy of x float32 [n, n_head * head_dim]; pos int32 [n, 2] (row, col)."""
    x = np.array(x, dtype=np.float32, order="C")
    pos = np.ascontiguousarray(pos, dtype=np.int32)
    if x.ndim != 2 or pos.shape != (x.shape[0], 2) or x.shape[1] % n_head:
        raise ValueError(f"x {x.shape} must be [n, n_head * head_dim] and pos {pos.shape} [n, 2]")
    check(lib.le_vision_op_rope(ffi.from_buffer("float[]", x), x.shape[0], n_head, x.shape[1] // n_head, x.shape[1],
                                ffi.from_buffer("int32_t[]", pos), theta, vision_fault_bits(faults)),
          "le_vision_op_rope")
    return x


def vision_attention(qkv: np.ndarray, seg_len: int, n_head: int, n_threads: int = 1) -> np.ndarray:
    """le_vision_op_attention: qkv float32 [n, 3 * n_head * head_dim] -> [n, n_head * head_dim]."""
    qkv = _f32(np.ascontiguousarray(qkv), "qkv")
    n, width = qkv.shape
    if width % (3 * n_head):
        raise ValueError(f"qkv rows of {width} are not 3 x {n_head} heads")
    out = np.empty((n, width // 3), dtype=np.float32)
    check(lib.le_vision_op_attention(ffi.from_buffer("float[]", qkv), n, seg_len, n_head, width // (3 * n_head),
                                     n_threads, ffi.from_buffer("float[]", out)), "le_vision_op_attention")
    return out


def vision_pos_embed(table: np.ndarray, grid_thw, merge: int, faults: dict | None = None) -> np.ndarray:
    """le_vision_op_pos_embed: table float32 [side², hidden] resampled to grid (t, h, w) -> [t*h*w, hidden]."""
    table = _f32(np.ascontiguousarray(table), "table")
    side = int(round(table.shape[0] ** 0.5))
    if side * side != table.shape[0]:
        raise ValueError(f"table has {table.shape[0]} rows, not a square grid")
    t, h, w = (int(x) for x in grid_thw)
    out = np.empty((t * h * w, table.shape[1]), dtype=np.float32)
    check(lib.le_vision_op_pos_embed(ffi.from_buffer("float[]", table), side, table.shape[1], t, h, w, merge,
                                     vision_fault_bits(faults), ffi.from_buffer("float[]", out)),
          "le_vision_op_pos_embed")
    return out
