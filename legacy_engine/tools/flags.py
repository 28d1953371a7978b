"""The model-loading flags every command that loads a model shares (run, chat, demo, serve, bench ...): how the
weights load (load_flags), the GPU engine's (gpu_flags), and what they become (engine_kwargs, check_gpu)."""
from __future__ import annotations

import argparse

from .. import gpu
from ..core.errors import UnavailableError
from ..cpu.model import parse_numa
from ..plan.planner import parse_size

CHECK_TENSORS_HELP = ("scan every tensor once at load: the scales of every quantised block and every f32/f16/bf16 "
                      "value must be finite; a bad file fails naming the tensor and block (reads the weights once "
                      "more: ~0.1 s per GiB from the page cache)")


def _numa_arg(v: str) -> str:
    try:
        parse_numa(v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return v


def load_flags(s) -> None:
    """--no-mmap, --numa, --no-pin and --check-tensors, for every command that loads a model (run, demo, serve,
    bench ...); pass them on as Engine/Model(mmap=args.mmap, numa=args.numa, pin=args.pin,
    check_tensors=args.check_tensors)."""
    s.add_argument("--no-pin", dest="pin", action="store_false",
                   help="leave the worker threads unpinned (default: worker i pinned to the i-th physical core, "
                        "spread over NUMA nodes; the calling thread is never pinned)")
    s.add_argument("--no-mmap", dest="mmap", action="store_false",
                   help="read the weights into anonymous memory (huge pages, own RAM) instead of memory-mapping "
                        "the file (default: mapped, shared through the page cache)")
    s.add_argument("--numa", type=_numa_arg, default="off", metavar="interleave|node:N|off",
                   help="NUMA placement of the weight pages: interleave over all nodes, all on node N, or off "
                        "(default: the kernel's first touch). Needs libnuma; a no-op on one node (see `info`). "
                        "With the file map, pages already in the page cache stay where they are: use --no-mmap "
                        "to place every page")
    s.add_argument("--check-tensors", action="store_true", help=CHECK_TENSORS_HELP)


def gpu_flags(s) -> None:
    """--gpu, --gpu-tier, --gpu-f32, --gpu-no-mma, --no-cuda-graphs: for the commands that generate (run, chat,
    demo, serve)."""
    s.add_argument("--gpu", action="store_true",
                   help="GPU-resident mode: the whole model in VRAM, prefill and decode on the GPU (needs an NVIDIA "
                        "driver; kernels built on first use, see `legacy-engine build-kernels`)")
    s.add_argument("--gpu-tier", choices=("fermi", "kepler", "dp4a"), default=None,
                   help="with --gpu: force a kernel tier (default: the GPU's own; a lower tier runs on any newer GPU)")
    s.add_argument("--gpu-f32", dest="gpu_int8", action="store_const", const=False, default=None,
                   help="with --gpu: f32 decode GEMVs and prefill GEMMs instead of the int8 DP4A ones (default: "
                        "DP4A on the dp4a tier)")
    s.add_argument("--gpu-no-mma", dest="gpu_mma", action="store_const", const=False, default=None,
                   help="with --gpu: no tensor cores: int8 prefill GEMMs with DP4A, the attention prefill and the "
                        "GDN scan on f32 FMA (default: tensor cores from sm_75, e.g. T4, the GDN scan's tf32 from "
                        "sm_80; for cards whose tensor cores are throttled)")
    s.add_argument("--vram", dest="gpu_vram", default=None, metavar="SIZE",
                   help="with --gpu: VRAM budget, e.g. 6GiB (default: free VRAM minus 512 MiB). A model that does not "
                        "fit runs split: routed experts streamed per layer for GPU prefill, hot ones pinned, decode "
                        "on the CPU or hybrid (--decode) (`legacy-engine plan` shows the prediction)")
    s.add_argument("--decode", dest="gpu_decode", choices=("auto", "cpu", "hybrid"), default=None,
                   help="with --gpu, when the model runs split: decode steps on the CPU, or hybrid (attention, GDN, "
                        "shared and pinned experts on the GPU, the other routed experts on the CPU); default auto: "
                        "the one the planner predicts faster")
    s.add_argument("--no-cuda-graphs", dest="gpu_graphs", action="store_const", const=False, default=None,
                   help="with --gpu: replay decode steps launch by launch instead of as one CUDA graph (default: "
                        "graphs where the driver has them, 11.4+, except on the fermi tier)")


def engine_kwargs(args) -> dict:
    """The Engine arguments of load_flags (and -t/--threads, -c/--ctx where the command has them)."""
    kw = dict(mmap=args.mmap, numa=args.numa, pin=args.pin, gpu=getattr(args, "gpu", False),
              gpu_tier=getattr(args, "gpu_tier", None), gpu_int8=getattr(args, "gpu_int8", None),
              gpu_graphs=getattr(args, "gpu_graphs", None), gpu_mma=getattr(args, "gpu_mma", None))
    decode = getattr(args, "gpu_decode", None)
    if decode is not None:
        kw["gpu_decode"] = decode
    vram = getattr(args, "gpu_vram", None)
    if vram is not None:
        kw["gpu_vram"] = parse_size(vram)
    if (kw["gpu_tier"] or kw["gpu_int8"] is not None or kw["gpu_graphs"] is not None or vram is not None
            or decode is not None or kw["gpu_mma"] is not None) and not kw["gpu"]:
        raise SystemExit("error: --gpu-tier, --gpu-f32, --gpu-no-mma, --vram, --decode and --no-cuda-graphs need "
                         "--gpu")
    if getattr(args, "mmproj", None):
        kw["mmproj"] = args.mmproj
    if getattr(args, "check_tensors", False):
        kw["check_tensors"] = True
    if getattr(args, "threads", None) is not None:
        kw["n_threads"] = args.threads
    if getattr(args, "ctx", None) is not None:
        kw["n_ctx"] = args.ctx
    return kw


def check_gpu() -> None:
    """UnavailableError with the reason when --gpu cannot run here (no driver, no device), before anything loads."""
    ok, why = gpu.available()
    if not ok:
        raise UnavailableError(f"--gpu: no usable GPU: {why} (without --gpu the model runs on the CPU)")
