"""legacy_engine: Qwen3.5 / Qwen3.6 GGUF inference on legacy NVIDIA GPUs and the host CPU.

Importing the package is cheap: the native core loads on first use (legacy_engine.core._native).
"""
__version__ = "0.1.0"
