"""The GPU engine: kernels built per tier (toolchain), the driver's objects (runtime), the kernels as ops (launch:
their constants; kernels with matmul, sync_kernels and vision_kernels: the launchers); the resident / streamed /
hybrid model (model, composed of residency, scratch, forward, hybrid and state), where it puts everything (layout,
placement; options: how it runs), sampling where the logits are (sample).

`from legacy_engine import gpu` gives the toolchain's, runtime's and launchers' public names (gpu.Buffer,
gpu.Kernels, gpu.build_ptx …), the engine's interface to the device; the model modules are imported by name
(legacy_engine.gpu.model)."""
from .kernels import *  # noqa: F401,F403
from .launch import *  # noqa: F401,F403
from .runtime import *  # noqa: F401,F403
from .toolchain import *  # noqa: F401,F403
