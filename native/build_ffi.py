"""cffi build of legacy_engine._core (out-of-line API mode); legacy_engine/core/_native/ owns it.

The cdef is read from the real headers in native/include/ (preprocessor lines
stripped), so the C API is declared once. Every C file of native/ and cpu_simd/
is compiled into the one extension; SIMD files pick their ISA inside the file
(#pragma GCC target), so one binary carries every path and still runs on a
baseline x86-64 CPU.

Build: `pip install -e .` (setup.py names this file in cffi_modules).
"""
import glob
import os
import re

from cffi import FFI

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INCLUDE = os.path.join(ROOT, "native", "include")

# Order matters: later headers use types of earlier ones.
API_HEADERS = ["le_status.h", "le_quants.h", "le_caps.h", "le_gpu.h", "le_model.h", "le_memory.h",
               "le_sample.h", "le_schema.h", "le_vision.h"]


def cdef_text(path):
    """A header as cffi's cdef accepts it: no preprocessor lines, no comments."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def sources():
    files = sorted(glob.glob(os.path.join(ROOT, "native", "*.c")))
    files += sorted(glob.glob(os.path.join(ROOT, "cpu_simd", "*.c")))
    # setuptools wants paths relative to setup.py
    return [os.path.relpath(f, ROOT) for f in files]


ffibuilder = FFI()
ffibuilder.cdef("\n".join(cdef_text(os.path.join(INCLUDE, h)) for h in API_HEADERS))
# le_model_set_yield's hook, defined in Python (legacy_engine/core/_native/model.py: @ffi.def_extern)
ffibuilder.cdef('extern "Python" void le_yield_to_python(void *ctx);')
ffibuilder.set_source(
    "legacy_engine._core",
    "\n".join(f'#include "{h}"' for h in API_HEADERS),
    sources=sources(),
    include_dirs=[os.path.relpath(INCLUDE, ROOT), "native", "cpu_simd"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                        "-fno-strict-aliasing"],
    libraries=["dl", "m", "pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
