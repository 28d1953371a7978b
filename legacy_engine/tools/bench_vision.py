"""`legacy-engine bench vision`: image encode time of the vision tower (issue 23), ours beside llama.cpp's mtmd.

    legacy-engine bench vision MMPROJ.gguf [--sizes 448x448,1024x1024,1920x1080] [--threads 2,16] [--reps 3]
                                           [--llama TEXT.gguf] [--seed 0] [--json FILE]

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
Results: benchmarks/results/vision_encode_cpu_2026-11-26.md.
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


def bench_ttft(text_gguf: str, mmproj: str, threads: int, images: dict, reps: int, log,
               gpu_tier: str | None = None) -> list[dict]:
    """Time to the first token of an image question through Engine/Session as `run --image` does it: the PNG's
    bytes decoded and preprocessed, the tower's encode (its cache of encoded images emptied each time), the prompt's
    prefill, the greedy first token; with the split of the three."""
    eng = Engine(text_gguf, n_threads=threads, mmproj=mmproj, gpu=gpu_tier is not None, gpu_tier=gpu_tier, pin=False)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    ids = eng.tokenizer.encode_prompt(*eng.chat_text(msgs, enable_thinking=False))
    rows = []
    for (w, h), rgb in images.items():
        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, format="PNG")
        png, phases = buf.getvalue(), []
        for _ in range(reps + 1):                   # the first run warms the scratch and the kernels: dropped
            eng._encoded.clear()
            t0 = time.perf_counter()
            imgs = eng.load_images([png])
            full, spans = eng.expand_images(ids, imgs)
            t1 = time.perf_counter()
            pi = eng.encode_images(spans, imgs)
            t2 = time.perf_counter()
            logits = eng.session().prefill(full, images=pi)
            int(np.argmax(logits))
            phases.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        phases = phases[1:]
        ttft = [sum(p) for p in phases]
        row = dict(image=f"{w}x{h}", prompt_tokens=len(full), image_tokens=imgs[0].n_tokens,
                   ttft_median_s=statistics.median(ttft), ttft_min_s=min(ttft),
                   preprocess_s=statistics.median(p[0] for p in phases),
                   encode_s=statistics.median(p[1] for p in phases),
                   prefill_s=statistics.median(p[2] for p in phases), where=eng.vision_where)
        log(f"  ttft {'gpu ' + gpu_tier if gpu_tier else 't' + str(threads)} {row['image']}: "
            f"{row['ttft_median_s']:.3f} s")
        rows.append(row)
    return rows


# ---- llama.cpp (mtmd through llama-cpp-python) ---------------------------------------------------------------------

_SILENT_LOG: list = []     # the no-op log callback, alive for the process: llama.cpp keeps calling the pointer


def _silent_log():
    import llama_cpp
    if not _SILENT_LOG:
        _SILENT_LOG.append(llama_cpp.llama_log_callback(lambda level, text, user: None))
    return _SILENT_LOG[0]


class LlamaMtmd:
    """An mtmd context of llama-cpp-python 0.3.36 over (mmproj, text model loaded vocab-only), llama.cpp's logs
    silenced while it lives (close() gives them back to llama-cpp-python's logger). RuntimeError with what failed
    when it cannot be made."""

    def __init__(self, mmproj: str, text_gguf: str, n_threads: int):
        import llama_cpp
        from llama_cpp import mtmd_cpp

        self.lc, self.mt = llama_cpp, mtmd_cpp
        llama_cpp.llama_log_set(_silent_log(), None)
        mtmd_cpp.mtmd_log_set(_silent_log(), None)
        llama_cpp.llama_backend_init()
        mp = llama_cpp.llama_model_default_params()
        mp.vocab_only = True          # mtmd reads the LM's n_embd and tokenizer only
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
        self.mt.mtmd_log_set(_logger.llama_log_callback, None)


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


def bench_vision(mmproj: str, threads=(2,), sizes=SIZES, reps: int = 3, llama: str | None = None, seed: int = 0,
                 log=None, gpu_tier: str | None = None, text: str | None = None) -> dict:
    """Runs the module docstring's measurements; returns {"ours": {t: [rows]}, "llama": {t: [rows]} or error,
    "gpu": [rows] with gpu_tier}."""
    log = log or (lambda s: None)
    hp = MmprojFile.open(mmproj).hparams
    images = {(w, h): synthetic_rgb(w, h, seed) for w, h in sizes}
    out = dict(mmproj=str(mmproj), hparams=dict(depth=hp.depth, hidden=hp.hidden, n_head=hp.n_head, ffn=hp.ffn,
                                                 out_hidden=hp.out_hidden),
               threads=list(threads), reps=reps, seed=seed, llama_text=llama, ours={}, llama={}, llama_error=None)
    for t in threads:
        out["ours"][str(t)] = bench_ours(mmproj, t, images, reps, log)
    if gpu_tier:
        out["gpu"] = {"tier": gpu_tier, "rows": bench_ours(mmproj, threads[0], images, reps, log, gpu_tier)}
    if text:
        out["ttft"] = {str(t): bench_ttft(text, mmproj, t, images, reps, log) for t in threads}
        if gpu_tier:
            out["ttft"]["gpu"] = bench_ttft(text, mmproj, threads[0], images, reps, log, gpu_tier)
    if llama:
        try:
            for t in threads:
                out["llama"][str(t)] = bench_llama(mmproj, llama, t, images, reps, hp, log)
        except (RuntimeError, ImportError, OSError, AttributeError) as e:
            out["llama_error"] = f"{type(e).__name__}: {e}"
            log(f"  llama.cpp: {out['llama_error']}")
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
        print(f"\ntime to first token of an image + \"{QUESTION}\" ({'GPU' if where == 'gpu' else where + ' threads'})")
        for r in rows:
            print(f"{r['image']:>10}  {r['prompt_tokens']:>5} tokens ({r['image_tokens']} image)  "
                  f"ttft {r['ttft_median_s']:.3f} s (min {r['ttft_min_s']:.3f}) = preprocess {r['preprocess_s']:.3f} "
                  f"+ encode {r['encode_s']:.3f} (tower on {r['where']}) + prefill {r['prefill_s']:.3f}")
    if res["llama_error"]:
        print(f"\nllama.cpp not measured: {res['llama_error']}")


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
                         "belongs to (its n_embd = the projector's output)")
    sp.add_argument("--seed", type=int, default=0, help="seed of the synthetic images (0)")
    sp.add_argument("--text", metavar="TEXT.gguf", default=None,
                    help="also time the first token of an image question through this model (Engine, as run --image "
                         "does it): preprocessing, encode, prefill")
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
