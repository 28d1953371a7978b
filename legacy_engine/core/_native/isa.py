"""Kernel tiers: the integer dot products (W4A8 ...) of cpu_simd/ per instruction-set tier. Select a tier
(le_set_isa), ask which tier serves a type, and call one row's kernel. The tier is process-wide: tests that
change it put it back."""
from __future__ import annotations

import numpy as np

from ..errors import UnavailableError
from ._lib import LE_OK, check, ffi, lib
from .quants import type_traits

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


def fp_flushes() -> bool:
    """Whether the C core's work runs with denormals flushed to zero (FTZ/DAZ; x86 builds)."""
    return bool(lib.le_fp_flushes())


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


def gemm_f32(a, b) -> np.ndarray:
    """The selected tier's f32 gemm tile kernel: a [m, k] @ b [n, k].T -> [m, n]."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"shapes {a.shape} and {b.shape}: expected [m, k] and [n, k]")
    c = np.empty((a.shape[0], b.shape[0]), np.float32)
    check(lib.le_gemm_f32_k(ffi.from_buffer("float[]", a), ffi.from_buffer("float[]", b), a.shape[0], b.shape[0],
                            a.shape[1], ffi.from_buffer("float[]", c)), "le_gemm_f32_k")
    return c


def gemm_nn_f32(a, b) -> np.ndarray:
    """The selected tier's f32 gemm_nn kernel: a [m, k] @ b [k, n] -> [m, n]."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"shapes {a.shape} and {b.shape}: expected [m, k] and [k, n]")
    c = np.empty((a.shape[0], b.shape[1]), np.float32)
    check(lib.le_gemm_nn_f32_k(ffi.from_buffer("float[]", a), ffi.from_buffer("float[]", b), a.shape[0], b.shape[1],
                               a.shape[1], ffi.from_buffer("float[]", c)), "le_gemm_nn_f32_k")
    return c


def exp_sub_sum_f32(x, scale: float = 1.0) -> tuple[np.ndarray, float]:
    """The selected tier's exp_sub_sum: (exp(x scale - max(x) scale), its sum) for float32 x [n]."""
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    y = np.empty_like(x)
    s = ffi.new("double *")
    check(lib.le_exp_sub_sum_f32_k(ffi.from_buffer("float[]", x), ffi.from_buffer("float[]", y), x.size,
                                   float(scale), s), "le_exp_sub_sum_f32_k")
    return y, s[0]


def silu_f32(x) -> np.ndarray:
    """The selected tier's silu kernel, x / (1 + exp(-x)), of float32 x."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    check(lib.le_silu_f32_k(ffi.from_buffer("float[]", x), x.size, ffi.from_buffer("float[]", out)), "le_silu_f32_k")
    return out


def gelu_tanh_f32(x) -> np.ndarray:
    """The selected tier's gelu_tanh kernel (the vision MLP's activation) of float32 x."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    check(lib.le_gelu_tanh_f32_k(ffi.from_buffer("float[]", x), x.size, ffi.from_buffer("float[]", out)),
          "le_gelu_tanh_f32_k")
    return out


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


def vec_dot_n(qtype: int, x, ys: list, n: int) -> np.ndarray:
    """x: n weights of `qtype`, ys: activation rows (each n values in its vec_dot_type, equal lengths) -> float32
    [len(ys)]: the dot products through the selected tier's several-row kernel (has_vec_dot_n) or its one-row one."""
    t = type_traits(qtype)
    need_x, need_y = _row_bytes(t, int(n)), _row_bytes(type_traits(t["vec_dot_type"]), int(n))
    if len(ffi.from_buffer(x)) < need_x or any(len(y) != need_y for y in ys):
        raise ValueError(f"{n} elements need {need_x} weight bytes and activation rows of {need_y} bytes")
    yb = b"".join(bytes(y) for y in ys) or b"\0"
    out = np.zeros(max(len(ys), 1), np.float32)
    check(lib.le_vec_dot_n(int(qtype), int(n), ffi.from_buffer(x), ffi.from_buffer(yb), need_y, len(ys),
                           ffi.from_buffer("float[]", out)), "le_vec_dot_n")
    return out[:len(ys)]


def has_vec_dot_n(qtype: int) -> bool:
    """Whether the selected tier has a several-row kernel of its own for `qtype` (else rows loop its one-row one)."""
    return bool(lib.le_has_vec_dot_n(int(qtype)))


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
