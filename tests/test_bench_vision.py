"""`legacy-engine bench vision` (tools/bench_vision.py) on the tiny vision tower that llama.cpp's converter made
(conftest tiny_vision_gguf): one rep, small images; the printed table and the --json numbers."""
from __future__ import annotations

import json

import numpy as np
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
        assert 0 < r["ttft_min_s"] <= r["ttft_median_s"] and r["where"].startswith("the CPU")
        assert r["ttft_median_s"] == pytest.approx(parts, rel=0.5)     # medians of parts vs the median of sums
        assert r["prompt_tokens"] > r["image_tokens"] > 0
    assert "time to first token" in text


# ---- llama.cpp's time to first token beside ours ------------------------------------------------------------------

TTFT_KEYS = {"image", "prompt_tokens", "image_tokens", "runs_s", "ttft_median_s", "ttft_min_s", "preprocess_s",
             "encode_s", "prefill_s", "first_token"}


def test_bench_vision_ttft_beside_llama_cpp(tiny_vision_gguf, tmp_path, capsys):
    pytest.importorskip("llama_cpp.mtmd_cpp", reason="llama-cpp-python without the mtmd bindings")
    _, text_gguf, mmproj = tiny_vision_gguf("dense", "f16")
    res, text = _run(tmp_path, capsys, mmproj, "--text", str(text_gguf), "--llama", str(text_gguf))
    assert res["llama_ttft_error"] is None, res["llama_ttft_error"]
    ours, theirs = res["ttft"]["1"], res["llama_ttft"]["1"]
    assert [r["image"] for r in theirs] == [r["image"] for r in ours] == ["448x448", "224x160"]
    for o, r in zip(ours, theirs):
        assert TTFT_KEYS <= set(r) and len(r["runs_s"]) == 1
        times = [r[k] for k in ("ttft_median_s", "ttft_min_s", "preprocess_s", "encode_s", "prefill_s")]
        assert all(np.isfinite(times)) and min(times) > 0
        assert 0 <= r["first_token"] < 1 << 20
        # the same rendered text around the image: the text tokens agree to the token
        assert r["prompt_tokens"] - r["image_tokens"] == o["prompt_tokens"] - o["image_tokens"] > 0
    assert theirs[0]["image_tokens"] == ours[0]["image_tokens"] == 196
    assert theirs[1]["image_tokens"] == 35 < ours[1]["image_tokens"]      # spec §2.7: llama.cpp resizes it smaller
    assert "time to first token" in text and text.count("llama.cpp") >= 2 and "ttft" in text


def test_llama_ttft_logits_beside_ours(tiny_vision_gguf):
    """The last position's logits of the image question, llama.cpp's (LlamaChat, the bench's steps) against ours
    (Engine's prefill): both engines saw the same prompt and the same PNG (448x448: the same 196-token grid)."""
    pytest.importorskip("llama_cpp.mtmd_cpp", reason="llama-cpp-python without the mtmd bindings")
    from legacy_engine.serve.generate import Engine
    from legacy_engine.tools.bench_vision import LlamaChat, QUESTION, llama_prompt, png_bytes, synthetic_rgb
    from tolerances import MTMD_TTFT_LOGITS_REL

    _, text_gguf, mmproj = tiny_vision_gguf("dense", "f16")
    png = png_bytes(synthetic_rgb(448, 448, 0))
    eng = Engine(str(text_gguf), n_threads=2, mmproj=str(mmproj), pin=False)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    prompt, literal = eng.chat_text(msgs, enable_thinking=False)
    imgs = eng.load_images([png])
    full, spans = eng.expand_images(eng.tokenizer.encode_prompt(prompt, literal), imgs)
    ours = np.asarray(eng.session().prefill(full, images=eng.encode_images(spans, imgs)), np.float64)

    m = LlamaChat(str(mmproj), str(text_gguf), 2)
    try:
        chunks, bmp = m.tokenize(llama_prompt(prompt, m.mt.mtmd_default_marker()), png)
        try:
            assert m.counts(chunks) == (len(full), 196)
            m.open_context(len(full))
            m.clear()
            m.eval(chunks)
            theirs = m.last_logits().astype(np.float64)
        finally:
            m.release(chunks, bmp)
    finally:
        m.close()
    scale = float(np.max(np.abs(ours)))
    rel = float(np.max(np.abs(ours - theirs))) / scale
    print(f"\nlast-position logits, max|d| / max|logit| ours vs llama.cpp: {rel:.3e} (scale {scale:.3f})")
    assert rel < MTMD_TTFT_LOGITS_REL
    # the same first token, where our top two are further apart than the engines' difference can move them
    top2 = np.sort(ours)[-2:]
    if top2[1] - top2[0] > 2 * MTMD_TTFT_LOGITS_REL * scale:
        assert int(np.argmax(theirs)) == int(np.argmax(ours))


def test_bench_vision_llama_ttft_error_is_reported(tiny_vision_gguf, tmp_path, capsys):
    """A text model llama.cpp cannot load: both llama.cpp measurements say why; ours run; no crash."""
    pytest.importorskip("llama_cpp.mtmd_cpp", reason="llama-cpp-python without the mtmd bindings")
    _, text_gguf, mmproj = tiny_vision_gguf("dense", "f16")
    bad = tmp_path / "missing.gguf"
    res, text = _run(tmp_path, capsys, mmproj, "--sizes", "224x160", "--text", str(text_gguf), "--llama", str(bad))
    assert res["llama_ttft"] == {} and "llama_model_load_from_file" in res["llama_ttft_error"]
    assert "llama_model_load_from_file" in res["llama_error"]
    assert res["ttft"]["1"][0]["ttft_median_s"] > 0
    assert "time to first token not measured" in text
