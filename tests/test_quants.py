"""The scalar quant references (native/quants_ref.c, native/dispatch.c) against gguf-py.

Dequantisation is compared bit for bit with gguf.quants.dequantize (NaN-aware: two NaNs
match whatever their payloads, because numpy may convert fp16 in hardware on other
CPUs); quantisation to Q8_0/F16/BF16/F32 byte for byte with gguf.quants.quantize, and
Q8_1/Q8_K (which gguf-py lacks) with numpy transcriptions of ggml's reference below.
"""
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from legacy_engine.core import _native
from legacy_engine.core.errors import EngineError, NativeError, UnavailableError

import tolerances as tol

# gguf-py's numpy warns on the inf/NaN scales these tests feed it on purpose
pytestmark = [pytest.mark.cpu, pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")]

SUPPORTED = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q8_1,
             T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4]
QUANTISABLE = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q8_1, T.Q8_K]
# activation type of each type's dot product (ggml-cpu type_traits_cpu, spec §4)
VEC_DOT_TYPE = {T.F32: T.F32, T.F16: T.F16, T.BF16: T.BF16,
                T.Q4_0: T.Q8_0, T.Q5_0: T.Q8_0, T.Q8_0: T.Q8_0, T.IQ4_NL: T.Q8_0, T.MXFP4: T.Q8_0,
                T.Q4_1: T.Q8_1, T.Q5_1: T.Q8_1, T.Q8_1: T.Q8_1,
                T.Q2_K: T.Q8_K, T.Q3_K: T.Q8_K, T.Q4_K: T.Q8_K, T.Q5_K: T.Q8_K, T.Q6_K: T.Q8_K,
                T.Q8_K: T.Q8_K, T.IQ4_XS: T.Q8_K}
# byte offsets of the fp16 scale fields of each block (le_blocks.h)
HALF_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
               T.Q8_1: [0, 2], T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2],
               T.Q6_K: [208], T.IQ4_NL: [0], T.IQ4_XS: [0]}
# gguf-py 0.19 still lists Q8_1 as 40 bytes (the old f32 d, s layout); ggml's block_q8_1 is
# two halves + 32 quants = 36 bytes (ggml-common.h static_assert; spec §4).
# Q8_1 is an activation type that never appears in GGUF files, so only the table is stale.
GGUF_PY_STALE_SIZES = {T.Q8_1: ((32, 40), (32, 36))}
SIZES = {**GGML_QUANT_SIZES, **{t: ggml for t, (_, ggml) in GGUF_PY_STALE_SIZES.items()}}
# fp16 max/-max, min subnormal, largest subnormal, min normal, +-inf, quiet/signalling NaNs, +-0, 1
EXTREME_HALVES = [0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x03FF, 0x0400, 0x7C00, 0xFC00,
                  0x7E00, 0xFE00, 0x7C01, 0x7DFF, 0x0000, 0x8000, 0x3C00]


def ggml_name(t: T) -> str:
    """ggml's spelling: lower case except the K of K-quants ("q4_K")."""
    return t.name.lower().replace("_k", "_K")


def ids(types):
    return [ggml_name(t) for t in types]


def assert_same_f32(got: np.ndarray, want: np.ndarray) -> None:
    """Bit-identical float32 arrays, except that any NaN matches any NaN."""
    got = np.ascontiguousarray(got, dtype=np.float32)
    want = np.ascontiguousarray(want, dtype=np.float32)
    assert got.shape == want.shape
    bad = (got.view(np.uint32) != want.view(np.uint32)) & ~(np.isnan(got) & np.isnan(want))
    if bad.any():
        i = np.flatnonzero(bad)[:5]
        g, w = got.reshape(-1)[i].view(np.uint32), want.reshape(-1)[i].view(np.uint32)
        pytest.fail(f"{bad.sum()} of {bad.size} differ; at {i.tolist()}: "
                    f"got {[hex(v) for v in g]} want {[hex(v) for v in w]}")


def assert_same_f16_bits(got: np.ndarray, want: np.ndarray) -> None:
    """Identical fp16 bit patterns (uint16), except that any NaN matches any NaN."""
    def is_nan(h):
        return ((h & 0x7C00) == 0x7C00) & ((h & 0x03FF) != 0)
    bad = (got != want) & ~(is_nan(got) & is_nan(want))
    if bad.any():
        i = np.flatnonzero(bad)[:5]
        pytest.fail(f"{bad.sum()} differ; got {[hex(v) for v in got[i]]} want {[hex(v) for v in want[i]]}")


def dequant_rows(qtype: T, raw: np.ndarray) -> np.ndarray:
    """raw: uint8[rows, row_bytes] -> float32[rows, n] through the C core, row by row."""
    block_size, type_size = SIZES[qtype]
    n = raw.shape[1] // type_size * block_size
    return np.stack([_native.dequantize_row(qtype, row.tobytes(), n) for row in raw])


def quant_rows(qtype: T, x: np.ndarray) -> np.ndarray:
    """x: float32[rows, n] -> uint8[rows, row_bytes] through the C core."""
    return np.stack([np.frombuffer(_native.quantize_row(qtype, row), dtype=np.uint8) for row in x])


def random_blocks(rng, qtype: T, rows: int, n_blocks: int) -> np.ndarray:
    """uint8[rows, n_blocks*type_size] of random bytes: every field takes arbitrary values
    (fp16 scales include subnormals, inf and NaN about 1 time in 32)."""
    return rng.integers(0, 256, size=(rows, n_blocks * SIZES[qtype][1]), dtype=np.uint8)


# ---- numpy transcriptions of what gguf-py does not implement (ggml-quants.c) ------------

def np_roundf(x):
    """C roundf: half away from zero (exact for float32: 2*(a - floor(a)) is exact)."""
    a = np.abs(x)
    f = np.floor(a)
    return np.sign(x) * (f + np.floor(2 * (a - f)))


def np_nearest_int(x):
    """ggml's nearest_int: add 1.5*2^23 in float32 and read the mantissa (half to even)."""
    v = (x.astype(np.float32) + np.float32(12582912.0)).view(np.int32)
    return (v & 0x007FFFFF) - 0x00400000


def ref_dequant_q8_1(raw: np.ndarray) -> np.ndarray:
    b = raw.reshape(-1, 36)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    q = b[:, 4:].view(np.int8).astype(np.float32)
    return (q * d).reshape(raw.shape[0], -1)


def ref_dequant_q8_k(raw: np.ndarray) -> np.ndarray:
    b = raw.reshape(-1, 292)
    d = b[:, 0:4].copy().view(np.float32)
    q = b[:, 4:260].view(np.int8).astype(np.float32)
    return (d * q).reshape(raw.shape[0], -1)


def ref_quant_q8_1(x: np.ndarray) -> np.ndarray:
    """quantize_row_q8_1_ref: Q8_0 plus s = fp16(d * sum(q)) with the f32 d."""
    blocks = x.reshape(-1, 32).astype(np.float32)
    d = (np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    q = np_roundf((blocks * inv).astype(np.float32)).astype(np.int8)
    s = (q.astype(np.int32).sum(axis=1, keepdims=True).astype(np.float32) * d).astype(np.float32)
    out = np.concatenate([d.astype(np.float16).view(np.uint8), s.astype(np.float16).view(np.uint8),
                          q.view(np.uint8)], axis=1)
    return out.reshape(x.shape[0], -1)


def ref_quant_q8_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q8_K_ref: signed max (first of largest |x|) -> -127, nearest_int, bsums.
    All-zero blocks: d = 0, q = 0, bsums = 0 (ggml leaves bsums unwritten there)."""
    blocks = x.reshape(-1, 256).astype(np.float32)
    out = np.zeros((blocks.shape[0], 292), dtype=np.uint8)
    for i, b in enumerate(blocks):
        mx = b[np.argmax(np.abs(b))]
        if mx == 0:
            continue
        iscale = np.float32(-127.0) / mx
        q = np.minimum(127, np_nearest_int((iscale * b).astype(np.float32))).astype(np.int8)
        bsums = q.astype(np.int32).reshape(16, 16).sum(axis=1).astype(np.int16)
        d = np.float32(1.0) / iscale
        out[i] = np.concatenate([np.array([d], np.float32).view(np.uint8), q.view(np.uint8),
                                 bsums.view(np.uint8)])
    return out.reshape(x.shape[0], -1)


def reference_dequantize(qtype: T, raw: np.ndarray) -> np.ndarray:
    if qtype == T.Q8_1:
        return ref_dequant_q8_1(raw)
    if qtype == T.Q8_K:
        return ref_dequant_q8_k(raw)
    return gguf_dequantize(raw, qtype)


def activations(rng, rows: int, n: int, block: int, lo: float = -20, hi: float = 20) -> np.ndarray:
    """float32[rows, n]: normal values with a different magnitude 10^U(lo, hi) per block,
    some blocks all zero, some with zeros/negative zeros/one spike."""
    x = rng.standard_normal((rows, n // block, block)).astype(np.float32)
    x *= (10.0 ** rng.uniform(lo, hi, size=(rows, n // block, 1))).astype(np.float32)
    x[:, ::7] = 0
    x[:, 1::5, ::3] = -0.0
    x[:, 2::6, 5] *= 1000
    return x.reshape(rows, n)


# ---- sizes and the capability table -------------------------------------------------------

@pytest.mark.oracle
@pytest.mark.parametrize("qtype", SUPPORTED, ids=ids(SUPPORTED))
def test_type_sizes_match_gguf(qtype):
    t = _native.type_traits(qtype)
    if qtype in GGUF_PY_STALE_SIZES:
        gguf_py, ggml = GGUF_PY_STALE_SIZES[qtype]
        assert GGML_QUANT_SIZES[qtype] == gguf_py, "gguf-py fixed its table: drop the exception"
        assert (t["block_size"], t["type_size"]) == ggml
    else:
        assert (t["block_size"], t["type_size"]) == GGML_QUANT_SIZES[qtype]
    assert t["name"] == ggml_name(qtype)
    assert t["type"] == qtype
    assert t["vec_dot_type"] == VEC_DOT_TYPE[qtype]
    assert t["can_dequantize"] == 1
    assert t["can_quantize"] == (qtype in QUANTISABLE)


def test_supported_ids_are_exactly_the_table():
    got = set()
    for tid in range(-2, 64):
        try:
            _native.type_traits(tid)
            got.add(tid)
        except UnavailableError:
            pass
    assert got == {int(t) for t in SUPPORTED}


# ---- dequantisation: bit-exact against gguf-py ----------------------------------------------

def n_blocks_for(qtype: T) -> int:
    block_size = SIZES[qtype][0]
    return {1: 512, 32: 24, 256: 3}[block_size]


@pytest.mark.oracle
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("qtype", SUPPORTED, ids=ids(SUPPORTED))
def test_dequantize_random_blocks(qtype, seed):
    rng = np.random.default_rng(1000 * seed + int(qtype))
    raw = random_blocks(rng, qtype, rows=4, n_blocks=n_blocks_for(qtype))
    assert_same_f32(dequant_rows(qtype, raw), reference_dequantize(qtype, raw))


@pytest.mark.oracle
@pytest.mark.parametrize("qtype", SUPPORTED, ids=ids(SUPPORTED))
def test_dequantize_zero_blocks(qtype):
    raw = np.zeros((2, n_blocks_for(qtype) * SIZES[qtype][1]), dtype=np.uint8)
    got = dequant_rows(qtype, raw)
    assert_same_f32(got, reference_dequantize(qtype, raw))
    assert np.all(got == 0)  # every scale is 0 (MXFP4: 2^-128 times grid value 0)


@pytest.mark.oracle
@pytest.mark.parametrize("qtype", list(HALF_FIELDS), ids=ids(HALF_FIELDS))
def test_dequantize_extreme_scales(qtype):
    """fp16 scale fields set to max, subnormals, inf, NaN, -0 (every field the same value,
    then independent random picks), quants random."""
    rng = np.random.default_rng(7 + int(qtype))
    type_size = SIZES[qtype][1]
    k = len(EXTREME_HALVES)
    raw = random_blocks(rng, qtype, rows=2, n_blocks=2 * k).reshape(-1, type_size)
    halves = np.array(EXTREME_HALVES, dtype=np.uint16)
    for off in HALF_FIELDS[qtype]:
        field = np.concatenate([halves, rng.choice(halves, size=k)])
        raw[:, off:off + 2] = np.tile(field, 2).view(np.uint8).reshape(-1, 2)
    raw = raw.reshape(2, -1)
    assert_same_f32(dequant_rows(qtype, raw), reference_dequantize(qtype, raw))


@pytest.mark.oracle
def test_dequantize_mxfp4_every_exponent():
    """Every E8M0 byte: 0 and 1 give subnormal 2^-128, 2^-127; 255 gives 2^127 (no NaN)."""
    rng = np.random.default_rng(39)
    raw = random_blocks(rng, T.MXFP4, rows=1, n_blocks=256).reshape(256, 17)
    raw[:, 0] = np.arange(256, dtype=np.uint8)
    raw = raw.reshape(1, -1)
    assert_same_f32(dequant_rows(T.MXFP4, raw), gguf_dequantize(raw, T.MXFP4))


def test_dequantize_q8_k_extreme_scales():
    rng = np.random.default_rng(15)
    ds = np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max, 1e-45, -1e-45,
                   np.inf, -np.inf, np.nan, 0.0, -0.0, 1.0], dtype=np.float32)
    raw = random_blocks(rng, T.Q8_K, rows=1, n_blocks=len(ds)).reshape(len(ds), 292)
    raw[:, 0:4] = ds.view(np.uint8).reshape(-1, 4)
    raw = raw.reshape(1, -1)
    assert_same_f32(dequant_rows(T.Q8_K, raw), ref_dequant_q8_k(raw))


@pytest.mark.oracle
@pytest.mark.parametrize("qtype", [T.F16, T.BF16], ids=ids([T.F16, T.BF16]))
def test_dequantize_every_16bit_pattern(qtype):
    raw = np.arange(65536, dtype=np.uint16).view(np.uint8).reshape(1, -1)
    assert_same_f32(dequant_rows(qtype, raw), gguf_dequantize(raw, qtype).reshape(1, -1))


def _numpy_fp16_casts_in_software() -> bool:
    """numpy's software fp16 casts copy NaN payloads (f16 0x7c01 -> f32 0x7f802000, f32
    0x7f800001 -> f16 0x7c01); a hardware cast (F16C, AVX512-FP16) quiets them instead."""
    h = np.array([0x7C01], dtype=np.uint16).view(np.float16)
    f = np.array([0x7F800001], dtype=np.uint32).view(np.float32)
    return (int(h.astype(np.float32).view(np.uint32)[0]) == 0x7F802000
            and int(f.astype(np.float16).view(np.uint16)[0]) == 0x7C01)


def test_fp16_nan_payloads_like_numpy():
    """Beyond NaN-awareness: NaN payloads in both directions exactly as numpy's software cast."""
    if not _numpy_fp16_casts_in_software():
        pytest.skip("this numpy converts fp16 in hardware (NaNs quieted); payload rule not comparable")
    h = np.arange(0x7C01, 0x10000, dtype=np.uint16)  # every +/- NaN pattern (and a few others)
    h = h[(h & 0x7C00) == 0x7C00]
    got = _native.dequantize_row(T.F16, h.tobytes(), h.size)
    assert np.array_equal(got.view(np.uint32), h.view(np.float16).astype(np.float32).view(np.uint32))
    rng = np.random.default_rng(3)
    nans = (rng.integers(1, 2**23, size=4096, dtype=np.uint32) | np.uint32(0x7F800000))
    nans[::2] |= np.uint32(0x80000000)
    x = nans.view(np.float32)
    with np.errstate(invalid="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    assert np.array_equal(np.frombuffer(_native.quantize_row(T.F16, x), np.uint16), want)


def test_comparators_catch_one_ulp_and_nan():
    """Negative control: the bit comparators used above do fail on the smallest differences."""
    x = np.array([1.0, -0.0, np.inf, 3.5], dtype=np.float32)
    for bits in (x.view(np.uint32) + np.uint32([1, 0, 0, 0]),       # one ulp
                 x.view(np.uint32) ^ np.uint32([0, 0x80000000, 0, 0]),  # -0 vs +0
                 np.where([0, 0, 1, 0], np.uint32(0x7FC00000), x.view(np.uint32))):  # inf vs NaN
        with pytest.raises(pytest.fail.Exception):
            assert_same_f32(bits.astype(np.uint32).view(np.float32), x)
    with pytest.raises(pytest.fail.Exception):
        assert_same_f16_bits(np.array([0x3C01], np.uint16), np.array([0x3C00], np.uint16))
    assert_same_f32(np.array([np.nan], np.float32), -np.array([np.nan], np.float32))


# ---- quantisation ------------------------------------------------------------------------

@pytest.mark.oracle
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quantize_q8_0_matches_gguf(seed):
    rng = np.random.default_rng(80 + seed)
    x = activations(rng, rows=3, n=32 * 64, block=32)
    assert np.array_equal(quant_rows(T.Q8_0, x), gguf_quantize(x, T.Q8_0))


@pytest.mark.oracle
def test_quantize_q8_0_ties_round_away_from_zero():
    """d = 1 exactly (amax 127): x = k + 0.5 are exact ties, roundf takes them away from 0."""
    x = np.zeros((1, 64), dtype=np.float32)
    x[0, :32] = np.arange(-16, 16) + 0.5
    x[0, 0] = 127.0
    x[0, 32:] = -(np.arange(32) % 5) - 0.5
    x[0, 40] = -127.0
    got = quant_rows(T.Q8_0, x)
    assert np.array_equal(got, gguf_quantize(x, T.Q8_0))
    qs = got[0, 2:34].view(np.int8)
    assert qs[1] == -15 and qs[17] == 2  # -14.5 -> -15, 1.5 -> 2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quantize_q8_1_matches_ggml_reference(seed):
    rng = np.random.default_rng(90 + seed)
    x = activations(rng, rows=3, n=32 * 64, block=32)
    assert np.array_equal(quant_rows(T.Q8_1, x), ref_quant_q8_1(x))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quantize_q8_k_matches_ggml_reference(seed):
    rng = np.random.default_rng(150 + seed)
    x = activations(rng, rows=2, n=256 * 12, block=256)
    assert np.array_equal(quant_rows(T.Q8_K, x), ref_quant_q8_k(x))


def test_quantize_q8_k_ties_round_half_even_and_signed_max():
    """max = -127 gives iscale = 1: nearest_int rounds k + 0.5 to even, unlike roundf;
    the element of largest |x| maps to -127 (d negative when that element is positive)."""
    x = np.zeros((1, 512), dtype=np.float32)
    x[0, :256] = (np.arange(256) % 20) - 10 + 0.5
    x[0, 3] = -127.0
    x[0, 256:] = np.linspace(-3, 5, 256, dtype=np.float32)
    got = quant_rows(T.Q8_K, x)
    assert np.array_equal(got, ref_quant_q8_k(x))
    blk = got[0, :292]
    qs = blk[4:260].view(np.int8)
    assert blk[:4].view(np.float32)[0] == 1.0
    assert qs[3] == -127 and qs[0] == -10 and qs[1] == -8 and qs[2] == -8  # -9.5 -> -10, -8.5 -> -8
    blk2 = got[0, 292:]
    assert blk2[:4].view(np.float32)[0] < 0 and blk2[4:260].view(np.int8)[-1] == -127


@pytest.mark.oracle
@pytest.mark.parametrize("seed", [0, 1])
def test_quantize_f16_matches_gguf(seed):
    """Random f32 bit patterns (every exponent, inf, NaN, subnormals) and values at and
    around every rounding tie of the 13 dropped bits."""
    rng = np.random.default_rng(16 + seed)
    bits = rng.integers(0, 2**32, size=1 << 17, dtype=np.uint64).astype(np.uint32)
    top = rng.integers(0, 2**19, size=1 << 15, dtype=np.uint64).astype(np.uint32) << np.uint32(13)
    ties = (top[:, None] | np.array([0, 1, 0x0FFF, 0x1000, 0x1001, 0x1FFF], np.uint32)).ravel()
    x = np.concatenate([bits, ties]).view(np.float32).reshape(4, -1)
    with np.errstate(over="ignore", invalid="ignore"):
        want = gguf_quantize(x, T.F16).view(np.uint16)
    got = quant_rows(T.F16, x).view(np.uint16)
    assert_same_f16_bits(got, want)


@pytest.mark.oracle
@pytest.mark.parametrize("seed", [0, 1])
def test_quantize_bf16_matches_gguf(seed):
    """Random bit patterns (NaN kept quiet, inf, subnormals) and every tie of the low 16 bits."""
    rng = np.random.default_rng(30 + seed)
    bits = rng.integers(0, 2**32, size=1 << 17, dtype=np.uint64).astype(np.uint32)
    top = rng.integers(0, 2**16, size=1 << 14, dtype=np.uint64).astype(np.uint32) << np.uint32(16)
    ties = (top[:, None] | np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)).ravel()
    x = np.concatenate([bits, ties]).view(np.float32).reshape(4, -1)
    want = gguf_quantize(x, T.BF16)
    assert np.array_equal(quant_rows(T.BF16, x), want)


@pytest.mark.oracle
def test_quantize_f32_is_a_bit_copy():
    rng = np.random.default_rng(32)
    x = rng.integers(0, 2**32, size=(2, 4096), dtype=np.uint64).astype(np.uint32).view(np.float32)
    got = quant_rows(T.F32, x)
    assert np.array_equal(got, gguf_quantize(x, T.F32).view(np.uint8).reshape(2, -1))
    assert_same_f32(dequant_rows(T.F32, got), x)
    assert np.array_equal(dequant_rows(T.F32, got).view(np.uint32), x.view(np.uint32))


@pytest.mark.parametrize(("qtype", "rel"), [(T.Q8_0, tol.Q8_0_ROUNDTRIP_REL),
                                            (T.Q8_1, tol.Q8_0_ROUNDTRIP_REL),
                                            (T.Q8_K, tol.Q8_K_ROUNDTRIP_REL)],
                         ids=ids([T.Q8_0, T.Q8_1, T.Q8_K]))
def test_activation_round_trip_error(qtype, rel):
    block = SIZES[qtype][0]
    rng = np.random.default_rng(int(qtype))
    # d = amax/127 must stay a normal fp16: block magnitudes 10^[-1, 3] (spikes x1000)
    x = activations(rng, rows=2, n=256 * 8, block=block, lo=-1, hi=3)
    back = dequant_rows(qtype, quant_rows(qtype, x))
    xb, bb = x.reshape(-1, block).astype(np.float64), back.reshape(-1, block).astype(np.float64)
    amax = np.abs(xb).max(axis=1, keepdims=True)
    assert np.all(np.abs(xb - bb) <= rel * amax)


@pytest.mark.parametrize(("qtype", "rel"), [(T.F16, tol.F16_ROUNDTRIP_REL),
                                            (T.BF16, tol.BF16_ROUNDTRIP_REL)],
                         ids=ids([T.F16, T.BF16]))
def test_float_round_trip_error(qtype, rel):
    rng = np.random.default_rng(int(qtype))
    # magnitudes across the normal fp16 range [2^-14, 2^15.9]
    x = (rng.choice([-1.0, 1.0], 4096) * 2.0 ** rng.uniform(-14, 15.9, 4096)).astype(np.float32)
    back = dequant_rows(qtype, quant_rows(qtype, x[None]))[0]
    assert np.all(np.abs(back.astype(np.float64) - x) <= rel * np.abs(x))


# ---- bad arguments: errors, never crashes ---------------------------------------------------

@pytest.mark.parametrize("tid", [16, 99, -1, 42, 1000, 2**31 - 1])
def test_unknown_type_ids_raise_unavailable(tid):
    with pytest.raises(UnavailableError):
        _native.type_traits(tid)
    with pytest.raises(UnavailableError):
        _native.dequantize_row(tid, bytes(1024), 32)
    with pytest.raises(UnavailableError):
        _native.quantize_row(tid, np.zeros(32, np.float32))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_K, T.IQ4_XS, T.MXFP4], ids=ids([T.Q4_0, T.Q4_K, T.IQ4_XS, T.MXFP4]))
def test_n_not_a_multiple_of_the_block(qtype):
    block_size, type_size = SIZES[qtype]
    with pytest.raises(NativeError, match="multiple of the block size") as e:
        _native.dequantize_row(qtype, bytes(4 * type_size), block_size + 1)
    assert e.value.code == _native.lib.LE_ERR_INVALID_ARG
    assert "dispatch.c:" in str(e.value)


def test_negative_n_and_short_buffers_raise_value_error():
    with pytest.raises(ValueError):
        _native.dequantize_row(T.Q8_0, bytes(34), -32)
    with pytest.raises(ValueError, match="need 68 bytes"):
        _native.dequantize_row(T.Q8_0, bytes(34), 64)
    with pytest.raises(ValueError):
        _native.quantize_row(T.Q8_K, np.zeros(100, np.float32))


def test_quantize_to_a_weight_type_is_unsupported():
    with pytest.raises(NativeError, match="no quantiser for q4_K") as e:
        _native.quantize_row(T.Q4_K, np.zeros(256, np.float32))
    assert e.value.code == _native.lib.LE_ERR_UNSUPPORTED
    assert isinstance(e.value, EngineError)


def test_c_entry_points_validate_arguments():
    """The C API itself (no Python checks in front): status codes and messages, no crash."""
    ffi, lib = _native.ffi, _native.lib
    src = ffi.new("char[]", 4096)
    dst = ffi.new("float[]", 1024)
    cases = [
        (lambda: lib.le_dequantize_row(T.Q8_0, ffi.NULL, dst, 32), lib.LE_ERR_INVALID_ARG, "src is NULL"),
        (lambda: lib.le_dequantize_row(T.Q8_0, src, ffi.NULL, 32), lib.LE_ERR_INVALID_ARG, "dst is NULL"),
        (lambda: lib.le_dequantize_row(T.Q8_0, src, dst, -32), lib.LE_ERR_INVALID_ARG, "negative"),
        (lambda: lib.le_dequantize_row(T.Q6_K, src, dst, 255), lib.LE_ERR_INVALID_ARG, "multiple"),
        (lambda: lib.le_dequantize_row(16, src, dst, 256), lib.LE_ERR_UNSUPPORTED, "type id 16"),
        (lambda: lib.le_dequantize_row(-5, src, dst, 32), lib.LE_ERR_UNSUPPORTED, "type id -5"),
        (lambda: lib.le_quantize_row(99, dst, src, 32), lib.LE_ERR_UNSUPPORTED, "type id 99"),
        (lambda: lib.le_quantize_row(T.Q8_K, dst, src, 32), lib.LE_ERR_INVALID_ARG, "multiple"),
        (lambda: lib.le_quantize_row(T.Q8_0, ffi.NULL, src, 32), lib.LE_ERR_INVALID_ARG, "src is NULL"),
        (lambda: lib.le_quantize_row(T.IQ4_NL, dst, src, 32), lib.LE_ERR_UNSUPPORTED, "no quantiser"),
        (lambda: lib.le_type_traits(T.Q4_K, ffi.NULL), lib.LE_ERR_INVALID_ARG, "NULL"),
        (lambda: lib.le_type_traits(16, ffi.new("le_type_info *")), lib.LE_ERR_UNSUPPORTED, "type id 16"),
    ]
    for i, (call, want_code, want_msg) in enumerate(cases):
        lib.le_clear_error()
        code = call()
        msg = ffi.string(lib.le_last_error()).decode()
        assert code == want_code, (i, msg)
        assert want_msg in msg and "dispatch.c:" in msg, (i, msg)
    # n == 0 is a valid empty row
    assert lib.le_dequantize_row(T.Q4_K, src, dst, 0) == lib.LE_OK
    assert lib.le_quantize_row(T.Q8_0, dst, src, 0) == lib.LE_OK


def test_fp16_scalar_helpers():
    lib = _native.lib
    assert lib.le_fp32_to_fp16(65504.0) == 0x7BFF
    assert lib.le_fp32_to_fp16(65520.0) == 0x7C00          # the first value rounding to inf
    assert lib.le_fp32_to_fp16(2.0**-25) == 0x0000          # tie between 0 and 2^-24: even
    assert lib.le_fp32_to_fp16(-(2.0**-24)) == 0x8001
    assert lib.le_fp16_to_fp32(0x0001) == 2.0**-24
    assert lib.le_fp16_to_fp32(0x7BFF) == 65504.0
