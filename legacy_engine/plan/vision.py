"""Where the vision tower runs beside a GPU model: the planner's VisionPlacement, which Engine applies.

The rule (`vision_placement`), in order; the first that fails sends the tower to the CPU, with its reason:
  1. a usable GPU, and a tower its kernels run (gpu/vision.py tower_unsupported);
  2. VRAM: the tower's footprint on the GPU (gpu/vision.py tower_footprint: its f32 weights and the scratch of the
     largest image the processor makes, hp.max_patches) fits what the model leaves of the budget:
       resident model (its footprint fits the budget): the budget less that footprint;
       split model: the budget less the split's footprint without pinned experts (at its shortest pass,
         planner.STREAM_CHUNKS[-1], with the most link experts the hybrid decode may fetch): the tower's bytes come
         out of the pinned experts' share; the model is then planned in the budget less them
         (planner.gpu_placement(reserve=...): its pass length, pins and decode as without a tower) and its
         Placement keeps them free (Placement.reserved);
       a model that fits neither way: the GPU model cannot be placed at all (gpu_placement says why);
     The weights stay in VRAM once uploaded: uploading them per image would need the same VRAM during the encode,
     and under a budget the split holds all of it;
  3. speed: the predicted encode of a reference image (VISION_REF_SIDE², capped at the largest) is faster on the
     GPU than on the CPU.

Models of time (`predict_encode_s`), from the tower's FLOPs (format/mmproj.py encode_flops) and the machine's probes:
  CPU  t = flops / (cpu_f32_gflops * VISION_CPU_EFF)          (the f32 GEMM tile kernel's rate at the engine's threads)
  GPU  t = flops / (gpu_gemm_tflops * VISION_GPU_EFF[tier]) + (patches, position rows, RoPE table up, the embeddings
       down) / link_gbps
"""
from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType
from typing import Mapping

from ..format.mmproj import VisionHparams, encode_flops
from ..gpu.layout import GiB, vram_footprint
from ..gpu.vision import scratch_floats, tower_footprint, tower_unsupported
from .planner import STREAM_CHUNKS
from .probe import Machine

# The reference image of the speed comparison: a 1024x1024 photo (4,096 patches of 16 px), the size the rates below
# were measured at.
VISION_REF_SIDE = 1024
# The CPU tower's rate / the f32 GEMM probe's (cpu_f32_gflops) at the same threads: its matmuls are that kernel's
# tiles, its attention (4·N²·H per block: 47 % of the FLOPs at 1024², a per-row, per-head loop) and row ops are
# slower. Qwen3.5-0.8B-sized tower (f16) at 1024x1024 after gemm_tile, 2026-11-26: the H200 host at 16 threads 3.82 s
# = 353 GFLOP/s, the 2-core box at 2 threads 25.3 s = 53 GFLOP/s; the probe on the 2-core box (AVX-512): 123-131
# GFLOP/s on 1 thread, 171-199 on 2 with other work on the box. 53 / ~250 = 0.21; 353 / (16 x ~125) = 0.18 (the
# GPU host's 16-thread probe not yet taken: its cores are the same class).
VISION_CPU_EFF = 0.2
# The GPU tower's rate / the GEMM probe's (gpu_gemm_tflops, the probe's tier): the tower runs gemm_f32 and
# attn_bidir_f32 on every tier (no int8 path), so on the dp4a tier, whose probe times the int8 prefill GEMM
# (gemm_mma from sm_75, ~2.4x gemm_f32 on an H200; gemm_dp4a below, ~1.4x), it reaches a smaller share.
# H200, 2026-11-26, 1024x1024: the 0.8B-sized tower 0.200 s = 6.7 TFLOP/s, the 35B's 0.68 s = 8.1, on the dp4a and
# fermi tiers alike (benchmarks/results/vision_encode_gpu_2026-11-26.md); the probe 59 TFLOP/s on the dp4a tier
# (gemm_mma, split_a3b_*_h200_*.json), gemm_f32 22-25 TFLOP/s (prefill_kernels_2026-11-25c.md, prefill_mma_*d.md):
# 0.11-0.14 and 0.27-0.36. A dp4a card without tensor cores (its probe is gemm_dp4a's) is predicted ~1.7x slow.
VISION_GPU_EFF = {"dp4a": 0.11, "kepler": 0.28, "fermi": 0.28}


@dataclasses.dataclass(frozen=True)
class VisionPlacement:
    """The planner's decision for the vision tower. where: 'gpu' or 'cpu'; reason: why (the rule's first failing
    test, or what made it the GPU); vram_bytes: the tower's footprint on the GPU (weights + the scratch of images up
    to max_patches), whether or not it goes there; predicted_s: {'gpu', 'cpu'} seconds of an encode of the reference
    image (empty where nothing was predicted); ref_patches: that image's patches."""
    where: str
    reason: str
    vram_bytes: int = 0
    predicted_s: Mapping[str, float] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    max_patches: int = 0
    ref_patches: int = 0

    def __post_init__(self):
        if self.where not in ("gpu", "cpu"):
            raise ValueError(f"VisionPlacement.where = {self.where!r}: 'gpu' or 'cpu'")
        object.__setattr__(self, "predicted_s", MappingProxyType(dict(self.predicted_s)))

    @property
    def reserve(self) -> int:
        """VRAM the model's placement must leave free for the tower: its footprint when it runs on the GPU."""
        return self.vram_bytes if self.where == "gpu" else 0

    def describe(self) -> str:
        """'the GPU (reason)' / 'the CPU (reason)': Engine.vision_where, `plan`, `run`'s stderr."""
        return f"the {self.where.upper()} ({self.reason})"

    def as_dict(self) -> dict:
        """JSON-ready fields (`plan --json`)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return dict(out, predicted_s=dict(self.predicted_s))


def ref_patches(hp: VisionHparams) -> int:
    """Patches of the reference image (VISION_REF_SIDE², in whole merge blocks), at most the largest image's."""
    blocks = VISION_REF_SIDE // (hp.patch_size * hp.merge)
    return min(max(blocks, 1) ** 2 * hp.merge * hp.merge, hp.max_patches)


def _image(hp: VisionHparams, n: int) -> str:
    side = math.isqrt(n) * hp.patch_size
    return f"{side}x{side}"


def predict_encode_s(hp: VisionHparams, m: Machine, n_patches: int) -> dict:
    """{'gpu': s, 'cpu': s} of one encode of an image of n_patches patches on this machine (the module's models of
    time); inf where the machine has no such rate (no GPU; a probe without the CPU's f32 rate)."""
    flops = encode_flops(hp, n_patches)
    cpu_rate = m.cpu_f32_gflops * 1e9 * VISION_CPU_EFF
    out = {"cpu": flops / cpu_rate if cpu_rate > 0 else math.inf, "gpu": math.inf}
    gpu_rate = m.gpu_gemm_tflops * 1e12 * VISION_GPU_EFF.get(m.gpu_tier, 0.0)
    if m.has_gpu and gpu_rate > 0 and m.link_gbps > 0:
        s = scratch_floats(hp, n_patches, n_patches)
        link = 4 * (s["patches"] + s["pos"] + s["cs"] + s["out"])
        out["gpu"] = flops / gpu_rate + link / (m.link_gbps * 1e9)
    return out


def vision_placement(file, hp: VisionHparams, m: Machine, budget: int, n_ctx: int = 4096,
                     int8: bool = True) -> VisionPlacement:
    """Where the vision tower of hp runs beside a GPU model of `file` under `budget` bytes of VRAM (states for
    n_ctx positions, int8 scratch as the GPU model's options ask) on machine `m`: the module's rule."""
    fp = tower_footprint(hp)
    n_ref = ref_patches(hp)
    pred = predict_encode_s(hp, m, n_ref)
    made = dict(vram_bytes=fp.total, predicted_s=pred, max_patches=hp.max_patches, ref_patches=n_ref)
    if not m.has_gpu:
        return VisionPlacement("cpu", "no usable GPU", **made)
    why = tower_unsupported(hp)
    if why:
        return VisionPlacement("cpu", f"the GPU tower cannot run it: {why}", **made)
    res = vram_footprint(file, n_ctx=n_ctx, int8=int8)
    if res.total <= budget:
        free, beside = budget - res.total, "the resident model"
    elif file.hparams.n_expert:
        split = vram_footprint(file, stream_experts=True, n_ctx=n_ctx, chunk=STREAM_CHUNKS[-1], int8=int8,
                               link_experts=file.hparams.n_expert_used)
        free, beside = budget - split.total, "the split model without pinned experts"
    else:
        return VisionPlacement("cpu", f"the model does not fit the VRAM budget of {budget / GiB:.2f} GiB", **made)
    parts = ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in fp.parts.items())
    need = (f"{fp.total / GiB:.2f} GiB of VRAM ({parts} for images up to {hp.max_patches:,} patches, "
            f"{_image(hp, hp.max_patches)})")
    room = f"{beside} leaves {max(free, 0) / GiB:.2f} GiB of the {budget / GiB:.2f} GiB budget"
    if fp.total > free:
        return VisionPlacement("cpu", f"on the GPU it needs {need}; {room}", **made)
    times = (f"an encode of a {_image(hp, n_ref)} image predicted {pred['gpu']:.2f} s on the GPU, "
             f"{pred['cpu']:.2f} s on the CPU")
    if not pred["gpu"] < pred["cpu"]:
        return VisionPlacement("cpu", f"faster on the CPU: {times}", **made)
    taken = ", its VRAM taken from the pinned experts' share" if beside.startswith("the split") else ""
    return VisionPlacement("gpu", f"it needs {need}, {room}{taken}; {times}", **made)


def cpu_vision_placement(hp: VisionHparams) -> VisionPlacement:
    """The decision of a CPU engine (no --gpu): nothing to weigh."""
    return VisionPlacement("cpu", "no --gpu", max_patches=hp.max_patches)
