"""llama.cpp's llama-server, the peer of `bench serve --llama`: found, or built from source.

The llama-cpp-python wheel carries the library but no llama-server. `build_llama_server` builds one from the
vendor/llama.cpp of the llama-cpp-python sdist of the version the tests' oracle pins (tests/conftest.py; fetched
with `pip download` into the package cache, as the converter fixture does): CMake Release, GGML_NATIVE=OFF plus
each AVX-512 / AVX-VNNI extension this CPU reports (ISA_OPTIONS; AVX2, FMA and F16C are on by default; AMX stays
off), so the peer runs this machine's best x86 kernels as ours do (`legacy-engine info`), where llama-cpp-python's
wheel may be AVX2 only. Static libraries (one file to run), no TLS, no web UI download, the target llama-server
only. The binary is kept at cache_dir()/llama-server-VERSION/llama-server with the build's log beside it; the
source and build trees are removed. About 20 minutes on 2 cores.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from ..core.errors import UnavailableError
from ..core.paths import cache_dir

LLAMA_CPP_PYTHON_VERSION = "0.3.36"     # the llama.cpp of tests/conftest.py's oracle
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF")
HOW = "legacy-engine bench serve --build-llama-server"
# /proc/cpuinfo flag -> the ggml option that compiles its kernels (AMX stays off: our kernels do not use it)
ISA_OPTIONS = (("avx512f", "GGML_AVX512"), ("avx512vbmi", "GGML_AVX512_VBMI"), ("avx512_vnni", "GGML_AVX512_VNNI"),
               ("avx512_bf16", "GGML_AVX512_BF16"), ("avx_vnni", "GGML_AVX_VNNI"))


def built_path(create: bool = False) -> Path:
    """Where build_llama_server puts the binary (it may not exist)."""
    return cache_dir(create) / f"llama-server-{LLAMA_CPP_PYTHON_VERSION}" / "llama-server"


def find_llama_server(path: str | None = None) -> str:
    """The llama-server to run: `path` if given (a file or a name on PATH), else `llama-server` on PATH, else the
    one build_llama_server made. Raises UnavailableError saying how to get one."""
    if path:
        found = shutil.which(path) or (path if os.path.isfile(path) and os.access(path, os.X_OK) else None)
        if not found:
            raise UnavailableError(f"--llama {path}: not an executable llama-server; give its path, or leave the "
                                   f"path out to use the one on PATH or the one `{HOW}` builds")
        return found
    found = shutil.which("llama-server")
    if found:
        return found
    built = built_path()
    if built.is_file() and os.access(built, os.X_OK):
        return str(built)
    raise UnavailableError(f"--llama: no llama-server on PATH nor at {built}; build it with `{HOW}` "
                           f"(about 20 minutes on 2 cores) or give its path: --llama PATH")


def isa_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """-DGGML_<EXT>=ON for each ISA_OPTIONS extension this CPU reports (none where /proc/cpuinfo is missing)."""
    try:
        with open(cpuinfo) as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        flags = []
    have = [opt for flag, opt in ISA_OPTIONS if flag in flags]
    if "GGML_AVX512" not in have:           # the AVX-512 extensions need AVX512F itself
        have = [opt for opt in have if not opt.startswith("GGML_AVX512")]
    return [f"-D{opt}=ON" for opt in have]


def _tools() -> tuple[str, str, str]:
    cmake = shutil.which("cmake")
    cc = next((shutil.which(c) for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    cxx = next((shutil.which(c) for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    missing = [name for name, p in (("cmake", cmake), ("a C compiler (cc)", cc), ("a C++17 compiler (c++)", cxx))
               if p is None]
    if missing:
        raise UnavailableError(f"building llama-server needs {', '.join(missing)} on PATH: e.g. apt-get install "
                               f"cmake g++ (or pip install cmake)")
    return cmake, cc, cxx


def _sdist(log) -> Path:
    """The llama-cpp-python sdist tarball, pip-downloaded once into the cache folder tests/conftest.py uses."""
    downloads = cache_dir() / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}-sdist"
    downloads.mkdir(parents=True, exist_ok=True)
    tarballs = sorted(downloads.glob("llama_cpp_python-*.tar.gz"))
    if not tarballs:
        log(f"llama-server: pip download llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} (sdist, ~77 MB) ...")
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                            f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(downloads)],
                           capture_output=True, encoding="utf-8", errors="replace", timeout=900)
        tarballs = sorted(downloads.glob("llama_cpp_python-*.tar.gz"))
        if r.returncode != 0 or not tarballs:
            raise UnavailableError(f"cannot download the llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist "
                                   f"(pip: {r.stderr.strip()[-500:]}); put the tarball in {downloads}")
    return tarballs[0]


def _unpack_llama_cpp(tarball: Path, dest: Path) -> Path:
    """vendor/llama.cpp of the sdist, unpacked under dest; returns its root."""
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
    root = dest / "llama.cpp"
    with tarfile.open(tarball) as tar:
        for m in tar.getmembers():
            rel = m.name[len(prefix):] if m.name.startswith(prefix) else None
            if rel is None or not m.isfile() or ".." in Path(rel).parts:
                continue
            out = root / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(tar.extractfile(m).read())
            if m.mode & 0o111:
                out.chmod(0o755)
    if not (root / "tools" / "server").is_dir():
        raise UnavailableError(f"{tarball.name} holds no vendor/llama.cpp/tools/server")
    return root


def _run_logged(cmd: list[str], logfile, log, progress: bool) -> None:
    """Runs cmd with its output appended to logfile; with progress, CMake's "[ NN%]" lines are passed to log."""
    logfile.write("$ " + " ".join(cmd) + "\n")
    logfile.flush()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, encoding="utf-8", errors="replace")
    shown = None
    for line in p.stdout:
        logfile.write(line)
        if progress and line.startswith("[") and "%]" in line[:8]:
            pct = line[1:line.index("%]")].strip()
            if pct != shown:
                shown = pct
                log(f"llama-server: {line.rstrip()}")
    if p.wait() != 0:
        logfile.flush()
        raise UnavailableError(f"`{' '.join(cmd[:3])} ...` failed ({p.returncode}); its output is in "
                               f"{logfile.name}")


def build_llama_server(jobs: int | None = None, log=print) -> Path:
    """Builds llama-server (the module docstring says how) and returns its path; a built one is kept as is."""
    out = built_path(create=True)
    if out.is_file():
        log(f"llama-server: already built: {out}")
        return out
    cmake, cc, cxx = _tools()
    jobs = jobs or os.cpu_count() or 1
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    tarball = _sdist(log)
    work = Path(tempfile.mkdtemp(dir=out.parent, prefix=".build-"))
    logpath = out.parent / "build.log"
    try:
        with open(logpath, "w") as logfile:
            log(f"llama-server: unpacking vendor/llama.cpp of {tarball.name} ...")
            src = _unpack_llama_cpp(tarball, work)
            build = work / "build"
            flags = [*CMAKE_FLAGS, *isa_flags()]
            log(f"llama-server: configuring ({' '.join(flags)}); log: {logpath}")
            _run_logged([cmake, "-S", str(src), "-B", str(build), f"-DCMAKE_C_COMPILER={cc}",
                         f"-DCMAKE_CXX_COMPILER={cxx}", *flags], logfile, log, progress=False)
            log(f"llama-server: building with {jobs} job(s) (about 20 minutes on 2 cores) ...")
            _run_logged([cmake, "--build", str(build), "--config", "Release", "--target", "llama-server",
                         "-j", str(jobs)], logfile, log, progress=True)
            binary = build / "bin" / "llama-server"
            if not binary.is_file():
                raise UnavailableError(f"the build finished but made no {binary}; see {logpath}")
            tmp = out.with_name(out.name + ".tmp")
            shutil.copy2(binary, tmp)
            os.replace(tmp, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"llama-server: built {out} in {time.monotonic() - t0:.0f} s")
    return out
