"""The integer dot products (native/vec_dot_ref.c, cpu_simd/vec_dot_*_<isa>.c) and the activation quantisers.

* The scalar reference of every weight type against f64 math on the dequantised rows (proves the ref), and
  against llama.cpp's own ggml_vec_dot_*_generic when llama-cpp-python is installed.
* Every SIMD tier the CPU can run against the ref (ids like q4_K-avx2); a tier the CPU lacks, or a tier with no
  kernel of its own for a type, skips with the reason: the fallback is never tested under the tier's name.
* The SIMD activation quantisers byte for byte against the refs (random rows and the rounding edge cases).
Tolerances: tests/tolerances.py (VEC_DOT_*).
"""
import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from legacy_engine.core import _native
from legacy_engine.core.errors import NativeError, UnavailableError

import tolerances as tol

pytestmark = [pytest.mark.cpu, pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")]

# weight type -> activation type of its dot product (ggml-cpu type_traits_cpu[].vec_dot_type)
ACT = {T.Q4_0: T.Q8_0, T.Q4_1: T.Q8_1, T.Q5_0: T.Q8_0, T.Q5_1: T.Q8_1, T.Q8_0: T.Q8_0,
       T.Q2_K: T.Q8_K, T.Q3_K: T.Q8_K, T.Q4_K: T.Q8_K, T.Q5_K: T.Q8_K, T.Q6_K: T.Q8_K,
       T.IQ4_NL: T.Q8_0, T.IQ4_XS: T.Q8_K, T.MXFP4: T.Q8_0}
TYPES = list(ACT)
SIMD_ISAS = ("ssse3", "avx2", "avx512vnni")
# fp16 scale fields (byte offset in the block) and, for types with a min term, (scale offset, min offset)
SCALE_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.Q2_K: [80, 82],
                T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208], T.IQ4_NL: [0], T.IQ4_XS: [0]}
MIN_FIELDS = {T.Q4_1: (0, 2), T.Q5_1: (0, 2), T.Q2_K: (80, 82), T.Q4_K: (0, 2), T.Q5_K: (0, 2)}
# activation quantisers that have a SIMD kernel of their own (cpu_simd/quantize_act_<isa>.c); the C API cannot
# say which tier serves a quantiser, so this list is kept by hand beside cpu_simd/kernels.c.
ACT_KERNELS = {(T.Q8_0, "avx2"), (T.Q8_1, "avx2"), (T.Q8_K, "avx2")}


def name(t: T) -> str:
    return t.name.lower().replace("_k", "_K")


def traits(t: T) -> dict:
    return _native.type_traits(t)


def n_blocks_list(t: T) -> list[int]:
    return [1, 2, 3, 7, 33] if traits(t)["block_size"] == 32 else [1, 2, 3, 5]


@pytest.fixture
def restore_isa():
    """Puts the process-wide tier back after the test."""
    prev = _native.get_isa()
    yield
    _native.set_isa(prev)


def use_isa(isa: str, qtype: T | None = None) -> None:
    """Selects `isa` or skips with the reason; with qtype, also skips when the tier has no kernel for it."""
    if not _native.isa_supported(isa):
        pytest.skip(f"this CPU cannot run {isa} kernels (CPUID/XGETBV); run on a host that has it")
    _native.set_isa(isa)
    if qtype is not None and _native.kernel_isa(qtype) != isa:
        pytest.skip(f"no {isa} kernel for {name(qtype)}: it falls back to {_native.kernel_isa(qtype)}")


# ---- data -----------------------------------------------------------------------------------------------

def random_weights(rng, qtype: T, nb: int) -> np.ndarray:
    """uint8[nb * type_size]: random quants, sane scales (|d| in 2^-6 .. 2^-3, random sign)."""
    ts = traits(qtype)["type_size"]
    raw = rng.integers(0, 256, size=(nb, ts), dtype=np.uint8)
    if qtype == T.MXFP4:
        raw[:, 0] = rng.integers(118, 134, size=nb)              # E8M0: 2^-10 .. 2^5
    for off in SCALE_FIELDS.get(qtype, []):
        h = (rng.uniform(2.0**-6, 2.0**-3, size=nb) * rng.choice([-1, 1], size=nb)).astype(np.float16)
        raw[:, off:off + 2] = h.view(np.uint8).reshape(nb, 2)
    return raw.reshape(-1)


def random_acts(rng, n: int) -> np.ndarray:
    x = rng.standard_normal(n).astype(np.float32)
    x *= (10.0 ** rng.uniform(-2, 2, size=n // 32)).repeat(32).astype(np.float32)   # block magnitudes differ
    return x


def quantized_acts(qtype: T, x: np.ndarray) -> bytes:
    """The activation row of qtype's dot product, by the reference quantiser."""
    return _native.quantize_row(ACT[qtype], x)


def with_field_zeroed(qtype: T, w: np.ndarray, off: int) -> np.ndarray:
    b = w.reshape(-1, traits(qtype)["type_size"]).copy()
    b[:, off:off + 2] = 0
    return b.reshape(-1)


def magnitude(qtype: T, w: np.ndarray, a: np.ndarray, n: int) -> float:
    """M = sum_i |w_i a_i|; for min types |scale part| + |min part| of each w_i (tolerances.py)."""
    if qtype in MIN_FIELDS:
        d_off, m_off = MIN_FIELDS[qtype]
        wd = _native.dequantize_row(qtype, with_field_zeroed(qtype, w, m_off), n).astype(np.float64)
        wm = _native.dequantize_row(qtype, with_field_zeroed(qtype, w, d_off), n).astype(np.float64)
        return float(np.sum(np.abs(a) * (np.abs(wd) + np.abs(wm))))
    return float(np.sum(np.abs(a * _native.dequantize_row(qtype, w, n).astype(np.float64))))


def exact_dot(qtype: T, w: np.ndarray, y: bytes, n: int) -> float:
    """The dot product in f64 on the dequantised rows. Q4_1/Q5_1: the min term uses Q8_1's stored
    s = fp16(d * sum q) per block, as the kernels must (that is Q8_1's contract)."""
    a = _native.dequantize_row(ACT[qtype], y, n).astype(np.float64)
    if ACT[qtype] != T.Q8_1:
        return float(np.dot(_native.dequantize_row(qtype, w, n).astype(np.float64), a))
    wd = _native.dequantize_row(qtype, with_field_zeroed(qtype, w, 2), n).astype(np.float64)
    m = w.reshape(-1, traits(qtype)["type_size"])[:, 2:4].copy().view(np.float16).astype(np.float64)
    s = np.frombuffer(y, np.uint8).reshape(-1, 36)[:, 2:4].copy().view(np.float16).astype(np.float64)
    return float(np.dot(wd, a) + np.sum(m * s))


def bound(want: float, M: float, nb: int) -> float:
    return tol.VEC_DOT_REL * abs(want) + tol.VEC_DOT_ABS_PER_BLOCK * (nb + tol.VEC_DOT_EXTRA_ROUNDINGS) * M


def assert_close(got: float, want: float, M: float, nb: int, what: str) -> None:
    b = bound(want, M, nb)
    assert abs(got - want) <= b, f"{what}: got {got!r}, want {want!r}, |diff| {abs(got - want):.3g} > {b:.3g}"


# ---- the reference ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", TYPES, ids=[name(t) for t in TYPES])
def test_ref_matches_f64_math(qtype, restore_isa):
    rng = np.random.default_rng(int(qtype))
    _native.set_isa("ref")
    for nb in n_blocks_list(qtype):
        n = nb * traits(qtype)["block_size"]
        w, x = random_weights(rng, qtype, nb), random_acts(rng, n)
        y = quantized_acts(qtype, x)
        got = _native.vec_dot(qtype, w, y, n)
        a = _native.dequantize_row(ACT[qtype], y, n)
        M = magnitude(qtype, w, a, n)
        assert bound(0, M, nb) < 1e-4 * M                       # the tolerance stays far below one bad element
        assert_close(got, exact_dot(qtype, w, y, n), M, nb, f"{name(qtype)} ref, {nb} blocks")


def _ggml_generic():
    """llama.cpp's libggml-cpu (from llama-cpp-python), or skip."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is the oracle of ggml's own kernels")
    path = os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-cpu.so")
    if not os.path.exists(path):
        pytest.skip(f"{path} not found in this llama-cpp-python build")
    lib = ctypes.CDLL(path)
    lib.ggml_cpu_init()                                  # fills ggml's fp16 -> f32 table the kernels read
    return lib


@pytest.mark.oracle
@pytest.mark.parametrize("qtype", TYPES, ids=[name(t) for t in TYPES])
def test_ref_matches_ggml_generic(qtype, restore_isa):
    lib = _ggml_generic()
    fn_name = f"ggml_vec_dot_{name(qtype)}_{name(ACT[qtype])}_generic"
    fn = getattr(lib, fn_name, None)
    if fn is None:
        pytest.skip(f"{fn_name} is not exported by this ggml build")
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t, ctypes.c_void_p,
                   ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = None
    rng = np.random.default_rng(100 + int(qtype))
    _native.set_isa("ref")
    for nb in n_blocks_list(qtype):
        n = nb * traits(qtype)["block_size"]
        w, x = random_weights(rng, qtype, nb), random_acts(rng, n)
        y = quantized_acts(qtype, x)
        out = ctypes.c_float()
        wbuf, ybuf = ctypes.create_string_buffer(w.tobytes()), ctypes.create_string_buffer(y)
        fn(n, ctypes.byref(out), 0, wbuf, 0, ybuf, 0, 1)
        got = _native.vec_dot(qtype, w, y, n)
        M = magnitude(qtype, w, _native.dequantize_row(ACT[qtype], y, n), n)
        assert_close(got, out.value, M, nb, f"{name(qtype)} ref vs {fn_name}, {nb} blocks")


# ---- every tier against the ref -----------------------------------------------------------------------------

TIER_CASES = [(t, isa) for t in TYPES for isa in SIMD_ISAS]


@pytest.mark.simd
@pytest.mark.parametrize("qtype,isa", TIER_CASES, ids=[f"{name(t)}-{isa}" for t, isa in TIER_CASES])
def test_tier_matches_ref(qtype, isa, restore_isa):
    rng = np.random.default_rng(1000 + int(qtype))
    bs = traits(qtype)["block_size"]
    cases = []
    for nb in n_blocks_list(qtype) + [64]:
        n = nb * bs
        w, x = random_weights(rng, qtype, nb), random_acts(rng, n)
        cases.append((nb, n, w, quantized_acts(qtype, x)))
    _native.set_isa("ref")
    want = [_native.vec_dot(qtype, w, y, n) for nb, n, w, y in cases]
    use_isa(isa, qtype)
    for (nb, n, w, y), ref in zip(cases, want):
        got = _native.vec_dot(qtype, w, y, n)
        M = magnitude(qtype, w, _native.dequantize_row(ACT[qtype], y, n), n)
        assert_close(got, ref, M, nb, f"{name(qtype)}-{isa}, {nb} blocks")


@pytest.mark.simd
@pytest.mark.parametrize("qtype,isa", TIER_CASES, ids=[f"{name(t)}-{isa}" for t, isa in TIER_CASES])
def test_tier_extreme_values(qtype, isa, restore_isa):
    """Every quant byte at its extreme (0x00, 0xff, 0x80, 0x7f patterns) against activations of +-127: the
    integer sums must not saturate (pmaddubsw) or overflow anywhere."""
    nb = 3
    n = nb * traits(qtype)["block_size"]
    cases = []
    for fill in (0xFF, 0x00, 0x80, 0x7F, 0xAA):
        w = np.full(nb * traits(qtype)["type_size"], fill, dtype=np.uint8)
        if qtype == T.MXFP4:
            w.reshape(nb, -1)[:, 0] = 127
        for off in SCALE_FIELDS.get(qtype, []):
            w.reshape(nb, -1)[:, off:off + 2] = np.array([1.0], np.float16).view(np.uint8)
        for sign in (1, -1):
            x = np.full(n, sign * 1.0, np.float32)
            x[1::2] *= -1 if fill == 0xAA else 1
            cases.append((w, quantized_acts(qtype, x)))
    _native.set_isa("ref")
    want = [_native.vec_dot(qtype, w, y, n) for w, y in cases]
    use_isa(isa, qtype)
    for (w, y), ref in zip(cases, want):
        M = magnitude(qtype, w, _native.dequantize_row(ACT[qtype], y, n), n)
        assert_close(_native.vec_dot(qtype, w, y, n), ref, M, nb, f"{name(qtype)}-{isa} fill {w[-1]:#x}")


# Several-row kernels (le_vec_dot_n_table): the types each SIMD tier has one for, kept by hand beside
# cpu_simd/kernels.c so a kernel that goes missing fails here rather than silently looping the one-row kernel.
VEC_DOT_N_KERNELS = {(t, isa) for t in (T.Q4_K, T.Q6_K) for isa in ("avx2", "avx512vnni")} | {(T.Q4_K, "ssse3")}
N_CASES = [(t, isa) for t in TYPES for isa in ("ref",) + SIMD_ISAS]


@pytest.mark.simd
@pytest.mark.parametrize("qtype,isa", N_CASES, ids=[f"{name(t)}-{isa}" for t, isa in N_CASES])
def test_vec_dot_n_equals_one_row_kernel(qtype, isa, restore_isa):
    """Row t of the several-row product is the tier's one-row kernel on activation row t, bit for bit, at every
    count of rows (the kernels go 4 rows a pass, Q4_K on AVX-512VL 8 then 4: 0..17 covers two full passes of 8 and
    every remainder), and the tier has a
    several-row kernel exactly where VEC_DOT_N_KERNELS says."""
    if isa != "ref":
        use_isa(isa, qtype)
    else:
        _native.set_isa("ref")
    assert _native.has_vec_dot_n(qtype) == ((qtype, isa) in VEC_DOT_N_KERNELS)
    rng = np.random.default_rng(2000 + int(qtype))
    bs = traits(qtype)["block_size"]
    for nb in (1, 3, 8):
        n = nb * bs
        w = random_weights(rng, qtype, nb)
        ys = [quantized_acts(qtype, random_acts(rng, n)) for _ in range(17)]
        for nt in range(0, 18):
            got = _native.vec_dot_n(qtype, w, ys[:nt], n)
            want = np.array([_native.vec_dot(qtype, w, y, n) for y in ys[:nt]], np.float32)
            assert got.tobytes() == want.tobytes(), f"{name(qtype)}-{isa}, {nb} blocks, {nt} rows"


@pytest.mark.simd
@pytest.mark.parametrize("isa", SIMD_ISAS)
def test_tier_gemv_rows(isa, restore_isa):
    """Many rows through vec_dot_rows (the benchmark's path) equal per-row calls of the ref."""
    rng = np.random.default_rng(7)
    for qtype in (T.Q4_K, T.Q8_0):
        nb, rows = 8, 16
        n = nb * traits(qtype)["block_size"]
        w = np.concatenate([random_weights(rng, qtype, nb) for _ in range(rows)])
        y = quantized_acts(qtype, random_acts(rng, n))
        _native.set_isa("ref")
        want = _native.vec_dot_rows(qtype, w, y, n, rows)
        use_isa(isa, qtype)
        got = _native.vec_dot_rows(qtype, w, y, n, rows)
        rb = w.size // rows
        for r in range(rows):
            wr = w[r * rb:(r + 1) * rb]
            M = magnitude(qtype, wr, _native.dequantize_row(ACT[qtype], y, n), n)
            assert_close(float(got[r]), float(want[r]), M, nb, f"{name(qtype)}-{isa} row {r}")


# ---- activation quantisers ---------------------------------------------------------------------------------------

def edge_rows(block: int) -> list[np.ndarray]:
    """Rows that hit every rounding rule: ties (roundf: away from zero; nearest_int: to even), zero, -0, NaN,
    inf, subnormal and huge blocks, and a signed max that appears twice."""
    ties = (np.arange(block, dtype=np.float32) - block / 2) + np.float32(0.5)
    ties[0] = 127.0                                      # amax 127 (Q8_0: d = 1) ...
    ties_k = ties.copy()
    ties_k[0] = -127.0                                   # ... max -127 (Q8_K: iscale = 1): x*1 keeps the .5
    dup = np.linspace(-3, 3, block).astype(np.float32)
    dup[3], dup[7] = -5.0, 5.0                           # first of the largest |x| is negative
    nan = np.ones(block, np.float32)
    nan[block // 3] = np.nan
    nan_last = np.ones(block, np.float32)
    nan_last[-1] = np.nan
    inf = np.linspace(-1, 1, block).astype(np.float32)
    inf[5] = np.inf
    rows = [ties, ties_k, -ties, dup, nan, nan_last, inf, np.zeros(block, np.float32),
            np.full(block, -0.0, np.float32), np.full(block, 1e-42, np.float32),
            np.linspace(-3e38, 3e38, block).astype(np.float32), np.linspace(-1e-5, 7e-6, block).astype(np.float32)]
    return [np.tile(r, 2) for r in rows]                 # two blocks: the loop's second step too


ACT_CASES = [(t, isa) for t in (T.Q8_0, T.Q8_1, T.Q8_K) for isa in SIMD_ISAS]


@pytest.mark.simd
@pytest.mark.parametrize("act,isa", ACT_CASES, ids=[f"{name(t)}-{isa}" for t, isa in ACT_CASES])
def test_quantize_act_bit_exact(act, isa, restore_isa):
    if (act, isa) not in ACT_KERNELS:
        pytest.skip(f"no {isa} quantiser for {name(act)}: it falls back to a lower tier's")
    block = traits(act)["block_size"]
    rng = np.random.default_rng(int(act))
    rows = edge_rows(block)
    for nb in (1, 2, 3, 17):
        rows.append(random_acts(rng, nb * block) if block == 32 else
                    rng.standard_normal(nb * block).astype(np.float32) * np.float32(10.0 ** rng.uniform(-3, 3)))
    for _ in range(8):                                   # random bit patterns: NaN, inf, subnormals anywhere
        rows.append(rng.integers(0, 2**32, size=4 * block, dtype=np.uint32).view(np.float32))
        wild = random_acts(rng, 4 * block)
        wild[rng.integers(0, wild.size, 5)] = rng.integers(0, 2**32, size=5, dtype=np.uint32).view(np.float32)
        rows.append(wild)
    use_isa(isa)
    for i, x in enumerate(rows):
        want = _native.quantize_row(act, x)              # le_quantize_row: always the reference
        got = _native.quantize_act(act, x)
        assert got == want, f"{name(act)}-{isa}, row {i}: bytes differ at {np.flatnonzero(np.frombuffer(got, np.uint8) != np.frombuffer(want, np.uint8))[:8]}"


# ---- the tier switch and errors ------------------------------------------------------------------------------------

def test_default_tier_is_the_best_supported():
    if os.environ.get("LE_FORCE_ISA"):
        pytest.skip("LE_FORCE_ISA is set")
    best = [i for i in _native.ISA_NAMES if _native.isa_supported(i)][-1]
    out = subprocess.run([sys.executable, "-c", "from legacy_engine.core import _native as N; print(N.get_isa())"],
                         capture_output=True, encoding="utf-8", errors="replace", check=True)
    assert out.stdout.strip() == best


@pytest.mark.parametrize("isa", _native.ISA_NAMES)
def test_force_isa_env(isa):
    if not _native.isa_supported(isa):
        pytest.skip(f"this CPU cannot run {isa}")
    code = "from legacy_engine.core import _native as N; print(N.get_isa(), N.kernel_isa(12))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, encoding="utf-8", errors="replace", check=True,
                         env=dict(os.environ, LE_FORCE_ISA=isa))
    tier, q4k = out.stdout.split()
    assert tier == isa and q4k in ("ref", isa)           # Q4_K's kernel: the forced tier's, or the ref below it


def test_every_type_has_a_kernel_at_every_tier(restore_isa):
    for isa in _native.ISA_NAMES:
        if not _native.isa_supported(isa):
            continue
        _native.set_isa(isa)
        assert _native.get_isa() == isa
        for t in TYPES:
            k = _native.kernel_isa(t)
            assert k is not None and _native.ISA_NAMES.index(k) <= _native.ISA_NAMES.index(isa)
        assert _native.kernel_isa(T.F32) is None


@pytest.mark.parametrize("isa", _native.ISA_NAMES)
def test_forced_tier_serves_types_with_its_own_kernels(isa, restore_isa):
    """set_isa(isa) puts isa's own kernels in front of at least one type (all of them today) and no kernel of a
    higher tier: a switch that did nothing would leave the default tier's, so the tests parametrised by tier
    (here and test_quantized.py's end-to-end ones) can fail instead of testing one tier under several names."""
    use_isa(isa)
    served = {name(t): _native.kernel_isa(t) for t in TYPES}
    order = _native.ISA_NAMES.index
    assert any(k == isa for k in served.values()), served
    assert all(k is not None and order(k) <= order(isa) for k in served.values()), served
    for other in (i for i in _native.ISA_NAMES if i != isa and _native.isa_supported(i)):
        _native.set_isa(other)                          # every other tier serves some type differently
        assert {name(t): _native.kernel_isa(t) for t in TYPES} != served, (isa, other)


def test_unsupported_isa_raises(restore_isa):
    prev = _native.get_isa()
    missing = [i for i in _native.ISA_NAMES if not _native.isa_supported(i)]
    if not missing:
        pytest.skip("this CPU runs every tier; nothing to refuse")
    with pytest.raises(UnavailableError, match=missing[0]):
        _native.set_isa(missing[0])
    assert _native.get_isa() == prev                     # a refused switch changes nothing
    with pytest.raises(ValueError):
        _native.set_isa("avx9000")


def test_vec_dot_errors():
    w = bytes(18 * 2)
    y = _native.quantize_row(T.Q8_0, np.ones(64, np.float32))
    with pytest.raises(ValueError):
        _native.vec_dot(T.Q4_0, w, y, 48)                # not a multiple of the block
    with pytest.raises(ValueError):
        _native.vec_dot(T.Q4_0, w[:20], y, 64)           # short weight buffer
    with pytest.raises(ValueError):
        _native.vec_dot(T.Q4_0, w, y[:40], 64)           # short activation buffer
    with pytest.raises(NativeError):
        _native.vec_dot(T.F32, bytes(256), bytes(256), 64)   # f32 has no integer dot product
    with pytest.raises(UnavailableError):
        _native.vec_dot(5, w, y, 64)                     # id 5 is no type
    assert _native.vec_dot(T.Q4_0, w, y, 0) == 0.0
