"""The installed package, not this source tree (issue 21): a wheel built from the tree carries the GPU kernel
sources (cuda8/*.cu, *.cuh and the native/include headers, as legacy_engine/_kernels/), `legacy-engine
build-kernels` builds PTX from that copy and `legacy-engine demo` runs, from a folder outside the repository with
nothing imported from it. Also the package's one cache folder, its jinja2 floor and the suite's skip summary.

The wheel is built once per module from a copy of the package's sources (no build/ lands in the tree) with
`pip wheel --no-build-isolation` (setuptools, wheel and cffi are here already; the network may not be), and
installed with `pip install --target` into a temp folder; the commands run with PYTHONPATH at that folder (ahead of
the editable install's finder, which comes after sys.path), cwd outside the repo and a fresh $LE_CACHE_DIR.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from legacy_engine import gpu

from legacy_engine.core import paths

from legacy_engine.format import vocab

pytestmark = pytest.mark.cpu

REPO = Path(__file__).resolve().parents[1]
PACKAGE_SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "legacy_engine", "native", "cpu_simd",
                   "cuda8")
BUILD_OUTPUTS = shutil.ignore_patterns("*.o", "*.so", "_core.c", "__pycache__", "*.egg-info", "build", "_kernels")


def _check(r: subprocess.CompletedProcess, what: str) -> subprocess.CompletedProcess:
    assert r.returncode == 0, f"{what} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in PACKAGE_SOURCES:
        p = REPO / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=BUILD_OUTPUTS)
        else:
            shutil.copy2(p, src / name)
    out = tmp_path_factory.mktemp("wheel")
    t0 = time.perf_counter()
    _check(subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "-w", str(out)], capture_output=True, encoding="utf-8",
                          errors="replace", timeout=1200), "pip wheel")
    print(f"wheel built in {time.perf_counter() - t0:.1f} s")
    (whl,) = out.glob("legacy_engine-*.whl")
    return whl


@pytest.fixture(scope="module")
def site(wheel, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("site")
    _check(subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                           str(d), str(wheel)], capture_output=True, encoding="utf-8", errors="replace",
                          timeout=600), "pip install --target")
    return d


def _run(site: Path, cache: Path, *args, timeout: int = 900) -> subprocess.CompletedProcess:
    """ARGS (a console script of the install, or python) from a folder outside the repo, the install first on
    the path, $LE_CACHE_DIR at `cache`."""
    cwd = cache.parent / "cwd"
    cwd.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LE_PTX_DIR", "LE_CACHE_DIR")}
    env.update(PYTHONPATH=str(site), LE_CACHE_DIR=str(cache), PYTHONUTF8="1")
    exe = [str(site / "bin" / args[0])] if (site / "bin" / args[0]).exists() else [args[0]]
    return subprocess.run(exe + [str(a) for a in args[1:]], cwd=cwd, env=env, capture_output=True, encoding="utf-8",
                          errors="replace", timeout=timeout)


@pytest.mark.slow
def test_wheel_carries_the_kernel_sources(wheel):
    """Every source and header the GPU build reads, equal to the tree's; and jinja2 >= 3.1.6 required."""
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        want = {f"legacy_engine/_kernels/cuda8/{n}.cu": gpu.CUDA_DIR / f"{n}.cu" for n in gpu.SOURCES}
        want |= {f"legacy_engine/_kernels/cuda8/{h}": gpu.CUDA_DIR / h for h in gpu.HEADERS}
        want |= {f"legacy_engine/_kernels/include/{h}": gpu.INCLUDE_DIR / h for h in gpu.SHARED_HEADERS}
        assert set(want) <= names, sorted(set(want) - names)
        for name, tree in want.items():
            assert z.read(name) == tree.read_bytes(), name
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "Requires-Dist: jinja2>=3.1.6" in meta.splitlines()


@pytest.mark.slow
def test_installed_package_is_apart_from_the_tree(site, tmp_path):
    probe = ("import json, sys, legacy_engine, legacy_engine.tools.cli, legacy_engine.gpu as g\n"
             "print(json.dumps({'file': legacy_engine.__file__, 'cuda': str(g.CUDA_DIR), 'include': str(g.INCLUDE_DIR),"
             " 'loaded': [m.__file__ for m in list(sys.modules.values()) if getattr(m, '__file__', None)],"
             " 'path': sys.path}))")
    r = _check(_run(site, tmp_path / "cache", sys.executable, "-c", probe), "import")
    got = json.loads(r.stdout)
    assert Path(got["file"]).is_relative_to(site), got["file"]
    assert Path(got["cuda"]) == site / "legacy_engine" / "_kernels" / "cuda8"
    assert Path(got["include"]) == site / "legacy_engine" / "_kernels" / "include"
    repo = str(REPO) + os.sep
    assert not [f for f in got["loaded"] if f.startswith(repo)] and not [p for p in got["path"] if p.startswith(repo)]
    r = _check(_run(site, tmp_path / "cache", "legacy-engine", "--version"), "--version")
    assert r.stdout.strip().startswith("legacy_engine ")


@pytest.mark.slow
def test_installed_package_builds_the_kernels(site, tmp_path):
    """`legacy-engine build-kernels` of the install, every tier at one arch, with the first toolchain here: PTX for
    every source, built from the shipped copy (its hash equals the tree's), into the fresh cache and --out."""
    chains = gpu.find_toolchains()
    if not chains:
        pytest.skip("no CUDA toolchain: nvcc, or the NVRTC wheels (python -m legacy_engine.gpu install-toolchains)")
    tc = chains[0]
    arch = max(tc.archs[0], 35)
    cache = tmp_path / "cache"
    cache.mkdir()
    if (paths.cache_dir() / "toolchains").is_dir():      # the NVRTC wheels install-toolchains put in the real cache
        (cache / "toolchains").symlink_to(paths.cache_dir() / "toolchains")
    out = tmp_path / "ptx"
    t0 = time.perf_counter()
    r = _check(_run(site, cache, "legacy-engine", "build-kernels", "--arch", arch, "--toolchain", tc.name,
                    "--out", out, "--strict"), "build-kernels")
    print(f"build-kernels --arch {arch} --toolchain {tc.name}: {time.perf_counter() - t0:.1f} s")
    tiers = [t for t in gpu.TIERS if arch >= gpu.TIERS[t][1] or t == "fermi"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert {(m["name"], m["tier"]) for m in manifest} == {(n, t) for n in gpu.SOURCES for t in tiers}, r.stdout
    for m in manifest:
        assert m["arch"] == arch and m["toolchain"] == tc.name
        assert m["source_hash"] == gpu.source_hash(m["name"]), m       # the shipped sources are the tree's
        assert (out / m["file"]).read_text().lstrip().startswith("//"), m["file"]
        cached = list((cache / "ptx").glob(f"{m['name']}.{m['tier']}.compute_{arch}.{tc.name}.*.ptx"))
        assert [p.name.split(".")[-2] for p in cached] == [m["source_hash"][:16]], cached   # key: the sources' hash


@pytest.mark.slow
def test_installed_demo_runs(site, tmp_path):
    """`legacy-engine demo` of the install: the model and the vocabulary's merges land in $LE_CACHE_DIR."""
    cache = tmp_path / "cache"
    r = _check(_run(site, cache, "legacy-engine", "demo", "-n", 4, "-t", 2), "demo")
    assert "architecture: qwen35moe" in r.stderr and "[length] load" in r.stderr, r.stderr
    assert r.stdout.strip()
    assert list(cache.glob("demo-*.gguf")) and list(cache.glob("qwen35_merges_*.npy")), sorted(cache.iterdir())


# ------------------------------------------------------------------------------------------------ the cache folder

def test_one_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("LE_CACHE_DIR", str(tmp_path / "le"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.cache_dir() == tmp_path / "le" and (tmp_path / "le").is_dir()
    monkeypatch.delenv("LE_CACHE_DIR")
    assert paths.cache_dir(create=False) == tmp_path / "xdg" / "legacy_engine"
    assert not (tmp_path / "xdg").exists()
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert paths.cache_dir(create=False) == tmp_path / "home" / ".cache" / "legacy_engine"
    from legacy_engine.tools import cli
    assert vocab.cache_dir is gpu.cache_dir is cli.cache_dir is paths.cache_dir    # one rule, $LE_CACHE_DIR first


# ------------------------------------------------------------------------------------------------ the skip summary

def test_gpu_skips_fold_into_one_summary_line(tmp_path):
    """tests/conftest.py's hook: skips of gpu-marked tests with one reason are one line of `-ra`, not one per test;
    other skips keep their line."""
    (tmp_path / "conftest.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('le_conftest', {str(REPO / 'tests' / 'conftest.py')!r})\n"
        "m = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(m)\n"
        "pytest_runtest_makereport = m.pytest_runtest_makereport\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    (tmp_path / "test_many.py").write_text(
        "import pytest\n\n"
        "@pytest.fixture\ndef device():\n    pytest.skip('no GPU: libcuda.so.1 not found')\n\n"
        + "".join(f"@pytest.mark.gpu\ndef test_gpu{i}(device):\n    pass\n\n" for i in range(3))
        + "@pytest.mark.gpu\n@pytest.mark.parametrize('k', [1, 2])\ndef test_gpu_param(device, k):\n    pass\n\n"
        "def test_other():\n    pytest.skip('no nvcc')\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-ra", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                       cwd=tmp_path, capture_output=True, encoding="utf-8", errors="replace", timeout=120)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("SKIPPED")]
    assert lines[0] == "SKIPPED [5] gpu-marked tests: no GPU: libcuda.so.1 not found", r.stdout
    assert len(lines) == 2 and lines[1].startswith("SKIPPED [1] test_many.py:") and "no nvcc" in lines[1], r.stdout
