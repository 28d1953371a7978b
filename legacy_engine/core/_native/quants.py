"""Quant types: the capability table's row of a ggml type, and a row (de)quantised by the reference code."""
from __future__ import annotations

import numpy as np

from ..errors import UnavailableError
from ._lib import check, ffi, lib, struct_to_dict


def type_traits(qtype: int) -> dict:
    """The capability-table row of a ggml type id; UnavailableError if unsupported."""
    p = ffi.new("le_type_info *")
    code = lib.le_type_traits(int(qtype), p)
    if code == lib.LE_ERR_UNSUPPORTED:
        raise UnavailableError(f"ggml type id {qtype} is not supported by legacy_engine")
    check(code, "le_type_traits")
    return struct_to_dict(p)


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
