"""Shared fixtures. Keep each section small and say which tests use it."""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

from legacy_engine.core.paths import cache_dir as le_cache_dir   # the package's one cache folder rule

# ------------------------------------------------------------------------------------------------ skip summary
# Without a GPU every gpu-marked test skips for the same reason: `-ra` prints it once, on one line
# ("SKIPPED [728] gpu-marked tests: no GPU: …"), not once per test function. Other skips stay per file and line.

GPU_SKIPS = "gpu-marked tests"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    if (rep.skipped and not hasattr(rep, "wasxfail") and isinstance(rep.longrepr, tuple)
            and item.get_closest_marker("gpu") is not None):
        rep.longrepr = (str(item.config.rootpath / GPU_SKIPS), None, rep.longrepr[2])   # folded by (path, line, reason)
    return rep


# ------------------------------------------------------------------------------------------------ tiny HF models
# Used by test_convert.py (and any test that needs a real-structure HF checkpoint). Needs torch + transformers.

@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """tiny_hf(kind, seed=0, tame=False) -> Path of a tests/fixtures/tiny_models checkpoint, made once a session."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from fixtures.tiny_models import make_tiny

    made: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("tiny_hf")

    def get(kind: str, seed: int = 0, tame: bool = False) -> Path:
        key = (kind, seed, tame)
        if key not in made:
            made[key] = make_tiny(kind, root / f"{kind}-s{seed}{'-tame' if tame else ''}", seed=seed, tame=tame)
        return made[key]
    return get


# ------------------------------------------------------------------------------------------------ llama.cpp converter
# The oracle for `legacy-engine convert` (../shared/oracle.md pitfall 2): llama.cpp's convert_hf_to_gguf.py is not
# in the llama-cpp-python wheel, only in its sdist. $LE_LLAMA_CPP_SRC names a directory holding it (the sdist root
# or its vendor/llama.cpp); otherwise the sdist is fetched with pip once and the three parts the converter needs
# are unpacked into the user cache (never into the repo).

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
_CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")

# Runs llama.cpp's converter with get_vocab_base_pre patched: the truncated tiny vocabulary does not hash like the
# real one, but its normalizer/regex/ByteLevel are Qwen3.5's (oracle pitfall 3).
_WRAPPER = '''\
import sys
src = sys.argv[1]
sys.path[0:0] = [src + "/gguf-py", src]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
convert_hf_to_gguf.main()
'''


def _find_converter(d: Path) -> Path | None:
    for cand in (d, d / "vendor" / "llama.cpp"):
        if (cand / "convert_hf_to_gguf.py").is_file() and (cand / "conversion").is_dir():
            return cand
    return None


def _fetch_converter(dest: Path) -> None:
    """pip-download the llama-cpp-python sdist and unpack convert_hf_to_gguf.py, conversion/, gguf-py/ to dest."""
    downloads = dest.parent / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}-sdist"
    downloads.mkdir(parents=True, exist_ok=True)
    tarballs = sorted(downloads.glob("llama_cpp_python-*.tar.gz"))
    if not tarballs:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(downloads)],
                       check=True, capture_output=True, encoding="utf-8", errors="replace", timeout=900)
        tarballs = sorted(downloads.glob("llama_cpp_python-*.tar.gz"))
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".unpack-"))
    with tarfile.open(tarballs[0]) as tar:
        for m in tar.getmembers():
            rel = m.name[len(prefix):] if m.name.startswith(prefix) else None
            if not m.isfile() or rel is None or ".." in Path(rel).parts or not rel.startswith(_CONVERTER_PARTS):
                continue
            out = tmp / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(tar.extractfile(m).read())
    os.replace(tmp, dest)
    for t in tarballs:                                  # 77 MB we no longer need
        t.unlink()


@pytest.fixture(scope="session")
def llama_cpp_src() -> Path:
    """Directory with llama.cpp's convert_hf_to_gguf.py, conversion/ and gguf-py/ (skips with the reason if none)."""
    pytest.importorskip("torch", reason="llama.cpp's converter needs torch")
    pytest.importorskip("transformers", reason="llama.cpp's converter needs transformers")
    if env := os.environ.get("LE_LLAMA_CPP_SRC"):
        found = _find_converter(Path(env))
        if found is None:
            pytest.fail(f"LE_LLAMA_CPP_SRC={env} holds no convert_hf_to_gguf.py + conversion/")
        return found
    dest = le_cache_dir() / f"llama.cpp-converter-{LLAMA_CPP_PYTHON_VERSION}"
    if _find_converter(dest) is None:
        try:
            _fetch_converter(dest)
        except (subprocess.SubprocessError, OSError, IndexError, tarfile.TarError) as e:
            detail = getattr(e, "stderr", "") or ""
            pytest.skip(f"cannot fetch llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist ({e} {detail[-300:]}); "
                        f"set LE_LLAMA_CPP_SRC to an unpacked copy")
    return dest


@pytest.fixture(scope="session")
def llama_cpp_convert(llama_cpp_src, tmp_path_factory):
    """llama_cpp_convert(hf_dir, out, outtype="f32") -> out: llama.cpp's own HF→GGUF conversion (--no-mtp)."""
    wrapper = tmp_path_factory.mktemp("llama_cpp_wrapper") / "convert_qwen35_tiny.py"
    wrapper.write_text(_WRAPPER)

    def convert(hf_dir, out, outtype: str = "f32") -> Path:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(llama_cpp_src / "gguf-py"), str(llama_cpp_src)]))
        env.pop("NO_LOCAL_GGUF", None)
        r = subprocess.run([sys.executable, str(wrapper), str(llama_cpp_src), str(hf_dir), "--outfile", str(out),
                            "--outtype", outtype, "--no-mtp"], env=env, capture_output=True, encoding="utf-8", errors="replace", timeout=600)
        if r.returncode != 0:
            raise AssertionError(f"llama.cpp's converter failed ({r.returncode}):\n{r.stderr[-3000:]}")
        return Path(out)
    return convert


# ---- CPU kernel tiers (test_quantized.py, test_f32_kernels.py)
@pytest.fixture
def forced_isa(request):
    """Tier `request.param` (parametrize indirect) forced for one test, skipping when this CPU cannot run it; the
    previous tier restored after."""
    from fixtures.isa import isa_forced

    with isa_forced(request.param) as isa:
        yield isa


# ---- tiny vision checkpoints converted by llama.cpp (test_mmproj.py; the vision tower's tests)
@pytest.fixture(scope="session")
def tiny_vision_gguf(llama_cpp_src, llama_cpp_convert, tmp_path_factory):
    """tiny_vision_gguf(kind="dense"|"moe", outtype="f32"|"f16", seed=0) -> (hf_dir, text_gguf, mmproj_gguf): a
    tests/fixtures/tiny_vision checkpoint and llama.cpp's conversion of it (the text model with --no-mtp; the mmproj
    with --mmproj, which refuses --no-mtp for *ForConditionalGeneration), made once a session."""
    from fixtures.tiny_vision import make_tiny_vision

    root = tmp_path_factory.mktemp("tiny_vision")
    wrapper = root / "convert_qwen35_tiny.py"
    wrapper.write_text(_WRAPPER)
    made: dict[tuple, tuple[Path, Path, Path]] = {}

    def get(kind: str = "dense", outtype: str = "f32", seed: int = 0) -> tuple[Path, Path, Path]:
        key = (kind, outtype, seed)
        if key not in made:
            hf = root / f"{kind}-s{seed}"
            if not (hf / "config.json").is_file():
                make_tiny_vision(kind, hf, seed=seed)
            text = llama_cpp_convert(hf, root / f"{kind}-s{seed}-{outtype}.gguf", outtype)
            mmproj = root / f"mmproj-{kind}-s{seed}-{outtype}.gguf"
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(llama_cpp_src / "gguf-py"), str(llama_cpp_src)]))
            env.pop("NO_LOCAL_GGUF", None)
            r = subprocess.run([sys.executable, str(wrapper), str(llama_cpp_src), str(hf), "--outfile", str(mmproj),
                                "--outtype", outtype, "--mmproj"], env=env, capture_output=True, encoding="utf-8",
                               errors="replace", timeout=600)
            if r.returncode != 0:
                raise AssertionError(f"llama.cpp's converter (--mmproj) failed ({r.returncode}):\n{r.stderr[-3000:]}")
            made[key] = (hf, text, mmproj)
        return made[key]
    return get
