# setuptools needs this file to name the cffi module and to ship the GPU kernel sources; metadata is in pyproject.toml.
import glob
import os

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
# The GPU kernels are compiled at run time (legacy_engine/gpu.py), so an installed package carries their sources:
# cuda8/*.cu, *.cuh and the native/include headers they include, as legacy_engine/_kernels/{cuda8,include}/.
# The folders stay where they are in the tree; an editable install skips build_py and gpu.py reads them there.
KERNEL_SOURCES = {"cuda8": ("cuda8/*.cu", "cuda8/*.cuh"), "include": ("native/include/*.h",)}


class build_py_with_kernels(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            return
        for sub, patterns in KERNEL_SOURCES.items():
            dest = os.path.join(self.build_lib, "legacy_engine", "_kernels", sub)
            self.mkpath(dest)
            for pattern in patterns:
                for src in sorted(glob.glob(os.path.join(HERE, pattern))):
                    self.copy_file(src, os.path.join(dest, os.path.basename(src)))


setup(cffi_modules=["native/build_ffi.py:ffibuilder"], cmdclass={"build_py": build_py_with_kernels})
