"""`legacy-engine plan MODEL|--preset NAME [--mmproj FILE | --vision]`: measure this machine (cached) and print the
predicted prefill/decode speed of every strategy (plan.planner) for a file or a make-model preset, and the one chosen;
with a vision tower, where it runs beside the GPU model (plan/vision.py) and the VRAM it keeps from the model."""
from __future__ import annotations

import argparse
import dataclasses as dc
import json
import sys

from ..format.gguf_model import ModelFile
from ..format.mmproj import MmprojFile, check_compatible
from ..format.presets import DescribedFile, preset_vision_hparams
from ..format.footprint import weight_footprint
from ..plan.planner import CPU_DECODE_EFF, GiB, Strategy, load_routing, parse_size, plan
from ..plan.slots import predict_batched_decode
from ..plan.probe import Machine, measure
from ..plan.vision import VisionPlacement, vision_placement


def print_plan(name: str, m: Machine, strategies: list[Strategy], prompt: int, gen: int, vram: int | None,
               vision: VisionPlacement | None = None) -> None:
    link = f"{m.link_gbps:.2f} GB/s{' (simulated)' if m.simulated_link else ''}"
    gpu_line = (f"GPU {m.gpu_name} ({m.gpu_tier} tier): {m.vram_free / GiB:.1f} GiB free, link {link}, GEMM "
                f"{m.gpu_gemm_tflops:.1f} TFLOP/s, GEMV {m.gpu_gemv_gbps:.0f} GB/s, {m.gpu_launch_us:.1f} µs/kernel"
                if m.has_gpu else "GPU none")
    kept = f" ({vision.reserve / GiB:.2f} GiB of it kept for the vision tower)" if vision and vision.reserve else ""
    print(f"{name}: prompt {prompt}, generate {gen}, VRAM budget "
          f"{'all free' if vram is None else f'{vram / GiB:.2f} GiB'}{kept}")
    print(f"CPU {m.cpu_threads} threads, {m.cpu_read_gbps:.1f} GB/s read; {gpu_line}")
    print(m.probe_note())
    print(f"{'strategy':<10}{'fits':>5}{'prefill tok/s':>15}{'decode tok/s':>14}{'total s':>10}  placement / why")
    for s in strategies:
        pre = prompt / s.prefill_s if s.fits and s.prefill_s > 0 else float("nan")
        dec = 1 / s.decode_s_per_tok if s.fits else float("nan")
        tot = f"{s.total_s(gen):>10.2f}" if s.fits else f"{'–':>10}"
        print(f"{s.name:<10}{'yes' if s.fits else 'no':>5}{pre:>15.1f}{dec:>14.1f}{tot}  {s.why}")
    best = strategies[0]
    print(f"chosen: {best.name}", end="")
    if best.name in ("stream", "hybrid"):
        parts = best.prefill_parts
        print(f" (GPU prefill for passes of >= {best.min_gpu_tokens} tokens; predicted prefill time: copies "
              f"{parts.get('copy', 0):.2f} s ({parts.get('copies', 0):.0f} of them), compute "
              f"{parts.get('compute', 0):.2f} s, handoff "
              f"{parts.get('handoff', 0):.3f} s, overlapped per layer when a chunk routes to most experts; decode "
              + ("on the CPU)" if best.name == "stream" else
                 "hybrid: {gpu:.1f} ms GPU + {cpu:.1f} ms CPU + {host:.1f} ms host steps per token)".format(
                     **{k: 1e3 * v for k, v in best.decode_parts.items() if k != "pinned_share"})))
    else:
        print()
    if vision is not None:
        print(f"vision tower (with --gpu): on {vision.describe()}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="legacy-engine plan", description="Measure this machine (cached) and print the "
                                 "predicted prefill/decode speed of every strategy for MODEL, and the one chosen.")
    ap.add_argument("model", nargs="?", help="a GGUF file (or --preset)")
    ap.add_argument("--preset", help="plan for a make-model preset instead of a file (e.g. qwen3.6-35b-a3b)")
    ap.add_argument("--quant", default=None, help="with --preset: the quant mix (default: the preset's)")
    ap.add_argument("--vram", default=None, help="VRAM budget, e.g. 6GiB (default: what is free now)")
    ap.add_argument("--mmproj", default=None, metavar="FILE",
                    help="the model's vision projector: where its tower runs beside the GPU model, and its VRAM")
    ap.add_argument("--vision", action="store_true",
                    help="with --preset: the preset's vision tower (what make-model --mmproj-out writes)")
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens (2048)")
    ap.add_argument("--gen", type=int, default=256, help="generated tokens (256)")
    ap.add_argument("-t", "--threads", type=int, default=None, help="CPU decode threads (default: physical cores)")
    ap.add_argument("--simulate-link", type=float, default=None, metavar="GBPS",
                    help="plan as if host->device copies ran at GBPS (0.25: a CMP 100-210 on PCIe Gen1 x1; 6: a Fermi "
                         "box on PCIe 2.0 x16)")
    ap.add_argument("--no-gpu", action="store_true", help="plan for this machine without its GPU")
    ap.add_argument("--remeasure", action="store_true", help="probe the machine again instead of the cached numbers")
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)
    if bool(args.model) == bool(args.preset):
        ap.error("give MODEL or --preset")
    if args.prompt < 1 or args.gen < 0:
        ap.error("--prompt must be >= 1 and --gen >= 0")
    if args.simulate_link is not None and args.simulate_link <= 0:
        ap.error("--simulate-link must be > 0")
    if args.vision and (not args.preset or args.mmproj):
        ap.error("--vision goes with --preset (a file's tower: --mmproj FILE)")
    vram = parse_size(args.vram) if args.vram is not None else None
    if args.preset:
        f = DescribedFile(args.preset, args.quant)
        name = f.name
    else:
        f = ModelFile.open(args.model)
        name = args.model
    m = measure(args.threads, gpu=not args.no_gpu, refresh=args.remeasure,
                log=lambda s: print(s, file=sys.stderr))
    if args.simulate_link is not None:
        m = dc.replace(m, link_gbps=args.simulate_link, simulated_link=True)
    counts = None if args.preset else load_routing(f)
    vp, budget = None, (m.vram_free if vram is None else vram)      # plan()'s budget
    hp = (preset_vision_hparams(args.preset) if args.vision else
          MmprojFile.open(args.mmproj).hparams if args.mmproj else None)
    if hp is not None:
        check_compatible(hp, f.hparams, args.mmproj or args.preset)
        vp = vision_placement(f, hp, m, budget, n_ctx=max(args.prompt + args.gen, 1), int8=m.gpu_tier == "dp4a")
    ss = plan(f, m, budget - vp.reserve if vp else vram, args.prompt, args.gen, counts=counts)
    batched = predict_batched_decode(m, f.hparams, weight_footprint(f), context=args.prompt + args.gen // 2,
                                     counts=counts, efficiency=CPU_DECODE_EFF)
    if args.json:
        print(json.dumps({"machine": dc.asdict(m), "strategies": [dc.asdict(s) for s in ss],
                          "vision": vp.as_dict() if vp else None, "cpu_batched_decode": batched},
                         indent=1, default=float))
    else:
        print_plan(name, m, ss, args.prompt, args.gen, vram, vp)
        print("serving (serve --parallel B), CPU decode of B streams at once, aggregate tok/s: " + ", ".join(
            f"B={b} {v:.1f} ({v / batched[1]:.2f}x)" for b, v in batched.items()))
        print("pinned experts: " + ("the hottest by this file's saved routing counts" if counts else
                                    "spread evenly (no routing counts saved for this file yet)"))
    return 0
