"""`legacy-engine bench vision`: image encode time of the vision tower (issue 23), ours beside llama.cpp's mtmd;
with --text, the time to the first token of an image question, also beside llama.cpp's.

    legacy-engine bench vision MMPROJ.gguf [--sizes 448x448,1024x1024,1920x1080] [--threads 2,16] [--reps 3]
                                           [--llama TEXT.gguf] [--text TEXT.gguf] [--gpu TIER] [--seed 0] [--json FILE]

Images are synthetic (seeded uniform RGB noise, WxH). Ours: the image through format/image.preprocess (transformers'
smart resize: a stretch to multiples of 32 pixels within 65,536 … 16,777,216 pixels), then cpu/vision.VisionTower
.encode; the preprocessing is not timed. llama.cpp (--llama, the text GGUF the mmproj belongs to; llama-cpp-python's
ctypes binding of libmtmd, the text model loaded vocab-only): mtmd_bitmap_init → mtmd_tokenize → mtmd_encode_chunk
on the image chunk, the encode timed (its own preprocessing, done in mtmd_tokenize, is not). llama.cpp resizes
differently (aspect-preserving within 8,192 … 4,194,304 pixels, spec §2.7), so its patch and token counts are
reported beside ours and the times are compared per image and per patch.

Each engine encodes one 256x256 image untimed per thread count (weights paged in, threads started), then every size
--reps times; median and min count. GFLOP per encode counts the matmuls and the attention of the hparams and that
engine's grid (format/mmproj.py encode_flops: N patches, H hidden, F ffn, D blocks, merge² = 4, O out):
  patch embedding 2·N·(3·2·P·P)·H; per block 2·N·H·3H (qkv) + 4·N²·H (QKᵀ and AV, full attention over the image)
  + 2·N·H² (proj) + 4·N·H·F (fc1, fc2); merger 2·(N/4)·(4H)² + 2·(N/4)·4H·O.

Time to first token (--text TEXT.gguf): an image + QUESTION in the model's chat template, through Engine as
`run --image` does it (bench_ttft: the PNG's bytes decoded and preprocessed, the encode, the prefill, the greedy first
token). With --llama as well, llama.cpp (the full --llama model and a llama context) takes the same rendered text,
the template's <|vision_start|><|image_pad|><|vision_end|> replaced by mtmd's marker (mtmd writes those two tokens
around the image chunk itself), and the same PNG bytes: mtmd_helper_bitmap_init_from_buf + mtmd_tokenize
(preprocess), then the steps of mtmd_helper_eval_chunks one chunk at a time, so that the image's mtmd_encode_chunk
(encode) is timed apart from the llama_decode of the text chunks and of the image's embeddings (prefill), then the
last token's logits and their argmax. Per size one warm-up run is dropped on each side.
Results: benchmarks/results/vision_encode_cpu_2026-11-26.md, vision_ttft_2026-11-28.md.
"""
from __future__ import annotations

import argparse
import ctypes
import io
import json
import statistics
import sys
import time

import numpy as np
from PIL import Image

from .. import gpu
from ..cpu.vision import VisionTower
from ..gpu.vision import GpuVisionTower
from ..serve.generate import Engine
from ..format.image import preprocess
from ..format.mmproj import MmprojFile, VisionHparams, encode_flops

SIZES = ((448, 448), (1024, 1024), (1920, 1080))
WARMUP = (256, 256)     # one untimed encode per engine and thread count: loads the weights' pages and the threads


def synthetic_rgb(width: int, height: int, seed: int) -> np.ndarray:
    """uint8 [height, width, 3] seeded noise."""
    return np.random.default_rng([seed, width, height]).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _stats(runs: list[float], flops: int, n_patches: int) -> dict:
    med = statistics.median(runs)
    return dict(runs_s=runs, median_s=med, min_s=min(runs), gflop=flops / 1e9, gflops=flops / med / 1e9,
                ms_per_patch=med / n_patches * 1e3)


# ---- ours -------------------------------------------------------------------------------------------------------

def bench_ours(mmproj: str, threads: int, images: dict, reps: int, log, gpu_tier: str | None = None) -> list[dict]:
    """Our tower's encodes: on the CPU at `threads`, or with gpu_tier on the GPU (gpu/vision.GpuVisionTower; an
    encode returns the embeddings in host memory, so each time includes the device's whole work)."""
    tower = cpu = VisionTower(mmproj, n_threads=threads)
    if gpu_tier:
        tower = GpuVisionTower(cpu, gpu.Kernels(gpu_tier))
    hp = cpu.hparams
    inputs = {k: preprocess(Image.fromarray(rgb)) for k, rgb in images.items()}
    tower.encode(preprocess(Image.fromarray(synthetic_rgb(*WARMUP, 0))))
    rows = []
    for (w, h), x in inputs.items():
        runs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            out = tower.encode(x)
            runs.append(time.perf_counter() - t0)
        _, gh, gw = x.grid_thw
        n = gh * gw
        row = dict(image=f"{w}x{h}", resized=f"{gw * hp.patch_size}x{gh * hp.patch_size}", grid=[gh, gw],
                   patches=n, tokens=x.n_tokens, finite=bool(np.isfinite(out).all()),
                   **_stats(runs, encode_flops(hp, n), n))
        log(f"  ours {'gpu ' + gpu_tier if gpu_tier else 't' + str(threads)} {row['image']}: {row['median_s']:.3f} s "
            f"({row['gflops']:.1f} GFLOP/s)")
        rows.append(row)
    return rows


# ---- time to first token ------------------------------------------------------------------------------------------

QUESTION = "What is in this picture?"


IMAGE_MARKUP = "<|vision_start|><|image_pad|><|vision_end|>"     # one image in Qwen3.5's chat template


def png_bytes(rgb: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def _ttft_row(image: str, prompt_tokens: int, image_tokens: int, phases: list[tuple], first_token: int,
              **extra) -> dict:
    """phases: (preprocess, encode, prefill) seconds of each timed run."""
    ttft = [sum(p) for p in phases]
    return dict(image=image, prompt_tokens=prompt_tokens, image_tokens=image_tokens, runs_s=ttft,
                ttft_median_s=statistics.median(ttft), ttft_min_s=min(ttft),
                preprocess_s=statistics.median(p[0] for p in phases), encode_s=statistics.median(p[1] for p in phases),
                prefill_s=statistics.median(p[2] for p in phases), first_token=first_token, **extra)


def bench_ttft(text_gguf: str, mmproj: str, threads: int, images: dict, reps: int, log,
               gpu_tier: str | None = None) -> tuple[list[dict], str]:
    """Time to the first token of an image question through Engine/Session as `run --image` does it: the PNG's
    bytes decoded and preprocessed, the tower's encode (its cache of encoded images emptied each time), the prompt's
    prefill, the greedy first token; with the split of the three. -> (rows, the rendered prompt text)."""
    eng = Engine(text_gguf, n_threads=threads, mmproj=mmproj, gpu=gpu_tier is not None, gpu_tier=gpu_tier, pin=False)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    prompt, literal = eng.chat_text(msgs, enable_thinking=False)
    ids = eng.tokenizer.encode_prompt(prompt, literal)
    rows = []
    for (w, h), rgb in images.items():
        png, phases = png_bytes(rgb), []
        for _ in range(reps + 1):                   # the first run warms the scratch and the kernels: dropped
            eng.forget_images()
            t0 = time.perf_counter()
            imgs = eng.load_images([png])
            full, spans = eng.expand_images(ids, imgs)
            t1 = time.perf_counter()
            pi = eng.encode_images(spans, imgs)
            t2 = time.perf_counter()
            first = int(np.argmax(eng.session().prefill(full, images=pi)))
            phases.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        row = _ttft_row(f"{w}x{h}", len(full), imgs[0].n_tokens, phases[1:], first, where=eng.vision_where)
        log(f"  ttft {'gpu ' + gpu_tier if gpu_tier else 't' + str(threads)} {row['image']}: "
            f"{row['ttft_median_s']:.3f} s")
        rows.append(row)
    return rows, prompt


# ---- llama.cpp (mtmd through llama-cpp-python) ---------------------------------------------------------------------

_SILENT_LOG: list = []     # the no-op log callback, alive for the process: llama.cpp keeps calling the pointer


def _silent_log():
    import llama_cpp
    if not _SILENT_LOG:
        _SILENT_LOG.append(llama_cpp.llama_log_callback(lambda level, text, user: None))
    return _SILENT_LOG[0]


class LlamaMtmd:
    """An mtmd context of llama-cpp-python 0.3.36 over (mmproj, text model loaded vocab-only unless vocab_only is
    False), llama.cpp's logs silenced while it lives (close() gives them back to llama-cpp-python's logger).
    RuntimeError with what failed when it cannot be made."""

    def __init__(self, mmproj: str, text_gguf: str, n_threads: int, vocab_only: bool = True):
        import llama_cpp
        from llama_cpp import mtmd_cpp

        self.lc, self.mt = llama_cpp, mtmd_cpp
        llama_cpp.llama_log_set(_silent_log(), None)
        mtmd_cpp.mtmd_helper_log_set(_silent_log(), None)      # the helpers' log, and mtmd_log_set's
        llama_cpp.llama_backend_init()
        mp = llama_cpp.llama_model_default_params()
        mp.vocab_only = vocab_only    # an encode alone: mtmd reads the LM's n_embd and tokenizer only
        self.model = llama_cpp.llama_model_load_from_file(text_gguf.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama_model_load_from_file({text_gguf!r}) returned NULL")
        p = mtmd_cpp.mtmd_context_params_default()
        p.use_gpu, p.n_threads, p.print_timings, p.warmup = False, int(n_threads), False, False
        self.ctx = mtmd_cpp.mtmd_init_from_file(mmproj.encode(), self.model, p)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise RuntimeError(f"mtmd_init_from_file({mmproj!r}) returned NULL (clip loader refused the mmproj)")

    def image_chunk(self, rgb: np.ndarray):
        """(chunks, chunk, bitmap) of one image tokenized; free with release()."""
        mt = self.mt
        h, w, _ = rgb.shape
        buf = (ctypes.c_uint8 * rgb.size).from_buffer_copy(np.ascontiguousarray(rgb).tobytes())
        bmp = mt.mtmd_bitmap_init(w, h, buf)
        chunks = mt.mtmd_input_chunks_init()
        marker = mt.mtmd_default_marker()
        txt = mt.mtmd_input_text()
        txt.text, txt.text_len, txt.add_special, txt.parse_special = marker, len(marker), False, True
        rc = mt.mtmd_tokenize(self.ctx, chunks, ctypes.byref(txt), (mt.mtmd_bitmap_p_ctypes * 1)(bmp), 1)
        if rc != 0:
            raise RuntimeError(f"mtmd_tokenize returned {rc}")
        for i in range(mt.mtmd_input_chunks_size(chunks)):
            c = mt.mtmd_input_chunks_get(chunks, i)
            if mt.mtmd_input_chunk_get_type(c) == mt.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                return chunks, c, bmp
        raise RuntimeError("mtmd_tokenize made no image chunk")

    def release(self, chunks, bmp) -> None:
        self.mt.mtmd_input_chunks_free(chunks)
        self.mt.mtmd_bitmap_free(bmp)

    def encode(self, chunk) -> float:
        t0 = time.perf_counter()
        rc = self.mt.mtmd_encode_chunk(self.ctx, chunk)
        dt = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"mtmd_encode_chunk returned {rc}")
        return dt

    def embeddings(self, chunk, n_embd: int) -> np.ndarray:
        """float32 [n_tokens, n_embd] (a copy): mtmd_encode_chunk on the image chunk, then mtmd_get_output_embd, which
        holds n_tokens × n_embd floats, token-major. n_embd: the projector's output width (the mmproj's out_hidden);
        the binding has no getter for it, and llama_model_n_embd of the vocab-only text model reads 0."""
        self.encode(chunk)
        n_tok = self.mt.mtmd_input_chunk_get_n_tokens(chunk)
        ptr = self.mt.mtmd_get_output_embd(self.ctx)
        if not ptr:
            raise RuntimeError("mtmd_get_output_embd returned NULL after mtmd_encode_chunk")
        return np.ctypeslib.as_array(ptr, shape=(n_tok * n_embd,)).reshape(n_tok, n_embd).copy()

    def grid(self, chunk) -> tuple[int, int, int]:
        """(tokens, token columns, token rows) of an image chunk."""
        it = self.mt.mtmd_input_chunk_get_tokens_image(chunk)
        return (self.mt.mtmd_input_chunk_get_n_tokens(chunk), self.mt.mtmd_image_tokens_get_nx(it),
                self.mt.mtmd_image_tokens_get_ny(it))

    def close(self) -> None:
        from llama_cpp import _logger
        self.mt.mtmd_free(self.ctx)
        self.lc.llama_model_free(self.model)
        # back to llama-cpp-python's own callback (its module keeps it alive), never a freed one
        self.lc.llama_log_set(_logger.llama_log_callback, None)
        self.mt.mtmd_helper_log_set(_logger.llama_log_callback, None)


def bench_llama(mmproj: str, text_gguf: str, threads: int, images: dict, reps: int, hp: VisionHparams,
                log) -> list[dict]:
    m = LlamaMtmd(mmproj, text_gguf, threads)
    try:
        chunks, chunk, bmp = m.image_chunk(synthetic_rgb(*WARMUP, 0))
        m.encode(chunk)
        m.release(chunks, bmp)
        rows = []
        for (w, h), rgb in images.items():
            chunks, chunk, bmp = m.image_chunk(rgb)
            try:
                runs = [m.encode(chunk) for _ in range(reps)]
                n_tok, nx, ny = m.grid(chunk)
            finally:
                m.release(chunks, bmp)
            n = n_tok * hp.merge ** 2
            side = hp.patch_size * hp.merge
            row = dict(image=f"{w}x{h}", resized=f"{nx * side}x{ny * side}", grid=[ny * hp.merge, nx * hp.merge],
                       patches=n, tokens=n_tok,
                       **_stats(runs, encode_flops(hp, n), n))
            log(f"  llama.cpp t{threads} {row['image']}: {row['median_s']:.3f} s ({row['gflops']:.1f} GFLOP/s)")
            rows.append(row)
        return rows
    finally:
        m.close()


class LlamaChat(LlamaMtmd):
    """LlamaMtmd over the full text model, plus a llama context (open_context): an image prompt evaluated as
    mtmd_helper_eval_chunks does it, with the image's encode timed apart."""

    def __init__(self, mmproj: str, text_gguf: str, n_threads: int):
        super().__init__(mmproj, text_gguf, n_threads, vocab_only=False)
        self.n_threads, self.lctx, self.n_batch = int(n_threads), None, 0
        self.n_vocab = self.lc.llama_vocab_n_tokens(self.lc.llama_model_get_vocab(self.model))

    def open_context(self, n_tokens: int) -> None:
        """A llama context for prompts of up to n_tokens. n_batch = n_ubatch = n_ctx: each chunk (text, or the image's
        rows: causal for Qwen, so mtmd could split them by n_batch) goes through the graph in one ubatch, llama.cpp's
        best case (ours prefills in serve.generate.PREFILL_BATCH-token calls)."""
        lc = self.lc
        cp = lc.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = int(n_tokens)
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = self.n_threads
        self.lctx = lc.llama_init_from_model(self.model, cp)
        if not self.lctx:
            raise RuntimeError(f"llama_init_from_model(n_ctx={n_tokens}) returned NULL")
        self.n_batch = int(n_tokens)

    def tokenize(self, prompt: bytes, png: bytes):
        """(chunks, bitmap) of the prompt (its one marker standing for the image) and the image file's bytes
        (stb_image decodes them); free with release()."""
        mt = self.mt
        buf = (ctypes.c_uint8 * len(png)).from_buffer_copy(png)
        bmp = mt.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(png), False)
        if not bmp:
            raise RuntimeError("mtmd_helper_bitmap_init_from_buf could not decode the image")
        chunks = mt.mtmd_input_chunks_init()
        # the text is the template's whole rendering: no BOS added, its control tokens parsed
        txt = mt.mtmd_input_text()
        txt.text, txt.text_len, txt.add_special, txt.parse_special = prompt, len(prompt), False, True
        rc = mt.mtmd_tokenize(self.ctx, chunks, ctypes.byref(txt), (mt.mtmd_bitmap_p_ctypes * 1)(bmp), 1)
        if rc != 0:
            self.release(chunks, bmp)
            raise RuntimeError(f"mtmd_tokenize returned {rc}")
        return chunks, bmp

    def counts(self, chunks) -> tuple[int, int]:
        """(prompt tokens, image tokens) of tokenized chunks."""
        mt, n_img = self.mt, 0
        for i in range(mt.mtmd_input_chunks_size(chunks)):
            c = mt.mtmd_input_chunks_get(chunks, i)
            if mt.mtmd_input_chunk_get_type(c) == mt.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                n_img += mt.mtmd_input_chunk_get_n_tokens(c)
        return mt.mtmd_helper_get_n_tokens(chunks), n_img

    def clear(self) -> None:
        """Empties the context's memory (KV cache and recurrent state): the next prompt starts at position 0."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.lctx), True)

    def eval(self, chunks) -> tuple[float, float]:
        """-> (encode s, prefill s): mtmd_helper_eval_chunks' loop (n_past 0, seq 0, logits of the last token), its
        image step split in two: mtmd_encode_chunk (the encode), then mtmd_helper_decode_image_chunk of
        mtmd_get_output_embd (the image rows' prefill, with the text chunks' mtmd_helper_eval_chunk_single)."""
        mt, lc = self.mt, self.lc
        n_past = lc.llama_pos(0)      # a text chunk adds its tokens to *new_n_past: it starts at n_past, as there
        enc = pre = 0.0
        n = mt.mtmd_input_chunks_size(chunks)
        for i in range(n):
            c = mt.mtmd_input_chunks_get(chunks, i)
            t0 = time.perf_counter()
            if mt.mtmd_input_chunk_get_type(c) == mt.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                rc = mt.mtmd_encode_chunk(self.ctx, c)
                if rc != 0:
                    raise RuntimeError(f"mtmd_encode_chunk returned {rc}")
                t1 = time.perf_counter()
                enc += t1 - t0
                t0 = t1
                no_callback = mt.mtmd_helper_post_decode_callback()      # NULL: nothing after each decode
                rc = mt.mtmd_helper_decode_image_chunk(self.ctx, self.lctx, c, mt.mtmd_get_output_embd(self.ctx),
                                                       n_past.value, 0, self.n_batch, ctypes.byref(n_past),
                                                       no_callback, None)
                what = "mtmd_helper_decode_image_chunk"
            else:
                rc = mt.mtmd_helper_eval_chunk_single(self.ctx, self.lctx, c, n_past.value, 0, self.n_batch,
                                                      i == n - 1, ctypes.byref(n_past))
                what = "mtmd_helper_eval_chunk_single"
            pre += time.perf_counter() - t0
            if rc != 0:
                raise RuntimeError(f"{what} (chunk {i} of {n}) returned {rc}")
        return enc, pre

    def last_logits(self) -> np.ndarray:
        """float32 [n_vocab] (a copy): the logits of the last token evaluated."""
        ptr = self.lc.llama_get_logits_ith(self.lctx, -1)
        if not ptr:
            raise RuntimeError("llama_get_logits_ith(-1) returned NULL: no logits after the prompt")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def close(self) -> None:
        if self.lctx:
            self.lc.llama_free(self.lctx)
            self.lctx = None
        super().close()


def llama_prompt(prompt: str, marker: bytes) -> bytes:
    """Our rendered image question for mtmd: the template's one image markup replaced by mtmd's marker. mtmd writes
    <|vision_start|> and <|vision_end|> around the image chunk (mtmd.cpp, PROJECTOR_TYPE_QWEN3VL), so both engines
    read the same tokens around the image."""
    if prompt.count(IMAGE_MARKUP) != 1:
        raise RuntimeError(f"the rendered prompt holds {prompt.count(IMAGE_MARKUP)} x {IMAGE_MARKUP}, not one")
    return prompt.replace(IMAGE_MARKUP, marker.decode()).encode()


def bench_llama_ttft(mmproj: str, text_gguf: str, threads: int, images: dict, reps: int, prompt: str,
                     log) -> list[dict]:
    """bench_ttft's measurement through llama.cpp (the module docstring): the same prompt text and PNG bytes."""
    m = LlamaChat(mmproj, text_gguf, threads)
    try:
        text = llama_prompt(prompt, m.mt.mtmd_default_marker())
        pngs = {size: png_bytes(rgb) for size, rgb in images.items()}
        longest = 0
        for png in pngs.values():                 # the context's size: the longest prompt, tokenized untimed
            chunks, bmp = m.tokenize(text, png)
            longest = max(longest, m.counts(chunks)[0])
            m.release(chunks, bmp)
        m.open_context(longest)
        rows = []
        for (w, h), png in pngs.items():
            phases = []
            for _ in range(reps + 1):               # the first run warms the scratch and the threads: dropped
                m.clear()
                t0 = time.perf_counter()
                chunks, bmp = m.tokenize(text, png)
                pre = time.perf_counter() - t0
                try:
                    enc, fill = m.eval(chunks)
                    t1 = time.perf_counter()
                    first = int(np.argmax(m.last_logits()))
                    fill += time.perf_counter() - t1
                    n_prompt, n_image = m.counts(chunks)
                finally:
                    m.release(chunks, bmp)
                phases.append((pre, enc, fill))
            row = _ttft_row(f"{w}x{h}", n_prompt, n_image, phases[1:], first)
            log(f"  llama.cpp ttft t{threads} {row['image']}: {row['ttft_median_s']:.3f} s")
            rows.append(row)
        return rows
    finally:
        m.close()


# what a missing, old or refusing llama-cpp-python raises (ArgumentError: a binding whose signatures moved):
# reported in the results, never a crash
LLAMA_ERRORS = (RuntimeError, ImportError, OSError, AttributeError, ctypes.ArgumentError)


def bench_vision(mmproj: str, threads=(2,), sizes=SIZES, reps: int = 3, llama: str | None = None, seed: int = 0,
                 log=None, gpu_tier: str | None = None, text: str | None = None) -> dict:
    """Runs the module docstring's measurements; returns {"ours": {t: [rows]}, "llama": {t: [rows]} or llama_error,
    "gpu": [rows] with gpu_tier, "ttft": {t or "gpu": [rows]} with text, "llama_ttft": {t: [rows]} or
    llama_ttft_error with text and llama}."""
    log = log or (lambda s: None)
    hp = MmprojFile.open(mmproj).hparams
    images = {(w, h): synthetic_rgb(w, h, seed) for w, h in sizes}
    out = dict(mmproj=str(mmproj), hparams=dict(depth=hp.depth, hidden=hp.hidden, n_head=hp.n_head, ffn=hp.ffn,
                                                 out_hidden=hp.out_hidden),
               threads=list(threads), reps=reps, seed=seed, llama_text=llama, ours={}, llama={}, llama_error=None,
               llama_ttft={}, llama_ttft_error=None)
    for t in threads:
        out["ours"][str(t)] = bench_ours(mmproj, t, images, reps, log)
    if gpu_tier:
        out["gpu"] = {"tier": gpu_tier, "rows": bench_ours(mmproj, threads[0], images, reps, log, gpu_tier)}
    prompt = None
    if text:
        out["ttft"] = {}
        for t in threads:
            out["ttft"][str(t)], prompt = bench_ttft(text, mmproj, t, images, reps, log)
        if gpu_tier:
            out["ttft"]["gpu"], _ = bench_ttft(text, mmproj, threads[0], images, reps, log, gpu_tier)
        out["ttft_prompt"] = prompt
    if llama:
        try:
            for t in threads:
                out["llama"][str(t)] = bench_llama(mmproj, llama, t, images, reps, hp, log)
        except LLAMA_ERRORS as e:
            out["llama_error"] = f"{type(e).__name__}: {e}"
            log(f"  llama.cpp: {out['llama_error']}")
    if llama and prompt is not None:
        try:
            for t in threads:
                out["llama_ttft"][str(t)] = bench_llama_ttft(mmproj, llama, t, images, reps, prompt, log)
        except LLAMA_ERRORS as e:
            out["llama_ttft_error"] = f"{type(e).__name__}: {e}"
            log(f"  llama.cpp ttft: {out['llama_ttft_error']}")
    return out


def print_vision(res: dict) -> None:
    hp = res["hparams"]
    print(f"{res['mmproj']}: depth {hp['depth']}, hidden {hp['hidden']}, heads {hp['n_head']}, ffn {hp['ffn']}, "
          f"out {hp['out_hidden']}; median (min) of {res['reps']} encode(s) after one 256x256 warm-up")
    for t, rows in res["ours"].items():
        lrows = {r["image"]: r for r in res["llama"].get(t, [])}
        print(f"\nthreads {t}\n{'image':>10} {'engine':>9} {'resized':>10} {'patches':>8} {'tokens':>7} "
              f"{'median s':>9} {'min s':>8} {'GFLOP':>8} {'GFLOP/s':>8} {'ms/patch':>9}")
        for r in rows:
            print(f"{r['image']:>10} {'ours':>9} {r['resized']:>10} {r['patches']:>8} {r['tokens']:>7} "
                  f"{r['median_s']:>9.3f} {r['min_s']:>8.3f} {r['gflop']:>8.1f} {r['gflops']:>8.1f} "
                  f"{r['ms_per_patch']:>9.3f}")
            lr = lrows.get(r["image"])
            if lr:
                print(f"{'':>10} {'llama.cpp':>9} {lr['resized']:>10} {lr['patches']:>8} {lr['tokens']:>7} "
                      f"{lr['median_s']:>9.3f} {lr['min_s']:>8.3f} {lr['gflop']:>8.1f} {lr['gflops']:>8.1f} "
                      f"{lr['ms_per_patch']:>9.3f}")
                print(f"{'':>10} {'ours/llama':>9}  per image {r['median_s'] / lr['median_s']:.2f}, per patch "
                      f"{r['ms_per_patch'] / lr['ms_per_patch']:.2f} (> 1: ours slower)")
    if res.get("gpu"):
        print(f"\nGPU ({res['gpu']['tier']} tier)")
        for r in res["gpu"]["rows"]:
            print(f"{r['image']:>10} {'ours gpu':>9} {r['resized']:>10} {r['patches']:>8} {r['tokens']:>7} "
                  f"{r['median_s']:>9.3f} {r['min_s']:>8.3f} {r['gflop']:>8.1f} {r['gflops']:>8.1f} "
                  f"{r['ms_per_patch']:>9.3f}")
    for where, rows in (res.get("ttft") or {}).items():
        lrows = {r["image"]: r for r in res.get("llama_ttft", {}).get(where, [])}
        print(f"\ntime to first token of an image + \"{QUESTION}\" ({'GPU' if where == 'gpu' else where + ' threads'}; "
              f"our tower on {rows[0]['where'] if rows else '-'}); median (min) of {res['reps']} after one warm-up")
        print(f"{'image':>10} {'engine':>10} {'tokens':>7} {'of img':>6} {'ttft s':>8} {'min s':>8} "
              f"{'preprocess':>10} {'encode':>8} {'prefill':>8} {'1st token':>9}")
        for r in rows:
            _print_ttft(r["image"], "ours", r)
            lr = lrows.get(r["image"])
            if lr:
                _print_ttft("", "llama.cpp", lr)
                print(f"{'':>10} {'ours/llama':>10}  ttft {r['ttft_median_s'] / lr['ttft_median_s']:.2f} (> 1: ours "
                      f"slower), encode {r['encode_s'] / lr['encode_s']:.2f}, prefill "
                      f"{r['prefill_s'] / lr['prefill_s']:.2f}")
    if res["llama_error"]:
        print(f"\nllama.cpp not measured: {res['llama_error']}")
    if res.get("llama_ttft_error"):
        print(f"\nllama.cpp's time to first token not measured: {res['llama_ttft_error']}")


def _print_ttft(image: str, engine: str, r: dict) -> None:
    print(f"{image:>10} {engine:>10} {r['prompt_tokens']:>7} {r['image_tokens']:>6} {r['ttft_median_s']:>8.3f} "
          f"{r['ttft_min_s']:>8.3f} {r['preprocess_s']:>10.3f} {r['encode_s']:>8.3f} {r['prefill_s']:>8.3f} "
          f"{r['first_token']:>9}")


def add_parser(sub) -> None:
    sp = sub.add_parser("vision", help="image encode time of the vision tower (mmproj), beside llama.cpp's mtmd",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("mmproj", help="a Qwen3.5/3.6 mmproj GGUF (e.g. from make-model --mmproj-out)")
    sp.add_argument("--sizes", default=",".join(f"{w}x{h}" for w, h in SIZES), metavar="WxH[,WxH...]",
                    help="synthetic image sizes (448x448,1024x1024,1920x1080)")
    sp.add_argument("--threads", default="2", metavar="N[,N...]", help="thread counts for both engines (2)")
    sp.add_argument("--reps", type=int, default=3, help="timed encodes per size after one warm-up (3)")
    sp.add_argument("--llama", metavar="TEXT.gguf", default=None,
                    help="also encode with llama.cpp's mtmd (llama-cpp-python); needs the text GGUF the mmproj "
                         "belongs to (its n_embd = the projector's output); with --text, also llama.cpp's time to "
                         "the first token through this model")
    sp.add_argument("--seed", type=int, default=0, help="seed of the synthetic images (0)")
    sp.add_argument("--text", metavar="TEXT.gguf", default=None,
                    help="also time the first token of an image question through this model (Engine, as run --image "
                         "does it): preprocessing, encode, prefill; beside llama.cpp's with --llama")
    sp.add_argument("--gpu", dest="gpu_tier", choices=("fermi", "kepler", "dp4a"), default=None,
                    help="also time the tower on the GPU with this kernel tier (gpu/vision.py)")
    sp.add_argument("--json", metavar="FILE", default=None, help="also write the numbers to FILE as JSON")


def main(args) -> int:
    try:
        threads = [int(t) for t in args.threads.split(",") if t]
        sizes = [tuple(int(v) for v in s.lower().split("x")) for s in args.sizes.split(",") if s]
    except ValueError:
        raise SystemExit(f"error: --threads takes N,N,... and --sizes WxH,WxH,..., not {args.threads!r} / "
                         f"{args.sizes!r}")
    if not threads or min(threads) < 1 or args.reps < 1 or not sizes or any(len(s) != 2 or min(s) < 1
                                                                             for s in sizes):
        raise SystemExit("error: --threads and --reps >= 1; --sizes WxH with W, H >= 1")
    res = bench_vision(args.mmproj, threads, sizes, args.reps, args.llama, args.seed,
                       log=lambda s: print(s, file=sys.stderr, flush=True), gpu_tier=args.gpu_tier, text=args.text)
    print_vision(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
