"""The GPU engine: kernels built per tier (toolchain), the driver's objects (runtime), the kernels as ops
(kernels); the resident / streamed / hybrid model (model), sampling where the logits are (sample).

`from legacy_engine import gpu` gives the first three's public names (gpu.Buffer, gpu.Kernels, gpu.build_ptx …),
the engine's interface to the device; the model modules are imported by name (legacy_engine.gpu.model)."""
from .kernels import *  # noqa: F401,F403
from .runtime import *  # noqa: F401,F403
from .toolchain import *  # noqa: F401,F403
