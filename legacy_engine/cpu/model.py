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

# GGUF tensor suffix -> C weight slot, per layer (spec §3.3)
LAYER_SLOTS = {
    "attn_norm.weight": "LE_W_ATTN_NORM", "post_attention_norm.weight": "LE_W_POST_NORM",
    "attn_gate.weight": "LE_W_GDN_GATE", "ssm_conv1d.weight": "LE_W_SSM_CONV", "ssm_dt.bias": "LE_W_SSM_DT",
    "ssm_a": "LE_W_SSM_A", "ssm_beta.weight": "LE_W_SSM_BETA", "ssm_alpha.weight": "LE_W_SSM_ALPHA",
    "ssm_norm.weight": "LE_W_SSM_NORM", "ssm_out.weight": "LE_W_SSM_OUT",
    "attn_q.weight": "LE_W_Q", "attn_k.weight": "LE_W_K", "attn_v.weight": "LE_W_V",
    "attn_output.weight": "LE_W_O", "attn_q_norm.weight": "LE_W_Q_NORM", "attn_k_norm.weight": "LE_W_K_NORM",
    "ffn_gate.weight": "LE_W_FFN_GATE", "ffn_up.weight": "LE_W_FFN_UP", "ffn_down.weight": "LE_W_FFN_DOWN",
    "ffn_gate_inp.weight": "LE_W_GATE_INP", "ffn_gate_exps.weight": "LE_W_GATE_EXPS",
    "ffn_up_exps.weight": "LE_W_UP_EXPS", "ffn_down_exps.weight": "LE_W_DOWN_EXPS",
    "ffn_gate_inp_shexp.weight": "LE_W_GATE_INP_SHEXP", "ffn_gate_shexp.weight": "LE_W_GATE_SHEXP",
    "ffn_up_shexp.weight": "LE_W_UP_SHEXP", "ffn_down_shexp.weight": "LE_W_DOWN_SHEXP",
}
GLOBAL_SLOTS = {"token_embd.weight": "LE_W_TOKEN_EMBD", "output_norm.weight": "LE_W_OUTPUT_NORM",
                "output.weight": "LE_W_OUTPUT"}

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


# le_hparams field -> the GGUF key (after "{arch}.") it comes from, for error messages
HPARAM_KEYS = {"n_layer": "block_count", "n_embd": "embedding_length", "n_head": "attention.head_count",
               "n_head_kv": "attention.head_count_kv", "head_dim": "attention.key_length",
               "n_rot": "rope.dimension_count", "ssm_conv_kernel": "ssm.conv_kernel", "ssm_d_state": "ssm.state_size",
               "ssm_n_group": "ssm.group_count", "ssm_dt_rank": "ssm.time_step_rank", "ssm_d_inner": "ssm.inner_size",
               "n_ff": "feed_forward_length", "n_expert": "expert_count", "n_expert_used": "expert_used_count",
               "n_ff_exp": "expert_feed_forward_length", "n_ff_shexp": "expert_shared_feed_forward_length"}


def native_hparams(hp, faults: dict | None = None) -> dict:
    """The le_hparams fields of a file's hyperparameters; FormatError for a value no C int holds (a hostile
    file: n_vocab = 2**31 rows of token_embd.weight, say), before anything reaches the C core."""
    c = dict(n_layer=hp.n_layer, n_embd=hp.n_embd, n_vocab=hp.n_vocab, n_head=hp.n_head,
             n_head_kv=hp.n_head_kv, head_dim=hp.head_dim, n_rot=hp.n_rot, rope_theta=hp.rope_theta,
             rms_eps=hp.rms_eps, ssm_conv_kernel=hp.ssm_conv_kernel, ssm_d_state=hp.ssm_d_state,
             ssm_n_group=hp.ssm_n_group, ssm_dt_rank=hp.ssm_dt_rank, ssm_d_inner=hp.ssm_d_inner,
             gdn_tiled=0 if (faults or {}).get("gdn_grouped") else 1, n_ff=hp.n_ff, n_expert=hp.n_expert,
             n_expert_used=hp.n_expert_used, n_ff_exp=hp.n_ff_exp, n_ff_shexp=hp.n_ff_shexp,
             faults=_native.fault_bits(faults or {}))
    for k, v in c.items():
        if isinstance(v, int) and not 0 <= v <= _native.INT_MAX:
            src = "rows of token_embd.weight" if k == "n_vocab" else f"{hp.arch}.{HPARAM_KEYS.get(k, k)}"
            raise FormatError(f"{k} = {v} ({src}) is more than this engine handles ({_native.INT_MAX}, a C int)")
    return c


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

    def _set(self, layer: int, slot: str, name: str, rows: tuple[int, int] | None = None, nb2: int = 0,
             ne1: int | None = None) -> None:
        t = self.file.tensors[name]
        ne = list(t.ne) + [1] * (3 - len(t.ne))
        while len(ne) > 3 and ne[-1] == 1:
            ne.pop()
        offset = 0
        if rows is not None:  # a row range of a fused tensor
            row_bytes = t.n_bytes // (ne[1] * ne[2])
            offset = rows[0] * row_bytes
            ne[1] = rows[1] - rows[0]
        if ne1 is not None:
            ne[1] = ne1
        self.native.set_weight(layer, slot, self.file.gguf.data(name), t.type, ne[0], ne[1], ne[2], nb2, offset,
                               what=name)

    def _set_weights(self) -> None:
        hp, tensors = self.hparams, self.file.tensors
        for name, slot in GLOBAL_SLOTS.items():
            if name in tensors:
                self._set(-1, slot, name)
        for i in range(hp.n_layer):
            p = f"blk.{i}."
            for suffix, slot in LAYER_SLOTS.items():
                if p + suffix in tensors:
                    self._set(i, slot, p + suffix)
            if hp.recurrent[i]:
                self._set(i, "LE_W_GDN_QKV", p + "attn_qkv.weight")
            elif p + "attn_qkv.weight" in tensors:  # fused Q+gate | K | V of an attention layer
                q = 2 * hp.n_head * hp.head_dim
                kv = hp.n_head_kv * hp.head_dim
                self._set(i, "LE_W_Q", p + "attn_qkv.weight", rows=(0, q))
                self._set(i, "LE_W_K", p + "attn_qkv.weight", rows=(q, q + kv))
                self._set(i, "LE_W_V", p + "attn_qkv.weight", rows=(q + kv, q + 2 * kv))
            if p + "ffn_gate_up_exps.weight" in tensors:  # fused gate|up experts: rows [0,ff) gate, [ff,2ff) up
                name = p + "ffn_gate_up_exps.weight"
                t = tensors[name]
                ff = hp.n_ff_exp
                stride = t.n_bytes // hp.n_expert
                self._set(i, "LE_W_GATE_EXPS", name, rows=(0, ff), nb2=stride)
                self._set(i, "LE_W_UP_EXPS", name, rows=(ff, 2 * ff), nb2=stride)

    def new_state(self, n_ctx: int = DEFAULT_CTX) -> _native.NativeState:
        if not 1 <= n_ctx <= _native.INT_MAX:
            raise ContextLengthError(f"a context of {n_ctx} tokens: this engine's contexts hold 1..{_native.INT_MAX}")
        return _native.NativeState(self.native, n_ctx)

    def forward(self, state: _native.NativeState, tokens, all_logits: bool = False, chunked: bool = True,
                want_logits: bool = True) -> np.ndarray | None:
        """tokens: int[n] at positions state.pos.. -> logits float32[n or 1, n_vocab].
        FormatError when a returned row is not finite (check_logits); the state has advanced then."""
        out = _native.forward(self.native, state, tokens, self.hparams.n_vocab, all_logits, chunked, want_logits)
        if out is not None:
            check_logits(out, state.pos - out.shape[0])
        return out
