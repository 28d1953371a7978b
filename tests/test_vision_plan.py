"""Where the vision tower runs (plan/vision.py) on described machines and files: its VRAM footprint on the GPU against
a hand count (gpu/vision.py weight_layout, scratch_layout, tower_footprint), the predicted encode times, the decision
beside a resident and a split model under small budgets with its reasons, the Placement's reserved bytes, `plan`'s
lines, and a CPU Engine's decision. That the GPU tower allocates exactly its layouts: test_gpu_vision.py (GPU)."""
from __future__ import annotations

import dataclasses
import math

import pytest

from legacy_engine.core.errors import FormatError, PlanningError
from legacy_engine.format.mmproj import VisionHparams, encode_flops
from legacy_engine.format.presets import DescribedFile, preset_vision_hparams
from legacy_engine.gpu import layout as L
from legacy_engine.gpu import vision as GV
from legacy_engine.gpu.placement import place
from legacy_engine.plan import planner as P
from legacy_engine.plan import probe
from legacy_engine.plan import vision as V
from legacy_engine.tools.plan_cmd import print_plan

pytestmark = pytest.mark.cpu

A3B = DescribedFile("qwen3.6-35b-a3b", "q4_k_m")
A3B_TOWER = preset_vision_hparams("qwen3.6-35b-a3b")           # depth 27, hidden 1152, ffn 4304
SMALL_LM = DescribedFile("qwen3.5-0.8b", "q4_k_m")
SMALL_TOWER = preset_vision_hparams("qwen3.5-0.8b")           # depth 12, hidden 768, ffn 3072
# The GPU machine as measured (README, benchmarks/results: H200, 16 cores; its f32 probe estimated at 16 x the 2-core
# box's ~125 GFLOP/s per core, plan/vision.py) and a legacy card beside a fast CPU.
H200 = probe.Machine(cpu_threads=16, cpu_read_gbps=90.0, cpu_f32_gflops=2000.0, gpu_name="H200", gpu_tier="dp4a",
                     vram_free=139 * L.GiB, link_gbps=55.0, gpu_gemm_tflops=59.0, gpu_gemv_gbps=3000.0,
                     gpu_launch_us=2.8)
FERMI_BOX = dataclasses.replace(H200, gpu_name="GTX 580", gpu_tier="fermi", link_gbps=6.0, gpu_gemm_tflops=0.3,
                                vram_free=3 * L.GiB)
NO_GPU = probe.Machine(cpu_threads=16, cpu_read_gbps=90.0, cpu_f32_gflops=2000.0)
# a tiny tower: ffn 100 is padded to 128 for the GEMM, out_hidden 48 floats are the one array off the 256-byte grid
TINY = VisionHparams(depth=2, hidden=64, n_head=2, ffn=100, patch_size=16, temporal_patch=2, merge=2, n_pos=64,
                     out_hidden=48, eps=1e-6, image_size=128, image_mean=(0.5,) * 3, image_std=(0.5,) * 3)


def test_footprint_is_the_hand_count():
    """The GPU tower's weight allocation: every f32 array it uploads (patch kernel [H, 1536], merger, per block four
    matrices and eight vectors, fc1 padded to 128 rows and fc2 to 128 columns), each at a 256-byte offset; its
    scratch for n patches; the footprint rounds each allocation to the driver's 2 MiB granule."""
    H, F, MH, O = 64, 128, 4 * 64, 48
    block = 6 * H + 3 * H + F + 3 * H * H + H * H + F * H + H * F     # ln1 w/b, o_b, ln2 w/b, fc2_b; qkv_b; fc1_b
    merger = 2 * H + MH * MH + MH + O * MH + O
    weights = 4 * (H * 1536 + H + merger + 2 * block) + (256 - 4 * O)  # merger_fc2_b: 192 bytes in a 256-byte slot
    assert GV.weight_layout(TINY)[1] == weights
    at, total = GV.weight_layout(TINY)
    assert at["fc1_w.1"][1] == 4 * F * H and at["fc2_w.0"][1] == 4 * H * F and at["patch_w"][1] == 4 * H * 1536
    assert all(off % L.WEIGHT_ALIGN == 0 for off, _ in at.values())
    n = 4096                                                         # a 1024x1024 image
    scratch = 4 * (n * 1536 + 4 * n * H + 3 * n * H + n * F + n * 32 + n // 4 * O)   # x xn att pos; qkv; ff; cs; out
    assert GV.scratch_layout(TINY, n, n)[1] == scratch
    fp = GV.tower_footprint(TINY, n)
    assert fp.parts == {"weights": 2 * L.MiB, "scratch": math.ceil(scratch / (2 * L.MiB)) * 2 * L.MiB}
    assert TINY.max_patches == 65536 and GV.tower_footprint(TINY).parts["scratch"] > 15 * fp.parts["scratch"]


def test_footprint_of_the_real_towers():
    """f32 weights (F16 files are dequantised at upload): the 35B's tower 1.66 GiB, the 0.8B's 0.37 GiB; the scratch
    of the largest image (4096x4096, 65,536 patches) 3.54 / 2.52 GiB, of a 1024x1024 one 0.22 / 0.16 GiB."""
    big, small = GV.tower_footprint(A3B_TOWER), GV.tower_footprint(SMALL_TOWER)
    assert round(big.parts["weights"] / L.GiB, 2) == 1.66 and round(big.parts["scratch"] / L.GiB, 2) == 3.54
    assert round(small.parts["weights"] / L.GiB, 2) == 0.37 and round(small.parts["scratch"] / L.GiB, 2) == 2.52
    assert round(GV.tower_footprint(A3B_TOWER, 4096).parts["scratch"] / L.GiB, 2) == 0.22


def test_encode_flops_and_predicted_times():
    """encode_flops (format/mmproj.py, also bench vision's count): the 0.8B tower at 1024x1024 is 1349.7 GFLOP
    (benchmarks/results/vision_encode_cpu_2026-11-26.md); the predictions are that count over each rate (the GPU's
    plus the image's copies over the link); no GPU: inf."""
    assert round(encode_flops(SMALL_TOWER, 4096) / 1e9, 1) == 1349.7
    n = V.ref_patches(SMALL_TOWER)
    assert n == 4096 and V.ref_patches(TINY) == 4096
    pred = V.predict_encode_s(SMALL_TOWER, H200, n)
    flops = encode_flops(SMALL_TOWER, n)
    assert pred["cpu"] == pytest.approx(flops / (2000e9 * V.VISION_CPU_EFF))
    compute = flops / (59e12 * V.VISION_GPU_EFF["dp4a"])
    assert compute < pred["gpu"] < compute + 0.01                      # ~45 MB over 55 GB/s
    assert V.predict_encode_s(SMALL_TOWER, NO_GPU, n)["gpu"] == math.inf
    # the measured anchors (H200, 2026-11-26): GPU 0.200 s, CPU 3.82 s at 16 threads; within 1.5x
    assert 0.2 / 1.5 < pred["gpu"] < 0.2 * 1.5 and 3.82 / 1.5 < pred["cpu"] < 3.82 * 1.5


def test_split_under_a_small_budget_keeps_the_tower_on_the_cpu():
    """The 35B split under 6 GiB: the split without pins leaves 3.39 GiB, the tower needs 5.20 GiB (weights and the
    largest image's scratch): the CPU, with both numbers in the reason; nothing is reserved."""
    vp = V.vision_placement(A3B, A3B_TOWER, H200, 6 * L.GiB)
    assert vp.where == "cpu" and vp.reserve == 0
    assert vp.reason.startswith("on the GPU it needs 5.20 GiB of VRAM (weights 1.66 GiB, scratch 3.54 GiB for images "
                                "up to 65,536 patches, 4096x4096); the split model without pinned experts leaves "
                                "3.39 GiB of the 6.00 GiB budget")
    assert vp.describe() == f"the CPU ({vp.reason})"
    assert vp.predicted_s["gpu"] < vp.predicted_s["cpu"]              # faster there, but it does not fit


def test_split_with_room_puts_the_tower_on_the_gpu_out_of_the_pins():
    """Under 9 GiB the split without pins (at its shortest pass, with link staging) leaves 6.39 GiB: the tower goes
    on the GPU, its VRAM reserved; the model is then planned in the rest, with fewer pinned experts than without the
    tower, and its placement holds the whole budget with the tower's bytes kept free."""
    budget = 9 * L.GiB
    vp = V.vision_placement(A3B, A3B_TOWER, H200, budget)
    assert vp.where == "gpu" and vp.reserve == vp.vram_bytes == GV.tower_footprint(A3B_TOWER).total
    assert "the split model without pinned experts leaves 6.39 GiB of the 9.00 GiB budget, its VRAM taken from the " \
           "pinned experts' share; an encode of a 1024x1024 image predicted" in vp.reason
    pins_all, _ = P.fill_pins(A3B, budget, 4096, 2048, True)
    pins, fp = P.fill_pins(A3B, budget - vp.reserve, 4096, 2048, True)
    assert fp.total <= budget - vp.reserve and 0 < sum(map(len, pins.values())) < sum(map(len, pins_all.values()))
    pl = place(A3B, budget=budget, reserved=vp.reserve, n_ctx=4096, chunk=2048, stream=True, pinned=pins)
    assert pl.budget == budget and pl.reserved == vp.reserve
    with pytest.raises(PlanningError, match="kept for the vision tower"):    # the pins of the whole budget do not fit
        place(A3B, budget=budget, reserved=vp.reserve, n_ctx=4096, chunk=2048, stream=True, pinned=pins_all)
    ss = P.plan(A3B, H200, budget - vp.reserve, prompt=2048, gen=64)
    assert next(s for s in ss if s.name == "stream").fits


def test_resident_model_and_the_remainder():
    """The 0.8B resident (1.18 GiB with the chunked GDN's scratch and the attention's planes): under 4 GiB the 2.82 GiB
    left do not hold the tower's 2.88 GiB -> the CPU; under 6 GiB -> the GPU, beside the resident model (no pins to
    give way)."""
    small = V.vision_placement(SMALL_LM, SMALL_TOWER, H200, 4 * L.GiB)
    assert small.where == "cpu" and "the resident model leaves 2.82 GiB of the 4.00 GiB budget" in small.reason
    vp = V.vision_placement(SMALL_LM, SMALL_TOWER, H200, 6 * L.GiB)
    assert vp.where == "gpu" and "the resident model leaves 4.82 GiB" in vp.reason and "pinned" not in vp.reason
    res = L.vram_footprint(SMALL_LM, n_ctx=4096)
    assert place(SMALL_LM, budget=6 * L.GiB, reserved=vp.reserve).footprint.total == res.total


def test_slow_gpu_beside_a_fast_cpu_keeps_the_cpu():
    """A Fermi card (0.3 TFLOP/s GEMM probe) beside 16 fast cores: room enough, but predicted slower."""
    vp = V.vision_placement(SMALL_LM, SMALL_TOWER, FERMI_BOX, 6 * L.GiB)
    assert vp.where == "cpu" and vp.reason.startswith("faster on the CPU: an encode of a 1024x1024 image predicted")
    assert vp.predicted_s["cpu"] < vp.predicted_s["gpu"]


def test_no_gpu_and_unsupported_towers():
    assert V.vision_placement(SMALL_LM, SMALL_TOWER, NO_GPU, 0).reason == "no usable GPU"
    odd = dataclasses.replace(TINY, hidden=80, n_head=2)             # hidden not a multiple of 32
    vp = V.vision_placement(SMALL_LM, odd, H200, 40 * L.GiB)
    assert vp.where == "cpu" and vp.reason == "the GPU tower cannot run it: hidden 80 is not a multiple of 32 " \
                                              "(the f32 GEMM's rows)"
    assert V.cpu_vision_placement(TINY).describe() == "the CPU (no --gpu)"
    with pytest.raises(ValueError, match="'gpu' or 'cpu'"):
        V.VisionPlacement("tpu", "")
    vp = V.vision_placement(SMALL_LM, SMALL_TOWER, H200, 6 * L.GiB)
    with pytest.raises(dataclasses.FrozenInstanceError):
        vp.where = "cpu"
    with pytest.raises(TypeError):
        vp.predicted_s["gpu"] = 0.0
    assert vp.as_dict()["predicted_s"] == dict(vp.predicted_s)


def test_plan_prints_the_vision_decision(capsys):
    """`plan`'s last line says where the tower runs with --gpu, and the header the VRAM it keeps from the model."""
    budget = 9 * L.GiB
    vp = V.vision_placement(A3B, A3B_TOWER, H200, budget)
    ss = P.plan(A3B, H200, budget - vp.reserve, prompt=512, gen=32)
    print_plan("a3b", H200, ss, 512, 32, budget, vp)
    out = capsys.readouterr().out
    assert "VRAM budget 9.00 GiB (5.20 GiB of it kept for the vision tower)" in out
    assert f"vision tower (with --gpu): on the GPU ({vp.reason})" in out


def test_cpu_engine_says_where_its_tower_runs(tmp_path):
    """A CPU Engine with an mmproj: the decision without weighing anything, said in vision_where."""
    from fixtures.make_reference import tiny_gguf
    from legacy_engine.serve.generate import Engine
    from test_gpu_vision import SMALL, write_mmproj
    text = tiny_gguf("moe", tmp_path / "moe.f32.gguf")
    eng = Engine(text, n_threads=2, pin=False)
    mm = write_mmproj(tmp_path / "mm.gguf", **dict(SMALL, out_hidden=eng.model.hparams.n_embd))
    eng = Engine(text, n_threads=2, pin=False, mmproj=mm)
    assert eng.vision_placement.where == "cpu" and eng.vision_gpu is None
    assert eng.vision_where == "the CPU (no --gpu)"
    with pytest.raises(FormatError, match="holds t\\*h\\*w = 24"):     # the checks both towers share
        eng.vision.encode_patches(__import__("numpy").zeros((23, 1536), "float32"), (1, 4, 6))
