"""Images end to end on the CPU: files -> format.image -> the tower (cpu/vision.py) -> the LM (M-RoPE, embeddings at the
pads) through Engine/Session, the CLI (`run --mmproj --image`, `chat`'s /image, `info MMPROJ`) and the server's
image_url parts (serve/images.py).

Oracle: Qwen3_5(Moe)ForConditionalGeneration in f32 on the same checkpoint, given the same pixel values (test_image
proves format.image equals transformers' processor bit for bit): the logits at every position of a two-image
conversation within LOGIT_ABS_F32.
"""
from __future__ import annotations

import base64
import io
import subprocess
import sys

import numpy as np
import pytest

from legacy_engine.format.image import load_image
from legacy_engine.serve.generate import Engine
from legacy_engine.serve.images import ImageRequestError, request_images

import tolerances as tol

pytestmark = pytest.mark.cpu
PIL = pytest.importorskip("PIL.Image")

IMAGE_PAD = 4012


def _png(path, w, h, seed):
    rng = np.random.default_rng(seed)
    PIL.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    return str(path)


def _png_bytes(w, h, seed):
    buf = io.BytesIO()
    rng = np.random.default_rng(seed)
    PIL.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _hf_logits(hf_dir, ids, images):
    pytest.importorskip("torch")
    from fixtures.tiny_vision import reference_logits
    return reference_logits(hf_dir, ids, np.concatenate([i.patches for i in images]), [i.grid_thw for i in images])


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_image_conversation_matches_transformers(tiny_vision_gguf, tmp_path, kind):
    hf, text, mmproj = tiny_vision_gguf(kind, "f32")
    eng = Engine(text, n_threads=2, mmproj=mmproj)
    images = eng.load_images([_png(tmp_path / "a.png", 97, 61, 1), _png(tmp_path / "b.png", 224, 160, 2)])
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this?"}]},
                {"role": "assistant", "content": "noise"},
                {"role": "user", "content": [{"type": "text", "text": "and this"}, {"type": "image"}]}]
    ids = eng.tokenizer.encode_prompt(*eng.chat_text(messages, enable_thinking=False))
    full, spans = eng.expand_images(ids, images)
    assert [s.n_tokens for s in spans] == [i.n_tokens for i in images]
    sess = eng.session()
    ours = sess.prefill(full, all_logits=True, images=eng.encode_images(spans, images))
    ref = _hf_logits(hf, full, images)
    err = np.abs(ours - ref).max()
    print(f"{kind}: max |Δlogit| {err:.2e} over {len(full)} positions ({sum(s.n_tokens for s in spans)} image rows)")
    assert err <= tol.LOGIT_ABS_F32, err
    # a different image with the same text gives other logits (the pixels reach the LM)
    other = eng.load_images([_png(tmp_path / "c.png", 97, 61, 3)]) + images[1:]
    assert other[0].digest != images[0].digest
    sess.reset()
    moved = sess.prefill(full, all_logits=True, images=eng.encode_images(spans, other))
    assert np.abs(moved - ours).max() > 100 * tol.LOGIT_ABS_F32


@pytest.mark.oracle
@pytest.mark.slow
def test_cli_run_and_info_with_an_image(tiny_vision_gguf, tmp_path):
    _, text, mmproj = tiny_vision_gguf("dense", "f32")
    img = _png(tmp_path / "a.png", 64, 96, 4)
    run = [sys.executable, "-m", "legacy_engine.tools.cli"]
    r = subprocess.run(run + ["run", text, "--mmproj", mmproj, "--image", img, "-p", "describe", "-n", "3", "-t", "2"],
                       capture_output=True, encoding="utf-8", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "[length]" in r.stderr
    r = subprocess.run(run + ["run", text, "--image", img, "-p", "x"], capture_output=True, encoding="utf-8", timeout=120)
    assert r.returncode == 2 and "--mmproj" in r.stderr
    r = subprocess.run(run + ["info", mmproj], capture_output=True, encoding="utf-8", timeout=120)
    assert r.returncode == 0 and "ViT: 2 blocks, hidden 64" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert "for images up to 65,536 patches" in r.stdout and "plan MODEL --mmproj FILE" in r.stdout, r.stdout
    r = subprocess.run(run + ["plan", text, "--mmproj", mmproj, "--no-gpu", "-t", "2"], capture_output=True, encoding="utf-8",
                       timeout=300)
    assert r.returncode == 0 and "vision tower (with --gpu): on the CPU (no usable GPU)" in r.stdout, r.stderr[-2000:]
    chat = subprocess.run(run + ["chat", text, "--mmproj", mmproj, "-n", "2", "-t", "2", "--no-think"],
                          input=f"/image {tmp_path / 'missing.png'}\n/image {img}\nwhat is it?\n", capture_output=True,
                          encoding="utf-8", timeout=300)
    assert chat.returncode == 0, chat.stderr[-2000:]
    assert "missing.png" in chat.stderr and "(image a.png: 70 tokens, with the next message)" in chat.stderr


class _Engine:
    """The part of Engine request_images uses: a vision flag and load_images."""
    def __init__(self, vision=True):
        self.vision = object() if vision else None

    def load_images(self, sources):
        return [load_image(s) for s in sources]


def _msg(url):
    return [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def test_request_images_parts(tmp_path):
    data = "data:image/png;base64," + base64.b64encode(_png_bytes(40, 30, 5)).decode()
    (img,) = request_images(_msg(data), _Engine(), None)
    assert img.grid_thw[0] == 1 and img.n_tokens > 0
    path = _png(tmp_path / "x.png", 40, 30, 5)
    (same,) = request_images(_msg(f"file://{path}"), _Engine(), str(tmp_path))
    assert same.digest == img.digest
    bad = {"data:image/png,abc": "base64", "data:image/png;base64,@@@": "base64 is invalid",
           "https://example.com/a.png": "fetches no URLs", f"file://{path}": "file:// image URLs are off",
           "data:image/png;base64," + base64.b64encode(b"not an image").decode(): "content\\[1\\]"}
    for url, why in bad.items():
        with pytest.raises(ImageRequestError, match=why):
            request_images(_msg(url), _Engine(), None)
    with pytest.raises(ImageRequestError, match="outside the directory"):
        request_images(_msg("file:///etc/passwd"), _Engine(), str(tmp_path))
    with pytest.raises(ImageRequestError, match="no vision projector") as e:
        request_images(_msg(data), _Engine(vision=False), None)
    assert e.value.code == "unsupported_value"
    assert request_images([{"role": "user", "content": "text only"}], _Engine(vision=False), None) == []


@pytest.mark.oracle
@pytest.mark.slow
def test_server_answers_an_image_url(tiny_vision_gguf, tmp_path):
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from test_server import MODEL_ID, serving
    from legacy_engine.serve.worker import Worker
    _, text, mmproj = tiny_vision_gguf("dense", "f32")
    eng = Engine(text, n_threads=2, n_ctx=1024, mmproj=mmproj)
    png = _png_bytes(80, 50, 6)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "what is it?"}]}]
    # the oracle: the same engine's Session on the same rendered prompt and image, greedy
    ids = eng.tokenizer.encode_prompt(*eng.chat_text(messages, enable_thinking=False))
    want = eng.session().generate(ids, max_tokens=4, images=eng.load_images([png]))
    with serving(Worker(eng), max_body=1 << 20) as (port, _):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        r = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=4, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        n_img = eng.load_images([png])[0].n_tokens
        assert r.usage.prompt_tokens == len(ids) - 1 + n_img
        assert r.choices[0].message.content == want.text
        bad = dict(messages=[{"role": "user", "content": [{"type": "image_url",
                                                           "image_url": {"url": "http://example.com/a.png"}}]}])
        with pytest.raises(openai.BadRequestError, match="fetches no URLs"):
            client.chat.completions.create(model=MODEL_ID, max_tokens=2, **bad)


@pytest.mark.oracle
@pytest.mark.slow
def test_prefix_cache_keys_images_by_their_pixels(tiny_vision_gguf, tmp_path):
    """The cache's answer equals a fresh session's bit for bit: a repeat (exact hit), the same text with another
    image (no reuse past the image's page), and an extension (restored inside the image: its rope delta with it,
    checked by decode steps after the restore)."""
    from legacy_engine.serve.cache import PrefixCache
    _, text, mmproj = tiny_vision_gguf("moe", "f32")
    eng = Engine(text, n_threads=2, mmproj=mmproj)
    cache = PrefixCache.for_model(eng.model, ram_bytes=1 << 28)
    img_a, img_b = eng.load_images([_png(tmp_path / "a.png", 97, 61, 1), _png(tmp_path / "b.png", 97, 61, 2)])
    system = [{"role": "system", "content": "you look at pictures " * 20}]

    def prompt(img, extra=""):
        msgs = system + [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?" + extra}]}]
        ids, spans = eng.expand_images(eng.tokenizer.encode_prompt(*eng.chat_text(msgs, enable_thinking=False)), [img])
        return ids, eng.encode_images(spans, [img])

    def fresh(ids, images, steps=3):
        s = eng.session()
        out = [s.prefill(ids, images=images)]
        for t in range(steps):
            out.append(s.decode(7 + t))
        return np.stack(out)

    def cached(ids, images, steps=3):
        s = eng.session()
        out = [cache.prefill(s, ids, images=images)]
        for t in range(steps):
            out.append(s.decode(7 + t))
        return np.stack(out), dict(cache.last)

    ids_a, im_a = prompt(img_a)
    start = im_a.spans[0].start
    got, last = cached(ids_a, im_a)
    assert last["reused"] == 0 and np.array_equal(got, fresh(ids_a, im_a))
    got, last = cached(ids_a, im_a)                      # the same prompt and image: an exact hit
    assert last["exact"] and np.array_equal(got, fresh(ids_a, im_a))
    ids_b, im_b = prompt(img_b)                          # the same text, another image
    assert ids_b == ids_a
    got, last = cached(ids_b, im_b)
    assert last["reused"] <= start and np.array_equal(got, fresh(ids_b, im_b))
    ids_x, im_x = prompt(img_a, " and more words after it, " * 8)   # an extension of the first prompt
    got, last = cached(ids_x, im_x)
    assert last["reused"] > start and np.array_equal(got, fresh(ids_x, im_x))   # restored inside the image


def _requantize(src, dst, qtype):
    """src's mmproj with every 2-D matrix but the position table as qtype (gguf-py's quantiser) -> (dst, and a copy
    whose matrices hold the dequantised values in F32)."""
    import gguf
    r = gguf.GGUFReader(str(src))
    outs = []
    for path, as_q in ((dst, True), (str(dst) + ".deq.gguf", False)):
        w = gguf.GGUFWriter(str(path), "clip")
        for k, f in r.fields.items():
            if k.startswith("GGUF.") or k == "general.architecture":
                continue
            v = f.contents()
            if isinstance(v, bool):
                w.add_bool(k, v)
            elif isinstance(v, int):
                w.add_uint32(k, v)
            elif isinstance(v, float):
                w.add_float32(k, v)
            elif isinstance(v, str):
                w.add_string(k, v)
            else:
                w.add_array(k, v)
        for t in r.tensors:
            x = np.array(t.data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
            if x.ndim == 2 and t.name != "v.position_embd.weight":    # the patch kernels stay float (llama.cpp's)
                q = gguf.quants.quantize(x, qtype)
                if as_q:
                    w.add_tensor(t.name, q, raw_dtype=qtype)
                    continue
                x = gguf.quants.dequantize(q, qtype).reshape(x.shape)
            w.add_tensor(t.name, np.ascontiguousarray(x))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        outs.append(path)
    return outs


@pytest.mark.oracle
@pytest.mark.slow
def test_q8_0_mmproj(tiny_vision_gguf, tmp_path):
    """A Q8_0 mmproj encodes as its dequantised F32 copy does (bit for bit: each row is dequantised, then the f32
    path), and stays near the f32 tower (its own rounding, measured here)."""
    import gguf
    from legacy_engine.cpu.vision import VisionTower
    _, _, mm = tiny_vision_gguf("dense", "f32")
    q8, deq = _requantize(mm, tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    img = load_image(_png(tmp_path / "a.png", 97, 61, 1))
    out = {name: VisionTower(p, n_threads=2).encode(img) for name, p in (("q8", q8), ("deq", deq), ("f32", mm))}
    assert np.array_equal(out["q8"], out["deq"])
    drift = float(np.abs(out["q8"] - out["f32"]).max())
    print(f"Q8_0 mmproj vs f32: max |Δ| {drift:.2e} (embeddings of std {out['f32'].std():.2f})")
    assert 0 < drift < 0.05 * float(np.abs(out["f32"]).max())
