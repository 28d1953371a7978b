"""cuda8 kernels and the driver API (native/gpu.c, legacy_engine/gpu.py).

Here (no GPU): PTX builds of every source for every tier with nvcc and with the NVRTC wheels, what each tier's
PTX may and may not contain, the PTX cache and prebuilt folders, ptxas on real sm_35/61/70 (slow), the CUDA-8 lint,
and "no driver" -> UnavailableError.
On a GPU (marker gpu): every kernel x tier variant against f64 math on the same inputs (weights dequantised by
the C reference le_dequantize_row), the VRAM budget, a bad PTX's JIT log, copies, streams, events and launch errors.

GPU machine, one command (after `pip install -e .`; nvcc there builds the sm_90 variants, the legacy ones come
prebuilt from this box: python -m legacy_engine.gpu build --out DIR):
    LE_PTX_DIR=DIR LE_GPU_STRICT=1 python -m pytest tests/test_gpu.py -m gpu
LE_GPU_STRICT=1 turns "this variant cannot be built here" into a failure instead of a skip.
Tolerances: tests/tolerances.py (GPU_*). Needs neither torch nor gguf.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from legacy_engine import _native, gpu
from legacy_engine.errors import NativeError, UnavailableError

import lint_cuda8
import tolerances as tol

lib = _native.lib
STRICT = os.environ.get("LE_GPU_STRICT") == "1"

# fp16 fields of each block (byte offsets): set to sane values in random blocks
HALF_FIELDS = {2: [0], 8: [0], 12: [0, 2], 13: [0, 2], 14: [208], 23: [0]}
# types with a min term: the byte range of the quant bits (zeroed, the reference dequantises to -m)
QUANT_BYTES = {12: (16, 144), 13: (16, 176)}
Q8_1_GPU = np.dtype([("d", "<f2"), ("s", "<f2"), ("qs", "i1", 32)])   # quantize_q8_1.cu's layout


def _gpu_state() -> tuple[bool, str, int]:
    try:
        ok, why = gpu.available()
    except Exception as e:     # pragma: no cover - a broken driver install
        return False, str(e), 90
    return ok, why, gpu.device_arch() if ok else 90


GPU_OK, GPU_WHY, NATIVE_ARCH = _gpu_state()
VARIANTS = list(gpu.LEGACY_VARIANTS) + [(t, NATIVE_ARCH) for t in gpu.TIERS]
VIDS = [gpu.variant_name(t, a) for t, a in VARIANTS]
TYPES = list(gpu.GPU_TYPES)


def tname(qtype: int) -> str:
    return gpu.GPU_TYPES[qtype][0]


# ================================================================================================ CPU side

@pytest.mark.cpu
def test_lint_cuda8_clean():
    assert lint_cuda8.lint() == []


@pytest.mark.cpu
def test_lint_cuda8_catches_each_rule():
    """Negative control: every rule fires on a file that breaks it (and comments are ignored)."""
    bad = """
#include <cooperative_groups.h>
// __shfl_xor_sync(0xffffffff, v, 1) in a comment is fine
__device__ auto f(int x) { return x; }
__device__ auto g(int x) -> int { return x; }
constexpr int h(int n) { int s = 0; for (int i = 0; i < n; i++) s += i; return s; }
constexpr int fine(int n) { return 2 * n; }
template <typename T> constexpr T pi = T(3);
__global__ void k(float *x) {
    __shared__ float big[13000];
    x[0] = __shfl_xor_sync(0xffffffff, x[0], 1) + __shfl_down(x[0], 1) + __ldg(x) + 0b101 + 1'000;
#if __CUDA_ARCH__ >= 610
    int a = __dp4a(1, 2, 3); __half hh; auto l = [](auto v) { return v; }; auto m = [y = 2]() { return y; };
    __syncwarp();
#endif
}
"""
    found = "\n".join(lint_cuda8.lint_text("bad.cu", bad))
    for what in ("*_sync", "warp shuffle", "__ldg", "__dp4a", "raw arch", "__half", "cooperative", "generic lambda",
                 "init-capture", "variable template", "binary literal", "digit separator", "auto return",
                 "constexpr function", "48 KB"):
        assert what in found, f"lint missed {what}:\n{found}"
    assert "bad.cu:3:" not in found and "bad.cu:5:" not in found and "bad.cu:7:" not in found, found
    # compat.cuh may use the intrinsics, never cooperative groups
    assert lint_cuda8.lint_text("compat.cuh", "__shfl_xor_sync(0xffffffffu, v, 1); __ldg(p);") == []


@pytest.mark.cpu
def test_shared_memory_fits_fermi():
    sizes = lint_cuda8.shared_report()
    assert set(sizes) >= {f"{s}.cu" for s in gpu.SOURCES}
    assert all(0 < b <= 48 * 1024 for b in sizes.values()), sizes


def _toolchain(kind: str, arch: int):
    try:
        return gpu.pick_toolchain(arch, kind)
    except UnavailableError as e:
        pytest.skip(str(e))


def _entries(ptx: bytes) -> set[bytes]:
    return set(re.findall(rb"\.entry\s+(\w+)", ptx))


def expected_entries(name: str) -> set[str]:
    per_type = {"gemv_f32": "gemv_f32_", "gemv_dp4a": "gemv_dp4a_", "gemm_f32": "gemm_f32_"}
    if name in per_type:
        out = {per_type[name] + tname(t) for t in TYPES}
    else:
        out = {{"rmsnorm": "rmsnorm_f32", "quantize_q8_1": "quantize_q8_1"}[name]}
    return {e.encode() for e in out} | {b"le_tier_probe"}


@pytest.mark.cpu
@pytest.mark.parametrize("tier", list(gpu.TIERS))
@pytest.mark.parametrize("name", gpu.SOURCES)
def test_ptx_nvcc(name, tier):
    """Every source x tier with the machine's nvcc at its lowest target (nvcc 13: compute_75)."""
    low = None
    try:
        chains = [t for t in gpu.find_toolchains() if t.kind == "nvcc"]
        low = chains[0].archs[0] if chains else None
    except IndexError:
        pass
    if low is None:
        pytest.skip("no nvcc on PATH or in /usr/local/cuda")
    arch = max(low, gpu.TIERS[tier][1])
    path, tc = gpu.build_ptx(name, tier, arch, "nvcc")
    ptx = path.read_bytes()
    assert f".target sm_{arch}".encode() in ptx and tc.kind == "nvcc"
    assert expected_entries(name) <= _entries(ptx)


@pytest.mark.cpu
@pytest.mark.parametrize("tier,arch", gpu.LEGACY_VARIANTS, ids=[gpu.variant_name(*v) for v in gpu.LEGACY_VARIANTS])
@pytest.mark.parametrize("name", gpu.SOURCES)
def test_ptx_nvrtc(name, tier, arch):
    """The legacy variants with NVRTC 11.8 (compute_35) / 12.9 (compute_61, 70), loaded from the PyPI wheels."""
    _toolchain("nvrtc", arch)
    path, tc = gpu.build_ptx(name, tier, arch, "nvrtc")
    ptx = path.read_bytes()
    assert f".target sm_{arch}".encode() in ptx and tc.kind == "nvrtc"
    assert expected_entries(name) <= _entries(ptx)


def _tier_ptx(tier: str, arch: int, kind: str = "auto") -> dict[str, bytes]:
    _toolchain(kind, arch)
    return {n: gpu.build_ptx(n, tier, arch, kind)[0].read_bytes() for n in gpu.SOURCES}


# PTX instructions (not names: the kernels gemv_dp4a_* are called so on every tier)
SHFL, LDG_NC, DP4A = rb"\bshfl\.", rb"\bld\.global\.nc\.", rb"\bdp4a\."


def has(pattern: bytes, ptx: bytes) -> bool:
    return re.search(pattern, ptx) is not None


@pytest.mark.cpu
@pytest.mark.parametrize("tier,arch", gpu.LEGACY_VARIANTS, ids=[gpu.variant_name(*v) for v in gpu.LEGACY_VARIANTS])
def test_ptx_uses_only_its_tier(tier, arch):
    """The instructions in each tier's PTX are the tier's: fermi none of shfl / ld.global.nc / dp4a, kepler shfl and
    ld.global.nc but no dp4a, dp4a all three. (On targets >= sm_61 the compiler may turn le_dp4a's byte loop into
    dp4a by itself, so the dp4a check on lower tiers is made at compute_35, where the instruction does not exist.)"""
    ptx = _tier_ptx(tier, arch)
    allp = b"".join(ptx.values())
    if tier == "fermi":
        assert not has(SHFL, allp) and not has(LDG_NC, allp) and not has(DP4A, allp)
        assert b"bar.sync" in ptx["gemv_f32"]
    elif tier == "kepler":
        assert has(SHFL, ptx["gemv_f32"]) and has(LDG_NC, ptx["gemv_f32"]) and not has(DP4A, allp)
    else:
        assert has(DP4A, ptx["gemv_dp4a"]) and has(SHFL, ptx["gemv_dp4a"]) and has(LDG_NC, ptx["gemv_dp4a"])


@pytest.mark.cpu
def test_ptx_forced_fermi_on_new_target():
    """-DLE_FORCE_TIER lowers the path on a new target too (nvcc 13, compute_75): no shuffles, no read-only loads."""
    chains = [t for t in gpu.find_toolchains() if t.kind == "nvcc"]
    if not chains:
        pytest.skip("no nvcc")
    arch = chains[0].archs[0]
    allp = b"".join(_tier_ptx("fermi", arch, "nvcc").values())
    assert not has(SHFL, allp) and not has(LDG_NC, allp)


@pytest.mark.cpu
def test_ptx_cache_and_prebuilt_folder(tmp_path, monkeypatch):
    chains = gpu.find_toolchains()
    if not chains:
        pytest.skip("no CUDA toolchain here")
    tc = chains[0]
    arch = max(tc.archs[0], 35)
    monkeypatch.setenv("LE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("LE_PTX_DIR", raising=False)
    p1, _ = gpu.build_ptx("rmsnorm", "fermi", arch, tc.name)
    mtime = p1.stat().st_mtime_ns
    p2, _ = gpu.build_ptx("rmsnorm", "fermi", arch, tc.name)
    assert p1 == p2 and p2.stat().st_mtime_ns == mtime, "second build must come from the cache"
    assert gpu.source_hash("rmsnorm")[:16] in p1.name and tc.name in p1.name

    out = tmp_path / "ptx"
    recs = gpu.build_kernels(out=out, variants=[("fermi", arch)], toolchain=tc.name)
    assert all("ptx" in r for r in recs)
    manifest = json.loads((out / "manifest.json").read_text())
    assert {m["name"] for m in manifest} == set(gpu.SOURCES)
    monkeypatch.setenv("LE_PTX_DIR", str(out))
    data, origin = gpu.get_ptx("rmsnorm", "fermi", arch)
    assert origin.startswith("prebuilt") and data == p1.read_bytes()
    # a manifest whose sources changed is refused, with what to do
    for m in manifest:
        m["source_hash"] = "0" * 64
    (out / "manifest.json").write_text(json.dumps(manifest))
    path, why = gpu.prebuilt_ptx("rmsnorm", "fermi", arch)
    assert path is None and "stale" in why and "build --out" in why


@pytest.mark.cpu
def test_nvrtc_compile_error_carries_log(tmp_path, monkeypatch):
    chains = gpu.find_toolchains()
    if not chains:
        pytest.skip("no CUDA toolchain here")
    tc = chains[-1]
    bad = tmp_path / "broken.cu"
    bad.write_text('#include "compat.cuh"\nextern "C" __global__ void broken(float *x) { x[0] = undefined_name; }\n')
    monkeypatch.setattr(gpu, "CUDA_DIR", tmp_path)
    (tmp_path / "compat.cuh").write_text((gpu.ROOT / "cuda8" / "compat.cuh").read_text())
    with pytest.raises(gpu.KernelBuildError, match="undefined_name"):
        tc.compile("broken", "fermi", max(tc.archs[0], 35))


@pytest.mark.cpu
def test_unknown_tier_and_bad_arch():
    with pytest.raises(ValueError, match="unknown tier"):
        gpu.build_ptx("rmsnorm", "volta", 70)
    with pytest.raises(ValueError, match="compute_61"):
        gpu.build_ptx("rmsnorm", "dp4a", 35)


@pytest.mark.cpu
@pytest.mark.slow
def test_ptxas_fits_the_legacy_chips():
    """Assemble every legacy variant into a real cubin for its own chip (sm_35 / sm_61 / sm_70) with ptxas from the
    nvidia-cuda-nvcc-cu11 / -cu12 wheels: proof that the code fits (registers, shared memory, no spills).
    The fermi tier must also fit Fermi's 63 registers per thread (assembled for sm_35, the lowest we can)."""
    if not gpu.find_ptxas():
        pytest.skip("no ptxas (python -m legacy_engine.gpu install-toolchains)")
    try:
        rows = gpu.ptxas_table()
    except UnavailableError as e:
        pytest.skip(str(e))
    assert {r["sm"] for r in rows} == {35, 61, 70}
    lines = [f"{r['variant']:<12} ptxas {r['ptxas']:<5} {r['kernel']:<18} regs {r['regs']:>3} smem {r['smem']:>5} "
             f"spill {r['spill_stores'] + r['spill_loads']}" for r in rows]
    print("\n" + "\n".join(lines))
    for r in rows:
        assert r["regs"] <= 255 and r["smem"] <= 48 * 1024, r
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        if r["variant"].startswith("fermi"):
            assert r["regs"] <= 63, f"{r['kernel']} needs {r['regs']} registers; Fermi has 63"


@pytest.mark.cpu
def test_no_driver_is_unavailable():
    """Without libcuda every GPU entry point raises UnavailableError naming the reason (a subprocess, since the
    driver is loaded once per process)."""
    code = ("from legacy_engine import gpu\nfrom legacy_engine.errors import UnavailableError\n"
            "print(gpu.available())\n"
            "for f in (gpu.init, lambda: gpu.Kernels('fermi', 35), lambda: gpu.Buffer(16)):\n"
            "    try:\n        f()\n    except UnavailableError as e:\n        print('UNAVAILABLE', e)\n")
    env = dict(os.environ, LE_CUDA_LIB="/nonexistent/libcuda.so.1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, encoding="utf-8", errors="replace", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "(False, 'LE_CUDA_LIB=/nonexistent/libcuda.so.1 cannot be opened')" in r.stdout
    assert r.stdout.count("UNAVAILABLE") == 3, r.stdout


@pytest.mark.cpu
def test_gpu_calls_before_init_are_errors():
    if _native.gpu_current_device() >= 0:
        pytest.skip("a GPU is open in this process")
    with pytest.raises((NativeError, UnavailableError)):
        _native.gpu_alloc(16)


# ================================================================================================ references

def random_weights(rng, qtype: int, nrows: int, ncols: int) -> np.ndarray:
    """nrows x ncols random weights of `qtype` as bytes; fp16 scales in ±[2^-7, 2^-5] (no inf/NaN)."""
    _, bs, ts = gpu.GPU_TYPES[qtype]
    nb = nrows * ncols // bs
    raw = rng.integers(0, 256, size=(nb, ts), dtype=np.uint8)
    for off in HALF_FIELDS[qtype]:
        h = (rng.uniform(1, 4, nb) * rng.choice([-1.0, 1.0], nb) * 2.0**-7).astype(np.float16)
        raw[:, off:off + 2] = h.view(np.uint8).reshape(nb, 2)
    return raw.reshape(-1)


def dequant(qtype: int, w: np.ndarray, nrows: int, ncols: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (W f64 [nrows, ncols] by the C reference, m f64 [nrows, ncols]: the min term of each element)."""
    W = _native.dequantize_row(qtype, w, nrows * ncols).astype(np.float64).reshape(nrows, ncols)
    m = np.zeros_like(W)
    if qtype in QUANT_BYTES:
        a, b = QUANT_BYTES[qtype]
        z = w.reshape(-1, gpu.GPU_TYPES[qtype][2]).copy()
        z[:, a:b] = 0
        m = -_native.dequantize_row(qtype, z.reshape(-1), nrows * ncols).astype(np.float64).reshape(nrows, ncols)
    return W, m


def quantize_q8_1_gpu_ref(x: np.ndarray):
    """quantize_q8_1.cu in numpy: per 32, d = f32(amax/127), q = roundf(f32(x/d)) (half away from zero) ->
    (d as fp16, q int8 [n/32, 32], sum of x in f64)."""
    xb = x.reshape(-1, 32).astype(np.float32)
    amax = np.abs(xb).max(axis=1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = (xb / d[:, None]).astype(np.float32).astype(np.float64)
    q = np.where(amax[:, None] == 0, 0.0, np.sign(v) * np.floor(np.abs(v) + 0.5))
    return d.astype(np.float16), q.astype(np.int8), xb.astype(np.float64).sum(axis=1)


def gemv_shapes(qtype: int) -> list[tuple[int, int]]:
    """(nrows, ncols): one block per row (most lanes idle), and more sub-blocks than lanes (lanes loop)."""
    bs = gpu.GPU_TYPES[qtype][1]
    return [(5, bs), (37, 70 * 32 if bs == 32 else 9 * 256)]


def assert_close_sum(got, ref, magnitude, chain, what):
    bound = (chain + tol.GPU_SUM_EXTRA_ROUNDINGS) * tol.GPU_SUM_U * magnitude
    err = np.abs(got.astype(np.float64) - ref)
    bad = np.nonzero(err > bound)[0]
    assert bad.size == 0, (f"{what}: {bad.size} of {err.size} outside the bound; first at {bad[0]}: got {got.flat[bad[0]]}"
                           f" want {ref.flat[bad[0]]} (err {err.flat[bad[0]]:.3g} > {bound.flat[bad[0]]:.3g})")


# ================================================================================================ GPU side

@pytest.fixture(scope="session")
def gpu_device():
    if not GPU_OK:
        pytest.skip(f"no GPU: {GPU_WHY}")
    return gpu.init()


_KERNELS: dict[tuple[str, int], object] = {}


@pytest.fixture
def kernels(gpu_device, request):
    """The Kernels of one variant (session-cached); skips (or fails with LE_GPU_STRICT=1) when it cannot be had."""
    tier, arch = request.param
    key = (tier, arch)
    if key not in _KERNELS:
        if arch > NATIVE_ARCH:
            pytest.skip(f"compute_{arch} PTX does not run on sm_{NATIVE_ARCH}")
        try:
            _KERNELS[key] = gpu.Kernels(tier, arch)
        except UnavailableError as e:
            _KERNELS[key] = e
    k = _KERNELS[key]
    if isinstance(k, Exception):
        (pytest.fail if STRICT else pytest.skip)(f"{gpu.variant_name(tier, arch)}: {k}")
    return k


def variant_params():
    return pytest.mark.parametrize("kernels", VARIANTS, ids=VIDS, indirect=True)


@pytest.mark.gpu
@variant_params()
def test_tier_probe(kernels):
    """The loaded code is the tier's code: __CUDA_ARCH__ of the target, the effective tier, the features in use."""
    for name in gpu.SOURCES:
        p = kernels.probe(name)
        assert p["arch"] == kernels.arch * 10
        want = {"fermi": 200, "kepler": 350 if kernels.arch >= 35 else kernels.arch * 10}.get(kernels.tier,
                                                                                              kernels.arch * 10)
        assert p["tier_cc"] == want, (name, p)
        feats = set(p["features"]) - {"sync"}
        assert feats == {"fermi": set(), "kepler": {"shfl", "ldg"}, "dp4a": {"shfl", "ldg", "dp4a"}}[kernels.tier]
        assert ("sync" in p["features"]) == (kernels.tier != "fermi" and p["compiler"] >= 900)
    info = kernels.modules["gemv_f32"].kernel("gemv_f32_q4_K").info()
    assert info["ptx_version"] == kernels.arch and info["binary_version"] == NATIVE_ARCH and info["num_regs"] > 0


@pytest.mark.gpu
@variant_params()
def test_rmsnorm(kernels):
    rng = np.random.default_rng(1)
    for nrows, ncols, with_w in ((3, 4096, True), (2, 1000, False), (70000, 64, True)):   # 70000 > 65535: grid-stride
        x = (rng.standard_normal((nrows, ncols)) * rng.uniform(0.1, 10, (nrows, 1))).astype(np.float32)
        w = rng.uniform(0.5, 1.5, ncols).astype(np.float32)
        eps = 1e-6
        xd = x.astype(np.float64)
        ref = xd / np.sqrt((xd * xd).mean(axis=1, keepdims=True) + eps) * (w if with_w else 1.0)
        with gpu.Buffer.from_array(x) as bx, gpu.Buffer.from_array(w) as bw, gpu.Buffer(x.nbytes) as by:
            kernels.rmsnorm(bx, bw if with_w else None, by, ncols, nrows, eps)
            y = by.download(dtype=np.float32).reshape(nrows, ncols)
            kernels.rmsnorm(bx, bw if with_w else None, bx, ncols, nrows, eps)    # in place
            y2 = bx.download(dtype=np.float32).reshape(nrows, ncols)
        err = np.abs(y - ref) / np.abs(ref)
        assert err.max() <= tol.GPU_RMSNORM_REL, (nrows, ncols, err.max())
        assert np.array_equal(y, y2)


@pytest.mark.gpu
@variant_params()
def test_quantize_q8_1(kernels):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(32 * 300) * rng.uniform(1e-3, 1e3, 32 * 300)).astype(np.float32)
    x[:32] = 0.0                                   # amax = 0: d = 0, q = 0
    x[32:64] = np.float32(127) * np.sign(rng.standard_normal(32))
    x[64] = 127.0                                  # d = 1 exactly: ties at .5 round away from zero
    x[65:96] = np.arange(31, dtype=np.float32) * 4 + np.float32(0.5) - 60
    big = 65535 * 128 + 96                         # more blocks than 65535 CUDA blocks of 4: grid-stride
    x = np.concatenate([x, rng.standard_normal(big).astype(np.float32)])
    n = x.size
    with gpu.Buffer.from_array(x) as bx, gpu.Buffer(n // 32 * 36) as by:
        kernels.quantize_q8_1(bx, by, n)
        got = by.download().view(Q8_1_GPU)
    d, q, s = quantize_q8_1_gpu_ref(x)
    assert np.array_equal(got["d"].view(np.uint16), d.view(np.uint16)), "d bits differ"
    bad = np.nonzero((got["qs"] != q).any(axis=1))[0]
    assert bad.size == 0, f"qs differ in {bad.size} blocks, first {bad[0]}: {got['qs'][bad[0]]} vs {q[bad[0]]}"
    sabs = np.abs(x.reshape(-1, 32).astype(np.float64)).sum(axis=1)
    bound = tol.GPU_Q8_1_SUM_REL * np.abs(s) + tol.GPU_Q8_1_SUM_ABS + tol.GPU_Q8_1_SUM_CHAIN * tol.GPU_SUM_U * sabs
    err = np.abs(got["s"].astype(np.float64) - s)
    assert (err <= bound).all(), f"s: max err/bound {np.max(err / bound):.3f}"


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES, ids=[tname(t) for t in TYPES])
@variant_params()
def test_gemv_f32(kernels, qtype):
    rng = np.random.default_rng(qtype)
    for nrows, ncols in gemv_shapes(qtype):
        w = random_weights(rng, qtype, nrows, ncols)
        x = rng.standard_normal(ncols).astype(np.float32)
        W, m = dequant(qtype, w, nrows, ncols)
        ref = W @ x.astype(np.float64)
        mag = (np.abs(W + m) + np.abs(m)) @ np.abs(x.astype(np.float64))
        with gpu.Buffer.from_array(w) as bw, gpu.Buffer.from_array(x) as bx, gpu.Buffer(4 * nrows) as by:
            kernels.gemv_f32(qtype, bw, bx, by, nrows, ncols)
            y = by.download(dtype=np.float32)
        chain = math.ceil(ncols / 4 / 32) * 4 + 5        # lane: every 32nd word of 4 elements; warp tree
        assert_close_sum(y, ref, mag, chain, f"gemv_f32 {tname(qtype)} {nrows}x{ncols}")


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES, ids=[tname(t) for t in TYPES])
@variant_params()
def test_gemv_dp4a(kernels, qtype):
    """W4A8/W8A8: activations quantised on the GPU by the same variant, the reference computed from those Q8_1
    blocks: sum_j w_j d8 q8_j exactly, plus m * (d8 * sum q8 - s8) per sub-block (the kernel's min term uses s8)."""
    rng = np.random.default_rng(100 + qtype)
    for nrows, ncols in gemv_shapes(qtype):
        w = random_weights(rng, qtype, nrows, ncols)
        x = rng.standard_normal(ncols).astype(np.float32)
        W, m = dequant(qtype, w, nrows, ncols)
        with gpu.Buffer.from_array(w) as bw, gpu.Buffer.from_array(x) as bx, \
                gpu.Buffer(ncols // 32 * 36) as bq, gpu.Buffer(4 * nrows) as by:
            kernels.quantize_q8_1(bx, bq, ncols)
            kernels.gemv_dp4a(qtype, bw, bq, by, nrows, ncols)
            y = by.download(dtype=np.float32)
            xq = bq.download().view(Q8_1_GPU)
        d8 = xq["d"].astype(np.float64)
        s8 = xq["s"].astype(np.float64)
        q8 = xq["qs"].astype(np.float64)
        xhat = (d8[:, None] * q8).reshape(-1)
        msub = m[:, ::32]                                          # [nrows, nsub]: m is constant per sub-block
        ref = W @ xhat + msub @ (d8 * q8.sum(axis=1) - s8)
        mag = (np.abs(W + m) + np.abs(m)) @ np.abs(xhat) + np.abs(msub) @ np.abs(s8)
        chain = math.ceil(ncols / 32 / 32) + 5
        assert_close_sum(y, ref, mag, chain, f"gemv_dp4a {tname(qtype)} {nrows}x{ncols}")


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES, ids=[tname(t) for t in TYPES])
@variant_params()
def test_gemm_f32(kernels, qtype):
    rng = np.random.default_rng(200 + qtype)
    for (nrows, ncols), ntok in zip(gemv_shapes(qtype), (1, 37)):
        nrows += 40        # a partial row tile
        w = random_weights(rng, qtype, nrows, ncols)
        X = rng.standard_normal((ntok, ncols)).astype(np.float32)
        W, m = dequant(qtype, w, nrows, ncols)
        ref = X.astype(np.float64) @ W.T
        mag = np.abs(X.astype(np.float64)) @ (np.abs(W + m) + np.abs(m)).T
        with gpu.Buffer.from_array(w) as bw, gpu.Buffer.from_array(X) as bx, gpu.Buffer(4 * nrows * ntok) as by:
            kernels.gemm_f32(qtype, bw, bx, by, nrows, ncols, ntok)
            Y = by.download(dtype=np.float32).reshape(ntok, nrows)
        assert_close_sum(Y, ref, mag, ncols, f"gemm_f32 {tname(qtype)} {ntok}x{nrows}x{ncols}")


@pytest.mark.gpu
@variant_params()
def test_gemv_grid_stride(kernels):
    """More rows than 65535 blocks of 4 warps (Fermi's grid limit): the kernels stride over the rest."""
    rng = np.random.default_rng(3)
    qtype, nrows, ncols = 8, 65535 * 4 + 7, 32
    w = random_weights(rng, qtype, nrows, ncols)
    x = rng.standard_normal(ncols).astype(np.float32)
    W, _ = dequant(qtype, w, nrows, ncols)
    with gpu.Buffer.from_array(w) as bw, gpu.Buffer.from_array(x) as bx, gpu.Buffer(4 * nrows) as by:
        by_init = np.full(nrows, np.nan, np.float32)
        by.upload(by_init)
        kernels.gemv_f32(qtype, bw, bx, by, nrows, ncols)
        y = by.download(dtype=np.float32)
    assert_close_sum(y, W @ x.astype(np.float64), np.abs(W) @ np.abs(x.astype(np.float64)), 32 + 5, "grid-stride")


@pytest.mark.gpu
def test_vram_budget(gpu_device):
    before = gpu.mem_stats()
    gpu.set_budget(before["used"] + (1 << 20))
    try:
        small = gpu.Buffer(512 << 10, "small")
        with pytest.raises(NativeError) as e:
            gpu.Buffer(1 << 20, "ballast")
        assert e.value.code == lib.LE_ERR_NO_MEMORY
        assert "exceeds the VRAM budget" in str(e.value) and "ballast" in str(e.value)
        st = gpu.mem_stats()
        assert st["used"] == before["used"] + (512 << 10) and st["budget"] == before["used"] + (1 << 20)
        small.free()
        fits = gpu.Buffer(1 << 20, "exactly the budget")
        assert gpu.mem_stats()["peak"] >= before["used"] + (1 << 20)
        fits.free()
    finally:
        gpu.set_budget(None)
    assert gpu.mem_stats()["used"] == before["used"]


@pytest.mark.gpu
def test_driver_out_of_memory_is_no_memory(gpu_device):
    """An allocation the card cannot hold: LE_ERR_NO_MEMORY naming cuMemAlloc and CUDA_ERROR_OUT_OF_MEMORY."""
    with pytest.raises(NativeError) as e:
        gpu.Buffer(gpu.mem_stats()["total_bytes"] * 4, "too big")
    assert e.value.code == lib.LE_ERR_NO_MEMORY and "CUDA_ERROR_OUT_OF_MEMORY" in str(e.value)
    assert "cuMemAlloc" in str(e.value)


@pytest.mark.gpu
def test_bad_ptx_reports_the_jit_log(gpu_device):
    bad = b".version 7.8\n.target sm_35\n.address_size 64\n.visible .entry k()\n{\n\tbogus_instruction;\n}\n"
    with pytest.raises(NativeError) as e:
        gpu.Module(bad, "bad-module")
    msg = str(e.value)
    assert "CUDA_ERROR_INVALID_PTX" in msg and "bad-module" in msg and "JIT log" in msg
    assert "bogus_instruction" in msg, msg


@pytest.mark.gpu
def test_cubin_loads_too(gpu_device, tmp_path):
    """cuModuleLoadData takes a cubin as well as PTX: nvcc -cubin for the card's own sm."""
    chains = [t for t in gpu.find_toolchains() if t.kind == "nvcc" and NATIVE_ARCH in t.archs]
    if not chains:
        pytest.skip(f"no nvcc here builds sm_{NATIVE_ARCH}")
    out = tmp_path / "rmsnorm.cubin"
    subprocess.run([chains[0].path, "-cubin", f"-arch=sm_{NATIVE_ARCH}", "-std=c++11", "-DLE_FORCE_TIER=LE_CC_FERMI",
                    f"-I{gpu.CUDA_DIR}", f"-I{gpu.INCLUDE_DIR}", "-o", str(out), str(gpu.CUDA_DIR / "rmsnorm.cu")],
                   check=True, capture_output=True)
    mod = gpu.Module(out.read_bytes(), "rmsnorm.cubin")
    with gpu.Buffer(16) as b:
        mod.kernel("le_tier_probe").launch((1, 1, 1), (32, 1, 1), [("ptr", b)])
        v = b.download(dtype=np.int32, count=4)
    assert v[0] == NATIVE_ARCH * 10 and v[1] == 200
    x = np.arange(1, 65, dtype=np.float32)
    with gpu.Buffer.from_array(x) as bx:
        mod.kernel("rmsnorm_f32").launch((1, 1, 1), (gpu.RMSNORM_THREADS, 1, 1),
                                         [("ptr", bx), ("ptr", 0), ("ptr", bx), ("i32", 64), ("i32", 1), ("f32", 0.0)])
        y = bx.download(dtype=np.float32)
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean())
    assert np.max(np.abs(y - ref) / ref) <= tol.GPU_RMSNORM_REL


@pytest.mark.gpu
def test_kernel_lookup_and_launch_errors_name_the_kernel(gpu_device):
    try:
        mod = gpu.Kernels("fermi", NATIVE_ARCH).modules["rmsnorm"]
    except UnavailableError as e:
        pytest.skip(str(e))
    with pytest.raises(NativeError, match="CUDA_ERROR_NOT_FOUND"):
        mod.kernel("no_such_kernel")
    with gpu.Buffer(4096) as b, pytest.raises(NativeError) as e:
        mod.kernel("rmsnorm_f32").launch((1, 1, 1), (2048, 1, 1),
                                         [("ptr", b), ("ptr", 0), ("ptr", b), ("i32", 16), ("i32", 1), ("f32", 1e-6)])
    assert "rmsnorm_f32" in str(e.value) and "CUDA_ERROR_INVALID_VALUE" in str(e.value)
    gpu.synchronize()   # the context survived


@pytest.mark.gpu
def test_copies_round_trip(gpu_device):
    rng = np.random.default_rng(4)
    for n in (1, 4095, (1 << 20) + 3):
        a = rng.integers(0, 256, n, dtype=np.uint8)
        with gpu.Buffer.from_array(a) as b, gpu.Buffer(n) as c:
            assert np.array_equal(b.download(), a)
            _native.gpu_copy_dtod(c.ptr, b.ptr, n)
            assert np.array_equal(c.download(), a)
            _native.gpu_memset8(c.ptr, 0xAB, n)
            assert (c.download() == 0xAB).all()
    # asynchronous, pinned, on a stream
    n = 8 << 20
    src, dst = gpu.PinnedBuffer(n), gpu.PinnedBuffer(n)
    try:
        src.array[:] = rng.integers(0, 256, n, dtype=np.uint8)
        s = gpu.Stream()
        with gpu.Buffer(n) as b:
            b.upload(src.array, stream=s)
            b.download(out=dst.array, stream=s)
            s.synchronize()
        assert np.array_equal(src.array, dst.array)
        pinned = gpu.mem_stats()["pinned"]
        assert pinned >= 2 * n
    finally:
        src.free()
        dst.free()
    assert gpu.mem_stats()["pinned"] == pinned - 2 * n
    with pytest.raises(NativeError, match="not a pointer from le_gpu_alloc"):
        _native.gpu_free(0x1234)


@pytest.mark.gpu
def test_events_time_a_kernel(gpu_device):
    try:
        k = gpu.Kernels("dp4a", NATIVE_ARCH)
    except UnavailableError as e:
        pytest.skip(str(e))
    rng = np.random.default_rng(5)
    nrows, ncols = 4096, 4096
    w = random_weights(rng, 12, nrows, ncols)
    with gpu.Buffer.from_array(w) as bw, gpu.Buffer.from_array(rng.standard_normal(ncols).astype(np.float32)) as bx, \
            gpu.Buffer(4 * nrows) as by:
        s, e0, e1 = gpu.Stream(), gpu.Event(), gpu.Event()
        e0.record(s)
        k.gemv_f32(12, bw, bx, by, nrows, ncols, stream=s)
        e1.record(s)
        ms = e0.elapsed_ms(e1)
    assert 0 < ms < 1000
