"""Engine (a loaded model + tokenizer) and Session (one conversation's state) with
prefill, decode and streamed generation."""
from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from ..format.chat import render_chat, render_prompt
from ..core.errors import Cancelled, ContextLengthError, EngineError, FormatError, UnavailableError
from ..cpu.model import DEFAULT_CTX, Model, check_logits
from ..cpu.vision import VisionTower
from ..format.image import ImageConfig, ImageInput, load_image
from ..format.mmproj import MmprojFile, check_compatible
from ..format.multimodal import ImageSpan, expand_pads, rope_positions
from .sampling import Sampler, SamplingParams
from ..format.tokenizer import Tokenizer
from ..gpu.model import GpuModel
from ..gpu.vision import GpuVisionTower
from ..gpu.options import GpuOptions
from ..plan import planner
from ..plan.probe import measure
from ..plan.split import SplitModel
from ..plan.vision import VisionPlacement, cpu_vision_placement, vision_placement

PREFILL_BATCH = 256  # tokens per forward call during prefill: bounds activation memory
PREFILL_SHARED = 64  # the server's least forward call (a multiple of the GDN chunk and the cache's page: calls split
                     # where they may); the running requests step between calls, so a call's length bounds their wait
PREFILL_CALL_S = 0.1  # the server's forward call at most this long where the measured prefill rate allows more than
                      # PREFILL_SHARED tokens: the running requests' wait for their next token (a new request starts
                      # between two layers of the call on the CPU engine, between calls elsewhere)
ENCODED_IMAGES = 16  # the tower's outputs kept by image digest (Engine._encode)


@dataclass
class Timings:
    load_s: float = 0.0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def summary(self) -> str:
        return (f"load {self.load_s:.2f} s | prefill {self.prefill_tokens} tok, {self.prefill_tps:.1f} tok/s | "
                f"decode {self.decode_tokens} tok, {self.decode_tps:.1f} tok/s")


@dataclass(frozen=True)
class PromptImages:
    """The images of a prompt: where their rows lie and the tower's merged embeddings for them, in order."""
    spans: tuple[ImageSpan, ...]
    embeddings: np.ndarray          # [sum of the spans' n_tokens, n_embd] f32


def image_rows(ids: list[int], images: PromptImages, n_embd: int, offset: int = 0) -> dict:
    """The forward arguments of a prompt with images: tokens (-1 at image rows), embd [n, n_embd] (the images' rows
    filled), M-RoPE positions [n, 3] from rope position `offset` (the state's position + its rope delta)."""
    toks = np.array(ids, dtype=np.int64)
    embd = np.zeros((len(ids), n_embd), np.float32)
    at = 0
    for s in images.spans:
        toks[s.start:s.end] = -1
        embd[s.start:s.end] = images.embeddings[at:at + s.n_tokens]
        at += s.n_tokens
    if at != len(images.embeddings):
        raise ValueError(f"{len(images.embeddings)} image embedding rows for spans of {at} tokens")
    return {"tokens": toks, "embd": embd, "positions": rope_positions(len(ids), list(images.spans), offset)}


def rope_delta_at(positions: np.ndarray, p: int) -> int:
    """The state's rope delta after rows [0, p) of a prompt with these positions (le_forward_embd's rule)."""
    return int(positions[:p].max()) + 1 - p if p else 0


@dataclass
class Generation:
    text: str
    tokens: list[int]
    finish_reason: str            # "stop" (EOS or stop string) or "length"
    timings: Timings = field(default_factory=Timings)


class Engine:
    """A model and its tokenizer. `Engine(path).session()` starts a conversation."""

    def __init__(self, path: str | os.PathLike, n_threads: int | None = None, n_ctx: int = DEFAULT_CTX,
                 mmap: bool = True, numa: str = "off", pin: bool = True, gpu: bool = False,
                 gpu_tier: str | None = None, gpu_int8: bool | None = None, gpu_graphs: bool | None = None,
                 gpu_vram: int | None = None, gpu_min_tokens: int | None = None, gpu_decode: str = "auto",
                 gpu_mma: bool | None = None, progress=None, check_tensors: bool = False,
                 mmproj: str | os.PathLike | None = None):
        """mmap, numa: where the weights live; pin: worker threads pinned; check_tensors: every weight's values
        scanned at load (Model's arguments of the same names).
        gpu: GPU-resident mode (gpu.model.GpuModel: the whole model in VRAM, prefill and decode on the GPU;
        gpu_tier 'fermi' | 'kepler' | 'dp4a' forces a kernel tier, gpu_int8 the DP4A decode GEMVs, gpu_graphs
        CUDA graphs for decode steps, gpu_mma the int8 prefill GEMMs on tensor cores; None = GpuModel's defaults; gpu_vram the VRAM budget in bytes, default
        free minus a margin: a model that does not fit runs split, planner.gpu_placement: experts streamed for GPU
        prefill of passes >= gpu_min_tokens, hot ones pinned; gpu_decode 'cpu', 'hybrid' (routed experts not pinned
        on the CPU, the rest on the GPU) or 'auto' (the planner's faster));
        `self.cpu_model` stays the CPU engine of the same file.
        mmproj: the vision projector GGUF of this model (llama.cpp's mmproj file): images in prompts
        (`prompt_images`); the tower on the CPU, or with gpu on the GPU where the planner puts it there
        (plan/vision.py: `self.vision_placement`, within the same VRAM budget)."""
        t0 = time.perf_counter()
        self.cpu_model = self.model = Model(path, n_threads, mmap=mmap, numa=numa, pin=pin,
                                            check_tensors=check_tensors)
        mm = None
        if mmproj is not None:
            mm = MmprojFile.open(mmproj)
            check_compatible(mm.hparams, self.cpu_model.hparams, mm.path)
        self.gpu = None
        self.placement = None
        self.vision_placement: VisionPlacement | None = None
        if gpu:
            opts = GpuOptions(tier=gpu_tier, int8=gpu_int8, graphs=gpu_graphs,
                              mma=None if gpu_mma is None or gpu_int8 is False else gpu_mma, progress=progress,
                              save_routing=functools.partial(planner.save_routing, self.cpu_model))
            budget, machine = planner.vram_budget(gpu_vram), None
            if mm is not None:     # the tower's place first: beside a split model, its VRAM comes out of the pins
                machine = measure(self.cpu_model.n_threads)
                self.vision_placement = vision_placement(self.cpu_model.file, mm.hparams, machine, budget, n_ctx,
                                                         planner.gpu_int8(opts))
            pl = self.placement = planner.gpu_placement(
                self.cpu_model, budget, n_ctx, opts, min_gpu_tokens=gpu_min_tokens, decode=gpu_decode,
                machine=machine, reserve=self.vision_placement.reserve if self.vision_placement else 0)
            self.gpu = self.model = GpuModel(self.cpu_model, pl, opts)
            if pl.stream:
                self.model = SplitModel(self.cpu_model, self.gpu, pl.min_gpu_tokens)
            import atexit
            atexit.register(self.gpu.flush_routing)   # routing statistics for the next run's pinned experts
        meta = self.model.file.metadata
        self.tokenizer = Tokenizer.from_metadata(meta)
        self.chat_template = meta.get("tokenizer.chat_template")
        self.template_source = f"the chat template of {os.path.basename(os.fspath(path))}"  # for its errors
        if n_ctx < 1:
            raise ValueError(f"n_ctx must be >= 1, got {n_ctx}")
        self.n_ctx = min(n_ctx, self.model.hparams.n_ctx_train)
        self.vision = self.vision_gpu = None
        self.vision_where = ""
        self._encoded: dict[str, np.ndarray] = {}     # image digest -> merged embeddings, oldest first
        if mm is not None:
            self.vision = VisionTower(mm, self.cpu_model.n_threads)
            v = mm.hparams     # the processor the tower was trained with, sized by this file
            self.image_config = ImageConfig(patch_size=v.patch_size, temporal_patch_size=v.temporal_patch,
                                            merge_size=v.merge, min_pixels=v.min_pixels, max_pixels=v.max_pixels,
                                            image_mean=v.image_mean, image_std=v.image_std)
            if self.vision_placement is None:
                self.vision_placement = cpu_vision_placement(v)
            self.vision_gpu = self._gpu_tower()
            self.vision_where = self.vision_placement.describe()
        self.load_s = time.perf_counter() - t0

    def session(self) -> "Session":
        return Session(self)

    def repin(self) -> bool:
        """Between requests: the planner re-chooses the GPU model's pinned experts where the routing counted since
        has drifted from them (planner.repin), and the GPU model applies the new placement. -> whether it did."""
        new = planner.repin(self.cpu_model.file, self.placement, self.gpu.recent_routes())
        if new is None:
            return False
        self.gpu.apply(new)
        self.placement = new
        return True

    def _gpu_tower(self) -> GpuVisionTower | None:
        """The planner's vision placement applied: the tower uploaded to the GPU where it chose the GPU (its VRAM
        kept free by the model's placement: Placement.reserved), else None (the CPU tower encodes)."""
        if self.vision_placement.where != "gpu":
            return None
        return GpuVisionTower(self.vision, self.gpu.k)

    def load_images(self, sources) -> list[ImageInput]:
        """Paths or bytes -> preprocessed images (format.image, the tower's patch and pixel limits)."""
        if self.vision is None:
            raise UnavailableError("images need the model's vision projector: load it with --mmproj FILE "
                                   "(llama.cpp's mmproj GGUF of this model)")
        return [load_image(s, self.image_config) for s in sources]

    def expand_images(self, ids: list[int], images: list[ImageInput]) -> tuple[list[int], list[ImageSpan]]:
        """ids with one <|image_pad|> per image (the chat template's) -> (ids with each pad widened to its image's
        tokens, the images' spans). FormatError when pads and images do not pair up."""
        pad = self.tokenizer.id_of("<|image_pad|>")
        if not images:
            if pad is not None and pad in ids:
                raise FormatError("the prompt holds <|image_pad|> but no image was given")
            return ids, []
        if self.vision is None:
            raise UnavailableError("images need the model's vision projector: load it with --mmproj FILE")
        if pad is None:
            raise FormatError("this model's vocabulary has no <|image_pad|> token: it takes no images")
        return expand_pads(ids, pad, images, self.vision.hparams.merge)

    def encode_images(self, spans: list[ImageSpan], images: list[ImageInput]) -> PromptImages | None:
        """The tower's merged embeddings of a prompt's images (expand_images' spans): None without images."""
        if not images:
            return None
        return PromptImages(tuple(spans), np.concatenate([self._encode(img) for img in images]))

    def forget_images(self) -> None:
        """Drops the tower's cached encodes: the next prompt's images are encoded again (a benchmark's repeats)."""
        self._encoded.clear()

    def _encode(self, img: ImageInput) -> np.ndarray:
        # the tower's output by the image's pixel hash: a repeated image (a conversation's earlier turns, a cached
        # prompt) is not encoded again
        out = self._encoded.pop(img.digest, None)
        if out is None:
            out = (self.vision_gpu or self.vision).encode(img)
        self._encoded[img.digest] = out
        while len(self._encoded) > ENCODED_IMAGES:
            self._encoded.pop(next(iter(self._encoded)))
        return out

    def chat_prompt(self, messages: list[dict], enable_thinking: bool = True, tools=None) -> str:
        return render_chat(messages, self.chat_template, add_generation_prompt=True,
                           enable_thinking=enable_thinking, tools=tools, source=self.template_source)

    def chat_text(self, messages: list[dict], enable_thinking: bool = True, tools=None,
                  special_in_user_text: bool = False, render=render_chat) -> tuple[str, list[tuple[int, int]]]:
        """(prompt, literal) for tokenizer.encode_prompt: control tokens then come only from the template's markup,
        user text that spells one (<|im_start|>) is tokenized as text (chat.render_prompt), unless
        special_in_user_text. render: render_chat or a TemplateRenderer's render."""
        specials = () if special_in_user_text else self.tokenizer.control_tokens
        return render_prompt(messages, self.chat_template, specials, render=render, add_generation_prompt=True,
                             enable_thinking=enable_thinking, tools=tools, source=self.template_source)


class Session:
    """One sequence: the tokens seen so far and the model state after them."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.state = engine.model.new_state(engine.n_ctx)
        self.tokens: list[int] = []
        self.timings = Timings(load_s=engine.load_s)

    @property
    def pos(self) -> int:
        return self.state.pos

    def reset(self) -> None:
        self.state.reset()
        self.tokens = []

    def _run(self, ids: list[int], run):
        """run() on the session's state for ids, after checking them (refused before anything runs: the session
        keeps its state); a failed run may have updated some layers: the state is no longer trusted, it is reset."""
        n_vocab = self.engine.model.hparams.n_vocab
        bad = [t for t in ids if not (isinstance(t, (int, np.integer)) and 0 <= t < n_vocab)]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is outside the vocabulary [0, {n_vocab})")
        try:
            return run()
        except EngineError:
            self.reset()
            raise

    def _forward(self, ids: list[int], all_logits: bool, chunked: bool, rows: dict | None = None) -> np.ndarray:
        """rows: an image pass's forward arguments (tokens with -1 at image rows, embd, positions)."""
        def run():
            kw = dict(rows or {"tokens": ids})       # the image rows' embd and positions, when there are
            out = self.engine.model.forward(self.state, kw.pop("tokens"), all_logits=all_logits, chunked=chunked, **kw)
            if self.engine.model is not self.engine.cpu_model:   # Model.forward checks its own rows
                check_logits(out, self.state.pos - out.shape[0])
            return out
        return self._run(ids, run)

    def image_rows(self, ids: list[int], images: PromptImages) -> dict:
        """image_rows of ids after what the session holds (its rope position)."""
        return image_rows(ids, images, self.engine.cpu_model.hparams.n_embd, self.state.pos + self.state.rope_delta)

    def prefill(self, ids: list[int], all_logits: bool = False, chunked: bool = True,
                cancel: Callable[[], bool] | None = None, images: PromptImages | None = None,
                step: Callable[[], int] | None = None) -> np.ndarray:
        """Runs ids after what the session holds. Returns logits of the last token
        (float32[n_vocab]) or of every token ([n, n_vocab]) when all_logits. cancel() is asked before each
        forward call; True raises Cancelled, the session then holds the chunks already run. step() (asked after
        cancel) gives the next call's length, a multiple of 64 (default PREFILL_BATCH: the server asks
        PREFILL_SHARED while other requests wait).
        images: the prompt's images (Engine.prompt_images: ids already widened)."""
        if not ids:
            raise ValueError("empty prompt: nothing to run")
        if self.pos + len(ids) > self.state.n_ctx:
            raise ContextLengthError(f"{len(ids)} tokens after {self.pos} exceed the context of "
                                     f"{self.state.n_ctx} tokens (raise --ctx, up to the model's "
                                     f"{self.engine.model.hparams.n_ctx_train})")
        t0 = time.perf_counter()
        outs = []
        rows = self.image_rows(ids, images) if images is not None else None
        i = 0
        while i < len(ids):
            if cancel is not None and cancel():
                raise Cancelled(f"prefill cancelled after {i} of {len(ids)} tokens")
            size = step() if step is not None else PREFILL_BATCH
            part = ids[i:i + size]
            last = i + size >= len(ids)
            chunk = {k: v[i:i + size] for k, v in rows.items()} if rows else None
            out = self._forward(part, all_logits=all_logits, chunked=chunked, rows=chunk)
            if all_logits or last:
                outs.append(out)
            self.tokens += part
            i += size
        self.timings.prefill_tokens += len(ids)
        self.timings.prefill_s += time.perf_counter() - t0
        return np.concatenate(outs) if all_logits else outs[-1][0]

    def _step(self, token: int, run):
        """One token after what the session holds: run() -> its result, the context checked before, the token
        kept and timed after."""
        if self.pos + 1 > self.state.n_ctx:
            raise ContextLengthError(f"the context of {self.state.n_ctx} tokens is full")
        t0 = time.perf_counter()
        out = run()
        self.tokens.append(token)
        self.timings.decode_tokens += 1
        self.timings.decode_s += time.perf_counter() - t0
        return out

    def decode(self, token: int) -> np.ndarray:
        """One token through the recurrent path -> logits float32[n_vocab]."""
        return self._step(token, lambda: self._forward([token], all_logits=False, chunked=False))[0]

    def decode_next(self, token: int, sampler: Sampler) -> int:
        """decode(token), then sampler's draw from its logits -> the next token. A model with sample_next (the GPU
        engines) draws where the logits are, without the whole row crossing the link (the same token)."""
        step = getattr(self.engine.model, "sample_next", None)
        if step is None:
            return sampler.sample(self.decode(token), self.tokens)
        return self._step(token, lambda: self._run([token], lambda: step(self.state, token, sampler,
                                                                           self.tokens + [token])))

    def stream(self, prompt: str | list[int], max_tokens: int = 128, params: SamplingParams | None = None,
               stop: list[str] | None = None, result: list | None = None,
               images: list[ImageInput] | None = None) -> Iterator[str]:
        """Yields text pieces as they are generated. A Generation is appended to `result`
        when given. Stops at an EOS token or a stop string (not included): finish "stop";
        at max_tokens or a full context: finish "length". images: one per <|image_pad|> of the prompt, in order
        (Engine.load_images)."""
        tok = self.engine.tokenizer
        ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
        ids, spans = self.engine.expand_images(ids, images or [])
        prompt_images = self.engine.encode_images(spans, images or [])
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        sampler = Sampler(params, model=self.engine.cpu_model)   # its pool: idle between forwards (and on a GPU)
        stop = [s for s in (stop or []) if s]
        logits = self.prefill(ids, images=prompt_images)
        decoder = tok.stream()
        text, pending, out_ids, finish, stopped_by_string = "", "", [], "length", False
        hold = max((len(s) for s in stop), default=1) - 1
        t = sampler.sample(logits, self.tokens) if max_tokens > 0 else None
        for i in range(max_tokens):
            out_ids.append(t)
            if t in tok.eos_ids:
                finish = "stop"
                break
            pending += decoder.push(t)
            cut = min((pending.find(s) for s in stop if s in pending), default=-1)
            if cut >= 0:
                pending, finish, stopped_by_string = pending[:cut], "stop", True
                break
            if len(pending) > hold:  # emit what can no longer start a stop string
                emit, pending = pending[:len(pending) - hold], pending[len(pending) - hold:]
                text += emit
                yield emit
            if self.pos >= self.state.n_ctx:  # the context is full: stop like max_tokens does
                break
            if i + 1 < max_tokens:
                t = self.decode_next(t, sampler)
            else:  # the last sampled token still enters the state, so the session can continue
                self.decode(t)
        if not stopped_by_string:
            pending += decoder.flush()
        if pending:
            text += pending
            yield pending
        if result is not None:
            result.append(Generation(text, out_ids, finish, self.timings))
        if self.engine.gpu is not None:   # between requests: the pinned experts follow the routing's drift
            self.engine.repin()

    def generate(self, prompt: str | list[int], max_tokens: int = 128, params: SamplingParams | None = None,
                 stop: list[str] | None = None, on_text: Callable[[str], None] | None = None,
                 images: list[ImageInput] | None = None) -> Generation:
        result: list[Generation] = []
        for piece in self.stream(prompt, max_tokens, params, stop, result, images):
            if on_text:
                on_text(piece)
        return result[0]


def _batches(model) -> bool:
    """Whether the server's decode step runs one pass for every sequence on this model."""
    return (getattr(model, "forward_batch", None) is not None and getattr(model, "can_batch", True)
            and getattr(model, "serve_batched", True))


def batched_decode(engine: Engine, force: bool = False) -> Callable[[list[Session], list[int], list], list[int]]:
    """decode(sessions, tokens, samplers) -> the next token of each session: every token run after what its session
    holds, then its sampler's draw. One pass for all of them where the model has forward_batch (the CPU engine and
    the split engine's CPU decode: each weight row read once for all sequences, each sequence's logits the bits of
    decoding it alone; the GPU-resident model: within the quantised gate); otherwise one session after another
    (batched_decode_mode says which). force: the batched pass wherever the model has one (tests, benchmarks: the
    GPU-resident model's is correct but not yet faster, GpuModel.serve_batched)."""
    m = engine.model
    fwd = m.forward_batch if _batches(m) or (force and getattr(m, "can_batch", False)) else None
    if fwd is None:
        return lambda sessions, tokens, samplers: [  # a constrained draw needs the whole row (needs_row)
            smp.sample(s.decode(t), s.tokens) if getattr(smp, "needs_row", False) else s.decode_next(t, smp)
            for s, t, smp in zip(sessions, tokens, samplers)]

    def decode(sessions: list[Session], tokens: list[int], samplers: list) -> list[int]:
        for s in sessions:
            if s.pos + 1 > s.state.n_ctx:
                raise ContextLengthError(f"the context of {s.state.n_ctx} tokens is full")
        t0 = time.perf_counter()
        try:
            logits = fwd([s.state for s in sessions], [[int(t)] for t in tokens], chunked=False)
        except EngineError:     # a failed pass may have updated some layers of any of them: none is trusted
            for s in sessions:
                s.reset()
            raise
        dt = time.perf_counter() - t0
        out = []
        for s, t, smp, row in zip(sessions, tokens, samplers, logits):
            s.tokens.append(int(t))
            s.timings.decode_tokens += 1
            s.timings.decode_s += dt
            out.append(smp.sample(row, s.tokens))
        return out
    return decode


def batched_decode_mode(engine: Engine) -> str:
    """What batched_decode does with this engine, in words (info, /metrics, serve's banner)."""
    if _batches(engine.model):
        return "batched: one pass for every running sequence"
    if getattr(engine.model, "can_batch", False):
        return ("sequential: one pass per sequence (the GPU's batched pass is not yet launched as a CUDA graph: "
                "slower than one graph per sequence)")
    return "sequential: one pass per sequence (this engine has no batched pass yet)"
