"""GEMV weight streaming of every integer dot-product kernel (cpu_simd/), per weight type x ISA tier, one thread.

    python -m pytest benchmarks/bench_gemv.py --benchmark-enable     # timings + extra_info (GB/s, % of bandwidth)
    python -m pytest benchmarks/bench_gemv.py                        # plain tests: one small run each
    python benchmarks/bench_gemv.py [--mib 256] [--reps 5]           # a table, with llama.cpp's kernels beside

What is timed: W @ a for a weight matrix of `rows` rows of N = 65536 elements (~256 MiB, 8x this box's L3, so the
weights come from DRAM), one le_vec_dot call per row from Python (legacy_engine.core._native.vec_dot_rows) with the
activation row already quantised (it stays in L2: 70 KiB of Q8_K). Bytes counted: the weight bytes, read once.
Rows are long so the per-call cost of Python + cffi (measured as the same loop with n = 0, `call_overhead_us` in
extra_info) is a few percent of a row; `gbps` is raw, `gbps_kernel` subtracts that overhead. The roofline is the
single-thread read bandwidth from the probe of benchmarks/bandwidth.py (legacy_engine.tools.bench.read_bandwidth),
measured once per session: `bandwidth_GBps`, and `pct_of_bandwidth` = 100 x gbps_kernel / bandwidth_GBps
(the table prints the same pair per cell).
A tier without its own kernel for a type (it would fall back) is skipped, never timed under the wrong name.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from a checkout without installing

from legacy_engine.core import _native  # noqa: E402
from legacy_engine.tools.bench import read_bandwidth  # noqa: E402

pytestmark = pytest.mark.cpu

N = 65536                                   # elements per row: long rows amortise the per-call cost
ACT = {T.Q4_0: T.Q8_0, T.Q4_1: T.Q8_1, T.Q5_0: T.Q8_0, T.Q5_1: T.Q8_1, T.Q8_0: T.Q8_0,
       T.Q2_K: T.Q8_K, T.Q3_K: T.Q8_K, T.Q4_K: T.Q8_K, T.Q5_K: T.Q8_K, T.Q6_K: T.Q8_K,
       T.IQ4_NL: T.Q8_0, T.IQ4_XS: T.Q8_K, T.MXFP4: T.Q8_0}
# fp16 scale fields per block (byte offsets): set to sane values so no f32 op sees NaN, inf or denormals
SCALE_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.Q2_K: [80, 82],
                T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208], T.IQ4_NL: [0], T.IQ4_XS: [0]}
TYPES = list(ACT)
ISAS = _native.ISA_NAMES
CASES = [(t, isa) for t in TYPES for isa in ISAS]


def name(t: T) -> str:
    return t.name.lower().replace("_k", "_K")


def make_weights(raw: np.ndarray, qtype: T, n: int) -> tuple[np.ndarray, int]:
    """The largest whole number of rows of `qtype` (n elements each) in `raw`, scales made sane in place."""
    tr = _native.type_traits(qtype)
    rb = n // tr["block_size"] * tr["type_size"]
    rows = raw.size // rb
    w = raw[:rows * rb]
    blocks = w.reshape(-1, tr["type_size"])
    if qtype == T.MXFP4:
        blocks[:, 0] = 120 + (blocks[:, 0] & 7)                # 2^-8 .. 2^-1
    half = np.array([0.01], np.float16).view(np.uint8)
    for off in SCALE_FIELDS.get(qtype, []):
        blocks[:, off], blocks[:, off + 1] = half[0], half[1]
    return w, rows


def activations(qtype: T, n: int) -> bytes:
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    return _native.quantize_row(ACT[qtype], x)


def call_overhead_s(qtype: T, w: np.ndarray, y: bytes, rows: int) -> float:
    """Seconds per row of the Python loop itself: the same calls with n = 0 (the kernel returns at once)."""
    k = min(rows, 2000)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        _native.vec_dot_rows(qtype, w, y, 0, k)
        best = min(best, time.perf_counter() - t0)
    return best / k


def select(qtype: T, isa: str) -> None:
    if not _native.isa_supported(isa):
        pytest.skip(f"this CPU cannot run {isa} kernels")
    _native.set_isa(isa)
    if _native.kernel_isa(qtype) != isa:
        pytest.skip(f"no {isa} kernel for {name(qtype)} (falls back to {_native.kernel_isa(qtype)})")


# ---- pytest-benchmark --------------------------------------------------------------------------------------------

def _timing(config) -> bool:
    """pytest-benchmark's rule: --benchmark-enable wins over the --benchmark-disable of pyproject's addopts."""
    return config.getoption("benchmark_enable", default=False) or not config.getoption("benchmark_disable",
                                                                                        default=True)


@pytest.fixture(scope="session")
def weight_bytes(request):
    """One random buffer shared by every case: 256 MiB when timing, 2 MiB for the plain one-run tests."""
    mib = 2 if not _timing(request.config) else int(os.environ.get("LE_BENCH_GEMV_MIB", "256"))
    return np.random.default_rng(0).integers(0, 256, size=mib << 20, dtype=np.uint8)


@pytest.fixture(scope="session")
def bandwidth_gbps(request):
    """Single-thread read GB/s (the kernels run on one thread) when timing, else None."""
    if not _timing(request.config):
        return None
    return read_bandwidth(1, size_mib=512, reps=3)


@pytest.fixture
def restore_isa():
    prev = _native.get_isa()
    yield
    _native.set_isa(prev)


@pytest.mark.parametrize("qtype,isa", CASES, ids=[f"{name(t)}-{isa}" for t, isa in CASES])
def test_gemv(benchmark, qtype, isa, weight_bytes, bandwidth_gbps, restore_isa):
    select(qtype, isa)
    w, rows = make_weights(weight_bytes, qtype, N)
    y = activations(qtype, N)
    out = benchmark.pedantic(_native.vec_dot_rows, args=(qtype, w, y, N, rows), rounds=5, warmup_rounds=1)
    assert out.shape == (rows,) and np.isfinite(out).all()
    overhead = call_overhead_s(qtype, w, y, rows)
    info = {"type": name(qtype), "isa": isa, "rows": rows, "n": N, "weight_bytes": int(w.size),
            "act_bytes_per_row": len(y), "call_overhead_us": overhead * 1e6,
            "flops": 2 * rows * N}
    if benchmark.stats is not None:
        t = benchmark.stats.stats.min
        info["gbps"] = w.size / t / 1e9
        info["gbps_kernel"] = w.size / max(t - overhead * rows, 1e-9) / 1e9
        if bandwidth_gbps:
            info["bandwidth_GBps"] = bandwidth_gbps
            info["pct_of_bandwidth"] = 100 * info["gbps_kernel"] / bandwidth_gbps
    benchmark.extra_info.update(info)


# ---- the table (python benchmarks/bench_gemv.py) -----------------------------------------------------------------

def _ggml_kernels():
    """llama.cpp's own CPU vec_dot (its best compiled variant) through ctypes, or None."""
    try:
        import llama_cpp
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-cpu.so")
    if not os.path.exists(path):
        return None
    lib = ctypes.CDLL(path)
    lib.ggml_cpu_init()
    return lib


def _time_ggml(lib, qtype: T, w: np.ndarray, y: bytes, rows: int, reps: int) -> float | None:
    fn = getattr(lib, f"ggml_vec_dot_{name(qtype)}_{name(ACT[qtype])}", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                   ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    rb = w.size // rows
    base, yb = w.ctypes.data, ctypes.c_char_p(y)
    out = ctypes.c_float()
    po = ctypes.addressof(out)

    def loop(n):
        for r in range(rows):
            fn(n, po, 0, base + r * rb, 0, yb, 0, 1)
    best, zero = float("inf"), float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        loop(N)
        best = min(best, time.perf_counter() - t0)
        t0 = time.perf_counter()
        loop(0)
        zero = min(zero, time.perf_counter() - t0)
    return w.size / max(best - zero, 1e-9) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="GEMV GB/s per type x ISA (one thread)")
    ap.add_argument("--mib", type=int, default=256, help="weight matrix size (default 256 MiB)")
    ap.add_argument("--reps", type=int, default=5, help="passes; the best counts")
    args = ap.parse_args(argv)
    raw = np.random.default_rng(0).integers(0, 256, size=args.mib << 20, dtype=np.uint8)
    bw = read_bandwidth(1, size_mib=max(args.mib, 512), reps=3)
    ggml = _ggml_kernels()
    isas = [i for i in ISAS if _native.isa_supported(i)]
    prev = _native.get_isa()
    print(f"GEMV, {args.mib} MiB of weights, rows of {N}, one thread; GB/s of weights read (per-call Python "
          f"overhead subtracted) and % of the single-thread read bandwidth, {bw:.1f} GB/s (bandwidth.py's probe)")
    print(f"{'type':>8} " + " ".join(f"{i:>18}" for i in isas) + (f"  {'ggml(best)':>18}" if ggml else "")
          + "   overhead")
    for t in TYPES:
        w, rows = make_weights(raw, t, N)
        y = activations(t, N)
        cells = []
        for isa in isas:
            _native.set_isa(isa)
            if _native.kernel_isa(t) != isa:
                cells.append(f"{'-':>18}")
                continue
            _native.vec_dot_rows(t, w, y, N, rows)            # warm-up
            best = min(_timed(_native.vec_dot_rows, t, w, y, N, rows) for _ in range(args.reps))
            ov = call_overhead_s(t, w, y, rows)
            cells.append(_cell(w.size / max(best - ov * rows, 1e-9) / 1e9, bw))
        g = _time_ggml(ggml, t, w, y, rows, args.reps) if ggml else None
        gcell = ("  " + (_cell(g, bw) if g else f"{'-':>18}")) if ggml else ""
        print(f"{name(t):>8} " + " ".join(cells) + gcell + f"   {ov * 1e6:.2f} us/row")
    _native.set_isa(prev)
    return 0


def _cell(gbps: float, bw: float) -> str:
    return f"{gbps:7.2f} GB/s {100 * gbps / bw:3.0f} %"


def _timed(f, *a) -> float:
    t0 = time.perf_counter()
    f(*a)
    return time.perf_counter() - t0


if __name__ == "__main__":
    raise SystemExit(main())
