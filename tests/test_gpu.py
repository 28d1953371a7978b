"""cuda8 kernels and the driver API (native/gpu.c, legacy_engine/gpu.py).

Here (no GPU): PTX builds of every source for every tier with nvcc and with the NVRTC wheels, what each tier's
PTX may and may not contain, the PTX cache and prebuilt folders, ptxas on real sm_35/61/70 (slow), the CUDA-8 lint,
and "no driver" -> UnavailableError.
On a GPU (marker gpu): every kernel x tier variant against f64 math on the same inputs (weights dequantised by
the C reference le_dequantize_row; the layer ops - conv1d, GDN, attention, MoE routing, argmax, elementwise -
against numpy transcriptions of native/gdn.c, attention.c, moe.c, with bounds named at "layer ops"), the VRAM budget, a bad PTX's JIT log, copies, streams, events and launch errors.

GPU machine, one command (after `pip install -e .`; nvcc there builds the sm_90 variants, the legacy ones come
prebuilt from this box: python -m legacy_engine.gpu build --out DIR):
    LE_PTX_DIR=DIR LE_GPU_STRICT=1 python -m pytest tests/test_gpu.py -m gpu
LE_GPU_STRICT=1 turns "this variant cannot be built here" into a failure instead of a skip.
Tolerances: tests/tolerances.py (GPU_*). Needs neither torch nor gguf.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from legacy_engine.core import _native

from legacy_engine import gpu
from legacy_engine.core.errors import NativeError, UnavailableError

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


class _MatsProbe(gpu.matmul.MatmulLaunchers):
    """MatmulLaunchers' argument checks without a device (_weights, _grid and _mats are pure)."""
    _grid = staticmethod(gpu.Kernels._grid)


@pytest.mark.cpu
def test_gemv_matrices_of_one_launch_cpu():
    """The dense GEMV's further matrices (quants.cuh LE_GEMV_MATS): one matrix keeps its grid-strided grid; several
    get their blocks one after another (ceil(rows / 4) each) and the kernel's offsets; too many matrices, a y not a
    whole float away, no rows, or more blocks than a grid holds are errors."""
    q8, rb = 8, 34 * 512 // 32                          # Q8_0 rows of 512: 544 bytes
    k, W, y = _MatsProbe(), 1 << 20, 1 << 24
    blocks, args = k._mats(q8, W, y, 300000, 512, (), "t")
    assert blocks == gpu.MAX_GRID and [v for _, v in args] == [0] * 9
    blocks, args = k._mats(q8, W, y, 6144, 512, [(W + 6144 * rb, y + 4 * 6144, 2048), (W - 16 * rb, y - 64, 16),
                                                 (W + 9000 * rb, y + 4 * 9000, 5)], "t")
    assert blocks == 1536 + 512 + 4 + 2
    assert [v for _, v in args] == [6144 * rb, 6144, 2048, -16 * rb, -16, 16, 9000 * rb, 9000, 5]
    blocks, args = k._mats(q8, W, y, 8, 512, [(W, y + 4 * 8, 8)], "t")
    assert blocks == 4 and [v for _, v in args][3:] == [0] * 6
    for more, match in (([(W, y + 4, 1)] * 4, "at most"), ([(W, y + 2, 8)], "whole number of floats"),
                        ([(W, y + 4, 0)], "0 rows"), ([(W, y + 4, 4 * gpu.MAX_GRID)], "launch them apart")):
        with pytest.raises(ValueError, match=match):
            k._mats(q8, W, y, 8, 512, more, "t")


@pytest.mark.cpu
def test_one_token_projections_share_a_launch_cpu():
    """_mm_many of one token: matrices of one type and width in one GEMV launch (GEMV_MAX_MATS at most), others
    apart; int8 where the weights are quantised (one Q8_1 of x for all), f32 GEMV for f32 weights; a group whose
    blocks exceed a grid runs apart. Recorded against a stand-in of the kernels (no device)."""
    from legacy_engine.gpu.forward import ForwardOps
    from legacy_engine.gpu.residency import _W

    calls = []

    class K:
        def gemv_dp4a(self, qtype, W, xq, y, nrows, ncols, more=()):
            calls.append(("dp4a", qtype, W, nrows, [m[2] for m in more]))

        def gemv_f32(self, qtype, W, x, y, nrows, ncols, more=()):
            calls.append(("f32", qtype, W, nrows, [m[2] for m in more]))

    class Ops(ForwardOps):
        k, int8, int8_prefill = K(), True, True

        def _q8_1(self, x, n_el, name):
            calls.append(("q8_1", n_el))
            return 77

    ops, E = Ops(), 1024
    qkv, z, b, a = (_W(100 * i, 8, r, E) for i, r in ((1, 6144), (2, 2048), (3, 16), (4, 16)))
    ops._mm_many([qkv, z, b, a], 0, [1, 2, 3, 4], 1)
    assert calls == [("q8_1", E), ("dp4a", 8, 100, 6144, [2048, 16, 16])]
    calls.clear()
    router, gate = _W(500, gpu.F32, 256, E), _W(600, gpu.F32, 1, E)
    ops._mm_many([router, _W(700, 12, 512, E), gate], 0, [1, 2, 3], 1, xq=55)
    assert calls == [("f32", gpu.F32, 500, 256, [1]), ("dp4a", 12, 700, 512, [])]
    calls.clear()
    five = [_W(i, 8, 8, E) for i in range(5)]
    ops._mm_many(five, 0, list(range(5)), 1, xq=55)
    assert calls == [("dp4a", 8, 0, 8, [8, 8, 8]), ("dp4a", 8, 4, 8, [])]
    calls.clear()
    wide = [_W(1, 8, 4 * gpu.MAX_GRID - 4, E), _W(2, 8, 64, E)]
    ops._mm_many(wide, 0, [1, 2], 1, xq=55)
    assert calls == [("dp4a", 8, 1, 4 * gpu.MAX_GRID - 4, []), ("dp4a", 8, 2, 64, [])]


@pytest.mark.cpu
def test_shared_memory_fits_fermi():
    sizes = lint_cuda8.shared_report()
    assert set(sizes) >= {f"{s}.cu" for s in gpu.SOURCES}
    assert all(0 <= b <= 48 * 1024 for b in sizes.values()), sizes   # conv1d and elementwise share nothing


@pytest.mark.cpu
def test_shared_memory_lint_counts_per_kernel_and_branch():
    """The 48 KB bound holds per kernel: an #if/#else counts its larger branch, arrays outside the kernels count
    for each; a kernel over the bound is named."""
    text = ("#define N 1024\n__shared__ float g[N];\n"
            "__global__ void a() {\n#if X\n__shared__ __align__(16) float x[N * 8];\n#else\n"
            "__shared__ float y[N * 10];\n#endif\n__shared__ float z[N];\n}\n"
            "__global__ void b() { __shared__ float q[N * 12]; }\n")
    per, problems = lint_cuda8.kernel_shared(text, lint_cuda8._macros(text))
    assert problems == [] and per == {"a": 4096 * 12, "b": 4096 * 13}
    assert lint_cuda8.lint_text("t.cu", text) == ["t.cu: b: 53248 bytes of static __shared__ arrays > 48 KB"]


def _toolchain(kind: str, arch: int):
    try:
        return gpu.pick_toolchain(arch, kind)
    except UnavailableError as e:
        pytest.skip(str(e))


def _entries(ptx: bytes) -> set[bytes]:
    return set(re.findall(rb"\.entry\s+(\w+)", ptx))


ENTRIES = {"rmsnorm": {"rmsnorm_f32", "add_rmsnorm_f32"}, "quantize_q8_1": {"quantize_q8_1", "swiglu_q8_1"},
           "conv1d": {"conv1d_silu_f32", "conv1d_state_f32", "conv1d_step_l2norm_f32"},
           "gdn": {"gdn_gates_f32", "gdn_l2norm_qk_f32", "gdn_recurrent_f32", "gdn_gated_rmsnorm_f32"},
           "gdn_chunked": {"gdn_chunk_prep_f32", "gdn_chunk_prep_ahead_f32", "gdn_chunk_scan_f32"},
           "gdn_scan_tf32": {"gdn_chunk_scan_tf32"},
           "attention": {"attn_decode_partial_f32", "attn_decode_merge_f32", "attn_prefill_f32", "attn_kv_store_f32",
                         "attn_prefill_tiled_f32", "attn_prefill_mma_f32", "attn_kv_planes_f16"},
           "moe_route": {"moe_route_f32"}, "moe_sort": {"moe_sort"}, "argmax": {"argmax_partial_f32", "argmax_final_i32"},
           "elementwise": {"swiglu_f32", "add_f32", "add_scaled_f32"}, "rope": {"qk_norm_rope_f32"},
           "moe_combine": {"moe_combine_f32"}, "hybrid_sync": {"hybrid_publish_f32", "hybrid_wait_f32", "hybrid_fetch_u8",
                                                          "hybrid_predict_f32", "hybrid_predict_publish_i32"},
           "grid_sync": {"grid_sync_check_u32", "grid_sync_time_u32", "grid_sync_stream_u32",
                         "grid_sync_stream_ahead_u32"},
           "sample_cut": {"sample_max_f32", "sample_hist_f32", "sample_cut_f32", "sample_compact_f32",
                          "sample_draw_blocks_f32", "sample_draw_pick_f32"},
           # the vision tower's (tests/test_gpu_vision.py)
           "layernorm": {"layernorm_f32"}, "gelu": {"gelu_tanh_f32", "gelu_erf_f32", "bias_add_f32", "bias_residual_f32"},
           "rope_vision": {"rope_vision_f32"}, "attention_bidir": {"attn_bidir_f32"},
           "peak": {"peak_fma_f32", "peak_dp4a_s8", "peak_mma_s8"}}


def expected_entries(name: str, tier: str = "dp4a", arch: int = 90) -> set[str]:
    """The entry points of a source: per weight type (f32 weights too, except the int8 GEMV), the MoE `_ids`
    forms of the GEMVs; gemm_mma's and the tensor-core attention prefill only where the variant has the mma
    (gpu.has_mma)."""
    suffixes = [tname(t) for t in TYPES]
    if name == "gemm_mma" and not gpu.has_mma(tier, arch):
        return {b"le_tier_probe"}
    if name == "attention":
        drop = ({"attn_prefill_tiled_f32"} if tier == "fermi" else set()) | \
            (set() if gpu.has_mma(tier, arch) else {"attn_prefill_mma_f32", "attn_kv_planes_f16"})
        return {e.encode() for e in ENTRIES[name] - drop} | {b"le_tier_probe"}
    if name == "gdn_chunked":
        drop = set() if gpu.many_regs(tier) else {"gdn_chunk_prep_ahead_f32"}
        return {e.encode() for e in ENTRIES[name] - drop} | {b"le_tier_probe"}
    if name == "gdn_scan_tf32" and not gpu.has_tf32(tier, arch):
        return {b"le_tier_probe"}
    if name == "peak" and not gpu.has_mma(tier, arch):
        return {e.encode() for e in ENTRIES[name] - {"peak_mma_s8"}} | {b"le_tier_probe"}
    if name in ("gemv_f32", "gemv_dp4a"):
        if name == "gemv_f32":
            suffixes.append("f32")
        out = {f"{name}_{s}" for s in suffixes} | {f"{name}_{s}_ids" for s in suffixes}
    elif name == "gemm_f32":
        out = {f"{name}_{s}" for s in suffixes + ["f32"]} | {f"{name}_{s}_ids" for s in suffixes + ["f32"]}
    elif name in ("gemm_dp4a", "gemm_mma"):
        forms = ("", "_multi") if gpu.many_regs(tier) else ("",)
        out = {f"{name}_{s}{f}" for s in suffixes for f in forms + ("_ids",)}
        if name == "gemm_mma":      # the 32-token plain and multi forms
            out |= {f"gemm_mma32_{s}{f}" for s in suffixes for f in forms}
    elif name == "get_rows":
        out = {f"{name}_{s}" for s in suffixes + ["f32", "raw16"]}
    else:
        out = ENTRIES[name]
    return {e.encode() for e in out} | {b"le_tier_probe"}


@pytest.mark.cpu
def test_every_source_is_known():
    """SOURCES lists every cuda8/*.cu (so the build, lint, ptxas and probe tests cover it) and each has its entries."""
    assert {p.stem for p in gpu.CUDA_DIR.glob("*.cu")} == set(gpu.SOURCES)
    assert set(gpu.SOURCES) - {"gemv_f32", "gemv_dp4a", "gemm_f32", "gemm_dp4a", "gemm_mma", "get_rows"} == set(ENTRIES)


@pytest.mark.cpu
def test_every_device_test_is_gpu_marked():
    """A test of the GPU test files that takes a device fixture carries the gpu marker (or its module does): the tier
    table selects `-m gpu`, and an unmarked test would never run there."""
    import ast
    for name in ("test_gpu.py", "test_gpu_model.py", "test_gpu_vision.py"):
        tree = ast.parse(open(os.path.join(os.path.dirname(__file__), name), encoding="utf-8").read())
        if any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
               and "gpu" in ast.unparse(n.value) for n in tree.body):
            continue
        for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")):
            if {"kernels", "gpu_device"} & {a.arg for a in fn.args.args}:
                assert any("mark.gpu" in ast.unparse(d) for d in fn.decorator_list), f"{name}::{fn.name}"


@pytest.mark.cpu
def test_bench_gpu_prints_the_profile(capsys):
    """bench gpu --profile's print: each phase's ms and share of the pass, each GEMM's TFLOP/s and % of its peak; a row
    without a profile, or whose pass had no phases (one token), prints nothing of it."""
    from legacy_engine.tools.bench_gpu import print_profiles
    gemm = {"phase": "gdn", "kernel": "gemm_mma", "s": 0.0135, "tflops": 57.3, "peak_tflops": 938.0,
            "pct_peak": 6.1, "launches": 90}
    rows = [{"engine": "legacy_engine dp4a-sm90", "profile": {"pp": 2048, "phases": {"gdn": 0.03, "attention": 0.01},
                                                              "gemms": [gemm], "total_s": 0.04}},
            {"engine": "one token", "profile": {"pp": 1, "phases": {}, "gemms": [], "total_s": 0.0}},
            {"engine": "no profile"}]
    print_profiles({"rows": rows})
    out = capsys.readouterr().out
    assert "one pp2048 pass, 40.00 ms of GPU work: gdn 30.00 ms (75 %), attention 10.00 ms (25 %)" in out
    assert "gemm_mma" in out and "57.3 TFLOP/s =   6.1 % of the 938 TFLOP/s peak" in out
    assert "one token" not in out and "no profile" not in out


# launch constants of gpu.py that must equal the #defines of a cuda8 source
LAUNCH_CONSTANTS = {"conv1d": ("CONV_THREADS", "CONV_TOKENS", "CONV_MAX_K"),
                    "gdn": ("GDN_THREADS", "GDN_COLS", "GDN_MAX_DK", "GDN_NORM_THREADS", "GDN_EW_THREADS"),
                    "attention": ("ATTN_THREADS", "ATTN_WARPS", "ATTN_PREFILL_THREADS", "ATTN_QTILE", "ATTN_MAX_HD",
                                  "ATTN_MIN_KEYS_PER_SPLIT"),
                    "moe_route": ("MOE_THREADS", "MOE_MAX_K"),
                    "moe_sort": ("MOE_SORT_THREADS", "MOE_SORT_MAX_E", "MOE_SORT_MAX_TILE"), "argmax": ("ARGMAX_THREADS", "ARGMAX_MAX_PARTS"),
                    "elementwise": ("EW_THREADS",), "rmsnorm": ("RMSNORM_THREADS",),
                    "gemv_f32": ("GEMV_THREADS",), "gemm_f32": ("GEMM_THREADS", "GEMM_ROWS", "GEMM_TT"),
                    "gemm_q8.cuh": ("GEMM_THREADS", "GEMM_ROWS", "GEMM_TT", "GEMM_MMA_TT"),
                    "rope": ("ROPE_THREADS", "ROPE_MAX_HD"), "get_rows": ("GET_ROWS_THREADS",),
                    "moe_combine": ("MOE_COMBINE_THREADS",), "hybrid_sync": ("HYBRID_THREADS", "HYBRID_FETCH_BLOCKS",
                                                                                    "HYBRID_PRED_E"),
                    "grid_sync": ("GRID_SYNC_THREADS",),
                    "sample_cut": ("SAMPLE_THREADS", "SAMPLE_MAX_PARTS", "SAMPLE_BINS", "SAMPLE_BINS_PER_NAT",
                                   "SAMPLE_FIX_BITS", "SAMPLE_DRAW_BLOCK")}


@pytest.mark.cpu
def test_launch_constants_match_sources():
    for name, consts in LAUNCH_CONSTANTS.items():
        text = (gpu.CUDA_DIR / (name if name.endswith(".cuh") else f"{name}.cu")).read_text(encoding="utf-8")
        defs = dict(re.findall(r"^#define\s+(\w+)\s+(\d+)\b", text, flags=re.M))
        for c in consts:
            assert int(defs[c]) == getattr(gpu, c), f"{name}.cu {c} = {defs[c]}, gpu.py {getattr(gpu, c)}"


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
    assert expected_entries(name, tier, arch) <= _entries(ptx)


def mma_forms(name: str, types: str) -> dict[int, set[str]]:
    """{75, 90: the mma.sync shapes (m16n8k16 …) of `types` (e.g. "s32.s8.s8.s32") in source `name`'s dp4a PTX}; skips
    without an nvcc that targets compute_75."""
    chains = [t for t in gpu.find_toolchains() if t.kind == "nvcc"]
    if not chains or chains[0].archs[0] > gpu.MMA_ARCH:
        pytest.skip("no nvcc that targets compute_75")
    pattern = r"mma\.sync\.aligned\.(m\d+n\d+k\d+)\.row\.col\." + re.escape(types)
    return {arch: set(re.findall(pattern, gpu.build_ptx(name, "dp4a", arch, "nvcc")[0].read_text()))
            for arch in (75, 90)}


@pytest.mark.cpu
def test_gemm_mma_ptx_forms():
    """gemm_mma's products: mma m8n8k16 on sm_75 (Turing); from sm_80 one m16n8k32 per sub-block where the type has
    one scale, two m16n8k16 where it has two (Q6_K); the same source forced to a lower tier holds no kernel."""
    assert mma_forms("gemm_mma", "s32.s8.s8.s32") == {75: {"m8n8k16"}, 90: {"m16n8k16", "m16n8k32"}}
    low = gpu.build_ptx("gemm_mma", "kepler", 75, "nvcc")[0].read_bytes()
    assert b"mma.sync" not in low and _entries(low) == {b"le_tier_probe"}


@pytest.mark.cpu
def test_attention_mma_ptx_forms():
    """The tensor-core attention prefill: f16 x f16 -> f32 mma, m16n8k8 on sm_75 (Turing), m16n8k16 from sm_80; the
    same source forced to the kepler tier holds no such kernel and no mma."""
    assert mma_forms("attention", "f32.f16.f16.f32") == {75: {"m16n8k8"}, 90: {"m16n8k16"}}
    low = gpu.build_ptx("attention", "kepler", 75, "nvcc")[0].read_bytes()
    assert b"mma.sync" not in low and b"attn_prefill_mma_f32" not in low


@pytest.mark.cpu
@pytest.mark.parametrize("tier,arch", gpu.LEGACY_VARIANTS, ids=[gpu.variant_name(*v) for v in gpu.LEGACY_VARIANTS])
@pytest.mark.parametrize("name", gpu.SOURCES)
def test_ptx_nvrtc(name, tier, arch):
    """The legacy variants with NVRTC 11.8 (compute_35) / 12.9 (compute_61, 70), loaded from the PyPI wheels."""
    _toolchain("nvrtc", arch)
    path, tc = gpu.build_ptx(name, tier, arch, "nvrtc")
    ptx = path.read_bytes()
    assert f".target sm_{arch}".encode() in ptx and tc.kind == "nvrtc"
    assert expected_entries(name, tier, arch) <= _entries(ptx)


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
    (tmp_path / "compat.cuh").write_bytes((gpu.CUDA_DIR / "compat.cuh").read_bytes())   # the package's, wherever
    monkeypatch.setattr(gpu.toolchain, "CUDA_DIR", tmp_path)
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
    code = ("from legacy_engine import gpu\nfrom legacy_engine.core.errors import UnavailableError\n"
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


@pytest.mark.cpu
def test_packed_launch_arguments_are_checked():
    """le_gpu_launch_packed reads each value at the next multiple of its size, as struct's "@" packs them; kinds
    it does not know, a blob shorter than the kinds, values out of their kind's range: clear errors before any
    launch (a fake kernel: the checks come before the driver)."""
    from legacy_engine.core._native import gpu_driver
    letters, packer = gpu_driver._packer(("ptr", "i32", "f32", "i64", "u32"))
    assert letters == b"pifqu" and packer.size == 28      # q aligned to 16, after i (8) and f (12)
    fake = _native.ffi.cast("le_gpu_kernel *", 1)
    lib = _native.lib
    for kinds, blob, said in ((b"px", bytes(16), "bad kinds"), (b"pq", bytes(12), "hold fewer arguments")):
        assert lib.le_gpu_launch_packed(fake, 1, 1, 1, 1, 1, 1, 0, _native.ffi.NULL, kinds, blob, len(blob)) != 0
        assert said in _native.ffi.string(lib.le_last_error()).decode()
    with pytest.raises(OverflowError, match="does not fit"):
        gpu_driver.gpu_launch(fake, (1, 1, 1), (1, 1, 1), [("i32", 1 << 40)])
    with pytest.raises(ValueError, match="unknown argument kind"):
        gpu_driver.gpu_launch(fake, (1, 1, 1), (1, 1, 1), [("f64", 1.0)])


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


def expert_weights(rng, qtype: int, n_exp: int, nrows: int, ncols: int) -> tuple[np.ndarray, int]:
    """n_exp experts of [nrows, ncols] weights of `qtype` (gpu.F32: f32 values) back to back -> (bytes or f32
    array, bytes per expert)."""
    if qtype == gpu.F32:
        return rng.standard_normal(n_exp * nrows * ncols).astype(np.float32), 4 * nrows * ncols
    _, bs, ts = gpu.GPU_TYPES[qtype]
    return random_weights(rng, qtype, n_exp * nrows, ncols), nrows * ncols // bs * ts


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
        feats = set(p["features"]) - {"sync", "mma"}
        assert feats == {"fermi": set(), "kepler": {"shfl", "ldg"}, "dp4a": {"shfl", "ldg", "dp4a"}}[kernels.tier]
        assert ("mma" in p["features"]) == kernels.has_mma == (kernels.tier == "dp4a" and kernels.arch >= 75)
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
def test_add_rmsnorm(kernels):
    """add_rmsnorm_f32 bit-equals add_f32, rmsnorm_f32 and quantize_q8_1 in sequence (each tested against its own
    reference above): x += y in place, h, and h's Q8_1; without y, without w, without hq; rows grid-strided; rows
    held in registers and rows looped."""
    rng = np.random.default_rng(3)
    # rows in registers of 4 and 8 elements a thread (<= 1024, <= 2048, whole warps of Q8_1 blocks or not), looped
    for nrows, ncols, with_y, with_w, with_q in ((1, 2048, True, True, True), (3, 96, True, False, True),
                                                 (2, 1000, False, True, False), (70000, 64, True, True, True),
                                                 (1, 1024, True, True, True), (2, 1312, True, True, True),
                                                 (2, 5120, True, True, True), (1, 3000, True, False, False)):
        x = (rng.standard_normal((nrows, ncols)) * rng.uniform(0.1, 10, (nrows, 1))).astype(np.float32)
        y = rng.standard_normal((nrows, ncols)).astype(np.float32)
        w = rng.uniform(0.5, 1.5, ncols).astype(np.float32)
        x[0, :32] = -y[0, :32]                     # a block of zeros after the add: d = 0, q = 0
        n, qb = nrows * ncols, nrows * ncols // 32 * 36
        with gpu.Buffer.from_array(x) as bx, gpu.Buffer.from_array(x) as bx2, gpu.Buffer.from_array(y) as by, \
                gpu.Buffer.from_array(w) as bw, gpu.Buffer(4 * n) as bh, gpu.Buffer(4 * n) as bh2, \
                gpu.Buffer(max(qb, 256)) as bq, gpu.Buffer(max(qb, 256)) as bq2:
            kernels.add_rmsnorm(bx, by if with_y else None, bw if with_w else None, bh, bq if with_q else None,
                                ncols, nrows, 1e-6)
            if with_y:
                kernels.add(bx2, by, bx2, n)
            kernels.rmsnorm(bx2, bw if with_w else None, bh2, ncols, nrows, 1e-6)
            if with_q:
                kernels.quantize_q8_1(bh2, bq2, n)
            for a, b in ((bx, bx2), (bh, bh2)) + (((bq, bq2),) if with_q else ()):
                got, want = a.download(dtype=np.uint8), b.download(dtype=np.uint8)
                assert np.array_equal(got, want), (nrows, ncols, with_y, with_w, with_q)


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
@variant_params()
def test_swiglu_q8_1(kernels):
    """swiglu_q8_1 (the FFN down projection's int8 input in one launch) equals swiglu then quantize_q8_1 byte for byte:
    large and zero gates, a zero block, more blocks than one grid of 65535 (grid-stride)."""
    rng = np.random.default_rng(3)
    n = 32 * (65535 * 4 + 37)
    g = (rng.standard_normal(n) * rng.uniform(0.1, 30.0, n)).astype(np.float32)
    u = rng.standard_normal(n).astype(np.float32)
    g[:32] = 0.0                                   # SiLU(0) = 0: a zero block (d = 0)
    g[32:64] = -100.0                              # e^100 overflows to inf: SiLU = -0
    with gpu.Buffer.from_array(g) as bg, gpu.Buffer.from_array(u) as bu, gpu.Buffer(4 * n) as bs, \
            gpu.Buffer(n // 32 * 36) as q1, gpu.Buffer(n // 32 * 36) as q2:
        kernels.swiglu(bg, bu, bs, n)
        kernels.quantize_q8_1(bs, q1, n)
        q2.upload(np.full(n // 32 * 36, 0xA5, np.uint8))
        kernels.swiglu_q8_1(bg, bu, q2, n)
        want, got = q1.download(dtype=np.uint8), q2.download(dtype=np.uint8)
    assert want.view(Q8_1_GPU)["qs"][2:].any()
    assert np.array_equal(got, want), f"first difference at byte {np.flatnonzero(got != want)[0]}"


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
@pytest.mark.parametrize("qtype", [gpu.F32, 12], ids=["f32", "q4_K"])
@variant_params()
def test_gemv_second_matrix(kernels, qtype):
    """A GEMV's further matrices (grid.z: gate and up, GDN's qkv, z, beta and alpha, q, k and v in one launch): the
    same bits as a launch each (two, and four of three heights), for the dense (the second of the same height, fewer
    rows or more) and the MoE (ids) forms, f32 and int8 activations, the second matrix after the first in memory and
    before it (a negative offset)."""
    rng = np.random.default_rng(31)
    nrows, ncols, ne, pairs = 96, 512, 3, 4
    w = [expert_weights(rng, qtype, ne, nrows, ncols)[0].view(np.uint8) for _ in range(2)]
    eb = w[0].nbytes // ne
    x = rng.standard_normal(ncols).astype(np.float32)
    ids = np.array([2, -1, 0, 1], dtype=np.int32)
    int8s = [False] if qtype == gpu.F32 else [False, True]
    with gpu.Buffer.from_array(np.concatenate([w[1], w[0]])) as bw, gpu.Buffer.from_array(x) as bx, \
            gpu.Buffer(ncols // 32 * 36) as bq, gpu.Buffer.from_array(ids) as bi, \
            gpu.Buffer(4 * 4 * nrows * pairs) as by:
        kernels.quantize_q8_1(bx, bq, ncols)
        w0, w1 = bw.ptr + w[1].nbytes, bw.ptr                  # the second matrix lies first
        for int8 in int8s:
            xin = bq if int8 else bx
            for first, second in ((w0, w1), (w1, w0)):
                y = [by.ptr + 4 * nrows * pairs * j for j in range(4)]
                if int8:
                    kernels.gemv_dp4a(qtype, first, xin, y[0], nrows, ncols)
                    kernels.gemv_dp4a(qtype, second, xin, y[1], nrows, ncols)
                    kernels.gemv_dp4a(qtype, first, xin, y[2], nrows, ncols, more=[(second, y[3], nrows)])
                else:
                    kernels.gemv_f32(qtype, first, xin, y[0], nrows, ncols)
                    kernels.gemv_f32(qtype, second, xin, y[1], nrows, ncols)
                    kernels.gemv_f32(qtype, first, xin, y[2], nrows, ncols, more=[(second, y[3], nrows)])
                out = by.download(dtype=np.float32).reshape(4, -1)[:, :nrows]
                np.testing.assert_array_equal(out[2], out[0])
                np.testing.assert_array_equal(out[3], out[1])
                assert not np.array_equal(out[0], out[1])
                # a second matrix of other height (GDN's qkv and z): its rows only, the first's all
                for n2 in (40, nrows * 2):
                    by.upload(np.full(4 * nrows * pairs, 7.0, np.float32))
                    if int8:
                        kernels.gemv_dp4a(qtype, second, xin, y[1], n2, ncols)
                        kernels.gemv_dp4a(qtype, first, xin, y[2], nrows, ncols, more=[(second, y[3], n2)])
                    else:
                        kernels.gemv_f32(qtype, second, xin, y[1], n2, ncols)
                        kernels.gemv_f32(qtype, first, xin, y[2], nrows, ncols, more=[(second, y[3], n2)])
                    o2 = by.download(dtype=np.float32).reshape(4, -1)
                    np.testing.assert_array_equal(o2[2][:nrows], out[0])
                    np.testing.assert_array_equal(o2[3][:n2], o2[1][:n2])
                    assert (o2[3][n2:] == 7.0).all()
                # four matrices of four heights in one launch (GDN's qkv, z, beta, alpha): each as its own launch
                heights = (nrows, 40, nrows, 8)
                mats = [(first if m % 2 == 0 else second) for m in range(4)]
                gemv = kernels.gemv_dp4a if int8 else kernels.gemv_f32
                by.upload(np.full(4 * nrows * pairs, 7.0, np.float32))
                ys = y
                gemv(qtype, mats[0], xin, ys[0], heights[0], ncols,
                     more=[(mats[m], ys[m], heights[m]) for m in range(1, 4)])
                got4 = by.download(dtype=np.float32).reshape(4, -1)
                for m in range(4):
                    hm = heights[m]
                    with gpu.Buffer(4 * hm) as one:
                        gemv(qtype, mats[m], xin, one, hm, ncols)
                        np.testing.assert_array_equal(got4[m][:hm], one.download(dtype=np.float32))
                    assert (got4[m][hm:] == 7.0).all(), m
                with pytest.raises(ValueError, match="at most"):
                    gemv(qtype, first, xin, ys[0], nrows, ncols, more=[(second, ys[1], nrows)] * 4)
                # the MoE form: pairs over experts ids (one skipped), x shared (x_group = pairs)
                xs = 0
                kernels.gemv_ids(qtype, first, xin, y[0], nrows, ncols, bi, pairs, eb, pairs, xs, int8=int8)
                kernels.gemv_ids(qtype, second, xin, y[1], nrows, ncols, bi, pairs, eb, pairs, xs, int8=int8)
                kernels.gemv_ids(qtype, first, xin, y[2], nrows, ncols, bi, pairs, eb, pairs, xs, int8=int8,
                                 W2=second, y2=y[3])
                out = by.download(dtype=np.float32).reshape(4, pairs, nrows)
                np.testing.assert_array_equal(out[2], out[0])
                np.testing.assert_array_equal(out[3], out[1])
                assert (out[3][1] == 0).all() and not np.array_equal(out[0], out[1])


@pytest.mark.cpu
def test_expert_tiles():
    ids = np.array([0, 0, 2] + [5] * 70 + [7], dtype=np.int32)
    t = gpu.Kernels.expert_tiles(ids)
    assert t.tolist() == [[0, 0, 2], [2, 2, 1], [5, 3, 32], [5, 35, 32], [5, 67, 6], [7, 73, 1]]
    t64 = gpu.Kernels.expert_tiles(ids, gpu.GEMM_MMA_TT)
    assert t64.tolist() == [[0, 0, 2], [2, 2, 1], [5, 3, 64], [5, 67, 6], [7, 73, 1]]
    assert len(t64) <= gpu.Kernels.sort_tiles_max(ids.size, 8, gpu.GEMM_MMA_TT)
    assert gpu.Kernels.group_tile(True, True) == gpu.GEMM_MMA_TT
    assert gpu.Kernels.group_tile(True, False) == gpu.Kernels.group_tile(False, False) == gpu.GEMM_TT
    assert gpu.Kernels.expert_tiles(np.zeros(0, np.int32)).shape == (0, 3)
    with pytest.raises(ValueError, match="sorted"):
        gpu.Kernels.expert_tiles(np.array([3, 1], np.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES + [gpu.F32], ids=[tname(t) for t in TYPES] + ["f32"])
@variant_params()
def test_gemm_ids(kernels, qtype):
    """The grouped expert GEMM gives, tile by tile, exactly what gemm_f32 gives for that expert's rows."""
    rng = np.random.default_rng(700 + qtype)
    n_exp, k = 5, 1
    nrows, ncols = 72, 512                            # a partial row tile; 2 K-quant blocks per row
    w, eb = expert_weights(rng, qtype, n_exp, nrows, ncols)
    ids = np.sort(rng.integers(0, n_exp, 90)).astype(np.int32)
    ids[ids == 3] = 4                                  # an expert with no tokens
    ids = np.sort(ids)
    n_pairs = ids.size * k
    X = rng.standard_normal((n_pairs, ncols)).astype(np.float32)
    tiles = gpu.Kernels.expert_tiles(ids)
    with gpu.Buffer.from_array(w) as bw, gpu.Buffer.from_array(X) as bx, gpu.Buffer.from_array(tiles) as bt, \
            gpu.Buffer(4 * n_pairs * nrows) as by, gpu.Buffer(4 * 32 * nrows) as b1:
        kernels.gemm_ids(qtype, bw, bx, by, nrows, ncols, bt, len(tiles), eb, n_pairs)
        Y = by.download(dtype=np.float32).reshape(n_pairs, nrows)
        for e, p0, cnt in tiles.tolist():
            kernels.gemm_f32(qtype, bw.ptr + e * eb, bx.ptr + 4 * p0 * ncols, b1, nrows, ncols, cnt)
            ref = b1.download(dtype=np.float32, count=cnt * nrows).reshape(cnt, nrows)
            np.testing.assert_array_equal(Y[p0:p0 + cnt], ref, err_msg=f"tile ({e}, {p0}, {cnt})")


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
def test_moe_sort(kernels):
    """The GPU's expert order equals numpy's stable argsort and expert_tiles, padded with empty tiles; counts
    accumulate over calls; a pass with unused experts, one with a single expert, one of a few pairs."""
    rng = np.random.default_rng(31)
    cases = [(2048, 8, 256, rng.integers(0, 256, 2048 * 8)), (37, 4, 16, np.full(37 * 4, 5)),
             (3, 2, 512, rng.integers(0, 512, 6)), (300, 8, 64, rng.zipf(1.3, 2400) % 64)]
    for (n_tok, k, ne, raw), tile in itertools.product(cases, (gpu.GEMM_TT, gpu.GEMM_MMA_TT)):
        ids = np.asarray(raw, dtype=np.int32)
        P, mt = ids.size, gpu.Kernels.sort_tiles_max(ids.size, ne, tile)
        order = np.argsort(ids, kind="stable")
        inv = np.empty(P, np.int64)
        inv[order] = np.arange(P)
        want_tiles = gpu.Kernels.expert_tiles(ids[order], tile)
        counts0 = rng.integers(0, 100, ne).astype(np.int32)
        with gpu.Buffer.from_array(ids) as bi, gpu.Buffer(4 * P) as be, gpu.Buffer(4 * P) as bt, \
                gpu.Buffer(4 * P) as bv, gpu.Buffer(12 * mt) as btl, gpu.Buffer.from_array(counts0) as bc:
            _native.gpu_memset8(btl.ptr, 0xAB, 12 * mt)
            for _ in range(2):
                kernels.moe_sort(bi, P, k, ne, be, bt, bv, btl, mt, bc, tile=tile)
            np.testing.assert_array_equal(be.download(dtype=np.int32), ids[order])
            np.testing.assert_array_equal(bt.download(dtype=np.int32), order // k)
            np.testing.assert_array_equal(bv.download(dtype=np.int32), inv)
            tiles = btl.download(dtype=np.int32).reshape(mt, 3)
            np.testing.assert_array_equal(tiles[:len(want_tiles)], want_tiles)
            assert (tiles[len(want_tiles):] == 0).all()
            np.testing.assert_array_equal(bc.download(dtype=np.int32), counts0 + 2 * np.bincount(ids, minlength=ne))


@pytest.mark.cpu
def test_moe_sort_checks_its_arguments():
    k = object.__new__(gpu.Kernels)
    with pytest.raises(ValueError, match="n_expert"):
        k.moe_sort(0, 16, 2, 513, 0, 0, 0, 0, 100, 0)
    with pytest.raises(ValueError, match="max_tiles"):
        k.moe_sort(0, 64, 8, 256, 0, 0, 0, 0, 2, 0)
    with pytest.raises(ValueError, match="tile"):
        k.moe_sort(0, 64, 8, 256, 0, 0, 0, 0, 300, 0, tile=65)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES, ids=[tname(t) for t in TYPES])
@variant_params()
def test_gemm_dp4a(kernels, qtype):
    """The int8 prefill GEMM: each (token, row) is gemv_dp4a's sum over sub-blocks, so the reference is
    test_gemv_dp4a's per token (Q8_1 blocks made by the same variant); sub-blocks are summed one after another."""
    rng = np.random.default_rng(300 + qtype)
    for (nrows, ncols), ntok in zip(gemv_shapes(qtype), (1, 37)):
        nrows += 40        # a partial row tile; ncols 32 / 2240: a partial step of 4 sub-blocks
        nsub = ncols // 32
        w = random_weights(rng, qtype, nrows, ncols)
        X = rng.standard_normal((ntok, ncols)).astype(np.float32)
        W, m = dequant(qtype, w, nrows, ncols)
        with gpu.Buffer.from_array(w) as bw, gpu.Buffer.from_array(X) as bx, \
                gpu.Buffer(ntok * nsub * 36) as bq, gpu.Buffer(4 * nrows * ntok) as by:
            kernels.quantize_q8_1(bx, bq, ntok * ncols)
            kernels.gemm_dp4a(qtype, bw, bq, by, nrows, ncols, ntok)
            Y = by.download(dtype=np.float32).reshape(ntok, nrows)
            xq = bq.download().view(Q8_1_GPU).reshape(ntok, nsub)
        d8, s8, q8 = xq["d"].astype(np.float64), xq["s"].astype(np.float64), xq["qs"].astype(np.float64)
        xhat = (d8[:, :, None] * q8).reshape(ntok, ncols)
        msub = m[:, ::32]                                          # [nrows, nsub]
        corr = d8 * q8.sum(axis=2) - s8                            # [ntok, nsub]
        ref = xhat @ W.T + corr @ msub.T
        mag = np.abs(xhat) @ (np.abs(W + m) + np.abs(m)).T + np.abs(s8) @ np.abs(msub).T
        assert_close_sum(Y, ref, mag, nsub + 5, f"gemm_dp4a {tname(qtype)} {ntok}x{nrows}x{ncols}")


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES, ids=[tname(t) for t in TYPES])
@variant_params()
def test_gemm_dp4a_ids(kernels, qtype):
    """The grouped int8 GEMM gives, tile by tile, exactly what gemm_dp4a gives for that expert's rows."""
    rng = np.random.default_rng(710 + qtype)
    n_exp, nrows, ncols = 5, 72, 512
    w, eb = expert_weights(rng, qtype, n_exp, nrows, ncols)
    ids = np.sort(rng.integers(0, n_exp, 90)).astype(np.int32)
    ids[ids == 3] = 4                                  # an expert with no tokens
    ids = np.sort(ids)
    n_pairs, qb = ids.size, ncols // 32 * 36
    X = rng.standard_normal((n_pairs, ncols)).astype(np.float32)
    tiles = np.concatenate([gpu.Kernels.expert_tiles(ids), np.zeros((2, 3), np.int32)])   # + moe_sort's padding
    with gpu.Buffer.from_array(w) as bw, gpu.Buffer.from_array(X) as bx, gpu.Buffer.from_array(tiles) as bt, \
            gpu.Buffer(n_pairs * qb) as bq, gpu.Buffer(4 * n_pairs * nrows) as by, gpu.Buffer(4 * 32 * nrows) as b1:
        kernels.quantize_q8_1(bx, bq, n_pairs * ncols)
        kernels.gemm_ids(qtype, bw, bq, by, nrows, ncols, bt, len(tiles), eb, n_pairs, int8=True)
        Y = by.download(dtype=np.float32).reshape(n_pairs, nrows)
        for e, p0, cnt in tiles[:-2].tolist():
            kernels.gemm_dp4a(qtype, bw.ptr + e * eb, bq.ptr + p0 * qb, b1, nrows, ncols, cnt)
            ref = b1.download(dtype=np.float32, count=cnt * nrows).reshape(cnt, nrows)
            np.testing.assert_array_equal(Y[p0:p0 + cnt], ref, err_msg=f"tile ({e}, {p0}, {cnt})")


# the variants with gemm_mma: sm_75's two m8n8k16 and the card's own (m16n8k16 from sm_80)
MMA_VARIANTS = sorted({("dp4a", gpu.MMA_ARCH), ("dp4a", NATIVE_ARCH)})


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES, ids=[tname(t) for t in TYPES])
@pytest.mark.parametrize("kernels", MMA_VARIANTS, ids=[gpu.variant_name(*v) for v in MMA_VARIANTS], indirect=True)
def test_gemm_mma(kernels, qtype):
    """The tensor-core GEMM gives gemm_dp4a's bits (the same integer sums, the same f32 update) in its 64- and
    32-token forms: a partial row tile, a partial last step of sub-blocks, one token, a partial token tile and several
    token tiles."""
    rng = np.random.default_rng(900 + qtype)
    for (nrows, ncols), ntok in zip(gemv_shapes(qtype) * 2, (1, 37, 150, 64)):   # 64 = GEMM_MMA_TT: one full tile
        nrows += 40
        nsub = ncols // 32
        w = random_weights(rng, qtype, nrows, ncols)
        X = rng.standard_normal((ntok, ncols)).astype(np.float32)
        with gpu.Buffer.from_array(w) as bw, gpu.Buffer.from_array(X) as bx, \
                gpu.Buffer(ntok * nsub * 36) as bq, gpu.Buffer(4 * nrows * ntok) as by:
            kernels.quantize_q8_1(bx, bq, ntok * ncols)
            kernels.gemm_dp4a(qtype, bw, bq, by, nrows, ncols, ntok)
            ref = by.download(dtype=np.float32).reshape(ntok, nrows)
            Y = {}
            for tt in (gpu.GEMM_TT, gpu.GEMM_MMA_TT):
                by.upload(np.full(ntok * nrows, np.nan, np.float32))
                kernels.gemm_mma(qtype, bw, bq, by, nrows, ncols, ntok, tt=tt)
                Y[tt] = by.download(dtype=np.float32).reshape(ntok, nrows)
        assert np.isfinite(ref).all() and np.abs(ref).max() > 0
        for tt, y in Y.items():
            np.testing.assert_array_equal(y, ref, err_msg=f"gemm_mma tt={tt} {tname(qtype)} {ntok}x{nrows}x{ncols}")


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES, ids=[tname(t) for t in TYPES])
@pytest.mark.parametrize("kernels", MMA_VARIANTS, ids=[gpu.variant_name(*v) for v in MMA_VARIANTS], indirect=True)
def test_gemm_mma_ids(kernels, qtype):
    """The grouped tensor-core GEMM (tiles of up to 64 pairs) equals the grouped dp4a one (tiles of 32) bit for bit:
    an expert with no tokens, one with more than 64 pairs, padded empty tiles."""
    rng = np.random.default_rng(950 + qtype)
    n_exp, nrows, ncols = 5, 72, 512
    w, eb = expert_weights(rng, qtype, n_exp, nrows, ncols)
    ids = np.sort(rng.integers(0, n_exp, 200)).astype(np.int32)
    ids[ids == 3] = 4
    ids = np.sort(ids)
    n_pairs = ids.size
    assert np.bincount(ids).max() > gpu.GEMM_MMA_TT
    X = rng.standard_normal((n_pairs, ncols)).astype(np.float32)
    with gpu.Buffer.from_array(w) as bw, gpu.Buffer.from_array(X) as bx, \
            gpu.Buffer(n_pairs * ncols // 32 * 36) as bq, gpu.Buffer(4 * n_pairs * nrows) as by:
        kernels.quantize_q8_1(bx, bq, n_pairs * ncols)
        Y = {}
        for mma in (False, True):
            tiles = np.concatenate([gpu.Kernels.expert_tiles(ids, gpu.Kernels.group_tile(True, mma)),
                                    np.zeros((2, 3), np.int32)])
            by.upload(np.full(n_pairs * nrows, np.nan, np.float32))
            with gpu.Buffer.from_array(tiles) as bt:
                kernels.gemm_ids(qtype, bw, bq, by, nrows, ncols, bt, len(tiles), eb, n_pairs, int8=True, mma=mma)
            Y[mma] = by.download(dtype=np.float32).reshape(n_pairs, nrows)
    assert np.isfinite(Y[False]).all()
    np.testing.assert_array_equal(Y[True], Y[False])


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES, ids=[tname(t) for t in TYPES])
@variant_params()
def test_gemm_multi(kernels, qtype):
    """Several matrices on one input in one launch (gemm_multi: a layer's projections) give each matrix exactly the
    bits of its own plain launch: dp4a, and mma in both token forms where the variant has it; 16-row matrices (GDN's
    beta / alpha), partial row tiles, one to four matrices, one and several token tiles."""
    if not kernels.many_regs:
        with pytest.raises(UnavailableError, match="multi"):
            kernels.gemm_multi(qtype, [(0, 0, 16)], 0, 256, 8, False)
        return
    rng = np.random.default_rng(980 + qtype)
    ncols = gemv_shapes(qtype)[1][1]
    forms = [(False, None)] + ([(True, gpu.GEMM_TT), (True, gpu.GEMM_MMA_TT)] if kernels.has_mma else [])
    for rows, ntok in (([16], 5), ([300, 16, 16, 129], 37), ([16, 200], 150)):
        ws = [random_weights(rng, qtype, r, ncols) for r in rows]
        X = rng.standard_normal((ntok, ncols)).astype(np.float32)
        bws = [gpu.Buffer.from_array(w) for w in ws]
        bys = [gpu.Buffer(4 * r * ntok) for r in rows]
        try:
            with gpu.Buffer.from_array(X) as bx, gpu.Buffer(ntok * ncols // 32 * 36) as bq:
                kernels.quantize_q8_1(bx, bq, ntok * ncols)
                for mma, tt in forms:
                    plain = kernels.gemm_mma if mma else kernels.gemm_dp4a
                    refs = []
                    for bw, by, r in zip(bws, bys, rows):
                        plain(qtype, bw, bq, by, r, ncols, ntok, **({"tt": tt} if mma else {}))
                        refs.append(by.download(dtype=np.float32).reshape(ntok, r))
                        by.upload(np.full(ntok * r, np.nan, np.float32))
                    kernels.gemm_multi(qtype, [(bw, by, r) for bw, by, r in zip(bws, bys, rows)], bq, ncols, ntok,
                                       mma, tt=tt)
                    for by, r, ref in zip(bys, rows, refs):
                        assert np.isfinite(ref).all() and np.abs(ref).max() > 0
                        np.testing.assert_array_equal(by.download(dtype=np.float32).reshape(ntok, r), ref,
                                                      err_msg=f"{tname(qtype)} mma={mma} tt={tt} rows={rows}")
        finally:
            for b in bws + bys:
                b.free()


@pytest.mark.gpu
@variant_params()
def test_gemm_mma_only_where_the_variant_has_it(kernels):
    """Variants without the int8 mma (fermi, kepler, dp4a below sm_75) say so instead of launching."""
    if kernels.has_mma:
        assert "gemm_mma_q4_K" in kernels.modules["gemm_mma"].kernel("gemm_mma_q4_K").name
        return
    with gpu.Buffer(4096) as b:
        with pytest.raises(UnavailableError, match="no int8 mma"):
            kernels.gemm_mma(12, b, b, b, 32, 256, 1)
        with pytest.raises(UnavailableError, match="gemm_mma_ids"):
            kernels.gemm_ids(12, b, b, b, 32, 256, b, 1, 0, 1, int8=True, mma=True)


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



def plan_kernels(graph: bool) -> "gpu.Kernels":
    """The kepler kernels for the launch-plan tests; skips where the driver lacks graphs (graph) or the tier."""
    if graph and not gpu.graphs_available():
        pytest.skip("the driver has no CUDA graphs")
    try:
        return gpu.Kernels("kepler", NATIVE_ARCH)
    except UnavailableError as e:
        pytest.skip(str(e))


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["replay", "graph"])
def test_launch_plan_replays_in_order(gpu_device, graph):
    """A recorded chain of dependent adds (x <- x + d, 40 times) replayed from a LaunchPlan, launch by launch or as
    one CUDA graph, runs every launch once and in order, after an upload on the default stream and before a
    download there: exact in f32 (small integers)."""
    k = plan_kernels(graph)
    n, steps = 4096, 40
    d = np.arange(n, dtype=np.float32) % 7
    with gpu.Buffer.from_array(np.zeros(n, np.float32)) as bx, gpu.Buffer.from_array(d) as bd:
        with gpu.record() as launches:
            for _ in range(steps):
                k.add(bx, bd, bx, n)
        assert len(launches) == steps
        plan = gpu.LaunchPlan(launches, graph=graph)
        assert plan.graph == graph and len(plan) == steps
        for rep in range(3):
            x0 = np.full(n, rep, np.float32)
            bx.upload(x0)
            plan.replay()
            got = bx.download(dtype=np.float32, count=n)
            np.testing.assert_array_equal(got, x0 + steps * d)


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["replay", "graph"])
def test_launch_plan_runs_host_steps_between_segments(gpu_device, graph):
    """Host steps (gpu.host_step) split a plan: each replay runs segment 1, the host step (which reads x, as the
    hybrid decode reads the routing, and writes a value the next segment adds), then segment 2, in that order."""
    k = plan_kernels(graph)
    n = 4096
    d = np.arange(n, dtype=np.float32) % 5
    seen = []
    with gpu.Buffer.from_array(np.zeros(n, np.float32)) as bx, gpu.Buffer.from_array(d) as bd, \
            gpu.Buffer(4 * n) as bh:
        def host():
            x = bx.download(dtype=np.float32, count=n)
            seen.append(x.copy())
            bh.upload(2 * x)
        with gpu.record() as launches:
            for _ in range(3):
                k.add(bx, bd, bx, n)
            gpu.host_step(host)
            k.add(bx, bh, bx, n)
        plan = gpu.LaunchPlan(launches, graph=graph)
        assert len(plan) == 4 and plan.host_steps == 1
        for rep in range(3):
            x0 = np.full(n, rep, np.float32)
            bx.upload(x0)
            plan.replay()
            mid = x0 + 3 * d
            np.testing.assert_array_equal(seen[-1], mid)
            np.testing.assert_array_equal(bx.download(dtype=np.float32, count=n), 3 * mid)
        assert len(seen) == 4          # once while recording, once per replay


# ================================================================================================ layer ops
# conv1d.cu, gdn.cu, attention.cu, moe_route.cu, argmax.cu, elementwise.cu against f64 numpy transcriptions of
# native/gdn.c, attention.c, moe.c on the same f32 inputs. Every bound is u = 2^-24 times a count of roundings (each
# named below with its reason) times a magnitude the reference computes; the mistakes these tests exist for (a
# wrong tap, head, mask, gate or tie) move results by a sizeable fraction of that magnitude, not by ulps.

U = tol.GPU_SUM_U
# SiLU / sigmoid as x / (1 + e^-x): CUDA's expf is within 2 ulp, which moves 1 + e^-x by at most 2u relative (the
# sum of positives does not cancel); then the add and the division round: 4u; times u (swiglu), 5u. 6u leaves 1u.
SILU_ROUNDINGS = 6
# The conv: K FMAs in a chain (K u sum|w x|), then SiLU, whose slope is within [-0.1, 1.1]: the sum's error passes
# with a factor <= 1.1, SiLU adds SILU_ROUNDINGS u of its value.
CONV_SLOPE = 1.1
# softplus(x) = log1p(e^x): expf 2 ulp (its error in log1p(y) is at most the same relative), log1pf 1 ulp, the add
# x + dt_bias (done in f32 in both: the reference below rounds it too) and the product with ssm_a: 4u; 8u with margin.
GATES_ROUNDINGS = 8
# l2norm and the gated RMSNorm: as GPU_RMSNORM_REL (a sum of squares over <= 128-thread blocks: chain 8 for d = 128,
# halved by the square root, 4 roundings for the scale, 2-3 products, SiLU's 4u): <= 15u; 2e-6 = 33u.
GDN_NORM_REL = 2e-6
# The delta rule per column c of S (spec §2.3): one step rounds S^T k (a chain of dk: <= dk u |S_c| since |k| = 1),
# v - kv, beta *, decay * S (expf: 2 more), S + k delta (each <= u of |S_c|, and |k delta| <= 2 max|S_c|): per step
# <= (dk + 8) u max|S_c|; 4 more for margin. The step is non-expansive on an error (decay <= 1, I - beta k k^T has
# eigenvalues 1 and 1 - beta in [0, 1]), so after t steps the state is off by <= t (dk + GDN_STEP_EXTRA) u max|S_c|,
# and o = S^T q adds its own chain of dk: |o err| <= |q| max|S_c| (t + 1)(dk + GDN_STEP_EXTRA) u (|.|: 2-norms).
GDN_STEP_EXTRA = 12
# Attention: a score s_p = scale q.k_p is off by <= (hd + 2) u scale sum|q k_p| (the dot product's chain, the scale);
# a weight e^(s_p - m) / sum by twice the largest score error; the online softmax rescales and adds per key (2 per
# key in the running sums, the same alpha on numerator and denominator), the merges add a few: chain 2 n_keys + 16;
# ATTN_EXTRA u of max|v| covers expf's 2 ulp on each weight and the roundings of s - m; then the gate's sigmoid.
ATTN_EXTRA = 32
# MoE weights: each p is e / sum with e from expf (2 ulp; the reference's exp 1 more) and a different f32 / f64
# denominator, which cancels in p_s / sum_s p_s up to the divisions; the k-term f32 sum and the last division round
# in both: <= 2 (3 + 1) + 2 (k + 1) u; (2k + 16) u.
MOE_W_EXTRA = 16


def silu64(x):
    x = np.asarray(x, np.float64)
    return x / (1.0 + np.exp(-x))


def sigmoid64(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


def conv1d_ref(x, w, state):
    """native/gdn.c: y[t, c] = SiLU(sum_k w[c, k] xin[t + k, c]), xin = [state; x]; the new state (f64, and the
    magnitude sum_k |w x|)."""
    K = w.shape[1]
    xin = np.concatenate([state, x]).astype(np.float64)
    n = x.shape[0]
    s = sum(w[:, k].astype(np.float64) * xin[k:k + n] for k in range(K))
    mag = sum(np.abs(w[:, k].astype(np.float64) * xin[k:k + n]) for k in range(K))
    return silu64(s), mag, xin[n:].astype(np.float32)


@pytest.mark.gpu
@variant_params()
def test_conv1d(kernels):
    rng = np.random.default_rng(10)
    for K, conv_dim, steps in ((4, 300, (1, 2, 150, 1)), (4, 8192, (1,)), (3, 130, (70, 1)), (8, 64, (5,))):
        w = rng.standard_normal((conv_dim, K)).astype(np.float32)
        state = rng.standard_normal((K - 1, conv_dim)).astype(np.float32)
        with gpu.Buffer.from_array(w) as bw, gpu.Buffer.from_array(state) as bs:
            for n in steps:       # one after another through the same state: n = 2 < K-1 shifts old state rows
                x = rng.standard_normal((n, conv_dim)).astype(np.float32) * 2
                ref, mag, state = conv1d_ref(x, w, state)
                with gpu.Buffer.from_array(x) as bx, gpu.Buffer(x.nbytes) as by:
                    kernels.conv1d_silu(bx, bw, bs, by, n, conv_dim, K)
                    y = by.download(dtype=np.float32).reshape(n, conv_dim)
                got_state = bs.download(dtype=np.float32).reshape(K - 1, conv_dim)
                assert np.array_equal(got_state, state), f"conv state after {n} tokens (K={K})"
                bound = CONV_SLOPE * K * U * mag + SILU_ROUNDINGS * U * np.abs(ref) + 1e-30
                err = np.abs(y - ref)
                assert (err <= bound).all(), f"conv1d K={K} n={n}: max err/bound {np.max(err / bound):.3g}"


@pytest.mark.gpu
@variant_params()
def test_conv1d_chunked_equals_stepwise(kernels):
    """150 tokens at once (three grid.y runs) give bit for bit what 150 single-token calls give."""
    rng = np.random.default_rng(11)
    K, conv_dim, n = 4, 200, 150
    w = rng.standard_normal((conv_dim, K)).astype(np.float32)
    state = rng.standard_normal((K - 1, conv_dim)).astype(np.float32)
    x = rng.standard_normal((n, conv_dim)).astype(np.float32)
    with gpu.Buffer.from_array(w) as bw, gpu.Buffer.from_array(state) as s1, gpu.Buffer.from_array(state) as s2, \
            gpu.Buffer.from_array(x) as bx, gpu.Buffer(x.nbytes) as by1, gpu.Buffer(x.nbytes) as by2:
        kernels.conv1d_silu(bx, bw, s1, by1, n, conv_dim, K)
        row = 4 * conv_dim
        for t in range(n):
            kernels.conv1d_silu(bx.ptr + t * row, bw, s2, by2.ptr + t * row, 1, conv_dim, K)
        assert np.array_equal(by1.download(dtype=np.float32), by2.download(dtype=np.float32))
        assert np.array_equal(s1.download(dtype=np.float32), s2.download(dtype=np.float32))


@pytest.mark.gpu
@variant_params()
def test_conv1d_step_l2norm_equals_its_three_launches(kernels):
    """A decode step's conv, state update and q/k l2 norms in one launch give bit for bit what conv1d_silu and
    gdn_l2norm_qk give (y and the state, several steps through one state), for Qwen3.5's heads (dk 128), a head
    narrower than the block and a v part that ends a block early; bad shapes are refused."""
    rng = np.random.default_rng(13)
    for K, Hk, dk, vdim in ((4, 16, 128, 4096), (4, 3, 40, 200), (3, 2, 128, 30)):
        conv_dim = 2 * Hk * dk + vdim
        w = rng.standard_normal((conv_dim, K)).astype(np.float32)
        state = rng.standard_normal((K - 1, conv_dim)).astype(np.float32)
        with gpu.Buffer.from_array(w) as bw, gpu.Buffer.from_array(state) as s1, gpu.Buffer.from_array(state) as s2, \
                gpu.Buffer(4 * conv_dim) as bx, gpu.Buffer(4 * conv_dim) as y1, gpu.Buffer(4 * conv_dim) as y2:
            for step in range(3):
                bx.upload(rng.standard_normal(conv_dim).astype(np.float32) * 2)
                kernels.conv1d_silu(bx, bw, s1, y1, 1, conv_dim, K)
                kernels.gdn_l2norm_qk(y1, 1, conv_dim, Hk, dk)
                kernels.conv1d_step_l2norm(bx, bw, s2, y2, conv_dim, K, Hk, dk)
                what = f"K={K} Hk={Hk} dk={dk} step {step}"
                np.testing.assert_array_equal(y2.download(dtype=np.float32), y1.download(dtype=np.float32), what)
                np.testing.assert_array_equal(s2.download(dtype=np.float32), s1.download(dtype=np.float32), what)
            with pytest.raises(ValueError):
                kernels.conv1d_step_l2norm(bx, bw, s2, y2, conv_dim, K, Hk, gpu.CONV_THREADS + 1)
            with pytest.raises(ValueError):
                kernels.conv1d_step_l2norm(bx, bw, s2, bx, conv_dim, K, Hk, dk)


@pytest.mark.gpu
@variant_params()
def test_grid_sync_holds(kernels):
    """le_grid_sync (cuda8/grid_sync.cuh): one, several and every SM's worth of co-resident blocks meet 200 times; no
    block ever sees another's count of a round stale past a barrier, each cell counts every round, and the barrier's
    words are back at (0, even count of rounds x 2) for the next launch."""
    for n_blocks in (1, 7, kernels.sm_count):
        with gpu.Buffer(8) as bar, gpu.Buffer(4 * (n_blocks + 1)) as cells:
            _native.gpu_memset8(bar.ptr, 0, 8)
            _native.gpu_memset8(cells.ptr, 0, cells.nbytes)
            kernels.grid_sync_check(bar, cells, n_blocks, 200)
            got = cells.download(dtype=np.uint32)
            assert got[n_blocks] == 0 and (got[:n_blocks] == 200).all(), (n_blocks, got[n_blocks], got[:4])
            assert list(bar.download(dtype=np.uint32)) == [0, 400], n_blocks
            kernels.grid_sync_time(bar, n_blocks, 50)
            assert list(bar.download(dtype=np.uint32)) == [0, 450], n_blocks
            with gpu.Buffer(16 * 64 * 3) as src, gpu.Buffer(4) as sink:
                _native.gpu_memset8(src.ptr, 0, src.nbytes)
                kernels.grid_sync_stream(bar, src, 64, 3, sink, n_blocks)
                kernels.grid_sync_stream(bar, src, 64, 3, sink, n_blocks, ahead=True)
                assert list(bar.download(dtype=np.uint32)) == [0, 456], n_blocks


@pytest.mark.gpu
@variant_params()
def test_gdn_gates_and_norms(kernels):
    rng = np.random.default_rng(12)
    # gates: beta = sigmoid(b), g = softplus(a + dt_bias) * ssm_a, both branches of softplus (x > 20: x)
    n, Hv = 37, 32
    b = (rng.standard_normal((n, Hv)) * 4).astype(np.float32)
    a = (rng.standard_normal((n, Hv)) * 8).astype(np.float32)
    a[0, :4] = [25.0, -30.0, 19.5, 20.5]
    dt = rng.standard_normal(Hv).astype(np.float32)
    A = -np.exp(rng.standard_normal(Hv)).astype(np.float32)
    x = (a + dt).astype(np.float32).astype(np.float64)                # the f32 add, as both sides do it
    sp = np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))
    g_ref, beta_ref = sp * A, sigmoid64(b)
    with gpu.Buffer.from_array(b) as bb, gpu.Buffer.from_array(a) as ba, gpu.Buffer.from_array(dt) as bd, \
            gpu.Buffer.from_array(A) as bA:
        kernels.gdn_gates(bb, ba, bd, bA, n, Hv)
        beta, g = bb.download(dtype=np.float32).reshape(n, Hv), ba.download(dtype=np.float32).reshape(n, Hv)
    assert np.all(np.abs(beta - beta_ref) <= GATES_ROUNDINGS * U * beta_ref + 1e-30)
    assert np.all(np.abs(g - g_ref) <= GATES_ROUNDINGS * U * np.abs(g_ref) + 1e-30), np.max(np.abs(g - g_ref))

    # l2norm of the q and k heads of u (v untouched), q then * 1/sqrt(dk)
    for n, Hk, Hv, dk, dv in ((5, 16, 32, 128, 128), (70000 // 4, 2, 2, 16, 32)):  # 2nd: n*2*Hk > 65535 rows
        conv_dim = 2 * Hk * dk + Hv * dv
        u = (rng.standard_normal((n, conv_dim)) * rng.uniform(0.01, 10, (n, 1))).astype(np.float32)
        qscale = np.float32(1) / np.sqrt(np.float32(dk))
        ud = u.astype(np.float64)
        heads = ud[:, :2 * Hk * dk].reshape(n, 2 * Hk, dk)
        ref = heads / np.sqrt((heads ** 2).sum(axis=2, keepdims=True) + 1e-6)
        ref[:, :Hk] *= np.float64(qscale)
        with gpu.Buffer.from_array(u) as bu:
            kernels.gdn_l2norm_qk(bu, n, conv_dim, Hk, dk, 1e-6)
            got = bu.download(dtype=np.float32).reshape(n, conv_dim)
        assert np.array_equal(got[:, 2 * Hk * dk:], u[:, 2 * Hk * dk:]), "v must not change"
        err = np.abs(got[:, :2 * Hk * dk].reshape(n, 2 * Hk, dk) - ref) / np.abs(ref)
        assert err.max() <= GDN_NORM_REL, (n, Hk, dk, err.max())

    # gated RMSNorm per head: RMSNorm(o) * w * SiLU(z), in place
    for nrows, dv in ((37 * 32, 128), (5, 16)):
        o = (rng.standard_normal((nrows, dv)) * rng.uniform(0.01, 10, (nrows, 1))).astype(np.float32)
        z = (rng.standard_normal((nrows, dv)) * 3).astype(np.float32)
        w = rng.uniform(0.5, 1.5, dv).astype(np.float32)
        od = o.astype(np.float64)
        ref = od / np.sqrt((od ** 2).mean(axis=1, keepdims=True) + 1e-6) * w * silu64(z)
        with gpu.Buffer.from_array(o) as bo, gpu.Buffer.from_array(z) as bz, gpu.Buffer.from_array(w) as bw, \
                gpu.Buffer(max(nrows * dv // 32, 1) * 36) as bq, gpu.Buffer(max(nrows * dv // 32, 1) * 36) as bq2:
            q8 = dv % 32 == 0          # with the out projection's Q8_1: the same bits as quantize_q8_1 of the result
            kernels.gdn_gated_rmsnorm(bo, bz, bw, bo, nrows, dv, 1e-6, yq=bq if q8 else None)
            got = bo.download(dtype=np.float32).reshape(nrows, dv)
            if q8:
                kernels.quantize_q8_1(bo, bq2, nrows * dv)
                assert np.array_equal(bq.download(), bq2.download())
        err = np.abs(got - ref) / np.maximum(np.abs(ref), 1e-300)
        assert err.max() <= GDN_NORM_REL, (nrows, dv, err.max())


def gdn_ref(u, g, beta, S0, Hk, Hv, dk, dv, tiled=True):
    """gdn.c gdn_recurrent_head in f64 for all heads -> (o [n, Hv*dv], S [Hv, dk, dv], cmax [n, Hv, dv]: the largest
    2-norm of each state column so far)."""
    n = u.shape[0]
    S = S0.astype(np.float64).copy()
    o = np.zeros((n, Hv, dv))
    cmax = np.zeros((n, Hv, dv))
    kh = np.arange(Hv) % Hk if tiled else np.arange(Hv) // (Hv // Hk)
    run = np.sqrt((S ** 2).sum(axis=1))
    for t in range(n):
        row = u[t].astype(np.float64)
        q = row[:Hk * dk].reshape(Hk, dk)[kh]                       # [Hv, dk]
        k = row[Hk * dk:2 * Hk * dk].reshape(Hk, dk)[kh]
        v = row[2 * Hk * dk:].reshape(Hv, dv)
        S *= np.exp(g[t].astype(np.float64))[:, None, None]
        kv = np.einsum("hij,hi->hj", S, k)
        delta = beta[t].astype(np.float64)[:, None] * (v - kv)
        run = np.maximum(run, np.sqrt((S ** 2).sum(axis=1)))
        S += k[:, :, None] * delta[:, None, :]
        run = np.maximum(run, np.sqrt((S ** 2).sum(axis=1)))
        cmax[t] = run
        o[t] = np.einsum("hij,hi->hj", S, q)
    return o.reshape(n, Hv * dv), S, cmax


def gdn_inputs(rng, n, Hk, Hv, dk, dv):
    """u with l2-normalised q (times 1/sqrt(dk)) and k heads (in f32, as the GPU's norm kernel leaves them), g < 0,
    beta in (0, 1), a random start state."""
    conv_dim = 2 * Hk * dk + Hv * dv
    u = rng.standard_normal((n, conv_dim)).astype(np.float32)
    qk = u[:, :2 * Hk * dk].reshape(n, 2 * Hk, dk)
    qk /= np.sqrt((qk.astype(np.float64) ** 2).sum(axis=2, keepdims=True)).astype(np.float32)
    qk[:, :Hk] *= np.float32(1) / np.sqrt(np.float32(dk))
    u[:, :2 * Hk * dk] = qk.reshape(n, -1)
    g = -rng.uniform(0.01, 2.0, (n, Hv)).astype(np.float32)
    beta = rng.uniform(0.05, 1.0, (n, Hv)).astype(np.float32)
    S0 = (rng.standard_normal((Hv, dk, dv)) * 0.5).astype(np.float32)
    return u, g, beta, S0


@pytest.mark.gpu
@variant_params()
def test_gdn_recurrent(kernels):
    rng = np.random.default_rng(13)
    for n, Hk, Hv, dk, dv, tiled in ((20, 2, 4, 128, 128, True), (9, 2, 6, 16, 32, True), (7, 1, 3, 32, 16, True),
                                     (6, 2, 4, 32, 40, False)):
        u, g, beta, S0 = gdn_inputs(rng, n, Hk, Hv, dk, dv)
        o_ref, S_ref, cmax = gdn_ref(u, g, beta, S0, Hk, Hv, dk, dv, tiled)
        with gpu.Buffer.from_array(u) as bu, gpu.Buffer.from_array(g) as bg, gpu.Buffer.from_array(beta) as bb, \
                gpu.Buffer.from_array(S0) as bS, gpu.Buffer(4 * n * Hv * dv) as bo:
            kernels.gdn_recurrent(bu, bg, bb, bS, bo, n, Hk, Hv, dk, dv, tiled)
            o = bo.download(dtype=np.float32).reshape(n, Hv, dv)
            S = bS.download(dtype=np.float32).reshape(Hv, dk, dv)
        qn = np.float64(1) / np.sqrt(dk)                               # |q| after the norm and the scale
        steps = np.arange(1, n + 1)[:, None, None]
        bound_o = qn * cmax * (steps + 1) * (dk + GDN_STEP_EXTRA) * U
        err_o = np.abs(o - o_ref.reshape(n, Hv, dv))
        what = f"gdn n={n} Hk={Hk} Hv={Hv} dk={dk} dv={dv} tiled={tiled}"
        assert (err_o <= bound_o).all(), f"{what}: o max err/bound {np.max(err_o / bound_o):.3g}"
        bound_S = (cmax[-1] * n * (dk + GDN_STEP_EXTRA) * U)[:, None, :]
        err_S = np.abs(S - S_ref)
        assert (err_S <= bound_S).all(), f"{what}: state max err/bound {np.max(err_S / bound_S):.3g}"
        if (np.arange(Hv) % Hk != np.arange(Hv) // (Hv // Hk)).any():   # negative control: the other mapping
            o_bad, _, _ = gdn_ref(u, g, beta, S0, Hk, Hv, dk, dv, not tiled)
            assert (np.abs(o - o_bad.reshape(n, Hv, dv)) > bound_o).any()


@pytest.mark.gpu
@variant_params()
def test_gdn_recurrent_takes_the_gates(kernels):
    """gdn_recurrent with dt_bias and ssm_a gates the raw beta and alpha projections itself: the same bits as
    gdn_gates then gdn_recurrent (o and the state), its inputs left as they were."""
    rng = np.random.default_rng(15)
    n, Hk, Hv, dk, dv = 9, 2, 4, 128, 128
    u, _g, _beta, S0 = gdn_inputs(rng, n, Hk, Hv, dk, dv)
    b = (rng.standard_normal((n, Hv)) * 3).astype(np.float32)
    a = (rng.standard_normal((n, Hv)) * 3).astype(np.float32)
    dt = rng.standard_normal(Hv).astype(np.float32)
    A = -np.exp(rng.standard_normal(Hv)).astype(np.float32)
    with gpu.Buffer.from_array(u) as bu, gpu.Buffer.from_array(b) as bb, gpu.Buffer.from_array(a) as ba, \
            gpu.Buffer.from_array(b) as bb2, gpu.Buffer.from_array(a) as ba2, gpu.Buffer.from_array(dt) as bd, \
            gpu.Buffer.from_array(A) as bA, gpu.Buffer.from_array(S0) as s1, gpu.Buffer.from_array(S0) as s2, \
            gpu.Buffer(4 * n * Hv * dv) as o1, gpu.Buffer(4 * n * Hv * dv) as o2:
        kernels.gdn_gates(bb2, ba2, bd, bA, n, Hv)
        kernels.gdn_recurrent(bu, ba2, bb2, s2, o2, n, Hk, Hv, dk, dv)
        kernels.gdn_recurrent(bu, ba, bb, s1, o1, n, Hk, Hv, dk, dv, dt_bias=bd, ssm_a=bA)
        assert np.array_equal(o1.download(dtype=np.float32), o2.download(dtype=np.float32))
        assert np.array_equal(s1.download(dtype=np.float32), s2.download(dtype=np.float32))
        assert np.array_equal(bb.download(dtype=np.float32), b.reshape(-1))


@pytest.mark.gpu
@variant_params()
def test_gdn_split_equals_whole(kernels):
    """The state carries over launches: 20 tokens at once == 13 then 7 (same arithmetic, bit for bit)."""
    rng = np.random.default_rng(14)
    n, Hk, Hv, dk, dv = 20, 2, 4, 128, 128
    u, g, beta, S0 = gdn_inputs(rng, n, Hk, Hv, dk, dv)
    conv_dim = 2 * Hk * dk + Hv * dv
    with gpu.Buffer.from_array(u) as bu, gpu.Buffer.from_array(g) as bg, gpu.Buffer.from_array(beta) as bb, \
            gpu.Buffer.from_array(S0) as s1, gpu.Buffer.from_array(S0) as s2, gpu.Buffer(4 * n * Hv * dv) as o1, \
            gpu.Buffer(4 * n * Hv * dv) as o2:
        kernels.gdn_recurrent(bu, bg, bb, s1, o1, n, Hk, Hv, dk, dv)
        kernels.gdn_recurrent(bu, bg, bb, s2, o2, 13, Hk, Hv, dk, dv)
        kernels.gdn_recurrent(bu.ptr + 13 * 4 * conv_dim, bg.ptr + 13 * 4 * Hv, bb.ptr + 13 * 4 * Hv, s2,
                              o2.ptr + 13 * 4 * Hv * dv, 7, Hk, Hv, dk, dv)
        assert np.array_equal(o1.download(dtype=np.float32), o2.download(dtype=np.float32))
        assert np.array_equal(s1.download(dtype=np.float32), s2.download(dtype=np.float32))


# The chunked form (cuda8/gdn_chunked.cu) computes the same rule by other products: per chunk T = (I + A)^-1 (a
# forward substitution of up to 63 terms whose entries the decays and beta <= 1 bound), then W S, Q S, P V' and
# K^T V' (chains of dk or of <= 64). It has no per-step proof like the recurrence's; it is held to the recurrent bound
# (GDN_CHUNK_FACTOR = 1): on the test inputs its largest error was 0.023 of that bound on every tier (H200, 2026-11-29).
# The tf32 scan (sm_80+) is held to the same bound: its products carry ~2^-21 instead of 2^-24.
GDN_CHUNK_FACTOR = 1


def gdn_scan_forms(kernels) -> tuple[bool, ...]:
    """The chunked scan's forms a variant has: the f32 FMA scan, and the tf32 tensor-core one where has_tf32."""
    return (False, True) if kernels.has_tf32 else (False,)


@pytest.mark.gpu
@variant_params()
def test_gdn_chunked(kernels):
    """The chunked form against the f64 rule (o and the state, GDN_CHUNK_FACTOR x the recurrent bound), with partial
    last chunks, one chunk and several, dk and dv below the tiles, and the k-head mapping's negative control."""
    rng = np.random.default_rng(23)
    worst = dict.fromkeys(gdn_scan_forms(kernels), 0.0)
    cases = ((200, 2, 4, 128, 128, True), (64, 2, 6, 16, 32, True), (7, 1, 3, 32, 16, True),
             (130, 2, 4, 32, 40, False), (129, 1, 2, 128, 128, True))
    for (n, Hk, Hv, dk, dv, tiled), mma in itertools.product(cases, worst):
        u, g, beta, S0 = gdn_inputs(rng, n, Hk, Hv, dk, dv)
        o_ref, S_ref, cmax = gdn_ref(u, g, beta, S0, Hk, Hv, dk, dv, tiled)
        chunks = -(-n // 64)
        with gpu.Buffer.from_array(u) as bu, gpu.Buffer.from_array(g) as bg, gpu.Buffer.from_array(beta) as bb, \
                gpu.Buffer.from_array(S0) as bS, gpu.Buffer(4 * n * Hv * dv) as bo, gpu.Buffer(4 * n * Hv * dk) as w, \
                gpu.Buffer(4 * n * Hv * dv) as bu2, gpu.Buffer(4 * chunks * Hv * 64 * 64) as bp, \
                gpu.Buffer(4 * n * Hv) as bgc:
            kernels.gdn_chunked(bu, bg, bb, bS, bo, n, Hk, Hv, dk, dv, (w, bu2, bp, bgc), tiled, mma=mma)
            o = bo.download(dtype=np.float32).reshape(n, Hv, dv)
            S = bS.download(dtype=np.float32).reshape(Hv, dk, dv)
        qn = np.float64(1) / np.sqrt(dk)
        steps = np.arange(1, n + 1)[:, None, None]
        bound_o = GDN_CHUNK_FACTOR * qn * cmax * (steps + 1) * (dk + GDN_STEP_EXTRA) * U
        err_o = np.abs(o - o_ref.reshape(n, Hv, dv))
        bound_S = GDN_CHUNK_FACTOR * (cmax[-1] * n * (dk + GDN_STEP_EXTRA) * U)[:, None, :]
        err_S = np.abs(S - S_ref)
        worst[mma] = max(worst[mma], GDN_CHUNK_FACTOR * max(np.max(err_o / bound_o), np.max(err_S / bound_S)))
        what = f"gdn_chunked n={n} Hk={Hk} Hv={Hv} dk={dk} dv={dv} tiled={tiled} mma={mma}"
        assert (err_o <= bound_o).all(), f"{what}: o max err/bound {np.max(err_o / bound_o):.3g}"
        assert (err_S <= bound_S).all(), f"{what}: state max err/bound {np.max(err_S / bound_S):.3g}"
        if (np.arange(Hv) % Hk != np.arange(Hv) // (Hv // Hk)).any():   # negative control: the other mapping
            o_bad, _, _ = gdn_ref(u, g, beta, S0, Hk, Hv, dk, dv, not tiled)
            assert (np.abs(o - o_bad.reshape(n, Hv, dv)) > bound_o).any()
    for mma, x in worst.items():
        print(f"gdn_chunked {kernels.name} {'tf32' if mma else 'f32'} scan: largest error / recurrent bound {x:.3g}")


@pytest.mark.gpu
@variant_params()
def test_gdn_chunked_split_at_a_chunk_equals_whole(kernels):
    """200 tokens at once == 128 then 72 (a cut at a chunk boundary: the same chunks), bit for bit: a snapshot at a
    chunk boundary equals a recompute; and either form of the prep gives those bits."""
    rng = np.random.default_rng(24)
    n, Hk, Hv, dk, dv, cut = 200, 2, 4, 128, 128, 128
    u, g, beta, S0 = gdn_inputs(rng, n, Hk, Hv, dk, dv)
    conv_dim = 2 * Hk * dk + Hv * dv
    with gpu.Buffer.from_array(u) as bu, gpu.Buffer.from_array(g) as bg, gpu.Buffer.from_array(beta) as bb, \
            gpu.Buffer.from_array(S0) as s1, gpu.Buffer.from_array(S0) as s2, gpu.Buffer(4 * n * Hv * dv) as o1, \
            gpu.Buffer(4 * n * Hv * dv) as o2, gpu.Buffer(4 * n * Hv * dk) as w, gpu.Buffer(4 * n * Hv * dv) as uu, \
            gpu.Buffer(4 * 4 * Hv * 64 * 64) as p, gpu.Buffer(4 * n * Hv) as gc:
        work = (w, uu, p, gc)
        for mma in gdn_scan_forms(kernels):         # each scan form: its own bits, a cut at a chunk keeps them
            for s in (s1, s2):
                s.upload(S0)
            kernels.gdn_chunked(bu, bg, bb, s1, o1, n, Hk, Hv, dk, dv, work, mma=mma)
            kernels.gdn_chunked(bu, bg, bb, s2, o2, cut, Hk, Hv, dk, dv, work, mma=mma)
            kernels.gdn_chunked(bu.ptr + cut * 4 * conv_dim, bg.ptr + cut * 4 * Hv, bb.ptr + cut * 4 * Hv, s2,
                                o2.ptr + cut * 4 * Hv * dv, n - cut, Hk, Hv, dk, dv, work, mma=mma)
            assert np.array_equal(o1.download(dtype=np.float32), o2.download(dtype=np.float32)), mma
            assert np.array_equal(s1.download(dtype=np.float32), s2.download(dtype=np.float32)), mma
            # the prep's two forms (a tile ahead where the grid is short, plain where occupancy hides the loads): same
            # bits
            for ahead in (False, True) if kernels.many_regs else (False,):
                s2.upload(S0)
                o2.upload(np.full(n * Hv * dv, np.nan, np.float32))
                kernels.gdn_chunked(bu, bg, bb, s2, o2, n, Hk, Hv, dk, dv, work, prep_ahead=ahead, mma=mma)
                assert np.array_equal(o1.download(dtype=np.float32), o2.download(dtype=np.float32)), (mma, ahead)
                assert np.array_equal(s1.download(dtype=np.float32), s2.download(dtype=np.float32)), (mma, ahead)
        if not kernels.has_tf32:
            with pytest.raises(UnavailableError, match="tf32 scan"):
                kernels.gdn_chunked(bu, bg, bb, s2, o2, n, Hk, Hv, dk, dv, work, mma=True)
        if not kernels.many_regs:
            with pytest.raises(UnavailableError, match="prep ahead"):
                kernels.gdn_chunked(bu, bg, bb, s2, o2, n, Hk, Hv, dk, dv, work, prep_ahead=True)


def attention_ref(qg, kc, vc, n, pos, n_head, n_kv, hd, scale):
    """The gated attention core (native/attention.c) in f64 for tokens at pos … pos+n-1 -> (o [n, n_head*hd],
    bound [n, n_head*hd]) with the bound of the comment at ATTN_EXTRA."""
    group = n_head // n_kv
    o = np.zeros((n, n_head, hd))
    bound = np.zeros((n, n_head, hd))
    q_all = qg.reshape(n, n_head, 2, hd).astype(np.float64)
    for t in range(n):
        nk = pos + t + 1
        for h in range(n_head):
            q, gate = q_all[t, h, 0], q_all[t, h, 1]
            K = kc[:nk].reshape(nk, n_kv, hd)[:, h // group].astype(np.float64)
            V = vc[:nk].reshape(nk, n_kv, hd)[:, h // group].astype(np.float64)
            s = K @ q * np.float64(scale)
            w = np.exp(s - s.max())
            w /= w.sum()
            sig = sigmoid64(gate)
            o[t, h] = (w @ V) * sig
            ds = (hd + 2) * U * np.float64(scale) * (np.abs(K) @ np.abs(q)).max()
            vabs = w @ np.abs(V)
            bound[t, h] = sig * ((2 * ds + (2 * nk + 16 + ATTN_EXTRA) * U) * vabs
                                 + ATTN_EXTRA * U * np.abs(V).max(axis=0)) + SILU_ROUNDINGS * U * np.abs(o[t, h])
    return o.reshape(n, -1), bound.reshape(n, -1)


ATTN_SHAPES = [(16, 2, 256), (4, 2, 32), (6, 6, 64)]   # (n_head, n_kv, hd): Qwen3.5-35B-A3B, tiny GQA, no GQA


@pytest.mark.gpu
@pytest.mark.parametrize("n_head,n_kv,hd", ATTN_SHAPES, ids=[f"h{a}kv{b}d{c}" for a, b, c in ATTN_SHAPES])
@variant_params()
def test_attention_decode(kernels, n_head, n_kv, hd):
    rng = np.random.default_rng(15 + hd)
    scale = np.float32(1) / np.sqrt(np.float32(hd))
    for n_keys, n_split in ((1, None), (1000, None), (1000, 1), (37, 50)):   # 50 splits of 1 key: 13 stay empty
        qg = (rng.standard_normal(n_head * 2 * hd) * 3).astype(np.float32)
        kc = rng.standard_normal((n_keys, n_kv * hd)).astype(np.float32)
        vc = rng.standard_normal((n_keys, n_kv * hd)).astype(np.float32)
        ref, bound = attention_ref(qg, kc, vc, 1, n_keys - 1, n_head, n_kv, hd, scale)
        ns = n_split or gpu.Kernels.attn_splits(n_keys)[0]
        with gpu.Buffer.from_array(qg) as bq, gpu.Buffer.from_array(kc) as bk, gpu.Buffer.from_array(vc) as bv, \
                gpu.Buffer(4 * n_head * hd) as bo, gpu.Buffer(gpu.Kernels.attn_partials_bytes(n_head, hd, ns)) as bp:
            kernels.attention_decode(bq, bk, bv, bo, bp, n_keys, n_head, n_kv, hd, scale, n_split)
            o = bo.download(dtype=np.float32)
        err = np.abs(o - ref[0])
        assert (err <= bound[0]).all(), f"decode n_keys={n_keys} splits={ns}: max err/bound {np.max(err / bound[0]):.3g}"
        if n_kv < n_head and n_keys > 1:   # negative control: V of the other kv head is far outside the bound
            bad = attention_ref(qg, kc, vc.reshape(n_keys, n_kv, hd)[:, ::-1].reshape(n_keys, -1).copy(), 1,
                                n_keys - 1, n_head, n_kv, hd, scale)[0][0]
            assert (np.abs(o - bad) > bound[0]).any()


@pytest.mark.gpu
@variant_params()
def test_attention_decode_position_uses_the_splits_it_needs(kernels):
    """With the position on the device, keys 0..p go to at most n_split splits of at least ATTN_MIN_KEYS_PER_SPLIT
    keys; the partials of the splits past them are never written nor read (NaN there changes nothing)."""
    rng = np.random.default_rng(19)
    n_head, n_kv, hd, n_ctx = 4, 2, 64, 300
    scale = np.float32(1) / np.sqrt(np.float32(hd))
    kc = rng.standard_normal((n_ctx, n_kv * hd)).astype(np.float32)
    vc = rng.standard_normal((n_ctx, n_kv * hd)).astype(np.float32)
    qg = (rng.standard_normal(n_head * 2 * hd) * 3).astype(np.float32)
    for n_split in (1, 10, 64):
        nan = np.full(gpu.Kernels.attn_partials_bytes(n_head, hd, n_split) // 4, np.nan, np.float32)
        for p in (0, 5, gpu.ATTN_MIN_KEYS_PER_SPLIT - 1, gpu.ATTN_MIN_KEYS_PER_SPLIT, 100, n_ctx - 1):
            with gpu.Buffer.from_array(np.array([0, p], np.int32)) as io, gpu.Buffer.from_array(kc) as bk, \
                    gpu.Buffer.from_array(vc) as bv, gpu.Buffer.from_array(qg) as bq, \
                    gpu.Buffer(4 * n_head * hd) as bo, gpu.Buffer.from_array(nan) as bp:
                kernels.attention_decode(bq, bk, bv, bo, bp, n_ctx, n_head, n_kv, hd, scale, n_split=n_split,
                                         pos_dev=io.ptr + 4)
                o = bo.download(dtype=np.float32)
            ref, bound = attention_ref(qg, kc[:p + 1], vc[:p + 1], 1, p, n_head, n_kv, hd, scale)
            assert (np.abs(o - ref[0]) <= bound[0]).all(), f"p={p} n_split={n_split}"


@pytest.mark.gpu
@variant_params()
def test_position_from_device(kernels):
    """The planned decode step's kernels read the position p from a device int: attn_kv_store_f32 writes row p of
    both caches (exactly), attention_decode with pos_dev attends keys 0..p (attention_ref's bound), qk_norm_rope
    with pos_dev reads table row p (bit-identical to passing that row's address)."""
    from legacy_engine.gpu.scratch import rope_table
    rng = np.random.default_rng(17)
    n_head, n_kv, hd, n_ctx, p = 4, 2, 128, 300, 211
    kvw = n_kv * hd
    scale = np.float32(1) / np.sqrt(np.float32(hd))
    kc = rng.standard_normal((n_ctx, kvw)).astype(np.float32)
    vc = rng.standard_normal((n_ctx, kvw)).astype(np.float32)
    k_new, v_new = rng.standard_normal((2, kvw)).astype(np.float32)
    qg = (rng.standard_normal(n_head * 2 * hd) * 3).astype(np.float32)
    ns = gpu.Kernels.attn_splits(n_ctx)[0]
    with gpu.Buffer.from_array(np.array([0, p], np.int32)) as io, gpu.Buffer.from_array(kc) as bk, \
            gpu.Buffer.from_array(vc) as bv, gpu.Buffer.from_array(k_new) as bkn, gpu.Buffer.from_array(v_new) as bvn, \
            gpu.Buffer.from_array(qg) as bq, gpu.Buffer(4 * n_head * hd) as bo, \
            gpu.Buffer(gpu.Kernels.attn_partials_bytes(n_head, hd, gpu.ATTN_MAX_SPLIT)) as bp:
        kernels.kv_store(bkn, bvn, bk, bv, io.ptr + 4, kvw)
        kc[p], vc[p] = k_new, v_new
        np.testing.assert_array_equal(bk.download(dtype=np.float32).reshape(n_ctx, kvw), kc)
        np.testing.assert_array_equal(bv.download(dtype=np.float32).reshape(n_ctx, kvw), vc)
        kernels.attention_decode(bq, bk, bv, bo, bp, n_ctx, n_head, n_kv, hd, scale, n_split=ns, pos_dev=io.ptr + 4)
        o = bo.download(dtype=np.float32)
    ref, bound = attention_ref(qg, kc[:p + 1], vc[:p + 1], 1, p, n_head, n_kv, hd, scale)
    assert (np.abs(o - ref[0]) <= bound[0]).all()
    hp = __import__("types").SimpleNamespace(n_rot=64, rope_theta=1e7, rope_sections=(11, 11, 10, 0))
    cs = rope_table(hp, n_ctx)
    w = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32)
    x = rng.standard_normal(n_head * 2 * hd).astype(np.float32)
    out = []
    with gpu.Buffer.from_array(np.array([0, p], np.int32)) as io, gpu.Buffer.from_array(w) as bw, \
            gpu.Buffer.from_array(cs) as bc:
        for pos_dev, table in ((io.ptr + 4, bc.ptr), (None, bc.ptr + 4 * p * hp.n_rot)):
            with gpu.Buffer.from_array(x) as bx:
                kernels.qk_norm_rope(bx, bw, table, 1, n_head, 2 * hd, n_head * 2 * hd, hd, hp.n_rot, 1e-6,
                                     pos_dev=pos_dev)
                out.append(bx.download(dtype=np.float32))
    np.testing.assert_array_equal(out[0], out[1])


@pytest.mark.gpu
@pytest.mark.parametrize("n_head,n_kv,hd", ATTN_SHAPES, ids=[f"h{a}kv{b}d{c}" for a, b, c in ATTN_SHAPES])
@variant_params()
def test_attention_prefill(kernels, n_head, n_kv, hd):
    """Every kernel the variant can run (the tensor-core one where it has_mma, and the f32 FMA one --gpu-no-mma
    keeps) within the f32 bound; asking a variant without the tensor-core kernel for it is an error."""
    check_attention_prefill(kernels, n_head, n_kv, hd, (True, False) if kernels.has_mma else (False,))


@pytest.mark.gpu
@pytest.mark.parametrize("n_head,n_kv,hd", ATTN_SHAPES, ids=[f"h{a}kv{b}d{c}" for a, b, c in ATTN_SHAPES])
@pytest.mark.parametrize("kernels", MMA_VARIANTS, ids=[gpu.variant_name(*v) for v in MMA_VARIANTS], indirect=True)
def test_attention_prefill_mma(kernels, n_head, n_kv, hd):
    """The tensor-core kernel on the Turing PTX too (two m16n8k8 per product where sm_80+ has one m16n8k16)."""
    check_attention_prefill(kernels, n_head, n_kv, hd, (True,))


def check_attention_prefill(kernels, n_head, n_kv, hd, paths):
    rng = np.random.default_rng(16 + hd)
    scale = np.float32(1) / np.sqrt(np.float32(hd))
    if not kernels.has_mma:
        with gpu.Buffer(4) as b, pytest.raises(UnavailableError, match="tensor-core"):
            kernels.attention_prefill(b, b, b, b, 1, 0, n_head, n_kv, hd, scale, mma=True)
    for (n, pos), mma in itertools.product(((45, 20), (1, 0), (8, 0), (70, 3), (130, 33)), paths):
        qg = (rng.standard_normal((n, n_head * 2 * hd)) * 3).astype(np.float32)
        kc = rng.standard_normal((pos + n, n_kv * hd)).astype(np.float32)
        vc = rng.standard_normal((pos + n, n_kv * hd)).astype(np.float32)
        ref, bound = attention_ref(qg, kc, vc, n, pos, n_head, n_kv, hd, scale)
        with gpu.Buffer.from_array(qg) as bq, gpu.Buffer.from_array(kc) as bk, gpu.Buffer.from_array(vc) as bv, \
                gpu.Buffer(4 * n * n_head * hd) as bo, gpu.Buffer(kernels.attn_planes_bytes(pos + n, n_kv, hd)) as bp:
            if mma:
                with pytest.raises(ValueError, match="planes"):
                    kernels.attention_prefill(bq, bk, bv, bo, n, pos, n_head, n_kv, hd, scale, mma=True)
            kernels.attention_prefill(bq, bk, bv, bo, n, pos, n_head, n_kv, hd, scale, mma=mma, planes=bp)
            o = bo.download(dtype=np.float32).reshape(n, -1)
        err = np.abs(o - ref)
        assert (err <= bound).all(), f"prefill n={n} pos={pos} mma={mma}: max err/bound {np.max(err / bound):.3g}"
        if n > 1:   # negative control: one future key let in (the mask off by one) is far outside the bound
            bad, _ = attention_ref(qg[:1], kc, vc, 1, pos + 1, n_head, n_kv, hd, scale)
            assert (np.abs(o[0] - bad[0]) > bound[0]).any()


def moe_route_ref(logits, k, wsum_min=gpu.MOE_WSUM_MIN):
    """moe.c: p = f32(e / sum) with e = expf(l - max) in f32 and the sum in f64; top-k by a stable sort (ties: the
    lower index); w = p / max(f32 sum of the k, wsum_min)."""
    l = logits.astype(np.float32)
    e = np.exp(l - l.max(axis=1, keepdims=True))
    p = (e / e.astype(np.float64).sum(axis=1, keepdims=True)).astype(np.float32)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :k]
    ps = np.take_along_axis(p, ids, axis=1)
    wsum = np.zeros(len(l), np.float32)
    for s in range(k):
        wsum = (wsum + ps[:, s]).astype(np.float32)
    wsum = np.maximum(wsum, np.float32(wsum_min))
    return ids.astype(np.int32), (ps / wsum[:, None]).astype(np.float32)


@pytest.mark.gpu
@variant_params()
def test_moe_route(kernels):
    rng = np.random.default_rng(17)
    def grid(x):   # logits on a 1/64 grid: distinct ones are >= 1.5 % apart in p (no near-ties), equal ones tie
        return (np.round(x * 64) / 64).astype(np.float32)
    cases = []
    lg = grid(rng.standard_normal((37, 256)) * 2)
    lg[0, [3, 100, 200]] = lg[0].max() + 1          # a three-way tie at the top: 3, 100, 200 in that order
    lg[1, :] = 0.5                                    # all equal: 0 … k-1
    lg[2, [7, 9]] = lg[2].max() + 0.5                 # tie at the top, then the rest by value
    lg[2, 250] = lg[2, 7]
    cases.append((lg, 8))
    cases.append((grid(rng.standard_normal((3, 512)) * 3), 10))
    cases.append((np.zeros((2, 20000), np.float32), 1))     # p = 1/20000 < wsum_min: the clamp, w = 0.819…
    cases.append((grid(rng.standard_normal((70000, 8))), 2))   # > 65535 tokens: grid-stride
    for logits, k in cases:
        n_tok, n_expert = logits.shape
        ids_ref, w_ref = moe_route_ref(logits, k)
        with gpu.Buffer.from_array(logits) as bl, gpu.Buffer(4 * n_tok * k) as bi, gpu.Buffer(4 * n_tok * k) as bw:
            kernels.moe_route(bl, bi, bw, n_tok, n_expert, k)
            ids = bi.download(dtype=np.int32).reshape(n_tok, k)
            w = bw.download(dtype=np.float32).reshape(n_tok, k)
        bad = np.nonzero((ids != ids_ref).any(axis=1))[0]
        assert bad.size == 0, f"{n_expert} experts top-{k}: token {bad[0]}: {ids[bad[0]]} vs {ids_ref[bad[0]]}"
        err = np.abs(w.astype(np.float64) - w_ref)
        assert (err <= (2 * k + MOE_W_EXTRA) * U * w_ref).all(), f"weights: max rel err {np.max(err / w_ref):.3g}"
    assert moe_route_ref(np.zeros((1, 20000), np.float32), 1)[1][0, 0] > 0.8   # the clamp case clamps
    for n_expert in (256, 2000):        # a NaN logit (a broken hidden state): every id INT_MAX, in both forms
        lg = grid(rng.standard_normal((2, n_expert)))
        lg[1, 5] = np.nan
        with gpu.Buffer.from_array(lg) as bl, gpu.Buffer(4 * 2 * 8) as bi, gpu.Buffer(4 * 2 * 8) as bw:
            kernels.moe_route(bl, bi, bw, 2, n_expert, 8)
            ids = bi.download(dtype=np.int32).reshape(2, 8)
        np.testing.assert_array_equal(ids[0], moe_route_ref(lg[:1], 8)[0][0])
        assert (ids[1] == np.iinfo(np.int32).max).all(), ids[1]


@pytest.mark.gpu
@variant_params()
def test_argmax(kernels):
    rng = np.random.default_rng(18)
    n = 248320                                         # Qwen3.5's LM-head rows
    x = rng.standard_normal((4, n)).astype(np.float32)
    x[0, [5000, 200000]] = 10.0                        # a tie far apart (different blocks): the lower wins
    x[1, [123456, 123457]] = 10.0                      # a tie in neighbouring threads
    x[2, :] = -np.inf
    x[2, n - 1] = -1e30                                # the only finite value, last
    x[3, :] = 1.0                                      # all equal: 0
    with gpu.Buffer.from_array(x) as bx, gpu.Buffer(4 * 4) as bo, \
            gpu.Buffer(8 * 4 * gpu.ARGMAX_MAX_PARTS) as bp:
        kernels.argmax(bx, bp, bo, n, n_rows=4)
        got = bo.download(dtype=np.int32)
        assert list(got) == list(np.argmax(x, axis=1)) == [5000, 123456, n - 1, 0]
        for parts in (1, 7, gpu.ARGMAX_MAX_PARTS):     # the answer does not depend on the split
            kernels.argmax(bx, bp, bo, n, n_rows=4, n_part=parts)
            assert list(bo.download(dtype=np.int32)) == [5000, 123456, n - 1, 0]
    y = rng.standard_normal(5).astype(np.float32)
    with gpu.Buffer.from_array(y) as by, gpu.Buffer(4) as bo, gpu.Buffer(8) as bp:
        kernels.argmax(by, bp, bo, 5)
        assert bo.download(dtype=np.int32)[0] == np.argmax(y)


@pytest.mark.gpu
@variant_params()
def test_peak_kernels(kernels):
    """cuda8/peak.cu: each chain's exact sum (so the loop ran every step: bench gpu's peak divides its counted
    operations by the time), the operations it reports, and no mma kernel where the variant has none."""
    blocks, iters, T, C = 3, 100, gpu.PEAK_THREADS, gpu.PEAK_CHAINS
    want = {"gemm_f32": (np.float32, C * iters + C * (C - 1) // 2, 2 * C),
            "gemm_dp4a": (np.int32, 4 * C * iters + C * (C - 1) // 2, 8 * C),
            "gemm_mma": (np.int32, 16 * 4 * gpu.PEAK_MMA_CHAINS * iters, 4096 // 32 * gpu.PEAK_MMA_CHAINS)}
    with gpu.Buffer(4 * blocks * T) as out:
        for gemm, (dt, total, per_iter) in want.items():
            if gemm == "gemm_mma" and not kernels.has_mma:
                with pytest.raises(gpu.UnavailableError, match="no int8 mma"):
                    kernels.peak(gemm, out, blocks, iters)
                continue
            assert kernels.peak(gemm, out, blocks, iters) == per_iter * iters * blocks * T
            np.testing.assert_array_equal(out.download(dtype=dt), np.full(blocks * T, total, dtype=dt))
        with pytest.raises(ValueError, match="blocks"):
            kernels.peak("gemm_f32", out, 0, iters)


def _sample_head(out: "gpu.Buffer", cap: int):
    raw = out.download(dtype=np.uint8, count=gpu.SAMPLE_HEAD.itemsize + 8 * cap)
    head = raw[:gpu.SAMPLE_HEAD.itemsize].view(gpu.SAMPLE_HEAD)[0]
    pairs = raw[gpu.SAMPLE_HEAD.itemsize:].view(np.int32).reshape(cap, 2)
    key = int(head["rest_key"])
    rest = -np.inf if key == -2**31 else float(np.array([key if key >= 0 else key ^ 0x7fffffff],
                                                        np.int32).view(np.float32)[0])
    return head, pairs, rest


SAMPLE_CAP = 16384     # gpu_sample.CAP
SAMPLE_CUT_CASES = [  # (row, top_k, top_p, min_p): modes 0 (candidates), 1 (window), -2 (the row)
    ("std3", 0, 0.95, 0.0), ("std3", 40, 1.0, 0.0), ("std3", 0, 1.0, 0.05), ("std3", 0, 0.5, 0.0),
    ("peaked", 0, 0.95, 0.0), ("peaked", 1, 1.0, 0.0), ("ties", 0, 0.5, 0.0), ("ties", 3, 1.0, 0.0),
    ("std8", 0, 0.99, 0.0), ("std1", 0, 0.95, 0.0), ("std1", 0, 0.5, 0.0), ("std1", 0, 0.9, 0.001),
    ("std1", 0, 1.0, 0.05), ("small", 0, 0.8, 0.0), ("small", 0, 1.0, 0.0)]


def _sample_row(shape: str) -> np.ndarray:
    rng = np.random.default_rng(["std1", "std3", "std8", "peaked", "ties", "small"].index(shape))
    if shape == "small":
        return (rng.standard_normal(37) * 2).astype(np.float32)
    if shape == "ties":
        return (np.round(rng.standard_normal(248320) * 2) / 2).astype(np.float32)
    x = (rng.standard_normal(248320) * (8.0 if shape == "std8" else 1.0 if shape == "std1" else 3.0))
    if shape == "peaked":
        x[rng.choice(x.size, 4, replace=False)] = [14.0, 12.5, 12.5, 10.0]
    return x.astype(np.float32)


@pytest.mark.gpu
@variant_params()
def test_sample_cut(kernels):
    """The sampler's candidates (cuda8/sample_cut.cu) against sample_cut_ref: the cut bin (or a neighbour where the
    running mass meets top-p's target within SAMPLE_MASS_REL), the mode, exactly the tokens of the chosen bins with
    their logits, Z and the mass before a window within SAMPLE_MASS_REL, the largest logit left out; a NaN or
    infinite logit: -1; the histogram left zeroed (a second call gives the same bits). Then le_sample_cand, or
    le_sample_window_cut and the GPU's draw, give the token Sampler.draw gives on the row for the same u."""
    from sample_cut_ref import bins, sample_cut_ref
    from legacy_engine.serve.sampling import Sampler, SamplingParams
    modes = set()
    with gpu.Buffer(gpu.SAMPLE_WORK_BYTES) as work, gpu.Buffer(gpu.SAMPLE_HEAD.itemsize + 8 * SAMPLE_CAP) as out, \
            gpu.Buffer(8 * gpu.Kernels.draw_blocks(248320)) as bsum:
        work.upload(np.zeros(gpu.SAMPLE_WORK_BYTES, np.uint8))
        for shape, top_k, top_p, min_p in SAMPLE_CUT_CASES:
            x = _sample_row(shape)
            n, cap = x.size, min(SAMPLE_CAP, x.size)
            what = f"{shape} k={top_k} p={top_p} min_p={min_p}"
            ref = sample_cut_ref(x, top_k, top_p, min_p, cap=cap)
            first = None
            with gpu.Buffer.from_array(x) as bx:
                for _ in range(2):
                    kernels.sample_cut(bx, work, out, n, top_k, top_p, min_p, cap)
                    head, pairs, rest = _sample_head(out, cap)
                    c, mode, nc = int(head["cut"]), int(head["mode"]), int(head["n_cand"])
                    if c != ref.cut:     # only where the running mass meets the target to rounding
                        lo = min(c, ref.cut)
                        assert abs(c - ref.cut) == 1 and abs(ref.cum_mass[lo] - ref.want) <= (
                            tol.SAMPLE_MASS_REL * ref.z), what
                        b = bins(x)
                        ref.ids = np.flatnonzero(b == c) if mode == 1 else np.flatnonzero(b <= c)
                        ref.mode = mode
                    assert mode == max(ref.mode, 0), what
                    assert nc == (ref.ids.size if ref.mode >= 0 else -2), (what, nc, ref.ids.size)
                    fix = 2.0 ** gpu.SAMPLE_FIX_BITS
                    assert float(head["m"]) == x.max()
                    assert abs(int(head["z"]) / fix - ref.z) <= tol.SAMPLE_MASS_REL * ref.z, what
                    if nc < 0:
                        break
                    got = pairs[:nc]
                    order = np.argsort(got[:, 0])
                    np.testing.assert_array_equal(got[order, 0], ref.ids, err_msg=what)
                    np.testing.assert_array_equal(got[order, 1].view(np.float32), x[ref.ids])
                    if mode == 1:
                        base = float(ref.cum_mass[c - 1]) if c > 0 else 0.0
                        assert abs(int(head["base"]) / fix - base) <= tol.SAMPLE_MASS_REL * ref.z, what
                    else:
                        left = x[bins(x) > c]
                        assert rest == (left.max() if left.size else -np.inf), what
                    assert first is None or first == head.tobytes()[:40], what    # the same bits again
                    first = head.tobytes()[:40]
                modes.add(mode if nc >= 0 else -2)
                if nc < 0:
                    continue
                s = Sampler(SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p, seed=1))
                if s.filters(n) != (top_k, top_p, min_p):
                    continue
                ids_c, x_c = got[:, 0], got[:, 1].view(np.float32)
                for u in (0.0, 0.3, 0.77, 0.999):
                    if mode == 0:
                        t = s.draw_candidates(ids_c, x_c, n, int(head["z"]) / fix, rest, u)
                    else:
                        cut = s.window_cut(ids_c, x_c, int(head["base"]) / fix, int(head["z"]) / fix, x.max())
                        assert cut is not None, what
                        kernels.set_draw(out, 1 / 0.8, cut[0], cut[1], u)
                        kernels.sample_draw(bx, out, bsum, n)
                        t = int(_sample_head(out, 0)[0]["token"])
                    assert t == s.draw(x, u), (what, mode, u)
        assert modes == {0, 1, -2}, modes
        for bad in (np.nan, np.inf, -np.inf):
            y = _sample_row("std3")
            y[12345] = bad
            with gpu.Buffer.from_array(y) as by:
                kernels.sample_cut(by, work, out, y.size, 40, 1.0, 0.0, SAMPLE_CAP)
                assert int(_sample_head(out, 0)[0]["n_cand"]) == -1, bad
        assert not work.download(dtype=np.uint8)[4 * gpu.SAMPLE_MAX_PARTS:].any()   # the histogram zeroed again


@pytest.mark.gpu
def test_device_sampler_paths(gpu_device):
    """DeviceSampler: a peaked row draws from candidates, a flat one through the window and the GPU's draw, a
    temperature alone from the row, each the token Sampler.sample gives on the row; a NaN: check_logits names the
    position."""
    from legacy_engine.core.errors import FormatError
    from legacy_engine.gpu.sample import DeviceSampler
    from legacy_engine.serve.sampling import Sampler, SamplingParams
    k = gpu.Kernels("dp4a" if NATIVE_ARCH >= 61 else "kepler", NATIVE_ARCH)
    ds = DeviceSampler(k, 248320)
    try:
        for shape, kw, path in (("peaked", dict(top_p=0.5), "candidates"), ("std1", dict(top_p=0.95), "window"),
                                ("std3", dict(), "row"), ("std3", dict(top_k=40), "candidates"),
                                ("std1", dict(top_p=0.9, min_p=0.001), "window")):
            x = _sample_row(shape)
            with gpu.Buffer.from_array(x) as bx:
                for seed in range(5):
                    before = dict(ds.stats)
                    got = ds.sample(bx, Sampler(SamplingParams(temperature=0.8, seed=seed, **kw)), [], 7)
                    assert got == Sampler(SamplingParams(temperature=0.8, seed=seed, **kw)).sample(x), (shape, seed)
                    assert ds.stats[path] == before[path] + 1, (shape, ds.stats)
        x = _sample_row("peaked")
        x[100] = np.nan
        with gpu.Buffer.from_array(x) as bx, pytest.raises(FormatError, match="position 7"):
            ds.sample(bx, Sampler(SamplingParams(temperature=0.8, top_p=0.95)), [], 7)
    finally:
        ds.close()


@pytest.mark.gpu
@variant_params()
def test_elementwise(kernels):
    rng = np.random.default_rng(19)
    n = 65535 * 256 + 77                               # more than one grid of blocks: grid-stride
    g = (rng.standard_normal(n) * 6).astype(np.float32)
    u = rng.standard_normal(n).astype(np.float32)
    with gpu.Buffer.from_array(g) as bg, gpu.Buffer.from_array(u) as bu, gpu.Buffer(4 * n) as bo:
        kernels.swiglu(bg, bu, bo, n)
        got = bo.download(dtype=np.float32)
        ref = silu64(g) * u
        assert np.all(np.abs(got - ref) <= SILU_ROUNDINGS * U * np.abs(ref) + 1e-38)
        kernels.add(bg, bu, bo, n)
        assert np.array_equal(bo.download(dtype=np.float32), g + u)          # IEEE f32 add, as numpy
        kernels.add(bg, bu, bg, n)                                           # in place
        assert np.array_equal(bg.download(dtype=np.float32), g + u)
        bo.upload(g)
        kernels.add_scaled(bo, bu, 0.375, n)
        ref = g.astype(np.float64) + 0.375 * u.astype(np.float64)
        got = bo.download(dtype=np.float32)
        assert np.all(np.abs(got - ref) <= 2 * U * (np.abs(g) + 0.375 * np.abs(u)))
