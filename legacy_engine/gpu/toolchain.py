"""GPU kernels' build: cuda8/*.cu to PTX per tier with any toolchain from CUDA 8 to 13, cached and prebuilt.

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
"""
from __future__ import annotations

import ctypes
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import EngineError, UnavailableError
from ..core.paths import cache_dir

ROOT = Path(__file__).resolve().parent.parent.parent


def kernel_source_dirs() -> tuple[Path, Path]:
    """(cuda8, native/include) to build from: the copies a wheel or `pip install .` ships in
    legacy_engine/_kernels/ (setup.py), else the source tree's (an editable install)."""
    shipped = Path(__file__).resolve().parent.parent / "_kernels"
    if (shipped / "cuda8").is_dir():
        return shipped / "cuda8", shipped / "include"
    return ROOT / "cuda8", ROOT / "native" / "include"


CUDA_DIR, INCLUDE_DIR = kernel_source_dirs()

SOURCES = ("rmsnorm", "quantize_q8_1", "gemv_f32", "gemv_dp4a", "gemm_f32", "gemm_dp4a", "gemm_mma", "conv1d", "gdn",
           "gdn_chunked", "gdn_scan_tf32", "attention", "moe_route", "moe_sort", "argmax", "elementwise", "rope",
           "get_rows", "moe_combine", "hybrid_sync", "grid_sync", "sample_cut", "layernorm", "gelu", "rope_vision",
           "attention_bidir", "peak")
HEADERS = ("compat.cuh", "quants.cuh", "gemm_tile.cuh", "gemm_q8.cuh", "gdn_chunked.cuh", "grid_sync.cuh")   # in cuda8/
SHARED_HEADERS = ("le_blocks.h", "le_hybrid.h")  # in native/include/

# tier -> the LE_FORCE_TIER value, and the lowest arch whose own path it is
TIERS = {"fermi": ("LE_CC_FERMI", 20), "kepler": ("LE_CC_LDG", 30), "dp4a": (None, 61)}
TIER_CC = {"fermi": 200, "kepler": 350, "dp4a": 610}
# The int8 tensor-core GEMM (gemm_mma.cu): the dp4a tier from this arch on (compat.cuh LE_HAS_MMA_INT8: mma.sync
# m8n8k16 .s8 on sm_75, m16n8k16 from sm_80); every toolchain that targets compute_75 knows the instruction.
MMA_ARCH = 75


def has_mma(tier: str, arch: int) -> bool:
    """Whether the variant (tier, arch) carries gemm_mma's kernels."""
    return tier == "dp4a" and arch >= MMA_ARCH


# The GDN scan's products on tf32 tensor cores (gdn_chunk_scan_tf32; compat.cuh LE_HAS_MMA_TF32: mma.sync m16n8k8
# .tf32 from sm_80, CUDA 11.0): the dp4a tier from this arch on.
TF32_ARCH = 80


def has_tf32(tier: str, arch: int) -> bool:
    """Whether the variant (tier, arch) carries the tf32 tensor-core GDN scan."""
    return tier == "dp4a" and arch >= TF32_ARCH


def many_regs(tier: str) -> bool:
    """compat.cuh's LE_HAS_MANY_REGS: every tier but fermi (63 registers a thread). The kernel forms that hold more
    in registers exist only there: the int8 GEMMs' multi-matrix kernels (gemm_multi; on fermi the selected matrix
    spilled) and the GDN prep's tiles loaded a tile ahead (gdn_chunk_prep_ahead_f32)."""
    return tier != "fermi"


# The legacy variants: built by NVRTC 11.8 (compute_35) and 12.9 (compute_61/70) here and carried.
LEGACY_VARIANTS = (("fermi", 35), ("kepler", 35), ("dp4a", 61), ("dp4a", 70))


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
