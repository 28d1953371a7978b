# setuptools needs this file only to name the cffi module; metadata is in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["native/build_ffi.py:ffibuilder"])
