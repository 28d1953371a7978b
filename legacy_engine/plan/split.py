"""The split engine: long prompts prefilled on the GPU, everything else (decode, short prompts) on the CPU.

`SplitModel` has Model's interface (file, hparams, new_state, forward), so Engine, Session, the snapshot cache and
the server use it unchanged. States are CPU states (NativeState); a pass of at least `min_gpu_tokens` tokens moves
the sequence to a GpuState (GpuState.from_cpu: GDN states and the KV rows so far), runs there and moves it back
(to_cpu), so the CPU decodes from exactly what the GPU computed. The GPU model is usually a streamed one (its
Placement streams the routed experts: copied from host RAM per layer, hot ones pinned in VRAM), which is how a 35B
MoE prefills on a 6 GB card; the planner chooses min_gpu_tokens (the prompt length where the GPU, copies included,
beats the CPU).

With a hybrid GPU model (its Placement's decode "hybrid") the sequence lives on the GPU: states are GpuStates, passes of
>= min_gpu_tokens run streamed there, shorter ones (decode steps included) run token by token as hybrid decode
steps (attention, GDN, shared and pinned experts on the GPU; the other routed experts on the CPU).
"""
from __future__ import annotations

import numpy as np


class SplitModel:
    def __init__(self, cpu_model, gpu_model, min_gpu_tokens: int = 32):
        """cpu_model: Model; gpu_model: GpuModel of the same file; passes of >= min_gpu_tokens go to the GPU."""
        if gpu_model.model is not cpu_model and gpu_model.file.gguf.path != cpu_model.file.gguf.path:
            raise ValueError("the GPU model was made from another file")
        if min_gpu_tokens < 1:
            raise ValueError(f"min_gpu_tokens = {min_gpu_tokens}")
        self.cpu, self.gm = cpu_model, gpu_model
        self.file, self.hparams = cpu_model.file, cpu_model.hparams
        self.min_gpu_tokens = int(min_gpu_tokens)
        self._gst = None
        self.hybrid = bool(getattr(gpu_model, "cpu_experts", False))     # the placement's hybrid decode
        self.passes = {"gpu": 0, "cpu": 0, "hybrid": 0}

    @property
    def forward_batch(self):
        """Model.forward_batch of the CPU engine where the states are CPU states (the stream placement: decode runs on
        the CPU, B sequences in one pass); None with the hybrid decode (GPU states: one sequence per pass)."""
        return None if self.hybrid else getattr(self.cpu, "forward_batch", None)

    def new_state(self, n_ctx: int):
        return self.gm.new_state(n_ctx) if self.hybrid else self.cpu.new_state(n_ctx)

    def _gpu_state(self, n_ctx: int):
        if self._gst is None or self._gst.n_ctx < n_ctx:
            self._gst = None                               # free the smaller one first (budget)
            self._gst = self.gm.new_state(n_ctx)
        return self._gst

    def forward(self, state, tokens, all_logits: bool = False, chunked: bool = True,
                want_logits: bool = True, embd: np.ndarray | None = None,
                positions: np.ndarray | None = None) -> np.ndarray | None:
        """Model.forward; the pass runs on the GPU when it has >= min_gpu_tokens tokens. embd, positions: an image
        pass's rows and M-RoPE positions (Model.forward); the rope delta crosses with the state."""
        img = {"embd": embd, "positions": positions}
        if self.hybrid:
            return self._forward_hybrid(state, tokens, all_logits, want_logits, img)
        ids = np.asarray(tokens)
        if ids.ndim == 1 and ids.size >= self.min_gpu_tokens:
            if state.pos + ids.size > state.n_ctx:
                raise ValueError(f"{ids.size} tokens at position {state.pos} exceed the context of {state.n_ctx}")
            gst = self._gpu_state(state.n_ctx)
            gst.from_cpu(state)
            pos0 = state.pos
            out = self.gm.forward(gst, ids, all_logits=all_logits, want_logits=want_logits, **img)
            gst.to_cpu_rows(state, pos0, ids.size)    # back: the recurrent states and the KV rows this pass wrote
            self.passes["gpu"] += 1
            return out
        self.passes["cpu"] += 1
        return self.cpu.forward(state, tokens, all_logits, chunked, want_logits, **img)

    def _forward_hybrid(self, state, tokens, all_logits: bool, want_logits: bool, img: dict) -> np.ndarray | None:
        ids = np.asarray(tokens)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError("tokens: a non-empty 1-D sequence of ids")
        if ids.size >= self.min_gpu_tokens:
            self.passes["gpu"] += 1
            return self.gm.forward(state, ids, all_logits=all_logits, want_logits=want_logits, **img)
        if state.pos + ids.size > state.n_ctx:      # checked before the first step: nothing runs
            raise ValueError(f"{ids.size} tokens at position {state.pos} exceed the context of {state.n_ctx}")
        outs = []
        for j in range(ids.size):
            last = j == ids.size - 1
            row = {k: None if v is None else v[j:j + 1] for k, v in img.items()}
            out = self.gm.forward(state, ids[j:j + 1], want_logits=want_logits and (all_logits or last), **row)
            self.passes["hybrid"] += 1
            if out is not None:
                outs.append(out)
        if not want_logits:
            return None
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    def sample_next(self, state, token: int, sampler, history: list[int] | None) -> int:
        """forward(state, [token]) and the sampler's draw (GpuModel.sample_next for a hybrid decode step: the
        logits stay in VRAM)."""
        if self.hybrid:
            if state.pos + 1 > state.n_ctx:
                raise ValueError(f"1 token at position {state.pos} exceeds the context of {state.n_ctx}")
            self.passes["hybrid"] += 1
            return self.gm.sample_next(state, token, sampler, history)
        return sampler.sample(self.forward(state, [token])[0], history)

    def describe(self) -> str:
        if self.hybrid:
            return (f"split: passes of >= {self.min_gpu_tokens} tokens streamed on the {self.gm.describe()}; decode "
                    f"and shorter passes hybrid (routed experts not pinned on the CPU, {self.cpu.n_threads} threads)")
        return (f"split: passes of >= {self.min_gpu_tokens} tokens on the {self.gm.describe()}; decode and shorter "
                f"passes on the CPU ({self.cpu.n_threads} threads)")
