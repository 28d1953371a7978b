"""The cffi `lib` and `ffi` of the C core (legacy_engine._core), loaded once, and what every wrapper shares:
turning a status code into an exception, checking an int for the C API, reading a C struct as a dict."""
from __future__ import annotations

from ..errors import NativeError, UnavailableError

try:
    from ..._core import ffi, lib
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


def struct_to_dict(cdata) -> dict:
    out = {}
    for field, _ in ffi.typeof(cdata[0]).fields:
        value = getattr(cdata[0], field)
        if isinstance(value, ffi.CData):  # char arrays
            value = ffi.string(value).decode("utf-8", "replace").strip()
        out[field] = value
    return out
