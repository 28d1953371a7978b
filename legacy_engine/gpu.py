"""GPU kernels: cuda8/*.cu built to PTX per tier, loaded through the CUDA driver API, run as ops.

Tiers (cuda8/compat.cuh): ``fermi`` (no shuffles, no __ldg, no dp4a; forced with
-DLE_FORCE_TIER=LE_CC_FERMI), ``kepler`` (shuffles and __ldg; forced with LE_CC_LDG) and ``dp4a``
(sm_61+, the target's own path). A *variant* is a (tier, arch) pair: PTX for compute_<arch>
taking that tier's code path. The driver JIT-compiles any variant whose arch is <= the card's,
so the legacy paths run on a Hopper exactly as they would on the old card.

Toolchains, any of which builds every source: nvcc 8 … 13 on PATH (or /usr/local/cuda), and
NVRTC loaded with ctypes from the PyPI wheels nvidia-cuda-nvrtc-cu11==11.8.89 (compute_35 …)
and nvidia-cuda-nvrtc-cu12==12.9.86 (compute_50 …). PTX is cached per (source, tier, arch,
toolchain version, source hash) in ``$LE_CACHE_DIR/ptx`` (default ~/.cache/legacy_engine);
``$LE_PTX_DIR`` names a folder of prebuilt PTX (``python -m legacy_engine.gpu build --out DIR``)
that is used first when its manifest's source hash matches the sources.

``python -m legacy_engine.gpu {build,toolchains,ptxas,install-toolchains,info}``; ``cli_build``
is the ``legacy-engine build-kernels`` entry point.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import EngineError, UnavailableError
from .paths import cache_dir

ROOT = Path(__file__).resolve().parent.parent


def kernel_source_dirs() -> tuple[Path, Path]:
    """(cuda8, native/include) to build from: the copies a wheel or `pip install .` ships in
    legacy_engine/_kernels/ (setup.py), else the source tree's (an editable install)."""
    shipped = Path(__file__).resolve().parent / "_kernels"
    if (shipped / "cuda8").is_dir():
        return shipped / "cuda8", shipped / "include"
    return ROOT / "cuda8", ROOT / "native" / "include"


CUDA_DIR, INCLUDE_DIR = kernel_source_dirs()

SOURCES = ("rmsnorm", "quantize_q8_1", "gemv_f32", "gemv_dp4a", "gemm_f32", "gemm_dp4a", "gemm_mma", "conv1d", "gdn",
           "attention", "moe_route", "moe_sort", "argmax", "elementwise", "rope", "get_rows", "moe_combine",
           "hybrid_sync", "sample_cut")
HEADERS = ("compat.cuh", "quants.cuh", "gemm_tile.cuh", "gemm_q8.cuh")   # in cuda8/
SHARED_HEADERS = ("le_blocks.h", "le_hybrid.h")  # in native/include/
ATTR_UNIFIED_ADDRESSING = 41    # CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: host pointers usable in kernels
HYBRID_THREADS, HYBRID_FETCH_BLOCKS, HYBRID_PRED_E = 256, 64, 1024   # cuda8/hybrid_sync.cu
HY_PRED_MAX, HY_EARLY_MAX = 32, 4                # native/include/le_hybrid.h LE_HY_PRED_MAX, LE_HY_EARLY_MAX

# tier -> the LE_FORCE_TIER value, and the lowest arch whose own path it is
TIERS = {"fermi": ("LE_CC_FERMI", 20), "kepler": ("LE_CC_LDG", 30), "dp4a": (None, 61)}
TIER_CC = {"fermi": 200, "kepler": 350, "dp4a": 610}
# The int8 tensor-core GEMM (gemm_mma.cu): the dp4a tier from this arch on (compat.cuh LE_HAS_MMA_INT8: mma.sync
# m8n8k16 .s8 on sm_75, m16n8k16 from sm_80); every toolchain that targets compute_75 knows the instruction.
MMA_ARCH = 75


def has_mma(tier: str, arch: int) -> bool:
    """Whether the variant (tier, arch) carries gemm_mma's kernels."""
    return tier == "dp4a" and arch >= MMA_ARCH
# The legacy variants: built by NVRTC 11.8 (compute_35) and 12.9 (compute_61/70) here and carried.
LEGACY_VARIANTS = (("fermi", 35), ("kepler", 35), ("dp4a", 61), ("dp4a", 70))

# ggml type id -> kernel suffix (cuda8/quants.cuh le_t_*), elements per block, bytes per block
GPU_TYPES = {2: ("q4_0", 32, 18), 8: ("q8_0", 32, 34), 12: ("q4_K", 256, 144), 13: ("q5_K", 256, 176),
             14: ("q6_K", 256, 210), 23: ("iq4_xs", 256, 136)}
F32 = 0   # f32 weights: gemv_f32_f32 / gemm_f32_f32 / get_rows_f32 (no int8 path)
Q8_1_BYTES = 36

GEMV_THREADS, GEMV_ROWS = 128, 4
GEMM_THREADS, GEMM_ROWS, GEMM_TT = 256, 128, 32   # gemm_f32.cu: a block's tile is GEMM_ROWS rows x GEMM_TT tokens
GEMM_MMA_TT = 64    # gemm_q8.cuh: tokens per block of gemm_mma, plain and grouped (its tiles: up to 64 pairs)
RMSNORM_THREADS, Q8_THREADS = 256, 128
MAX_GRID = 65535   # Fermi's grid x limit (y/z everywhere); kernels grid-stride beyond it
# the #defines of the newer sources (tests check they agree with cuda8/)
CONV_THREADS, CONV_TOKENS, CONV_MAX_K = 128, 64, 8
GDN_THREADS, GDN_COLS, GDN_MAX_DK, GDN_NORM_THREADS, GDN_EW_THREADS = 256, 16, 128, 128, 256
ATTN_THREADS, ATTN_WARPS, ATTN_PREFILL_THREADS, ATTN_QTILE, ATTN_MAX_HD = 128, 4, 256, 8, 256
ATTN_MIN_KEYS_PER_SPLIT, ATTN_MAX_SPLIT = 32, 64   # decode split-K: the fewest keys a split takes (the kernels'
# too, with pos_dev: a replayed step uses only the splits its context needs), the most splits (the launcher's)
MOE_THREADS, MOE_MAX_K = 256, 32
MOE_SORT_THREADS, MOE_SORT_MAX_E, MOE_SORT_MAX_TILE = 256, 512, 64   # moe_sort.cu (largest tile = GEMM_MMA_TT)
MOE_WSUM_MIN = 6.103515625e-5                            # native/moe.c MOE_WSUM_MIN (llama.cpp's clamp)
ARGMAX_THREADS, ARGMAX_MAX_PARTS = 256, 256
SAMPLE_THREADS, SAMPLE_MAX_PARTS, SAMPLE_BINS, SAMPLE_BINS_PER_NAT = 256, 256, 1024, 32   # cuda8/sample_cut.cu
SAMPLE_FIX_BITS, SAMPLE_DRAW_BLOCK = 40, 256
SAMPLE_HEAD = np.dtype([("n_cand", "<i4"), ("cut", "<i4"), ("mode", "<i4"), ("rest_key", "<i4"), ("m", "<f4"),
                        ("written", "<i4"), ("z", "<u8"), ("base", "<u8"), ("token", "<i4"), ("pad", "<i4"),
                        ("inv_t", "<f4"), ("cut_x", "<f4"), ("cut_id", "<i4"), ("pad2", "<i4"), ("u", "<f8")])
SAMPLE_DRAW_AT = 48     # the head's draw fields (inv_t, cut_x, cut_id, pad2, u): written by Kernels.set_draw
SAMPLE_WORK_BYTES = 4 * SAMPLE_MAX_PARTS + 8 * SAMPLE_BINS + 4 * SAMPLE_BINS   # partials, bin masses, bin counts
EW_THREADS = 256
ROPE_THREADS, ROPE_MAX_HD = 128, 512
GET_ROWS_THREADS = 128
MOE_COMBINE_THREADS = 256
MAX_PAIRS = 65535  # (token, expert) pairs of one MoE GEMV launch: grid.y


class KernelBuildError(RuntimeError, EngineError):
    """A kernel source failed to compile; the message carries the compiler's log."""


def source_hash(name: str) -> str:
    """sha256 over a kernel source and every header it may include (the build's real inputs)."""
    h = hashlib.sha256()
    for p in [CUDA_DIR / f"{name}.cu"] + [CUDA_DIR / x for x in HEADERS] + [INCLUDE_DIR / x for x in SHARED_HEADERS]:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def variant_name(tier: str, arch: int) -> str:
    return f"{tier}-sm{arch}"


def check_variant(tier: str, arch: int) -> None:
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; one of {', '.join(TIERS)}")
    if arch < TIERS[tier][1] and tier != "fermi":
        raise ValueError(f"tier {tier} needs compute_{TIERS[tier][1]} or newer, not compute_{arch}")


def defines(tier: str) -> list[str]:
    force = TIERS[tier][0]
    return [f"LE_FORCE_TIER={force}"] if force else []


# ------------------------------------------------------------------------------------------ toolchains

# NVRTC has no system headers; le_blocks.h needs only these.
_NVRTC_STDINT = b"""#pragma once
typedef signed char int8_t; typedef unsigned char uint8_t; typedef short int16_t; typedef unsigned short uint16_t;
typedef int int32_t; typedef unsigned int uint32_t; typedef long long int64_t; typedef unsigned long long uint64_t;
typedef long long intptr_t; typedef unsigned long long uintptr_t;
"""


@dataclass
class Toolchain:
    """A compiler that turns cuda8/*.cu into PTX: nvcc (a subprocess) or NVRTC (ctypes)."""
    kind: str                    # "nvcc" or "nvrtc"
    version: tuple[int, int]
    path: str
    archs: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.version[0]}.{self.version[1]}"

    def compile(self, name: str, tier: str, arch: int) -> bytes:
        """PTX of cuda8/<name>.cu for (tier, arch); KernelBuildError with the log on failure."""
        if arch not in self.archs:
            raise UnavailableError(f"{self.name} cannot target compute_{arch} (it does {self.archs[0]}…"
                                   f"{self.archs[-1]})")
        src = CUDA_DIR / f"{name}.cu"
        opts = [f"-D{d}" for d in defines(tier)] + [f"-I{CUDA_DIR}", f"-I{INCLUDE_DIR}"]
        if self.kind == "nvcc":
            return self._nvcc(src, arch, opts)
        return self._nvrtc(src, arch, opts)

    def _nvcc(self, src: Path, arch: int, opts: list[str]) -> bytes:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "out.ptx"
            cmd = [self.path, "-ptx", f"-arch=compute_{arch}", "-std=c++11", *opts, "-o", str(out), str(src)]
            r = subprocess.run(cmd, capture_output=True, encoding="utf-8", errors="replace")
            if r.returncode != 0:
                raise KernelBuildError(f"{self.name} failed on {src.name} for compute_{arch}:\n{r.stderr[-4000:]}")
            return out.read_bytes()

    def _nvrtc(self, src: Path, arch: int, opts: list[str]) -> bytes:
        lib = _nvrtc_lib(self.path)
        prog = ctypes.c_void_p()
        headers = (ctypes.c_char_p * 1)(_NVRTC_STDINT)
        names = (ctypes.c_char_p * 1)(b"stdint.h")
        rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src.read_bytes(), src.name.encode(), 1, headers, names)
        if rc != 0:
            raise KernelBuildError(f"{self.name}: nvrtcCreateProgram({src.name}) returned {rc}")
        try:
            args = [f"--gpu-architecture=compute_{arch}", "-std=c++11", *opts]
            argv = (ctypes.c_char_p * len(args))(*[a.encode() for a in args])
            rc = lib.nvrtcCompileProgram(prog, len(args), argv)
            n = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
            log = ctypes.create_string_buffer(n.value)
            lib.nvrtcGetProgramLog(prog, log)
            if rc != 0:
                raise KernelBuildError(f"{self.name} failed on {src.name} for compute_{arch}:\n"
                                       f"{log.value.decode('utf-8', 'replace')[-4000:]}")
            lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
            ptx = ctypes.create_string_buffer(n.value)
            lib.nvrtcGetPTX(prog, ptx)
            return ptx.value
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


_NVRTC_LIBS: dict[str, ctypes.CDLL] = {}


def _nvrtc_lib(path: str) -> ctypes.CDLL:
    if path not in _NVRTC_LIBS:
        _NVRTC_LIBS[path] = ctypes.CDLL(path)
    return _NVRTC_LIBS[path]


def _nvrtc_toolchain(path: str) -> Toolchain | None:
    try:
        lib = _nvrtc_lib(path)
        major, minor = ctypes.c_int(), ctypes.c_int()
        if lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) != 0:
            return None
        n = ctypes.c_int()
        if lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)) != 0:
            return None
        archs = (ctypes.c_int * n.value)()
        lib.nvrtcGetSupportedArchs(archs)
    except (OSError, AttributeError):
        return None
    return Toolchain("nvrtc", (major.value, minor.value), path, sorted(archs))


# The lowest compute_XX each nvcc major version accepts (CUDA 8 still targets Fermi).
_NVCC_MIN_ARCH = {8: 20, 9: 30, 10: 30, 11: 35, 12: 50, 13: 75}
_KNOWN_ARCHS = (20, 30, 32, 35, 37, 50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90)


def _nvcc_toolchain(path: str) -> Toolchain | None:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, encoding="utf-8", errors="replace", timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        return None
    version = (int(m.group(1)), int(m.group(2)))
    archs: list[int] = []
    try:   # CUDA 11+: the exact list
        r = subprocess.run([path, "--list-gpu-arch"], capture_output=True, encoding="utf-8", errors="replace", timeout=60)
        archs = sorted({int(a) for a in re.findall(r"compute_(\d+)", r.stdout)})
    except (OSError, subprocess.SubprocessError):
        pass
    if not archs:
        low = _NVCC_MIN_ARCH.get(version[0], 75)
        archs = [a for a in _KNOWN_ARCHS if a >= low]
    return Toolchain("nvcc", version, path, archs)


def _site_dirs() -> list[Path]:
    dirs = [Path(p) for p in sys.path if p and os.path.isdir(p)]
    dirs += sorted(Path(cache_dir(), "toolchains").glob("*"))
    return dirs


def find_toolchains() -> list[Toolchain]:
    """Every usable compiler: nvcc (PATH, $CUDA_HOME, /usr/local/cuda) and NVRTC from the wheels
    ($LE_NVRTC, colon-separated paths, first), newest first within a kind."""
    found: dict[tuple, Toolchain] = {}
    nvccs = [shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")]
    for p in nvccs:
        if p and os.path.isfile(p) and (t := _nvcc_toolchain(p)):
            found.setdefault((t.kind, t.version), t)
    libs = [p for p in os.environ.get("LE_NVRTC", "").split(":") if p]
    for d in _site_dirs():
        libs += sorted(glob.glob(str(d / "nvidia" / "cuda_nvrtc" / "lib" / "libnvrtc.so.*[0-9]")))
        libs += sorted(glob.glob(str(d / "nvidia" / "cu13" / "lib" / "libnvrtc.so.*[0-9]")))
    for p in libs:
        if "builtins" in p or "alt" in os.path.basename(p):
            continue
        if (t := _nvrtc_toolchain(p)):
            found.setdefault((t.kind, t.version), t)
    return sorted(found.values(), key=lambda t: (t.kind != "nvcc", tuple(-v for v in t.version)))


def pick_toolchain(arch: int, toolchain: str = "auto", chains: list[Toolchain] | None = None) -> Toolchain:
    """The toolchain that builds compute_<arch>: `toolchain` is "auto" (nvcc if it can, else the newest
    NVRTC that can), "nvcc", "nvrtc", or a name like "nvrtc-11.8"."""
    chains = find_toolchains() if chains is None else chains
    ok = [t for t in chains if arch in t.archs and
          (toolchain == "auto" or toolchain in (t.kind, t.name))]
    if not ok:
        have = ", ".join(f"{t.name} (compute_{t.archs[0]}…{t.archs[-1]})" for t in chains) or "none"
        raise UnavailableError(
            f"no {'' if toolchain == 'auto' else toolchain + ' '}toolchain builds compute_{arch}; found: {have}. "
            "Install nvidia-cuda-nvrtc-cu11==11.8.89 (compute_35+) or nvidia-cuda-nvrtc-cu12==12.9.86 (compute_50+) "
            "with pip, or point $LE_PTX_DIR at prebuilt PTX (python -m legacy_engine.gpu build --out DIR)")
    return ok[0]


# ------------------------------------------------------------------------------------------ PTX: build, cache, prebuilt

def ptx_filename(name: str, tier: str, arch: int) -> str:
    return f"{name}.{tier}.compute_{arch}.ptx"


def build_ptx(name: str, tier: str, arch: int, toolchain: str = "auto",
              chains: list[Toolchain] | None = None) -> tuple[Path, Toolchain]:
    """cuda8/<name>.cu -> PTX for (tier, arch), from the user cache when already built."""
    check_variant(tier, arch)
    tc = pick_toolchain(arch, toolchain, chains)
    h = source_hash(name)
    out = cache_dir() / "ptx" / f"{name}.{tier}.compute_{arch}.{tc.name}.{h[:16]}.ptx"
    if not out.exists():
        ptx = tc.compile(name, tier, arch)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(ptx)
        os.replace(tmp, out)
    return out, tc


def default_variants(chains: list[Toolchain] | None = None, native_archs=(75, 90)) -> list[tuple[str, int]]:
    """The legacy variants (compute_35/61/70, NVRTC) plus every tier at `native_archs` that some
    toolchain here can build (nvcc 13: 75 and 90)."""
    chains = find_toolchains() if chains is None else chains
    out = list(LEGACY_VARIANTS)
    for arch in native_archs:
        if any(arch in t.archs for t in chains):
            out += [(tier, arch) for tier in TIERS]
    return out


def build_kernels(arch: int | None = None, toolchain: str = "auto", out: str | os.PathLike | None = None,
                  variants: list[tuple[str, int]] | None = None, skip_missing: bool = True) -> list[dict]:
    """Builds every cuda8 source for every tier at `arch` (None: default_variants()); with `out`, also
    copies the PTX there with a manifest.json (a folder for $LE_PTX_DIR). -> one record per PTX.

    A variant no toolchain here can build is skipped (with skip_missing) and reported with its reason."""
    chains = find_toolchains()
    if variants is None:
        variants = ([(t, arch) for t in TIERS if arch >= TIERS[t][1] or t == "fermi"] if arch
                    else default_variants(chains))
    records = []
    for tier, a in variants:
        for name in SOURCES:
            rec = {"name": name, "tier": tier, "arch": a, "source_hash": source_hash(name)}
            try:
                path, tc = build_ptx(name, tier, a, toolchain, chains)
            except UnavailableError as e:
                if not skip_missing:
                    raise
                rec["skipped"] = str(e)
                records.append(rec)
                continue
            rec.update(toolchain=tc.name, ptx=str(path), bytes=path.stat().st_size)
            records.append(rec)
    if out is not None:
        dest = Path(out)
        dest.mkdir(parents=True, exist_ok=True)
        manifest = []
        for rec in records:
            if "ptx" not in rec:
                continue
            fn = ptx_filename(rec["name"], rec["tier"], rec["arch"])
            shutil.copyfile(rec["ptx"], dest / fn)
            manifest.append({k: rec[k] for k in ("name", "tier", "arch", "toolchain", "source_hash")} | {"file": fn})
        old = _read_manifest(dest)
        keep = [m for m in old if (m["name"], m["tier"], m["arch"]) not in
                {(n["name"], n["tier"], n["arch"]) for n in manifest}]
        (dest / "manifest.json").write_text(json.dumps(keep + manifest, indent=1))
    return records


def _read_manifest(d: Path) -> list[dict]:
    try:
        return json.loads((d / "manifest.json").read_text())
    except (OSError, ValueError):
        return []


def prebuilt_ptx(name: str, tier: str, arch: int) -> tuple[Path | None, str]:
    """PTX for (name, tier, arch) from $LE_PTX_DIR -> (path or None, why not)."""
    d = os.environ.get("LE_PTX_DIR")
    if not d:
        return None, "LE_PTX_DIR is not set"
    for m in _read_manifest(Path(d)):
        if (m["name"], m["tier"], m["arch"]) == (name, tier, arch):
            if m["source_hash"] != source_hash(name):
                return None, (f"{d}/{m['file']} is stale (built from other sources); rebuild it with "
                              f"python -m legacy_engine.gpu build --out {d}")
            return Path(d) / m["file"], f"prebuilt by {m['toolchain']}"
    return None, f"{d} has no {ptx_filename(name, tier, arch)}"


def get_ptx(name: str, tier: str, arch: int, toolchain: str = "auto") -> tuple[bytes, str]:
    """The PTX of (name, tier, arch) -> (text, origin): $LE_PTX_DIR first, then the cache / a compiler."""
    path, why = prebuilt_ptx(name, tier, arch)
    if path is not None:
        return path.read_bytes(), f"{why} ({path})"
    try:
        p, tc = build_ptx(name, tier, arch, toolchain)
    except UnavailableError as e:
        raise UnavailableError(f"no PTX for {name} {variant_name(tier, arch)}: {e}; and {why}") from None
    return p.read_bytes(), f"built by {tc.name} ({p})"


# ------------------------------------------------------------------------------------------ ptxas reports

def find_ptxas() -> list[tuple[tuple[int, int], str]]:
    """[(version, path)] of every ptxas here: the nvidia-cuda-nvcc-cu11/-cu12 wheels (installed under
    the cache by install-toolchains, or in site-packages) and the CUDA toolkit's."""
    cands = []
    for d in _site_dirs():
        cands += glob.glob(str(d / "nvidia" / "cuda_nvcc" / "bin" / "ptxas"))
    cands += [shutil.which("ptxas") or "", os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "ptxas")]
    found = {}
    for p in cands:
        if not p or not os.path.isfile(p):
            continue
        try:
            out = subprocess.run([p, "--version"], capture_output=True, encoding="utf-8", errors="replace", timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        if m := re.search(r"release (\d+)\.(\d+)", out):
            found.setdefault((int(m.group(1)), int(m.group(2))), os.path.realpath(p))
    return sorted(found.items())


def ptxas_report(ptx: Path | str, sm: int, ptxas: str, max_regs: int | None = None) -> dict[str, dict]:
    """Assembles PTX into a real sm_<sm> cubin with `ptxas -v` -> {kernel: {regs, smem, cmem, stack,
    spill_stores, spill_loads}}; KernelBuildError if ptxas fails."""
    with tempfile.TemporaryDirectory() as tmp:
        cap = [f"-maxrregcount={max_regs}"] if max_regs else []
        r = subprocess.run([ptxas, "-v", f"-arch=sm_{sm}", *cap, str(ptx), "-o", os.path.join(tmp, "out.cubin")],
                           capture_output=True, encoding="utf-8", errors="replace")
    if r.returncode != 0:
        raise KernelBuildError(f"ptxas -arch=sm_{sm} {ptx} failed:\n{r.stderr[-3000:]}")
    out: dict[str, dict] = {}
    cur = None
    for line in r.stderr.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            cur = out.setdefault(m.group(1), {"regs": 0, "smem": 0, "cmem": 0, "stack": 0, "spill_stores": 0,
                                              "spill_loads": 0})
        elif cur is not None and (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                                                 r"(\d+) bytes spill loads", line)):
            cur.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif cur is not None and "Used" in line:
            if m := re.search(r"Used (\d+) registers", line):
                cur["regs"] = int(m.group(1))
            if m := re.search(r"(\d+) bytes smem", line):
                cur["smem"] = int(m.group(1))
            if m := re.search(r"(\d+) bytes cmem\[0\]", line):
                cur["cmem"] = int(m.group(1))
    return out


# The lowest sm_XX each ptxas major version assembles.
_PTXAS_MIN_SM = {8: 20, 9: 30, 10: 30, 11: 35, 12: 50, 13: 75}
FERMI_MAX_REGS = 63


def ptxas_table(variants=LEGACY_VARIANTS) -> list[dict]:
    """ptxas -v of every source for each legacy variant on its own chip (sm_35/61/70). Each PTX goes to the
    newest ptxas that targets the chip and accepts the PTX's ISA version (a newer PTX needs a newer ptxas).
    The fermi tier is assembled with -maxrregcount=63, Fermi's per-thread register limit (as CUDA 8 for sm_20 would).
    Rows: {variant, sm, source, ptxas, kernel, regs, smem, cmem, stack, spill_stores, spill_loads}."""
    assemblers = find_ptxas()
    rows = []
    for tier, arch in variants:
        usable = [(v, p) for v, p in reversed(assemblers) if arch >= _PTXAS_MIN_SM.get(v[0], 75)]
        if not usable:
            raise UnavailableError(f"no ptxas here assembles sm_{arch}; run python -m legacy_engine.gpu "
                                   "install-toolchains (nvidia-cuda-nvcc-cu11 / -cu12 wheels)")
        for name in SOURCES:
            ptx, _ = get_ptx(name, tier, arch)
            with tempfile.NamedTemporaryFile(suffix=".ptx") as f:
                f.write(ptx)
                f.flush()
                err = None
                for version, ptxas in usable:
                    try:
                        report = ptxas_report(f.name, arch, ptxas, FERMI_MAX_REGS if tier == "fermi" else None)
                        break
                    except KernelBuildError as e:
                        err = e
                else:
                    raise err
            for kernel, info in report.items():
                rows.append({"variant": variant_name(tier, arch), "sm": arch, "source": name,
                             "ptxas": f"{version[0]}.{version[1]}", "kernel": kernel, **info})
    return rows


TOOLCHAIN_WHEELS = ("nvidia-cuda-nvrtc-cu11==11.8.89", "nvidia-cuda-nvrtc-cu12==12.9.86",
                    "nvidia-cuda-nvcc-cu11==11.8.89", "nvidia-cuda-nvcc-cu12==12.9.86")


def install_toolchains() -> Path:
    """pip-installs the NVRTC and ptxas wheels, each into its own folder under the cache (the cu11 and
    cu12 nvcc wheels both write nvidia/cuda_nvcc/bin/ptxas, so one site-packages holds only one)."""
    root = cache_dir() / "toolchains"
    for spec in TOOLCHAIN_WHEELS:
        dest = root / spec.replace("==", "-")
        if dest.exists():
            continue
        tmp = root / (dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp), spec],
                       check=True)
        os.replace(tmp, dest)
    return root


# ------------------------------------------------------------------------------------------ runtime objects

def _native():
    from . import _native as n   # imported late: building PTX needs no compiled core
    return n


def available() -> tuple[bool, str]:
    """(True, "") when a driver and a device are there, else (False, why)."""
    info = _native().gpu_info()
    if not info["available"]:
        return False, info["reason"]
    if info["device_count"] < 1:
        return False, "the CUDA driver sees no device"
    return True, ""


def init(device: int = 0) -> dict:
    """Opens `device` (UnavailableError with the reason when there is no driver or device) -> its info."""
    ok, why = available()
    if not ok:
        raise UnavailableError(f"no usable GPU: {why}")
    n = _native()
    n.gpu_init(device)
    return n.gpu_info()["devices"][device]


def device_arch(device: int = 0) -> int:
    d = _native().gpu_info()["devices"][device]
    return d["cc_major"] * 10 + d["cc_minor"]


def set_budget(nbytes: int | None) -> None:
    """VRAM budget for every Buffer (None: none); a Buffer beyond it raises NativeError (LE_ERR_NO_MEMORY)."""
    _native().gpu_set_budget(nbytes)


def mem_stats() -> dict:
    return _native().gpu_mem_stats()


def _ensure_open() -> None:
    """Opens device 0 on first use (UnavailableError with the reason when there is none)."""
    if _native().gpu_current_device() < 0:
        init()


class Buffer:
    """Device memory; freed by free(), by `with`, or when garbage-collected."""

    def __init__(self, nbytes: int, what: str = "buffer"):
        _ensure_open()
        self.nbytes = int(nbytes)
        self.what = what
        self.ptr = _native().gpu_alloc(self.nbytes, what)

    @classmethod
    def from_array(cls, a, what: str = "buffer") -> "Buffer":
        a = np.ascontiguousarray(a) if isinstance(a, np.ndarray) else a
        mv = memoryview(a).cast("B")
        b = cls(max(mv.nbytes, 1), what)
        if mv.nbytes:
            b.upload(mv)
        return b

    def upload(self, src, stream: "Stream | None" = None) -> None:
        n = memoryview(src).nbytes
        if n > self.nbytes:
            raise ValueError(f"{n} bytes do not fit the {self.nbytes}-byte {self.what}")
        _native().gpu_copy_htod(self.ptr, src, n, None if stream is None else stream.handle)

    def download(self, out=None, dtype=np.uint8, count: int | None = None, stream: "Stream | None" = None):
        """-> a numpy array of `count` `dtype` items (default: the whole buffer), or fills `out`."""
        if out is None:
            dt = np.dtype(dtype)
            out = np.empty(self.nbytes // dt.itemsize if count is None else count, dtype=dt)
        n = memoryview(out).nbytes
        if n > self.nbytes:
            raise ValueError(f"{n} bytes asked from the {self.nbytes}-byte {self.what}")
        _native().gpu_copy_dtoh(out, self.ptr, n, None if stream is None else stream.handle)
        return out

    def free(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            _native().gpu_free(ptr)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    def __del__(self):
        try:
            self.free()
        except Exception:   # interpreter shutdown or a closed context: nothing left to free
            pass


class BufferView(Buffer):
    """nbytes of a Buffer from an offset, read and written as a Buffer; it owns nothing (free() forgets the address,
    the Buffer keeps the memory)."""

    def __init__(self, parent: Buffer, offset: int, nbytes: int, what: str = "view"):
        if offset < 0 or offset + nbytes > parent.nbytes:
            raise ValueError(f"{what}: bytes {offset}…{offset + nbytes} outside the {parent.nbytes}-byte {parent.what}")
        self.parent, self.nbytes, self.what = parent, int(nbytes), what
        self.ptr = parent.ptr + int(offset)

    def free(self) -> None:
        self.ptr = 0


class PinnedBuffer:
    """Page-locked host memory (fast and asynchronous copies); .array is a uint8 numpy view."""

    def __init__(self, nbytes: int):
        _ensure_open()
        self.nbytes = int(nbytes)
        self.ptr, buf = _native().gpu_host_alloc(self.nbytes)
        self.array = np.frombuffer(buf, dtype=np.uint8)

    def free(self) -> None:
        if self.ptr is not None:
            ptr, self.ptr = self.ptr, None
            self.array = None
            _native().gpu_host_free(ptr)

    def __del__(self):
        try:
            self.free()
        except Exception:
            pass


class Stream:
    """ordered=False: independent of the default stream (cudaStreamNonBlocking); True: ordered with it both ways
    (work launched on the default stream before runs first, work launched there after waits)."""

    def __init__(self, ordered: bool = False):
        _ensure_open()
        self.handle = _native().gpu_stream_create(ordered)

    def synchronize(self) -> None:
        _native().gpu_stream_synchronize(self.handle)

    def query(self) -> bool:
        """Whether the work launched on this stream so far has finished (does not wait)."""
        return _native().gpu_stream_query(self.handle)

    def wait(self, event: "Event") -> None:
        """Work launched on this stream from now on waits for `event`."""
        _native().gpu_stream_wait_event(self.handle, event.handle)

    def __del__(self):
        try:
            if self.handle is not None:
                _native().gpu_stream_destroy(self.handle)
                self.handle = None
        except Exception:
            pass


def wait_default(event: "Event") -> None:
    """Work launched on the default stream from now on waits for `event`."""
    _native().gpu_stream_wait_event(None, event.handle)


class Event:
    def __init__(self):
        _ensure_open()
        self.handle = _native().gpu_event_create()

    def record(self, stream: Stream | None = None) -> None:
        _native().gpu_event_record(self.handle, None if stream is None else stream.handle)

    def synchronize(self) -> None:
        _native().gpu_event_synchronize(self.handle)

    def elapsed_ms(self, end: "Event") -> float:
        """Milliseconds from this event to `end` (both recorded; waits for `end`)."""
        end.synchronize()
        return _native().gpu_event_elapsed_ms(self.handle, end.handle)

    def __del__(self):
        try:
            if self.handle is not None:
                _native().gpu_event_destroy(self.handle)
                self.handle = None
        except Exception:
            pass


class Module:
    """A loaded PTX/cubin image; kernel(name) fetches its functions."""

    def __init__(self, image: bytes, name: str):
        _ensure_open()
        self.name = name
        self.handle = _native().gpu_module_load(image, name)
        self._kernels: dict[str, Kernel] = {}

    @property
    def jit_log(self) -> str:
        return _native().gpu_module_log(self.handle)

    def kernel(self, name: str) -> "Kernel":
        if name not in self._kernels:
            self._kernels[name] = Kernel(self, name, _native().gpu_kernel_get(self.handle, name))
        return self._kernels[name]

    def unload(self) -> None:
        if self.handle is not None:
            h, self.handle = self.handle, None
            self._kernels.clear()
            _native().gpu_module_unload(h)

    def __del__(self):
        try:
            self.unload()
        except Exception:
            pass


class Kernel:
    def __init__(self, module: Module, name: str, handle):
        self.module, self.name, self.handle = module, name, handle

    def info(self) -> dict:
        """Registers, shared/local bytes, PTX and binary versions as the driver compiled it."""
        return _native().gpu_kernel_info(self.handle)

    def launch(self, grid, block, args, shared_bytes: int = 0, stream: Stream | None = None) -> None:
        """grid/block: (x, y, z); args: [(kind, value)], kind in ptr/i32/u32/i64/f32 (Buffer -> its ptr).
        Inside `record()` the launch is also appended to the recording."""
        args = [(k, v.ptr if isinstance(v, Buffer) else v) for k, v in args]
        sh = None if stream is None else stream.handle
        if _RECORDING is not None:
            _RECORDING.append((self.handle, tuple(grid), tuple(block), args, shared_bytes, sh))
        _native().gpu_launch(self.handle, grid, block, args, shared_bytes, sh)


_RECORDING: list | None = None


class record:
    """`with gpu.record() as launches:` every kernel launched inside runs as usual and is appended to `launches`
    (for LaunchPlan). Not reentrant."""

    def __enter__(self) -> list:
        global _RECORDING
        if _RECORDING is not None:
            raise RuntimeError("gpu.record() is already active")
        _RECORDING = []
        return _RECORDING

    def __exit__(self, *exc):
        global _RECORDING
        _RECORDING = None


def graphs_available() -> bool:
    """The driver exports the CUDA graph entry points (11.4+)."""
    _ensure_open()
    return _native().gpu_graphs_available()


def host_step(fn) -> None:
    """Runs fn() now; inside record() the recording also keeps the call, and a LaunchPlan made from it calls fn
    again at that point of every replay, between the launches before and after it (the hybrid decode reads the
    routing and runs the CPU's experts there: fn's copies on the default stream order it with the launches)."""
    if _RECORDING is not None:
        _RECORDING.append(("host", fn))
    fn()


class LaunchPlan:
    """A recorded sequence of launches with their arguments prepared once; replay() launches them again in order
    (~1 µs of Python per launch instead of ~30). Valid while every buffer it names is alive and where it was.
    Host steps (host_step) in the recording split it into segments; replay() calls each host step between them.

    graph=True: each segment of launches is also captured once as a CUDA graph on one stream ordered with the
    default stream, and replays as one cuGraphLaunch (no per-kernel host cost; the order with default-stream copies
    before and after, the host steps' included, is kept). Every recorded launch must have been on the default
    stream."""

    def __init__(self, launches: list, graph: bool = False):
        n = _native()
        self._keep = []
        self._graphs: list = []
        self._stream = None
        self._parts: list = []       # [("launches", prepared) | ("graph", graph) | ("host", fn)] in order
        self._n = 0
        if graph:
            if any(item[0] != "host" and item[5] is not None for item in launches):
                raise ValueError("LaunchPlan(graph=True): a recorded launch is on a non-default stream")
            self._stream = Stream(ordered=True)
        seg: list = []
        for item in list(launches) + [None]:
            if item is not None and item[0] != "host":
                handle, grid, block, args, shared, stream = item
                params, keep = n.gpu_launch_args(args)
                self._keep.append((params, keep))
                seg.append((handle, grid, block, shared, stream, params))
                continue
            if seg:
                self._n += len(seg)
                if graph:
                    g = n.gpu_capture(seg, self._stream.handle)
                    self._graphs.append(g)
                    self._parts.append(("graph", g))
                else:
                    self._parts.append(("launches", seg))
                seg = []
            if item is not None:
                self._parts.append(("host", item[1]))

    def __len__(self) -> int:
        return self._n

    @property
    def graph(self) -> bool:
        return self._stream is not None

    @property
    def host_steps(self) -> int:
        return sum(kind == "host" for kind, _ in self._parts)

    def replay(self) -> None:
        n = _native()
        for kind, what in self._parts:
            if kind == "graph":
                n.gpu_graph_launch(what, self._stream.handle)
            elif kind == "launches":
                n.gpu_replay(what)
            else:
                what()

    def __del__(self):
        try:
            for g in self._graphs:
                _native().gpu_graph_destroy(g)
            self._graphs = []
        except Exception:
            pass


def synchronize() -> None:
    _native().gpu_synchronize()


def time_ms(launch, reps: int, warmup: int = 1) -> float:
    """Milliseconds per call of `launch` (work on the default stream), timed by events after `warmup` calls."""
    for _ in range(warmup):
        launch()
    e0, e1 = Event(), Event()
    e0.record()
    for _ in range(reps):
        launch()
    e1.record()
    return e0.elapsed_ms(e1) / reps


def _aligned16(b, what: str) -> None:
    """gemm_f32.cu reads X as float4: its address must be a multiple of 16 bytes (every Buffer is)."""
    if _ptr(b) % 16:
        raise ValueError(f"{what}: address {_ptr(b):#x} is not 16-byte aligned")


def _ptr(b) -> int:
    return 0 if b is None else (b.ptr if isinstance(b, Buffer) else int(b))


def _need(buf, nbytes: int, what: str) -> None:
    if isinstance(buf, Buffer) and buf.nbytes < nbytes:
        raise ValueError(f"{what} needs {nbytes} bytes; the buffer has {buf.nbytes}")


class Kernels:
    """The cuda8 kernels of one variant (tier, arch) on the open device.

    Each op checks shapes and buffer sizes before launching (an out-of-bounds kernel would take the
    whole context down) and launches on `stream` (default stream when None) without waiting."""

    def __init__(self, tier: str, arch: int | None = None, toolchain: str = "auto"):
        _ensure_open()
        self.arch = device_arch(_native().gpu_current_device()) if arch is None else int(arch)
        self.tier = tier
        check_variant(tier, self.arch)
        self.has_mma = has_mma(tier, self.arch)     # gemm_mma's kernels (tensor cores) are in this variant
        self.modules: dict[str, Module] = {}
        self.origins: dict[str, str] = {}
        for name in SOURCES:
            ptx, origin = get_ptx(name, tier, self.arch, toolchain)
            self.modules[name] = Module(ptx, f"{name}.{variant_name(tier, self.arch)}")
            self.origins[name] = origin

    @property
    def name(self) -> str:
        return variant_name(self.tier, self.arch)

    def probe(self, source: str = "gemv_f32") -> dict:
        """What a module was compiled as: {'arch', 'tier_cc', 'compiler', 'features'} (le_tier_probe)."""
        with Buffer(16, "probe") as out:
            self.modules[source].kernel("le_tier_probe").launch((1, 1, 1), (32, 1, 1), [("ptr", out)])
            v = out.download(dtype=np.int32, count=4)
        feats = [f for bit, f in ((1, "shfl"), (2, "ldg"), (4, "dp4a"), (8, "sync"),
                                                  (16, "mma")) if v[3] & bit]
        return {"arch": int(v[0]), "tier_cc": int(v[1]), "compiler": int(v[2]), "features": feats}

    @staticmethod
    def _grid(n_units: int) -> int:
        return max(1, min(n_units, MAX_GRID))

    def rmsnorm(self, x, w, y, ncols: int, nrows: int, eps: float, stream: Stream | None = None) -> None:
        """x, y: [nrows, ncols] f32 (y may be x); w: [ncols] f32 or None."""
        _need(x, 4 * ncols * nrows, "rmsnorm x")
        _need(y, 4 * ncols * nrows, "rmsnorm y")
        _need(w, 4 * ncols, "rmsnorm w")
        self.modules["rmsnorm"].kernel("rmsnorm_f32").launch(
            (self._grid(nrows), 1, 1), (RMSNORM_THREADS, 1, 1),
            [("ptr", _ptr(x)), ("ptr", _ptr(w)), ("ptr", _ptr(y)), ("i32", ncols), ("i32", nrows), ("f32", eps)],
            stream=stream)

    def add_rmsnorm(self, x, y, w, h, hq, ncols: int, nrows: int, eps: float, stream: Stream | None = None) -> None:
        """x [nrows, ncols] += y (None: no add); h = rmsnorm(x) * w (w None: no weight); hq: None, or h as
        [nrows * ncols / 32] block_q8_1 (GPU layout). One launch, bit-identical to add, rmsnorm, quantize_q8_1."""
        if hq is not None and ncols % 32:
            raise ValueError(f"add_rmsnorm: ncols = {ncols} is not a multiple of 32 (Q8_1 blocks)")
        for b, nb, what in ((x, 4 * ncols * nrows, "x"), (y, 4 * ncols * nrows, "y"), (w, 4 * ncols, "w"),
                            (h, 4 * ncols * nrows, "h"), (hq, ncols * nrows // 32 * Q8_1_BYTES, "hq")):
            _need(b, nb, f"add_rmsnorm {what}")
        self.modules["rmsnorm"].kernel("add_rmsnorm_f32").launch(
            (self._grid(nrows), 1, 1), (RMSNORM_THREADS, 1, 1),
            [("ptr", _ptr(x)), ("ptr", _ptr(y)), ("ptr", _ptr(w)), ("ptr", _ptr(h)), ("ptr", _ptr(hq)),
             ("i32", ncols), ("i32", nrows), ("f32", eps)], stream=stream)

    def quantize_q8_1(self, x, y, n: int, stream: Stream | None = None) -> None:
        """x: [n] f32 (n % 32 == 0) -> y: [n/32] block_q8_1, GPU layout (d, s = sum of x)."""
        if n % 32:
            raise ValueError(f"quantize_q8_1: n = {n} is not a multiple of 32")
        _need(x, 4 * n, "quantize_q8_1 x")
        _need(y, n // 32 * Q8_1_BYTES, "quantize_q8_1 y")
        self.modules["quantize_q8_1"].kernel("quantize_q8_1").launch(
            (self._grid(-(-n // Q8_THREADS)), 1, 1), (Q8_THREADS, 1, 1),
            [("ptr", _ptr(x)), ("ptr", _ptr(y)), ("i32", n)], stream=stream)

    def _weights(self, qtype: int, W, nrows: int, ncols: int, what: str) -> str:
        if qtype == F32:
            if ncols <= 0 or ncols % 32:
                raise ValueError(f"{what}: ncols = {ncols} of f32 weights is not a positive multiple of 32")
            if _ptr(W) % 16:
                raise ValueError(f"{what}: f32 weights must be 16-byte aligned")
            _need(W, 4 * nrows * ncols, f"{what} W")
            return "f32"
        if qtype not in GPU_TYPES:
            raise UnavailableError(f"{what}: no GPU kernel for ggml type {qtype}; GPU types: "
                                   + ", ".join(v[0] for v in GPU_TYPES.values()))
        suffix, bs, ts = GPU_TYPES[qtype]
        if ncols <= 0 or ncols % bs:
            raise ValueError(f"{what}: ncols = {ncols} is not a positive multiple of {suffix}'s block size {bs}")
        if _ptr(W) % 4:
            raise ValueError(f"{what}: weights must be 4-byte aligned")
        _need(W, nrows * (ncols // bs) * ts, f"{what} W")
        return suffix

    def gemv_f32(self, qtype: int, W, x, y, nrows: int, ncols: int, W2=None, y2=None, nrows2: int | None = None,
                 stream: Stream | None = None) -> None:
        """y[nrows] = W[nrows, ncols] (ggml type `qtype`) x[ncols] f32; with W2 (a matrix of the same type and
        width, nrows2 rows: default nrows) also y2 = W2 x in the same launch."""
        suffix = self._weights(qtype, W, nrows, ncols, "gemv_f32")
        if _ptr(x) % 16:
            raise ValueError("gemv_f32: x must be 16-byte aligned (it is read as float4)")
        _need(x, 4 * ncols, "gemv_f32 x")
        _need(y, 4 * nrows, "gemv_f32 y")
        n2 = nrows if nrows2 is None else int(nrows2)
        z, w_z, y_z = self._second(qtype, W, y, W2, y2, n2, ncols, n2, "gemv_f32")
        self.modules["gemv_f32"].kernel(f"gemv_f32_{suffix}").launch(
            (self._grid(-(-max(nrows, n2 if z == 2 else 0) // GEMV_ROWS)), 1, z), (GEMV_THREADS, 1, 1),
            [("ptr", _ptr(W)), ("ptr", _ptr(x)), ("ptr", _ptr(y)), ("i32", nrows), ("i32", ncols), ("i64", w_z),
             ("i64", y_z), ("i32", n2)], stream=stream)

    def _second(self, qtype: int, W, y, W2, y2, nrows: int, ncols: int, out_rows: int,
                what: str) -> tuple[int, int, int]:
        """A GEMV's second matrix (grid.z = 2), checked as the first: -> (Z, W2 - W in bytes, y2 - y in floats);
        (1, 0, 0) without."""
        if W2 is None and y2 is None:
            return 1, 0, 0
        if W2 is None or y2 is None:
            raise ValueError(f"{what}: a second matrix needs both W2 and y2")
        self._weights(qtype, W2, nrows, ncols, what)
        _need(y2, 4 * out_rows, f"{what} y2")
        dy = _ptr(y2) - _ptr(y)
        if dy % 4:
            raise ValueError(f"{what}: y2 - y = {dy} bytes is not a whole number of floats")
        return 2, _ptr(W2) - _ptr(W), dy // 4

    def gemv_ids(self, qtype: int, W, x, y, nrows: int, ncols: int, ids, n_pairs: int, expert_bytes: int,
                 x_group: int, x_stride: int, int8: bool = False, n_experts: int | None = None, W2=None, y2=None,
                 stream: Stream | None = None) -> None:
        """The MoE GEMV: for pair p < n_pairs, y[p, :nrows] = W_e x_p with e = ids[p] (int32, device), W_e at
        W + e * expert_bytes ([nrows, ncols] each), x_p = x + (p // x_group) * x_stride (floats; with int8:
        block_q8_1 of quantize_q8_1, x_stride in blocks). The ids are not read back: the caller makes them
        (moe_route) < n_experts. ids[p] < 0 skips pair p and zeroes its row (the hybrid decode's CPU experts).
        W2, y2: a second matrix of the same shape and type (expert e at W2 + e * expert_bytes: a SwiGLU's up
        beside its gate) into y2 [n_pairs, nrows] in the same launch."""
        what = "gemv_dp4a_ids" if int8 else "gemv_f32_ids"
        suffix = self._weights(qtype, W, nrows, ncols, what)
        if int8 and qtype == F32:
            raise ValueError(f"{what}: f32 weights have no int8 path")
        if not 0 < n_pairs <= MAX_PAIRS or x_group <= 0 or x_stride < 0:
            raise ValueError(f"{what}: n_pairs = {n_pairs} (1…{MAX_PAIRS}), x_group = {x_group}, x_stride = {x_stride}")
        if not int8 and (x_stride % 4 or _ptr(x) % 16):
            raise ValueError(f"{what}: x and x_stride must keep rows 16-byte aligned")
        if n_experts is not None:
            _need(W, n_experts * expert_bytes, f"{what} W")
        _need(ids, 4 * n_pairs, f"{what} ids")
        _need(y, 4 * nrows * n_pairs, f"{what} y")
        z, w_z, y_z = self._second(qtype, W, y, W2, y2, nrows, ncols, nrows * n_pairs, what)
        mod = "gemv_dp4a" if int8 else "gemv_f32"
        self.modules[mod].kernel(f"{mod}_{suffix}_ids").launch(
            (self._grid(-(-nrows // GEMV_ROWS)), n_pairs, z), (GEMV_THREADS, 1, 1),
            [("ptr", _ptr(W)), ("ptr", _ptr(x)), ("ptr", _ptr(y)), ("i32", nrows), ("i32", ncols), ("ptr", _ptr(ids)),
             ("i64", int(expert_bytes)), ("i32", x_group), ("i32", x_stride), ("i64", w_z), ("i64", y_z)],
            stream=stream)

    def gemv_dp4a(self, qtype: int, W, xq, y, nrows: int, ncols: int, W2=None, y2=None, nrows2: int | None = None,
                  stream: Stream | None = None) -> None:
        """y[nrows] = W[nrows, ncols] xq, xq: [ncols/32] block_q8_1 from quantize_q8_1; with W2 (a matrix of the
        same type and width, nrows2 rows: default nrows) also y2 = W2 xq in the same launch."""
        if qtype == F32:
            raise ValueError("gemv_dp4a: f32 weights have no int8 path (use gemv_f32)")
        suffix = self._weights(qtype, W, nrows, ncols, "gemv_dp4a")
        _need(xq, ncols // 32 * Q8_1_BYTES, "gemv_dp4a xq")
        _need(y, 4 * nrows, "gemv_dp4a y")
        n2 = nrows if nrows2 is None else int(nrows2)
        z, w_z, y_z = self._second(qtype, W, y, W2, y2, n2, ncols, n2, "gemv_dp4a")
        self.modules["gemv_dp4a"].kernel(f"gemv_dp4a_{suffix}").launch(
            (self._grid(-(-max(nrows, n2 if z == 2 else 0) // GEMV_ROWS)), 1, z), (GEMV_THREADS, 1, 1),
            [("ptr", _ptr(W)), ("ptr", _ptr(xq)), ("ptr", _ptr(y)), ("i32", nrows), ("i32", ncols), ("i64", w_z),
             ("i64", y_z), ("i32", n2)], stream=stream)

    def gemm_f32(self, qtype: int, W, X, Y, nrows: int, ncols: int, ntok: int, stream: Stream | None = None) -> None:
        """Y[ntok, nrows] = X[ntok, ncols] f32 times W[nrows, ncols]^T."""
        _need(X, 4 * ncols * ntok, "gemm_f32 X")
        _aligned16(X, "gemm_f32 X")
        self._gemm("gemm_f32", qtype, W, X, Y, nrows, ncols, ntok, stream)

    def gemm_dp4a(self, qtype: int, W, xq, Y, nrows: int, ncols: int, ntok: int, stream: Stream | None = None) -> None:
        """Y[ntok, nrows] = xq[ntok, ncols/32] (block_q8_1 rows from one quantize_q8_1 of the [ntok, ncols] f32
        activations) times W[nrows, ncols]^T, in int8 (W4A8/W8A8)."""
        self._gemm_q8("gemm_dp4a", qtype, W, xq, Y, nrows, ncols, ntok, stream, GEMM_TT)

    def gemm_mma(self, qtype: int, W, xq, Y, nrows: int, ncols: int, ntok: int, stream: Stream | None = None) -> None:
        """gemm_dp4a on tensor cores (same arguments, same bits); only where has_mma (dp4a tier, sm_75+)."""
        if not self.has_mma:
            raise UnavailableError(f"gemm_mma: the {self.name} kernels have no int8 mma (the dp4a tier at "
                                   f"compute_{MMA_ARCH}+ has)")
        self._gemm_q8("gemm_mma", qtype, W, xq, Y, nrows, ncols, ntok, stream, GEMM_MMA_TT)

    def _gemm_q8(self, mod: str, qtype: int, W, xq, Y, nrows: int, ncols: int, ntok: int, stream, tt: int) -> None:
        """The int8 GEMMs' checks (quantised weights, xq of ntok Q8_1 rows), then their launch."""
        if qtype == F32:
            raise ValueError(f"{mod}: f32 weights have no int8 path (use gemm_f32)")
        _need(xq, ntok * (ncols // 32) * Q8_1_BYTES, f"{mod} xq")
        self._gemm(mod, qtype, W, xq, Y, nrows, ncols, ntok, stream, tt)

    def _gemm(self, mod: str, qtype: int, W, X, Y, nrows: int, ncols: int, ntok: int, stream,
              tt: int = GEMM_TT) -> None:
        """The launch the prefill GEMMs share (same arguments; tt tokens per block); X is checked by the caller."""
        suffix = self._weights(qtype, W, nrows, ncols, mod)
        if not 0 < ntok <= tt * MAX_GRID:
            raise ValueError(f"{mod}: ntok = {ntok} outside 1…{tt * MAX_GRID}")
        _need(Y, 4 * nrows * ntok, f"{mod} Y")
        self.modules[mod].kernel(f"{mod}_{suffix}").launch(
            (self._grid(-(-nrows // GEMM_ROWS)), -(-ntok // tt), 1), (GEMM_THREADS, 1, 1),
            [("ptr", _ptr(W)), ("ptr", _ptr(X)), ("ptr", _ptr(Y)), ("i32", nrows), ("i32", ncols), ("i32", ntok)],
            stream=stream)

    @staticmethod
    def group_tile(int8: bool, mma: bool) -> int:
        """Pairs per tile of the grouped GEMM gemm_ids(int8, mma) runs: its work list (expert_tiles, moe_sort) must
        be cut with this tile."""
        return GEMM_MMA_TT if int8 and mma else GEMM_TT

    @staticmethod
    def expert_tiles(sorted_ids: np.ndarray, tile: int = GEMM_TT) -> np.ndarray:
        """int32 [n_tiles, 3] (expert, first pair, count <= tile) over pairs sorted by expert: each expert's
        run cut into tiles of `tile` pairs (gemm_ids' work list; group_tile)."""
        ids = np.asarray(sorted_ids)
        if ids.size and (np.diff(ids) < 0).any():
            raise ValueError("expert_tiles: the ids must be sorted")
        starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]]) if ids.size else np.zeros(0, dtype=np.int64)
        ends = np.r_[starts[1:], ids.size]
        out = [(int(ids[a]), p, min(tile, b - p)) for a, b in zip(starts, ends) for p in range(a, b, tile)]
        return np.asarray(out, dtype=np.int32).reshape(-1, 3)

    def gemm_ids(self, qtype: int, W, X, Y, nrows: int, ncols: int, tiles, n_tiles: int, expert_bytes: int,
                 n_pairs: int, stream: Stream | None = None, int8: bool = False, mma: bool = False) -> None:
        """The grouped expert GEMM: for each tile (e, p0, cnt) of `tiles` (device int32 [n_tiles, 3], from
        expert_tiles with tile = group_tile(int8, mma): 32 pairs, 64 for gemm_mma), Y[p0:p0+cnt] = X[p0:p0+cnt]
        W_e^T with W_e at W + e * expert_bytes; X [n_pairs, ncols] f32 rows sorted by expert, or with int8 their
        block_q8_1 rows [n_pairs, ncols/32] (gemm_dp4a_*_ids, or with mma too gemm_mma_*_ids); Y [n_pairs, nrows].
        The tiles live on the device (no check of their counts here): a longer tile than the kernel's leaves pairs
        uncomputed."""
        mod = ("gemm_mma" if mma else "gemm_dp4a") if int8 else "gemm_f32"
        what = f"{mod}_ids" if int8 else "gemm_ids"
        if mma and not (int8 and self.has_mma):
            raise UnavailableError(f"gemm_mma_ids: needs int8 and a variant with the int8 mma, not {self.name}")
        if int8 and qtype == F32:
            raise ValueError(f"{what}: f32 weights have no int8 path")
        suffix = self._weights(qtype, W, nrows, ncols, what)
        if not 0 < n_tiles <= MAX_GRID:
            raise ValueError(f"{what}: n_tiles = {n_tiles} outside 1…{MAX_GRID}")
        if int8:
            _need(X, n_pairs * (ncols // 32) * Q8_1_BYTES, f"{what} xq")
        else:
            _need(X, 4 * ncols * n_pairs, f"{what} X")
            _aligned16(X, f"{what} X")
        _need(Y, 4 * nrows * n_pairs, f"{what} Y")
        _need(tiles, 12 * n_tiles, f"{what} tiles")
        self.modules[mod].kernel(f"{mod}_{suffix}_ids").launch(
            (self._grid(-(-nrows // GEMM_ROWS)), n_tiles, 1), (GEMM_THREADS, 1, 1),
            [("ptr", _ptr(W)), ("ptr", _ptr(X)), ("ptr", _ptr(Y)), ("i32", nrows), ("i32", ncols),
             ("ptr", _ptr(tiles)), ("i64", int(expert_bytes))], stream=stream)


    # ---- the layer ops after the matmuls (cuda8/conv1d.cu, gdn.cu, attention.cu, moe_route.cu, argmax.cu,
    # elementwise.cu); every tensor f32 unless said, shapes as in each file's header.

    def conv1d_silu(self, x, w, state, y, n: int, conv_dim: int, K: int, stream: Stream | None = None) -> None:
        """y[n, conv_dim] = SiLU(causal depthwise conv of [state; x] with w[conv_dim, K]); state[K-1, conv_dim]
        (oldest row first) becomes the last K-1 rows of [state; x]. y must not be x."""
        if not 1 <= K <= CONV_MAX_K:
            raise ValueError(f"conv1d: K = {K} outside 1…{CONV_MAX_K}")
        if n <= 0 or conv_dim <= 0:
            raise ValueError(f"conv1d: n = {n}, conv_dim = {conv_dim}")
        if _ptr(x) == _ptr(y):
            raise ValueError("conv1d: y must not be x (later tokens read x after earlier ones are written)")
        _need(x, 4 * n * conv_dim, "conv1d x")
        _need(y, 4 * n * conv_dim, "conv1d y")
        _need(w, 4 * conv_dim * K, "conv1d w")
        _need(state, 4 * max(K - 1, 1) * conv_dim, "conv1d state")
        gx = -(-conv_dim // CONV_THREADS)
        mod = self.modules["conv1d"]
        mod.kernel("conv1d_silu_f32").launch(
            (gx, self._grid(-(-n // CONV_TOKENS)), 1), (CONV_THREADS, 1, 1),
            [("ptr", _ptr(x)), ("ptr", _ptr(w)), ("ptr", _ptr(state)), ("ptr", _ptr(y)), ("i32", n),
             ("i32", conv_dim), ("i32", K)], stream=stream)
        mod.kernel("conv1d_state_f32").launch(
            (gx, 1, 1), (CONV_THREADS, 1, 1),
            [("ptr", _ptr(x)), ("ptr", _ptr(state)), ("i32", n), ("i32", conv_dim), ("i32", K)], stream=stream)

    def gdn_gates(self, beta, g, dt_bias, ssm_a, n: int, Hv: int, stream: Stream | None = None) -> None:
        """In place, [n, Hv] each: beta <- sigmoid(beta); g <- softplus(g + dt_bias) * ssm_a (the log decay)."""
        _need(beta, 4 * n * Hv, "gdn_gates beta")
        _need(g, 4 * n * Hv, "gdn_gates g")
        _need(dt_bias, 4 * Hv, "gdn_gates dt_bias")
        _need(ssm_a, 4 * Hv, "gdn_gates ssm_a")
        self.modules["gdn"].kernel("gdn_gates_f32").launch(
            (self._grid(-(-n * Hv // GDN_EW_THREADS)), 1, 1), (GDN_EW_THREADS, 1, 1),
            [("ptr", _ptr(beta)), ("ptr", _ptr(g)), ("ptr", _ptr(dt_bias)), ("ptr", _ptr(ssm_a)), ("i32", n),
             ("i32", Hv)], stream=stream)

    def gdn_l2norm_qk(self, u, n: int, conv_dim: int, Hk: int, dk: int, eps: float = 1e-6,
                      qscale: float | None = None, stream: Stream | None = None) -> None:
        """In place on u[n, conv_dim] (q | k | v per row): each of the Hk q and Hk k heads of dk <- l2-normalised
        (x / sqrt(sum x^2 + eps)), q heads then * qscale (default 1/sqrt(dk) in f32, as gdn.c)."""
        if conv_dim < 2 * Hk * dk:
            raise ValueError(f"gdn_l2norm_qk: conv_dim {conv_dim} < 2 * {Hk} * {dk}")
        _need(u, 4 * n * conv_dim, "gdn_l2norm_qk u")
        qscale = float(np.float32(1) / np.sqrt(np.float32(dk))) if qscale is None else qscale
        self.modules["gdn"].kernel("gdn_l2norm_qk_f32").launch(
            (self._grid(n * 2 * Hk), 1, 1), (GDN_NORM_THREADS, 1, 1),
            [("ptr", _ptr(u)), ("i32", n), ("i32", conv_dim), ("i32", Hk), ("i32", dk), ("f32", qscale),
             ("f32", eps)], stream=stream)

    def gdn_recurrent(self, u, g, beta, S, o, n: int, Hk: int, Hv: int, dk: int, dv: int, tiled: bool = True,
                      dt_bias=None, ssm_a=None, stream: Stream | None = None) -> None:
        """The delta rule over n tokens: u [n, 2*Hk*dk + Hv*dv] (normalised q | k | v), g and beta [n, Hv],
        S [Hv, dk, dv] updated in place, o [n, Hv*dv]. v-head j reads k-head j % Hk (tiled, qwen35*) or
        j / (Hv/Hk) (qwen3next). dt_bias, ssm_a [Hv]: g and beta are the raw projections and the gates (gdn_gates)
        are taken here; None: already gated."""
        if not 0 < dk <= GDN_MAX_DK:
            raise ValueError(f"gdn_recurrent: dk = {dk} outside 1…{GDN_MAX_DK}")
        if Hk <= 0 or Hv % Hk or dv <= 0 or n <= 0:
            raise ValueError(f"gdn_recurrent: Hv = {Hv} is not a multiple of Hk = {Hk} (or dv = {dv}, n = {n})")
        conv_dim = 2 * Hk * dk + Hv * dv
        _need(u, 4 * n * conv_dim, "gdn_recurrent u")
        _need(g, 4 * n * Hv, "gdn_recurrent g")
        _need(beta, 4 * n * Hv, "gdn_recurrent beta")
        _need(S, 4 * Hv * dk * dv, "gdn_recurrent S")
        _need(o, 4 * n * Hv * dv, "gdn_recurrent o")
        if (dt_bias is None) != (ssm_a is None):
            raise ValueError("gdn_recurrent: the gates need both dt_bias and ssm_a")
        if dt_bias is not None:
            _need(dt_bias, 4 * Hv, "gdn_recurrent dt_bias")
            _need(ssm_a, 4 * Hv, "gdn_recurrent ssm_a")
        self.modules["gdn"].kernel("gdn_recurrent_f32").launch(
            (Hv, -(-dv // GDN_COLS), 1), (GDN_THREADS, 1, 1),
            [("ptr", _ptr(u)), ("ptr", _ptr(g)), ("ptr", _ptr(beta)), ("ptr", _ptr(S)), ("ptr", _ptr(o)),
             ("i32", n), ("i32", conv_dim), ("i32", Hk), ("i32", Hv), ("i32", dk), ("i32", dv),
             ("i32", int(bool(tiled))), ("ptr", _ptr(dt_bias)), ("ptr", _ptr(ssm_a))], stream=stream)

    def gdn_gated_rmsnorm(self, o, z, w, y, nrows: int, dv: int, eps: float, yq=None,
                          stream: Stream | None = None) -> None:
        """y = RMSNorm(o) * w * SiLU(z) per row of dv (nrows = n * Hv); y may be o. yq: also y's Q8_1 blocks (the
        out projection's int8 input), bit-identical to quantize_q8_1 of y."""
        _need(o, 4 * nrows * dv, "gdn_gated_rmsnorm o")
        _need(z, 4 * nrows * dv, "gdn_gated_rmsnorm z")
        _need(y, 4 * nrows * dv, "gdn_gated_rmsnorm y")
        _need(w, 4 * dv, "gdn_gated_rmsnorm w")
        if yq is not None:
            if dv % 32:
                raise ValueError(f"gdn_gated_rmsnorm: Q8_1 rows need dv % 32 == 0, dv = {dv}")
            _need(yq, nrows * dv // 32 * Q8_1_BYTES, "gdn_gated_rmsnorm yq")
        self.modules["gdn"].kernel("gdn_gated_rmsnorm_f32").launch(
            (self._grid(nrows), 1, 1), (GDN_NORM_THREADS, 1, 1),
            [("ptr", _ptr(o)), ("ptr", _ptr(z)), ("ptr", _ptr(w)), ("ptr", _ptr(y)), ("ptr", _ptr(yq)), ("i32", nrows),
             ("i32", dv), ("f32", eps)], stream=stream)

    @staticmethod
    def _attn_shape(n_head: int, n_kv: int, hd: int, what: str) -> None:
        if hd <= 0 or hd % 32 or hd > ATTN_MAX_HD:
            raise ValueError(f"{what}: head size {hd} is not a multiple of 32 in 32…{ATTN_MAX_HD}")
        if n_kv <= 0 or n_head % n_kv:
            raise ValueError(f"{what}: n_head = {n_head} is not a multiple of n_kv = {n_kv}")

    @staticmethod
    def attn_splits(n_keys: int) -> tuple[int, int]:
        """Decode split-K: (n_split, keys_per_split): at least ATTN_MIN_KEYS_PER_SPLIT keys a split (a multiple
        of the block's warps), at most ATTN_MAX_SPLIT splits."""
        kps = max(ATTN_MIN_KEYS_PER_SPLIT, -(-n_keys // ATTN_MAX_SPLIT))
        kps = -(-kps // ATTN_WARPS) * ATTN_WARPS
        return max(1, -(-n_keys // kps)), kps

    @staticmethod
    def attn_partials_bytes(n_head: int, hd: int, n_split: int) -> int:
        """Bytes of the f32 partials of attention_decode: [n_head, n_split, hd + 2]."""
        return 4 * n_head * n_split * (hd + 2)

    def attention_decode(self, qg, kc, vc, o, part, n_keys: int, n_head: int, n_kv: int, hd: int,
                         scale: float | None = None, n_split: int | None = None, pos_dev=None,
                         stream: Stream | None = None) -> None:
        """One query token: qg [n_head * 2 * hd] (q_h then gate_h per head), kc/vc [>= n_keys, n_kv * hd],
        o [n_head * hd] = softmax(scale q K^T) V * sigmoid(gate), split-K over n_split blocks per head
        (default attn_splits) with f32 partials in `part` (attn_partials_bytes) merged by log-sum-exp.
        pos_dev: a device int32 p; the kernels then take n_keys = p + 1 from it (n_keys here is only the
        bound the buffers are checked against) and split the keys over at most n_split blocks of at least
        ATTN_MIN_KEYS_PER_SPLIT keys (a short context uses few splits; the merge reads only those)."""
        self._attn_shape(n_head, n_kv, hd, "attention_decode")
        if n_keys <= 0:
            raise ValueError(f"attention_decode: n_keys = {n_keys}")
        if n_split is None:
            n_split, kps = self.attn_splits(n_keys)
        else:
            if not 0 < n_split <= MAX_GRID:
                raise ValueError(f"attention_decode: n_split = {n_split} outside 1…{MAX_GRID}")
            kps = -(-n_keys // n_split)
        scale = float(np.float32(1) / np.sqrt(np.float32(hd))) if scale is None else scale
        _need(qg, 4 * n_head * 2 * hd, "attention_decode qg")
        _need(kc, 4 * n_keys * n_kv * hd, "attention_decode kc")
        _need(vc, 4 * n_keys * n_kv * hd, "attention_decode vc")
        _need(o, 4 * n_head * hd, "attention_decode o")
        _need(part, self.attn_partials_bytes(n_head, hd, n_split), "attention_decode partials")
        mod = self.modules["attention"]
        mod.kernel("attn_decode_partial_f32").launch(
            (n_head, n_split, 1), (ATTN_THREADS, 1, 1),
            [("ptr", _ptr(qg)), ("ptr", _ptr(kc)), ("ptr", _ptr(vc)), ("ptr", _ptr(part)), ("i32", n_keys),
             ("i32", n_head), ("i32", n_kv), ("i32", hd), ("f32", scale), ("i32", kps), ("ptr", _ptr(pos_dev))],
            stream=stream)
        mod.kernel("attn_decode_merge_f32").launch(
            (n_head, 1, 1), (ATTN_THREADS, 1, 1),
            [("ptr", _ptr(part)), ("ptr", _ptr(qg)), ("ptr", _ptr(o)), ("i32", n_head), ("i32", hd),
             ("i32", n_split), ("ptr", _ptr(pos_dev))], stream=stream)

    def attention_prefill(self, qg, kc, vc, o, n: int, pos: int, n_head: int, n_kv: int, hd: int,
                          scale: float | None = None, stream: Stream | None = None) -> None:
        """n query tokens at positions pos … pos+n-1 (qg [n, n_head * 2 * hd]; their keys already in kc/vc
        [>= pos+n, n_kv * hd]), causal: o [n, n_head * hd]."""
        self._attn_shape(n_head, n_kv, hd, "attention_prefill")
        if n <= 0 or pos < 0:
            raise ValueError(f"attention_prefill: n = {n}, pos = {pos}")
        scale = float(np.float32(1) / np.sqrt(np.float32(hd))) if scale is None else scale
        _need(qg, 4 * n * n_head * 2 * hd, "attention_prefill qg")
        _need(kc, 4 * (pos + n) * n_kv * hd, "attention_prefill kc")
        _need(vc, 4 * (pos + n) * n_kv * hd, "attention_prefill vc")
        _need(o, 4 * n * n_head * hd, "attention_prefill o")
        self.modules["attention"].kernel("attn_prefill_f32").launch(
            (n_head, self._grid(-(-n // ATTN_QTILE)), 1), (ATTN_PREFILL_THREADS, 1, 1),
            [("ptr", _ptr(qg)), ("ptr", _ptr(kc)), ("ptr", _ptr(vc)), ("ptr", _ptr(o)), ("i32", n), ("i32", pos),
             ("i32", n_head), ("i32", n_kv), ("i32", hd), ("f32", scale)], stream=stream)

    def moe_route(self, logits, ids, weights, n_tok: int, n_expert: int, k: int, wsum_min: float = MOE_WSUM_MIN,
                  stream: Stream | None = None) -> None:
        """logits [n_tok, n_expert] -> ids [n_tok, k] int32 (largest first, ties to the lower index) and
        weights [n_tok, k] = the top-k softmax probabilities / max(their sum, wsum_min)."""
        if not 0 < k <= min(MOE_MAX_K, n_expert):
            raise ValueError(f"moe_route: k = {k} outside 1…min({MOE_MAX_K}, n_expert = {n_expert})")
        _need(logits, 4 * n_tok * n_expert, "moe_route logits")
        _need(ids, 4 * n_tok * k, "moe_route ids")
        _need(weights, 4 * n_tok * k, "moe_route weights")
        self.modules["moe_route"].kernel("moe_route_f32").launch(
            (self._grid(n_tok), 1, 1), (MOE_THREADS, 1, 1),
            [("ptr", _ptr(logits)), ("ptr", _ptr(ids)), ("ptr", _ptr(weights)), ("i32", n_tok), ("i32", n_expert),
             ("i32", k), ("f32", wsum_min)], stream=stream)

    @staticmethod
    def sort_tiles_max(n_pairs: int, n_expert: int, tile: int = GEMM_TT) -> int:
        """Length of moe_sort's tile list: every full tile plus at most one partial tile per expert."""
        return -(-n_pairs // tile) + min(n_expert, n_pairs)

    def moe_sort(self, ids, n_pairs: int, k: int, n_expert: int, eids, ptok, pinv, tiles, max_tiles: int, counts,
                 stream: Stream | None = None, tile: int = GEMM_TT) -> None:
        """The routing ids [n_pairs] (moe_route's [n_tok, k], each in [0, n_expert)) in expert order, stable:
        eids = ids[order], ptok = order // k, pinv[order] = arange (int32 [n_pairs] each); tiles int32
        [max_tiles, 3] = expert_tiles(eids, tile) then (0, 0, 0) rows; counts int32 [n_expert] += pairs per expert.
        max_tiles >= sort_tiles_max(n_pairs, n_expert, tile). All on the GPU (the host never waits)."""
        if not 0 < n_pairs <= MAX_PAIRS or not 0 < k <= MOE_MAX_K or not 0 < n_expert <= MOE_SORT_MAX_E:
            raise ValueError(f"moe_sort: n_pairs = {n_pairs} (1…{MAX_PAIRS}), k = {k}, n_expert = {n_expert} "
                             f"(1…{MOE_SORT_MAX_E})")
        if not 0 < tile <= MOE_SORT_MAX_TILE:
            raise ValueError(f"moe_sort: tile = {tile} outside 1…{MOE_SORT_MAX_TILE}")
        if not self.sort_tiles_max(n_pairs, n_expert, tile) <= max_tiles <= MAX_GRID:
            raise ValueError(f"moe_sort: max_tiles = {max_tiles} outside "
                             f"{self.sort_tiles_max(n_pairs, n_expert, tile)}…{MAX_GRID}")
        for b, nb, what in ((ids, 4 * n_pairs, "ids"), (eids, 4 * n_pairs, "eids"), (ptok, 4 * n_pairs, "ptok"),
                            (pinv, 4 * n_pairs, "pinv"), (tiles, 12 * max_tiles, "tiles"),
                            (counts, 4 * n_expert, "counts")):
            _need(b, nb, f"moe_sort {what}")
        self.modules["moe_sort"].kernel("moe_sort").launch(
            (1, 1, 1), (MOE_SORT_THREADS, 1, 1),
            [("ptr", _ptr(ids)), ("i32", n_pairs), ("i32", k), ("i32", n_expert), ("ptr", _ptr(eids)),
             ("ptr", _ptr(ptok)), ("ptr", _ptr(pinv)), ("ptr", _ptr(tiles)), ("i32", max_tiles),
             ("ptr", _ptr(counts)), ("i32", tile)], stream=stream)

    @staticmethod
    def argmax_parts(n: int) -> int:
        """Blocks of the first argmax pass for a row of n: ~8 elements a thread, at most ARGMAX_MAX_PARTS."""
        return max(1, min(ARGMAX_MAX_PARTS, -(-n // (ARGMAX_THREADS * 8))))

    def argmax(self, x, part, out, n: int, n_rows: int = 1, n_part: int | None = None,
               stream: Stream | None = None) -> None:
        """out[n_rows] int32 = the index of the first maximum of each row of x [n_rows, n]; part: scratch of
        8 * n_rows * n_part bytes (n_part default argmax_parts(n))."""
        n_part = self.argmax_parts(n) if n_part is None else n_part
        if not 0 < n_part <= ARGMAX_MAX_PARTS or not 0 < n_rows <= MAX_GRID or n <= 0:
            raise ValueError(f"argmax: n_part = {n_part} (1…{ARGMAX_MAX_PARTS}), n_rows = {n_rows}, n = {n}")
        _need(x, 4 * n * n_rows, "argmax x")
        _need(part, 8 * n_rows * n_part, "argmax partials")
        _need(out, 4 * n_rows, "argmax out")
        part_v, part_i = _ptr(part), _ptr(part) + 4 * n_rows * n_part
        mod = self.modules["argmax"]
        mod.kernel("argmax_partial_f32").launch(
            (n_part, n_rows, 1), (ARGMAX_THREADS, 1, 1),
            [("ptr", _ptr(x)), ("i32", n), ("ptr", part_v), ("ptr", part_i)], stream=stream)
        mod.kernel("argmax_final_i32").launch(
            (n_rows, 1, 1), (ARGMAX_THREADS, 1, 1),
            [("ptr", part_v), ("ptr", part_i), ("i32", n_part), ("ptr", _ptr(out))], stream=stream)

    @staticmethod
    def sample_parts(n: int) -> int:
        """Blocks of sample_cut's row passes: ~16 elements a thread, at most SAMPLE_MAX_PARTS."""
        return max(1, min(SAMPLE_MAX_PARTS, -(-n // (SAMPLE_THREADS * 16))))

    @staticmethod
    def min_p_bin(min_p: float) -> int:
        """sample_cut's min-p bin: the one holding d = -log(min_p), plus one of slack; 0: off (or beyond the bins)."""
        if not min_p > 0:
            return 0
        b = int(math.floor(-math.log(min_p) * SAMPLE_BINS_PER_NAT)) + 1
        return b if b < SAMPLE_BINS - 1 else 0

    def sample_cut(self, x, work, out, n: int, top_k: int, top_p: float, min_p: float, cap: int,
                   stream: Stream | None = None) -> None:
        """The sampler's candidates of the row x[n] f32 (cuda8/sample_cut.cu): out = a SAMPLE_HEAD, then cap
        (int32 id, f32 x) pairs (the first head.n_cand written, in no order): mode 0, every token of the bins up
        to the cut; mode 1, top-p's bin alone (head.base: the mass before it). work: SAMPLE_WORK_BYTES, zero before
        the first call (each call leaves it so). top_k >= n, top_p 1, min_p 0: off."""
        if not 0 < n or not 0 < cap <= n or not 0 < top_p <= 1 or top_k < 0:
            raise ValueError(f"sample_cut: n = {n}, cap = {cap}, top_k = {top_k}, top_p = {top_p}")
        _need(x, 4 * n, "sample_cut x")
        _need(work, SAMPLE_WORK_BYTES, "sample_cut work")
        _need(out, SAMPLE_HEAD.itemsize + 8 * cap, "sample_cut out")
        n_part = self.sample_parts(n)
        part = _ptr(work)
        hm = part + 4 * SAMPLE_MAX_PARTS
        hc = hm + 8 * SAMPLE_BINS
        head, cand = _ptr(out), _ptr(out) + SAMPLE_HEAD.itemsize
        mod = self.modules["sample_cut"]
        mod.kernel("sample_max_f32").launch((n_part, 1, 1), (SAMPLE_THREADS, 1, 1),
                                            [("ptr", _ptr(x)), ("i32", n), ("ptr", part)], stream=stream)
        mod.kernel("sample_hist_f32").launch(
            (n_part, 1, 1), (SAMPLE_THREADS, 1, 1),
            [("ptr", _ptr(x)), ("i32", n), ("ptr", part), ("i32", n_part), ("ptr", hm), ("ptr", hc)], stream=stream)
        mod.kernel("sample_cut_f32").launch(
            (1, 1, 1), (SAMPLE_THREADS, 1, 1),
            [("ptr", part), ("i32", n_part), ("ptr", hm), ("ptr", hc), ("i32", top_k if top_k < n else 0),
             ("f32", float(top_p)), ("i32", self.min_p_bin(min_p)), ("i32", cap), ("ptr", head)], stream=stream)
        mod.kernel("sample_compact_f32").launch(
            (n_part, 1, 1), (SAMPLE_THREADS, 1, 1), [("ptr", _ptr(x)), ("i32", n), ("ptr", head), ("ptr", cand)],
            stream=stream)

    @staticmethod
    def draw_blocks(n: int) -> int:
        """Blocks of sample_draw's sums over a row of n."""
        return -(-n // SAMPLE_DRAW_BLOCK)

    @staticmethod
    def set_draw(out, inv_t: float, cut_x: float, cut_id: int, u: float) -> None:
        """The next sample_draw's parameters into the head in `out` (a device buffer): the kept set {x_i > cut_x, or
        x_i == cut_x and i <= cut_id}, weights exp((x_i - m) * inv_t), u in [0, 1)."""
        if not 0 <= u < 1 or not 0 < inv_t < float("inf"):
            raise ValueError(f"sample_draw: u = {u}, inv_t = {inv_t}")
        p = np.zeros(1, SAMPLE_HEAD)
        p["inv_t"], p["cut_x"], p["cut_id"], p["u"] = inv_t, cut_x, cut_id, u
        BufferView(out, SAMPLE_DRAW_AT, SAMPLE_HEAD.itemsize - SAMPLE_DRAW_AT).upload(
            p.view(np.uint8)[SAMPLE_DRAW_AT:])

    def sample_draw(self, x, out, bsum, n: int, stream: Stream | None = None) -> None:
        """The draw set_draw described over the row x[n] (the max from sample_cut's head in `out`): u inverted over
        the kept weights in index order (le_sample's pass_draw); the token in head.token. bsum: 8 * draw_blocks(n)
        bytes. Same arguments every token: a LaunchPlan replays it."""
        nb = self.draw_blocks(n)
        if not 0 < n:
            raise ValueError(f"sample_draw: n = {n}")
        _need(x, 4 * n, "sample_draw x")
        _need(out, SAMPLE_HEAD.itemsize, "sample_draw head")
        _need(bsum, 8 * nb, "sample_draw block sums")
        mod = self.modules["sample_cut"]
        args = [("ptr", _ptr(x)), ("i32", n), ("ptr", _ptr(out)), ("ptr", _ptr(bsum))]
        mod.kernel("sample_draw_blocks_f32").launch((self._grid(nb), 1, 1), (SAMPLE_DRAW_BLOCK, 1, 1), args,
                                                    stream=stream)
        mod.kernel("sample_draw_pick_f32").launch((1, 1, 1), (SAMPLE_DRAW_BLOCK, 1, 1), args, stream=stream)

    def _elementwise(self, kernel: str, args: list, n: int, bufs: list, stream: Stream | None) -> None:
        for b, what in bufs:
            _need(b, 4 * n, f"{kernel} {what}")
        self.modules["elementwise"].kernel(kernel).launch(
            (self._grid(-(-n // EW_THREADS)), 1, 1), (EW_THREADS, 1, 1), args + [("i32", n)], stream=stream)

    def get_rows(self, qtype: int, W, ids, y, n: int, ncols: int, stream: Stream | None = None) -> None:
        """y[n, ncols] f32 = rows ids[:n] (int32, device; the caller checks them) of W [*, ncols], dequantised."""
        suffix = self._weights(qtype, W, 1, ncols, "get_rows")
        if n <= 0:
            raise ValueError(f"get_rows: n = {n}")
        _need(ids, 4 * n, "get_rows ids")
        _need(y, 4 * n * ncols, "get_rows y")
        self.modules["get_rows"].kernel(f"get_rows_{suffix}").launch(
            (self._grid(n), 1, 1), (GET_ROWS_THREADS, 1, 1),
            [("ptr", _ptr(W)), ("ptr", _ptr(ids)), ("ptr", _ptr(y)), ("i32", n), ("i32", ncols)], stream=stream)

    def get_rows_raw(self, W, ids, y, n: int, row_bytes: int, stream: Stream | None = None) -> None:
        """y[n, row_bytes] = rows ids[:n] (int32, device; the caller checks them) of W [*, row_bytes], bytes copied
        as they are (row_bytes and the addresses: multiples of 16)."""
        if n <= 0 or row_bytes <= 0 or row_bytes % 16 or _ptr(W) % 16 or _ptr(y) % 16:
            raise ValueError(f"get_rows_raw: n = {n}, row_bytes = {row_bytes} (a multiple of 16, as the addresses)")
        _need(ids, 4 * n, "get_rows_raw ids")
        _need(y, n * row_bytes, "get_rows_raw y")
        self.modules["get_rows"].kernel("get_rows_raw16").launch(
            (self._grid(n), 1, 1), (GET_ROWS_THREADS, 1, 1),
            [("ptr", _ptr(W)), ("ptr", _ptr(ids)), ("ptr", _ptr(y)), ("i32", n), ("i32", row_bytes // 16)],
            stream=stream)

    def qk_norm_rope(self, x, w, cs, n: int, n_heads: int, head_stride: int, row_stride: int, hd: int, n_rot: int,
                     eps: float, pos_dev=None, stream: Stream | None = None) -> None:
        """In place: head h of token t (x + t*row_stride + h*head_stride floats, hd of them) <- RMSNorm * w, then
        the NeoX rotation of its first n_rot dims by cs [n, n_rot/2] (cos, sin) pairs (rope_table rows).
        pos_dev: a device int32 p; token t then reads row p + t of cs (cs: the whole table)."""
        if not 0 < hd <= ROPE_MAX_HD or n_rot % 2 or not 0 <= n_rot <= hd or n <= 0 or n_heads <= 0:
            raise ValueError(f"qk_norm_rope: hd = {hd} (1…{ROPE_MAX_HD}), n_rot = {n_rot}, n = {n}, n_heads = {n_heads}")
        _need(x, 4 * ((n - 1) * row_stride + (n_heads - 1) * head_stride + hd), "qk_norm_rope x")
        _need(w, 4 * hd, "qk_norm_rope w")
        _need(cs, 4 * n * n_rot, "qk_norm_rope cs")
        self.modules["rope"].kernel("qk_norm_rope_f32").launch(
            (self._grid(n * n_heads), 1, 1), (ROPE_THREADS, 1, 1),
            [("ptr", _ptr(x)), ("ptr", _ptr(w)), ("ptr", _ptr(cs)), ("i32", n), ("i32", n_heads),
             ("i32", head_stride), ("i32", row_stride), ("i32", hd), ("i32", n_rot // 2), ("f32", eps),
             ("ptr", _ptr(pos_dev))], stream=stream)

    def kv_store(self, k, v, kc, vc, pos_dev, kvw: int, stream: Stream | None = None) -> None:
        """Row *pos_dev of kc, vc [n_ctx, kvw] <- k, v [kvw] (the caller keeps *pos_dev < n_ctx)."""
        _need(k, 4 * kvw, "kv_store k")
        _need(v, 4 * kvw, "kv_store v")
        self.modules["attention"].kernel("attn_kv_store_f32").launch(
            (-(-kvw // ATTN_THREADS), 1, 1), (ATTN_THREADS, 1, 1),
            [("ptr", _ptr(k)), ("ptr", _ptr(v)), ("ptr", _ptr(kc)), ("ptr", _ptr(vc)), ("ptr", _ptr(pos_dev)),
             ("i32", kvw)], stream=stream)

    def moe_combine(self, y, w, sh, shgate, out, n: int, k: int, E: int, rows=None,
                    stream: Stream | None = None) -> None:
        """out[n, E] = sum_s w[t, s] y[r(t, s)] + sigmoid(shgate[t]) sh[t] (sh None: no shared expert), r(t, s) =
        t*k + s, or rows[t*k + s] (device int32 [n*k], a permutation of 0..n*k-1: the caller's)."""
        if n <= 0 or k <= 0 or E <= 0:
            raise ValueError(f"moe_combine: n = {n}, k = {k}, E = {E}")
        _need(y, 4 * n * k * E, "moe_combine y")
        _need(w, 4 * n * k, "moe_combine w")
        if rows is not None:
            _need(rows, 4 * n * k, "moe_combine rows")
        _need(out, 4 * n * E, "moe_combine out")
        if sh is not None:
            _need(sh, 4 * n * E, "moe_combine sh")
            _need(shgate, 4 * n, "moe_combine shgate")
        self.modules["moe_combine"].kernel("moe_combine_f32").launch(
            (self._grid(-(-n * E // MOE_COMBINE_THREADS)), 1, 1), (MOE_COMBINE_THREADS, 1, 1),
            [("ptr", _ptr(y)), ("ptr", _ptr(w)), ("ptr", _ptr(sh)), ("ptr", _ptr(shgate)), ("ptr", _ptr(out)),
             ("i32", n), ("i32", k), ("i32", E), ("ptr", _ptr(rows))], stream=stream)

    def hybrid_publish(self, h, ids, w, pin_idx, n_link: int, meta, slot: int, chan: int, E: int, k: int,
                       pred=None, n_early: int = 0, extra_idx=None, stream: Stream | None = None) -> None:
        """The hybrid decode's routing into the host channel (cuda8/hybrid_sync.cu): h [E], ids/w [k] (moe_route)
        into `slot`, READY = chan's SEQ; meta [k gids | k lids | k lslots | k fids | k eids | 2k + 1 weights]
        (device) from pin_idx [n_expert] (None: nothing pinned), n_link (n_link experts neither pinned nor early are
        the GPU's, fetched over the link into staging slots 0..n_link-1: hybrid_fetch with fids): the first in slot
        order, or with pred (device int32 [HY_PRED_MAX], hybrid_predict_publish's) the ones predicted last; and the
        early experts (n_early > 0: those the CPU copied into its early buffer, flagged in the slot in time; eids
        their place there, to be copied into staging slots n_link..: hybrid_fetch with eids); extra_idx [n_expert]
        (None: none) the decode extras' places (experts not pinned that the staging holds between prefills: slots
        n_link + n_early + place; -1 elsewhere).
        slot, chan: device-visible addresses of page-locked host memory (le_hybrid.h)."""
        if (not 0 < k <= min(MOE_MAX_K, HYBRID_THREADS) or E <= 0 or not 0 <= n_link <= k
                or not 0 <= n_early <= HY_EARLY_MAX):
            raise ValueError(f"hybrid_publish: E = {E}, k = {k}, n_link = {n_link}, n_early = {n_early}")
        _need(h, 4 * E, "hybrid_publish h")
        _need(meta, 4 * (7 * k + 1), "hybrid_publish meta")
        self.modules["hybrid_sync"].kernel("hybrid_publish_f32").launch(
            (1, 1, 1), (HYBRID_THREADS, 1, 1),
            [("ptr", _ptr(h)), ("ptr", _ptr(ids)), ("ptr", _ptr(w)), ("ptr", _ptr(pin_idx)), ("ptr", _ptr(extra_idx)),
             ("i32", n_link),
             ("ptr", _ptr(pred)), ("i32", n_early), ("ptr", _ptr(meta)), ("ptr", int(slot)), ("ptr", int(chan)),
             ("i32", E), ("i32", k)], stream=stream)

    def hybrid_predict(self, R, h, s, logits, ne: int, E: int, stream: Stream | None = None) -> None:
        """The lookahead's router (cuda8/hybrid_sync.cu): logits [ne] = R [ne, E] (f32) @ (h * s), h and s [E]."""
        if ne <= 0 or E <= 0:
            raise ValueError(f"hybrid_predict: ne = {ne}, E = {E}")
        _need(R, 4 * ne * E, "hybrid_predict R")
        _need(logits, 4 * ne, "hybrid_predict logits")
        warps = HYBRID_THREADS // 32
        self.modules["hybrid_sync"].kernel("hybrid_predict_f32").launch(
            (-(-ne // warps), 1, 1), (HYBRID_THREADS, 1, 1),
            [("ptr", _ptr(R)), ("ptr", _ptr(h)), ("ptr", _ptr(s)), ("ptr", _ptr(logits)), ("i32", ne), ("i32", E)],
            stream=stream)

    def hybrid_predict_publish(self, logits, ne: int, n_pred: int, pin_idx, pred, slot: int, chan: int, E: int,
                               k: int, stream: Stream | None = None) -> None:
        """The n_pred largest logits' experts (largest first; -1 where pin_idx [ne] >= 0, None: nothing pinned)
        into pred (device int32 [HY_PRED_MAX], the rest -1) and `slot`'s PRED, then PRED_READY = chan's SEQ."""
        if not 0 < ne <= HYBRID_PRED_E or not 0 < n_pred <= HY_PRED_MAX or E <= 0 or k <= 0:
            raise ValueError(f"hybrid_predict_publish: ne = {ne} (<= {HYBRID_PRED_E}), n_pred = {n_pred} "
                             f"(<= {HY_PRED_MAX}), E = {E}, k = {k}")
        _need(logits, 4 * ne, "hybrid_predict_publish logits")
        _need(pred, 4 * HY_PRED_MAX, "hybrid_predict_publish pred")
        self.modules["hybrid_sync"].kernel("hybrid_predict_publish_i32").launch(
            (1, 1, 1), (HYBRID_THREADS, 1, 1),
            [("ptr", _ptr(logits)), ("i32", ne), ("i32", n_pred), ("ptr", _ptr(pin_idx)), ("ptr", _ptr(pred)),
             ("ptr", int(slot)), ("ptr", int(chan)), ("i32", E), ("i32", k)], stream=stream)

    def hybrid_fetch(self, lids, lslots, k: int, tensors, stream: Stream | None = None) -> None:
        """Copies the experts lids[s] >= 0 (device int32 [k]) of up to three tensors, [(src, dst, expert bytes)]
        (src: device-visible host memory or VRAM, dst: VRAM, all multiples of 16 bytes), from src + id * eb to
        dst + lslots[s] * eb, with a copy kernel (cuda8/hybrid_sync.cu)."""
        if not 0 < len(tensors) <= 3 or not 0 < k <= MOE_MAX_K:
            raise ValueError(f"hybrid_fetch: {len(tensors)} tensors, k = {k}")
        args = []
        for src, dst, eb in list(tensors) + [(0, 0, 0)] * (3 - len(tensors)):
            if eb and (eb % 16 or int(src) % 16 or _ptr(dst) % 16):
                raise ValueError(f"hybrid_fetch: expert bytes {eb} and addresses must be multiples of 16")
            args += [("ptr", int(src)), ("ptr", _ptr(dst)), ("i64", int(eb))]
        self.modules["hybrid_sync"].kernel("hybrid_fetch_u8").launch(
            (HYBRID_FETCH_BLOCKS, k, 3), (HYBRID_THREADS, 1, 1),
            [("ptr", _ptr(lids)), ("ptr", _ptr(lslots)), ("i32", k)] + args, stream=stream)

    def hybrid_wait(self, slot: int, chan: int, row, E: int, k: int, max_cycles: int,
                    stream: Stream | None = None) -> None:
        """Waits (on the GPU) until the CPU marks `slot` DONE for chan's SEQ, then row [E] (device) = its ROW; NaN
        after max_cycles clock cycles without it."""
        if E <= 0 or E % 4 or k <= 0 or max_cycles <= 0:
            raise ValueError(f"hybrid_wait: E = {E} (a multiple of 4: 16-byte words), k = {k}, max_cycles = "
                             f"{max_cycles}")
        _need(row, 4 * E, "hybrid_wait row")
        self.modules["hybrid_sync"].kernel("hybrid_wait_f32").launch(
            (1, 1, 1), (HYBRID_THREADS, 1, 1),
            [("ptr", int(slot)), ("ptr", int(chan)), ("ptr", _ptr(row)), ("i32", E), ("i32", k),
             ("i64", int(max_cycles))], stream=stream)

    def swiglu(self, g, u, out, n: int, stream: Stream | None = None) -> None:
        """out[n] = SiLU(g) * u (out may be g or u)."""
        self._elementwise("swiglu_f32", [("ptr", _ptr(g)), ("ptr", _ptr(u)), ("ptr", _ptr(out))], n,
                          [(g, "g"), (u, "u"), (out, "out")], stream)

    def add(self, a, b, out, n: int, stream: Stream | None = None) -> None:
        """out[n] = a + b (out may be a or b)."""
        self._elementwise("add_f32", [("ptr", _ptr(a)), ("ptr", _ptr(b)), ("ptr", _ptr(out))], n,
                          [(a, "a"), (b, "b"), (out, "out")], stream)

    def add_scaled(self, acc, y, w: float, n: int, stream: Stream | None = None) -> None:
        """acc[n] += w * y (an expert's output into the MoE sum)."""
        self._elementwise("add_scaled_f32", [("ptr", _ptr(acc)), ("ptr", _ptr(y)), ("f32", w)], n,
                          [(acc, "acc"), (y, "y")], stream)


# ------------------------------------------------------------------------------------------ CLI

def _print_records(records: list[dict]) -> None:
    for r in records:
        v = variant_name(r["tier"], r["arch"])
        if "skipped" in r:
            print(f"  {r['name']:<14} {v:<12} skipped: {r['skipped']}")
        else:
            print(f"  {r['name']:<14} {v:<12} {r['toolchain']:<11} {r['bytes']:>8} B  {r['ptx']}")


def cli_build(argv: list[str] | None = None) -> int:
    """`legacy-engine build-kernels` / `python -m legacy_engine.gpu build`."""
    p = argparse.ArgumentParser(prog="legacy-engine build-kernels",
                                description="Build cuda8/*.cu to PTX for every tier (cached; --out also writes a "
                                            "folder usable as $LE_PTX_DIR).")
    p.add_argument("--arch", type=int, help="compute capability x10 (35, 61, 70, 90 …); default: the legacy "
                                            "variants plus 75 and 90 where a toolchain can")
    p.add_argument("--toolchain", default="auto", help="auto, nvcc, nvrtc, or a name such as nvrtc-11.8")
    p.add_argument("--out", help="copy the PTX and a manifest.json into this folder")
    p.add_argument("--strict", action="store_true", help="fail when a variant cannot be built")
    a = p.parse_args(argv)
    try:
        records = build_kernels(a.arch, a.toolchain, a.out, skip_missing=not a.strict)
    except (UnavailableError, KernelBuildError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    _print_records(records)
    built = sum("ptx" in r for r in records)
    print(f"{built} PTX built or cached, {len(records) - built} skipped" + (f"; folder {a.out}" if a.out else ""))
    return 0 if built else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m legacy_engine.gpu")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="build PTX (build -h)", add_help=False)
    sub.add_parser("toolchains", help="list the compilers and assemblers found")
    s = sub.add_parser("ptxas", help="assemble the legacy PTX for sm_35/61/70 and print registers / smem")
    s.add_argument("--json", help="also write the rows to this file")
    sub.add_parser("install-toolchains", help="pip-install the NVRTC and ptxas wheels under the cache")
    sub.add_parser("info", help="the device, and which variants load on it")
    if argv and argv[0] == "build":
        return cli_build(argv[1:])
    a = p.parse_args(argv)
    if a.cmd == "toolchains":
        for t in find_toolchains():
            print(f"{t.name:<12} compute_{t.archs[0]}…{t.archs[-1]}  {t.path}")
        for v, path in find_ptxas():
            print(f"ptxas-{v[0]}.{v[1]:<6} {path}")
        return 0
    if a.cmd == "install-toolchains":
        print(install_toolchains())
        return 0
    if a.cmd == "ptxas":
        rows = ptxas_table()
        print(f"{'variant':<12} {'ptxas':<5} {'kernel':<22} {'regs':>4} {'smem':>6} {'spill':>6}")
        for r in rows:
            print(f"{r['variant']:<12} {r['ptxas']:<5} {r['kernel']:<22} {r['regs']:>4} {r['smem']:>6} "
                  f"{r['spill_stores'] + r['spill_loads']:>6}")
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=1))
        return 0
    if a.cmd == "info":
        ok, why = available()
        if not ok:
            print(f"no GPU: {why}")
            return 1
        dev = init()
        arch = device_arch()
        print(f"{dev['name']} sm_{arch}, {dev['total_mem'] / 2**30:.1f} GiB")
        for tier, va in default_variants(native_archs=(arch,)):
            if va > arch:
                print(f"  {variant_name(tier, va):<12} not runnable on sm_{arch}")
                continue
            try:
                k = Kernels(tier, va)
                print(f"  {k.name:<12} {k.probe()}  ({k.origins['gemv_f32']})")
            except EngineError as e:
                print(f"  {variant_name(tier, va):<12} unavailable: {str(e)[:200]}")
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
