"""A Qwen3.5/3.6 GGUF loaded into the C core: weights stay in the memory map.

`Model(path)` validates the file (gguf_model.ModelFile), hands every weight to the C
core as a pointer into the map (no copy), and creates sequence states. `forward` runs
tokens through the model and returns logits, and raises when a returned row is not finite.
`Model(path, mmap=False)` reads the weights into anonymous memory instead, and `numa=`
places their pages (GGUFFile.load_data); `check_tensors=True` scans every weight's scales
and values first (gguf_model.check_tensor_values).
"""
from __future__ import annotations

import os

import numpy as np

from ..core import _native
from . import cpu_load
from .threads import default_threads, pin_decision
from ..core.errors import ContextLengthError, FormatError, UnavailableError
from ..format.gguf_model import ModelFile, check_tensor_values
from ..format.schema import Weight, native_hparams, weights

DEFAULT_CTX = 4096
MAX_THREADS = 1024     # native/threads.c's pool


def parse_numa(value: str | None) -> tuple[str, int]:
    """--numa's value -> (mode, node): 'off' | None -> ('off', -1), 'interleave' -> ('interleave', -1),
    'node:N' -> ('node', N). ValueError for anything else."""
    v = "off" if value is None else str(value).strip().lower()
    if v in ("off", "interleave"):
        return v, -1
    if v.startswith("node:"):
        n = v[5:]
        if n.isdigit():
            return "node", int(n)
    raise ValueError(f"numa={value!r}: expected 'interleave', 'node:N' (N a node number, e.g. node:0) or 'off'")


def check_logits(logits: np.ndarray, first_pos: int) -> None:
    """FormatError when a row of logits (row i at position first_pos + i) holds NaN or inf: bad weights
    (or an overflow they cause) would otherwise run on silently. ~30 us per 248k-entry row.
    What it cannot see: the integer kernels quantise activations with a max that skips NaN, so a NaN
    born before a quantised matmul (a NaN scale in a Q4_K block, say) leaves finite, wrong logits on the
    int8 path; check_tensor_values (--check-tensors) finds those weights."""
    if np.isfinite(logits).all():
        return
    row = int(np.argmax(~np.isfinite(logits).all(axis=-1)))
    raise FormatError(f"the model produced non-finite logits at position {first_pos + row}; run with "
                      f"--check-tensors (Model(check_tensors=True)) to find a bad tensor")


class Model:
    def __init__(self, path: str | os.PathLike, n_threads: int | None = None, mmap: bool = True,
                 numa: str = "off", pin: bool | str = True, check_tensors: bool = False, _faults: dict | None = None):
        """n_threads: default one per physical core (default_threads).
        mmap: weights in the file's memory map (True) or read into anonymous memory (False).
        numa: 'off', 'interleave' (weight pages over every NUMA node) or 'node:N' (all on node N);
        ValueError for another value, UnavailableError without libnuma or for a node this machine
        lacks. `load_report` says what the kernel did (huge pages, where the pages are).
        pin: pin worker thread i to pin_order()[i] (the calling thread, thread 0, stays free: it is the
        application's) where no other work runs on the CPUs at load (pin_decision; 'always': regardless);
        `pinned` lists the CPU of each thread (-1: not pinned), `pin_why` and load_report say why.
        check_tensors: scan every tensor's scales and values once loaded (check_tensor_values; ~0.1 s
        per GiB in the page cache): FormatError naming the first non-finite one;
        `tensor_check` holds the scan's report (None when not asked for).
        _faults (tests only): inject known bugs for negative controls, e.g.
        {"rope_interleaved": True, "no_topk_renorm": True, "gdn_grouped": True}."""
        numa_mode, numa_node = parse_numa(numa)
        self.n_threads = n_threads or default_threads()
        if not 1 <= self.n_threads <= MAX_THREADS:
            raise ValueError(f"n_threads = {self.n_threads}, expected 1..{MAX_THREADS}")
        self.faults = dict(_faults or {})   # the GPU engine (legacy_engine/gpu) injects the same ones
        self.file = ModelFile.open(path)
        hp = self.hparams = self.file.hparams
        if hp.arch == "qwen3next":
            raise UnavailableError("the forward pass for qwen3next (fused ssm_in/ssm_ba) is not implemented; "
                                   "qwen35 and qwen35moe files run")
        try:
            c = native_hparams(hp, _faults)
        except FormatError as e:
            raise FormatError(f"{self.file.path}: {e}") from None
        # before any weight view is taken: the views point into wherever the data now lives,
        # and keep it alive as long as the C model holds them (NativeModel.keep)
        self.load_report = self.file.gguf.load_data(mmap=mmap, numa=numa_mode, node=numa_node)
        self.tensor_check = check_tensor_values(self.file.gguf) if check_tensors else None
        self.native = _native.NativeModel(c, list(hp.recurrent), hp.rope_sections, self.n_threads)
        self._set_weights()
        self.native.finalize()
        # other work on the CPUs (cpu_load) decides whether to pin (issue 21)
        self.cpu_load = cpu_load.current() if pin is True and self.n_threads > 1 else None
        order, self.pin_why = pin_decision(pin, self.n_threads, self.cpu_load)
        if order:
            self.native.pin_threads(order)
        self.pinned = self.native.pinned_cpus(self.n_threads)
        self.load_report.update(threads=self.n_threads, pinning=self.pin_why,
                                cpu_load=self.cpu_load.as_dict() if self.cpu_load else None)

    def _set(self, layer: int, w: Weight) -> None:
        """Hands slot w of `layer` to the C core: the tensor's bytes in the map, or a row range of a fused one
        (inside every expert of a 3-D one: the experts keep their stride)."""
        t = self.file.tensors[w.tensor]
        ne = list(t.ne) + [1] * (3 - len(t.ne))
        while len(ne) > 3 and ne[-1] == 1:
            ne.pop()
        offset, nb2 = 0, 0
        if w.rows is not None:
            row_bytes = t.n_bytes // (ne[1] * ne[2])
            offset = w.rows[0] * row_bytes
            nb2 = t.n_bytes // ne[2] if ne[2] > 1 else 0
            ne[1] = w.rows[1] - w.rows[0]
        self.native.set_weight(layer, w.slot_id, self.file.gguf.data(w.tensor), t.type, ne[0], ne[1], ne[2], nb2,
                               offset, what=w.tensor)

    def _set_weights(self) -> None:
        # every slot of every layer from the tensor the schema names (format/schema.py)
        for layer in range(-1, self.hparams.n_layer):
            for w in weights(self.hparams, layer, self.file.tensors):
                self._set(layer, w)

    def new_state(self, n_ctx: int = DEFAULT_CTX) -> _native.NativeState:
        if not 1 <= n_ctx <= _native.INT_MAX:
            raise ContextLengthError(f"a context of {n_ctx} tokens: this engine's contexts hold 1..{_native.INT_MAX}")
        return _native.NativeState(self.native, n_ctx)

    def forward(self, state: _native.NativeState, tokens, all_logits: bool = False, chunked: bool = True,
                want_logits: bool = True, embd: np.ndarray | None = None,
                positions: np.ndarray | None = None) -> np.ndarray | None:
        """tokens: int[n] at positions state.pos.. -> logits float32[n or 1, n_vocab].
        embd, positions (images): rows [n, n_embd] that replace the tokens marked -1, and M-RoPE positions [n, 3]
        (format/multimodal.py); _native.forward says more.
        FormatError when a returned row is not finite (check_logits); the state has advanced then."""
        out = _native.forward(self.native, state, tokens, self.hparams.n_vocab, all_logits, chunked, want_logits,
                              embd, positions)
        if out is not None:
            check_logits(out, state.pos - out.shape[0])
        return out

    def set_yield(self, hook):
        """hook() runs between two layers of a forward() call once the returned object's wake() was called (from any
        thread): a server starts a new request's prompt inside a long prompt's call (le_model_set_yield says what
        the hook may run). None: off. An exception of the hook is raised by that forward() after its pass."""
        return self.native.set_yield(hook)

    def clear_yield(self, y) -> None:
        """Turns the hook off if `y` (what set_yield returned) is still the one set (another may have replaced it)."""
        if self.native._yield is y:
            self.native.set_yield(None)

    def forward_batch(self, states: list[_native.NativeState], token_lists, chunked: bool = True) -> np.ndarray:
        """One pass advancing several sequences: states[s] (distinct) runs token_lists[s] (int[n_s], n_s >= 1) at
        positions states[s].pos.. -> logits float32[n_seq, n_vocab], row s the last token's of sequence s. Each
        weight row is read once for all of them (batched decode; a prefill chunk may ride along); row s and
        states[s] afterwards equal forward(states[s], token_lists[s], chunked=chunked) bit for bit.
        ValueError / ContextLengthError before anything runs (_native.forward_seqs); FormatError when a row is not
        finite (check_logits; the states have advanced then)."""
        out = _native.forward_seqs(self.native, states, token_lists, self.hparams.n_vocab, chunked)
        if not np.isfinite(out).all():      # the first bad row, named by its sequence's position
            for s, st in enumerate(states):
                check_logits(out[s:s + 1], st.pos - 1)
        return out

