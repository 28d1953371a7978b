"""`legacy-engine bench vision` (tools/bench_vision.py) on the tiny vision tower that llama.cpp's converter made
(conftest tiny_vision_gguf): one rep, small images; the printed table and the --json numbers."""
from __future__ import annotations

import json

import pytest

from legacy_engine.format.mmproj import MmprojFile, encode_flops
from legacy_engine.tools import bench_cmd

pytestmark = [pytest.mark.cpu, pytest.mark.oracle, pytest.mark.slow]

SIZES = "448x448,224x160"          # 224x160: transformers stretches it to 320x224 (70 tokens), llama.cpp keeps 35
ROW_KEYS = {"image", "resized", "grid", "patches", "tokens", "runs_s", "median_s", "min_s", "gflop", "gflops",
            "ms_per_patch"}


def _run(tmp_path, capsys, mmproj, *extra):
    out = tmp_path / "bench.json"
    assert bench_cmd.main(["vision", str(mmproj), "--sizes", SIZES, "--threads", "1", "--reps", "1",
                           "--json", str(out), *extra]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_bench_vision_ours(tiny_vision_gguf, tmp_path, capsys):
    _, _, mmproj = tiny_vision_gguf("dense", "f16")
    res, text = _run(tmp_path, capsys, mmproj)
    hp = MmprojFile.open(mmproj).hparams
    rows = res["ours"]["1"]
    assert [r["image"] for r in rows] == ["448x448", "224x160"]
    assert res["llama"] == {} and res["llama_error"] is None
    for r in rows:
        assert ROW_KEYS | {"finite"} <= set(r) and r["finite"] and len(r["runs_s"]) == 1
        assert r["patches"] == r["grid"][0] * r["grid"][1] == 4 * r["tokens"]
        assert r["gflop"] == pytest.approx(encode_flops(hp, r["patches"]) / 1e9)
        assert r["gflops"] == pytest.approx(r["gflop"] / r["median_s"])
    assert (rows[0]["resized"], rows[0]["tokens"]) == ("448x448", 196)
    assert (rows[1]["resized"], rows[1]["tokens"]) == ("320x224", 70)
    assert "threads 1" in text and "448x448" in text and "GFLOP/s" in text and "llama.cpp" not in text


def test_bench_vision_beside_llama_cpp(tiny_vision_gguf, tmp_path, capsys):
    pytest.importorskip("llama_cpp.mtmd_cpp", reason="llama-cpp-python without the mtmd bindings")
    _, text_gguf, mmproj = tiny_vision_gguf("dense", "f16")
    res, text = _run(tmp_path, capsys, mmproj, "--llama", str(text_gguf))
    assert res["llama_error"] is None, res["llama_error"]
    ours, theirs = res["ours"]["1"], res["llama"]["1"]
    assert [r["image"] for r in theirs] == [r["image"] for r in ours]
    for r in theirs:
        assert ROW_KEYS <= set(r) and r["patches"] == 4 * r["tokens"] > 0 and r["median_s"] > 0
    assert theirs[0]["tokens"] == ours[0]["tokens"] == 196          # 448x448: both keep it (multiple of 32)
    assert theirs[1]["tokens"] == 35 < ours[1]["tokens"]        # spec §2.7: llama.cpp keeps fewer tokens
    assert "ours/llama" in text and "per patch" in text


def test_bench_vision_time_to_first_token(tiny_vision_gguf, tmp_path, capsys):
    _, text_gguf, mmproj = tiny_vision_gguf("dense", "f16")
    res, text = _run(tmp_path, capsys, mmproj, "--text", str(text_gguf))
    rows = res["ttft"]["1"]
    assert [r["image"] for r in rows] == ["448x448", "224x160"]
    for r in rows:
        parts = r["preprocess_s"] + r["encode_s"] + r["prefill_s"]
        assert 0 < r["ttft_min_s"] <= r["ttft_median_s"] and r["where"] == "the CPU"
        assert r["ttft_median_s"] == pytest.approx(parts, rel=0.5)     # medians of parts vs the median of sums
        assert r["prompt_tokens"] > r["image_tokens"] > 0
    assert "time to first token" in text
