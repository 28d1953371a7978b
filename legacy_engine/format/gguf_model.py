"""Qwen3.5 / Qwen3.6 / Qwen3-Next models in GGUF files: hyperparameters, the tensor
schema of each architecture, and strict validation against it.

`ModelFile(path)` opens a GGUF (structurally validated by gguf_file), reads the
hyperparameters (spec §3.2), and checks that every tensor the architecture needs is
present with the expected shape (spec §3.3: the schema of format/schema.py, the C core's
table). The same schema (`expected_tensors`) is what make-model writes, so the writer and
the reader cannot disagree.

`check_tensor_values` (--check-tensors) reads every tensor once more: the f16 scales of every
quantised block and every value of f32/f16/bf16 tensors must be finite (llama.cpp's
--check-tensors does the same); the first bad tensor and block are a FormatError.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..core.errors import FormatError
from .gguf_file import PROGRESS_MIN_BYTES, GGUFFile, TensorInfo
from .schema import ARCHITECTURES, groups

MOE_ARCHITECTURES = ("qwen35moe", "qwen3next")


@dataclass(frozen=True)
class Hparams:
    """Hyperparameters of one model, named as in the spec (§1.3 derived ones as properties)."""
    arch: str
    n_layer_all: int          # block_count (includes MTP layers)
    n_nextn: int              # nextn_predict_layers (MTP), not run
    n_ctx_train: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int             # attention key_length
    head_dim_v: int           # attention value_length
    rms_eps: float
    rope_theta: float
    n_rot: int                # rotary dims (partial RoPE)
    rope_sections: tuple[int, int, int, int]
    ssm_conv_kernel: int      # K
    ssm_d_state: int          # d_k
    ssm_n_group: int          # H_k
    ssm_dt_rank: int          # H_v
    ssm_d_inner: int          # H_v * d_v
    recurrent: tuple[bool, ...]   # per layer to run: True = Gated DeltaNet, False = full attention
    n_vocab: int
    n_ff: int = 0             # dense FFN width (0 for MoE)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    tied_embeddings: bool = False

    @property
    def n_layer(self) -> int:
        """Layers to run = block_count - nextn_predict_layers."""
        return self.n_layer_all - self.n_nextn

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    @property
    def d_v(self) -> int:
        return self.ssm_d_inner // self.ssm_dt_rank

    @property
    def key_dim(self) -> int:
        return self.ssm_n_group * self.ssm_d_state

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.ssm_d_inner

    def summary(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["recurrent"] = "".join("L" if r else "F" for r in self.recurrent)
        d["n_layer"] = self.n_layer
        return d


def meta_value(meta: dict, path: str, key: str, kind, default=None, required=True):
    """meta[key] as int/float/list, or default; FormatError naming the key otherwise."""
    if key not in meta:
        if required and default is None:
            raise FormatError(f"{path}: required key {key!r} is missing")
        return default
    v = meta[key]
    if kind is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise FormatError(f"{path}: key {key!r} should be an integer, found {v!r:.60}")
        if v < 0:
            raise FormatError(f"{path}: key {key!r} = {v} should not be negative")
    elif kind is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise FormatError(f"{path}: key {key!r} should be a number, found {v!r:.60}")
        v = float(v)
    elif kind is list:
        if not isinstance(v, list):
            raise FormatError(f"{path}: key {key!r} should be an array, found {v!r:.60}")
    return v


def positive(path: str, name: str, v: int) -> int:
    if v <= 0:
        raise FormatError(f"{path}: {name} = {v}, expected > 0")
    return v


def read_hparams(meta: dict, tensors: dict[str, TensorInfo], path: str = "<model>") -> Hparams:
    """Hyperparameters from GGUF metadata (spec §3.2), with every consistency check the
    forward pass relies on. Raises FormatError naming the key."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise FormatError(f"{path}: required key 'general.architecture' is missing")
    if arch not in ARCHITECTURES:
        raise FormatError(f"{path}: architecture {arch!r} is not supported "
                          f"(legacy_engine runs {', '.join(ARCHITECTURES)})")
    a = arch
    n_layer_all = positive(path, f"{a}.block_count", meta_value(meta, path, f"{a}.block_count", int))
    n_nextn = meta_value(meta, path, f"{a}.nextn_predict_layers", int, 0)
    if n_nextn >= n_layer_all:
        raise FormatError(f"{path}: {a}.nextn_predict_layers = {n_nextn} leaves no layer of "
                          f"{a}.block_count = {n_layer_all} to run")
    n_embd = positive(path, f"{a}.embedding_length", meta_value(meta, path, f"{a}.embedding_length", int))
    n_head = positive(path, f"{a}.attention.head_count", meta_value(meta, path, f"{a}.attention.head_count", int))
    n_head_kv = meta_value(meta, path, f"{a}.attention.head_count_kv", int, n_head)
    if n_head_kv <= 0 or n_head % n_head_kv:
        raise FormatError(f"{path}: {a}.attention.head_count_kv = {n_head_kv} must divide head_count = {n_head}")
    head_dim = meta_value(meta, path, f"{a}.attention.key_length", int, n_embd // n_head)
    head_dim_v = meta_value(meta, path, f"{a}.attention.value_length", int, head_dim)
    positive(path, f"{a}.attention.key_length", head_dim)
    if head_dim_v != head_dim:
        raise FormatError(f"{path}: {a}.attention.value_length = {head_dim_v} differs from key_length = "
                          f"{head_dim}; Qwen3.5 attention has equal key and value head sizes")
    rms_eps = meta_value(meta, path, f"{a}.attention.layer_norm_rms_epsilon", float)
    if not 0 < rms_eps < 1:
        raise FormatError(f"{path}: {a}.attention.layer_norm_rms_epsilon = {rms_eps}, expected in (0, 1)")
    rope_theta = meta_value(meta, path, f"{a}.rope.freq_base", float, 10000.0)
    if not rope_theta > 0:
        raise FormatError(f"{path}: {a}.rope.freq_base = {rope_theta}, expected > 0")
    n_rot = meta_value(meta, path, f"{a}.rope.dimension_count", int, head_dim)
    if n_rot <= 0 or n_rot > head_dim or n_rot % 2:
        raise FormatError(f"{path}: {a}.rope.dimension_count = {n_rot}, expected even and in (0, {head_dim}]")
    if a == "qwen3next":
        sections = (0, 0, 0, 0)
    else:
        sec = meta_value(meta, path, f"{a}.rope.dimension_sections", list)
        if len(sec) != 4 or not all(isinstance(s, int) and s >= 0 for s in sec):
            raise FormatError(f"{path}: {a}.rope.dimension_sections = {sec!r:.60}, expected 4 integers >= 0")
        if sum(sec) > n_rot // 2:
            raise FormatError(f"{path}: {a}.rope.dimension_sections {sec} cover more than n_rot/2 = {n_rot // 2}")
        sections = tuple(sec)

    k = positive(path, f"{a}.ssm.conv_kernel", meta_value(meta, path, f"{a}.ssm.conv_kernel", int))
    d_state = positive(path, f"{a}.ssm.state_size", meta_value(meta, path, f"{a}.ssm.state_size", int))
    n_group = positive(path, f"{a}.ssm.group_count", meta_value(meta, path, f"{a}.ssm.group_count", int))
    dt_rank = positive(path, f"{a}.ssm.time_step_rank", meta_value(meta, path, f"{a}.ssm.time_step_rank", int))
    d_inner = positive(path, f"{a}.ssm.inner_size", meta_value(meta, path, f"{a}.ssm.inner_size", int))
    if dt_rank % n_group:
        raise FormatError(f"{path}: ssm.time_step_rank (H_v = {dt_rank}) must be a multiple of "
                          f"ssm.group_count (H_k = {n_group})")
    if d_inner % dt_rank:
        raise FormatError(f"{path}: ssm.inner_size = {d_inner} is not a multiple of time_step_rank = {dt_rank}")
    if d_inner // dt_rank != d_state:
        raise FormatError(f"{path}: value head size inner_size/time_step_rank = {d_inner // dt_rank} differs "
                          f"from ssm.state_size = {d_state}; llama.cpp and this engine need them equal")

    n_layer = n_layer_all - n_nextn
    rec_key = f"{a}.attention.recurrent_layers"
    if rec_key in meta:
        rec = meta_value(meta, path, rec_key, list)
        if len(rec) < n_layer:
            raise FormatError(f"{path}: {rec_key} has {len(rec)} entries, {n_layer} layers expected")
        recurrent = tuple(bool(r) for r in rec[:n_layer])
    else:
        interval = meta_value(meta, path, f"{a}.full_attention_interval", int, 4)
        positive(path, f"{a}.full_attention_interval", interval)
        recurrent = tuple((i + 1) % interval != 0 for i in range(n_layer))

    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise FormatError(f"{path}: required tensor 'token_embd.weight' is missing")
    if len(emb.ne) != 2 or emb.ne[0] != n_embd:
        raise FormatError(f"{path}: tensor 'token_embd.weight' has ne={list(emb.ne)}, expected [{n_embd}, n_vocab]")
    n_vocab = emb.ne[1]
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None and not isinstance(tokens, list):
        raise FormatError(f"{path}: tokenizer.ggml.tokens should be an array of strings, found {tokens!r:.60}")
    if isinstance(tokens, list) and len(tokens) != n_vocab:
        raise FormatError(f"{path}: tokenizer.ggml.tokens has {len(tokens)} entries but token_embd.weight "
                          f"has {n_vocab} rows")

    kw = {}
    if a in MOE_ARCHITECTURES:
        n_expert = positive(path, f"{a}.expert_count", meta_value(meta, path, f"{a}.expert_count", int))
        n_used = positive(path, f"{a}.expert_used_count", meta_value(meta, path, f"{a}.expert_used_count", int))
        if n_used > n_expert:
            raise FormatError(f"{path}: {a}.expert_used_count = {n_used} exceeds expert_count = {n_expert}")
        n_ff = meta_value(meta, path, f"{a}.feed_forward_length", int, 0, required=False)
        n_ff_exp = meta_value(meta, path, f"{a}.expert_feed_forward_length", int, 0, required=False)
        if n_ff_exp == 0:
            n_ff_exp = n_ff // n_used if n_ff else 0
        positive(path, f"{a}.expert_feed_forward_length", n_ff_exp)
        n_ff_shexp = meta_value(meta, path, f"{a}.expert_shared_feed_forward_length", int, 0, required=False)
        up_s = tensors.get("blk.0.ffn_up_shexp.weight")
        if n_ff_shexp == 0 and up_s is not None:
            if not n_ff and len(up_s.ne) < 2:
                raise FormatError(f"{path}: tensor 'blk.0.ffn_up_shexp.weight' has ne={list(up_s.ne)}, expected "
                                  f"[{n_embd}, n_ff_shexp] (and {a}.expert_shared_feed_forward_length is missing)")
            n_ff_shexp = n_ff or up_s.ne[1]
        kw.update(n_expert=n_expert, n_expert_used=n_used, n_ff_exp=n_ff_exp, n_ff_shexp=n_ff_shexp)
    else:
        kw["n_ff"] = positive(path, f"{a}.feed_forward_length", meta_value(meta, path, f"{a}.feed_forward_length", int))

    return Hparams(
        arch=a, n_layer_all=n_layer_all, n_nextn=n_nextn,
        n_ctx_train=meta_value(meta, path, f"{a}.context_length", int),
        n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, head_dim_v=head_dim_v,
        rms_eps=rms_eps, rope_theta=rope_theta, n_rot=n_rot, rope_sections=sections,
        ssm_conv_kernel=k, ssm_d_state=d_state, ssm_n_group=n_group, ssm_dt_rank=dt_rank,
        ssm_d_inner=d_inner, recurrent=recurrent, n_vocab=n_vocab,
        tied_embeddings="output.weight" not in tensors, **kw)


# ---- the tensor schema (format/schema.py: the C core's table) ------------------------


def expected_tensors(hp: Hparams) -> dict[str, tuple[int, ...]]:
    """The standard layout: every tensor name -> ne that a file of these hparams holds
    (first alternative of each group; output.weight only when not tied)."""
    out: dict[str, tuple[int, ...]] = {}
    for grp in [x for i in range(-1, hp.n_layer) for x in groups(hp, i)]:
        if grp.optional and hp.tied_embeddings:
            continue
        out.update(grp.alternatives[0])
    return out


def same_shape(have: tuple[int, ...], want: tuple[int, ...]) -> bool:
    # trailing 1s are not significant (a {2048, 1} vector is a {2048} vector)
    h = list(have)
    while len(h) > len(want) and h[-1] == 1:
        h.pop()
    return tuple(h) == want


def check_schema(hp: Hparams, tensors: dict[str, TensorInfo], path: str = "<model>") -> dict[str, int]:
    """Checks every group; returns {group description: chosen alternative index}.
    Raises FormatError naming the first missing or misshapen tensor."""
    chosen = {}
    try:
        every = [(i, g) for i in range(-1, hp.n_layer) for g in groups(hp, i)]
    except FormatError as e:
        raise FormatError(f"{path}: {e}") from None
    for layer, grp in every:
        where = f"{grp.what}" + (f" of layer {layer}" if layer >= 0 else "")
        pick = next((k for k, alt in enumerate(grp.alternatives) if all(n in tensors for n in alt)), None)
        if pick is None:
            if grp.optional:
                continue
            first = grp.alternatives[0]
            missing = [n for n in first if n not in tensors]
            alts = "" if len(grp.alternatives) == 1 else " (nor any alternative layout: " + "; ".join(
                ", ".join(a) for a in grp.alternatives[1:]) + ")"
            raise FormatError(f"{path}: {where}: required tensor {missing[0]!r} is missing{alts}")
        for name, want in grp.alternatives[pick].items():
            have = tensors[name].ne
            if not same_shape(have, want):
                raise FormatError(f"{path}: tensor {name!r} has ne={list(have)}, expected {list(want)} "
                                  f"(from the hyperparameters)")
        chosen[where] = pick
    return chosen


@dataclass
class ModelFile:
    """A validated Qwen3.5-family GGUF: file, hyperparameters and schema all checked."""
    path: str
    gguf: GGUFFile = field(repr=False)
    hparams: Hparams
    layout: dict[str, int] = field(repr=False)

    @classmethod
    def open(cls, path: str | os.PathLike) -> "ModelFile":
        f = GGUFFile(path)
        hp = read_hparams(f.metadata, f.tensors, f.path)
        layout = check_schema(hp, f.tensors, f.path)
        return cls(f.path, f, hp, layout)

    @property
    def metadata(self) -> dict:
        return self.gguf.metadata

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        return self.gguf.tensors

    def bytes_by_type(self) -> dict[str, tuple[int, int]]:
        """{type name: (tensor count, bytes)} over all tensors."""
        out: dict[str, list[int]] = {}
        for t in self.tensors.values():
            e = out.setdefault(t.type_name, [0, 0])
            e[0] += 1
            e[1] += t.n_bytes
        return {k: (v[0], v[1]) for k, v in sorted(out.items(), key=lambda kv: -kv[1][1])}


# ---- --check-tensors ------------------------------------------------------------------

_T = GGMLQuantizationType
# The f16 fields of each quantised block: (name, byte offset) as in native/include/le_blocks.h.
_D, _DM = ("d", 0), ("dmin", 2)
F16_SCALES = {_T.Q4_0: (_D,), _T.Q4_1: (_D, ("m", 2)), _T.Q5_0: (_D,), _T.Q5_1: (_D, ("m", 2)), _T.Q8_0: (_D,),
              _T.Q8_1: (_D, ("s", 2)), _T.IQ4_NL: (_D,), _T.IQ4_XS: (_D,), _T.Q2_K: (("d", 80), ("dmin", 82)),
              _T.Q3_K: (("d", 108),), _T.Q4_K: (_D, _DM), _T.Q5_K: (_D, _DM), _T.Q6_K: (("d", 208),)}
CHECK_CHUNK = 64 << 20        # bytes scanned per numpy pass: bounds the temporaries


def _first(bad: np.ndarray) -> int | None:
    return int(np.argmax(bad)) if bad.any() else None


def _first_nonfinite16(v: np.ndarray, exp: int) -> int | None:
    """Index of the first f16/bf16 (bits in v, uint16) with every exponent bit set (inf or NaN), or None.
    why the max first: one pass without a bool array, ~2x faster than the mask on finite data."""
    if (v & 0x7FFF).max(initial=0) < exp:
        return None
    return _first((v & exp) == exp)


def _first_nonfinite(qt: GGMLQuantizationType, raw: np.ndarray) -> tuple[int, str] | None:
    """(index, 'element' | 'block') of the first non-finite value of raw (whole blocks or elements of type qt),
    or None when all are finite. qt must be in SCANNED_TYPES."""
    if qt == _T.F32:
        i = _first(~np.isfinite(raw.view("<f4")))
        return None if i is None else (i, "element")
    if qt in (_T.F16, _T.BF16):
        i = _first_nonfinite16(raw.view("<u2"), 0x7C00 if qt == _T.F16 else 0x7F80)
        return None if i is None else (i, "element")
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[qt][1])
    if qt == _T.Q8_K:
        i = _first(~np.isfinite(blocks[:, 0:4].view("<f4")[:, 0]))
    elif qt == _T.MXFP4:
        i = _first(blocks[:, 0] == 0xFF)  # E8M0 0xFF is NaN
    else:
        hits = [j for _, off in F16_SCALES[qt]
                if (j := _first_nonfinite16(blocks[:, off:off + 2].view("<u2")[:, 0], 0x7C00)) is not None]
        i = min(hits) if hits else None
    return None if i is None else (i, "block")


SCANNED_TYPES = frozenset({_T.F32, _T.F16, _T.BF16, _T.Q8_K, _T.MXFP4, *F16_SCALES})


def check_tensor_values(gguf: GGUFFile, progress: bool | None = None) -> dict:
    """Scans every tensor's data (where gguf.data() points: the map, or memory after load_data): quantised
    blocks' f16 scales (d, dmin; Q8_K's f32 d; MXFP4's exponent) and every f32/f16/bf16 value must be
    finite. Raises FormatError naming the first bad tensor, block or element, and its value. Returns
    {'tensors', 'bytes', 'seconds', 'unchecked': [names of tensors of a type with no known float field]}.
    progress: a bar (None: on a terminal from 1 GiB up, as load_data)."""
    from tqdm import tqdm

    tensors = sorted(gguf.tensors.values(), key=lambda t: t.offset)
    total = sum(t.n_bytes for t in tensors)
    disable = (not progress) if progress is not None else (None if total >= PROGRESS_MIN_BYTES else True)
    t0, unchecked = time.perf_counter(), []
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="checking tensors",
              disable=disable, leave=False) as bar:
        for t in tensors:
            qt = GGMLQuantizationType(t.type)
            if qt not in SCANNED_TYPES:
                unchecked.append(t.name)
                bar.update(t.n_bytes)
                continue
            step = max(CHECK_CHUNK // GGML_QUANT_SIZES[qt][1], 1) * GGML_QUANT_SIZES[qt][1]
            data = gguf.data(t.name)
            for start in range(0, t.n_bytes, step):
                raw = data[start:start + step]
                found = _first_nonfinite(qt, raw)
                if found is not None:
                    _raise_bad(gguf.path, t, raw, *found, start)
                bar.update(len(raw))
    return {"tensors": len(tensors), "bytes": total, "seconds": time.perf_counter() - t0, "unchecked": unchecked}


def _raise_bad(path: str, t: TensorInfo, raw: np.ndarray, i: int, unit: str, start: int) -> None:
    block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(t.type)]
    where = f"{path}: tensor {t.name!r} ({t.type_name}, ne={list(t.ne)})"
    if unit == "element":
        elem_bytes = block_bytes // block_elems
        k = start // elem_bytes + i
        bits = bytes(raw[i * elem_bytes:(i + 1) * elem_bytes])
        if elem_bytes == 2 and t.type == _T.BF16:  # the top half of an f32
            bits = b"\0\0" + bits
        value = float(np.frombuffer(bits, {4: "<f4", 2: "<f2"}[len(bits)])[0])
        raise FormatError(f"{where}: element {k} (row {k // t.ne[0]}, column {k % t.ne[0]}) is {value}")
    b = start // block_bytes + i
    blk = raw[i * block_bytes:(i + 1) * block_bytes]
    qt = GGMLQuantizationType(t.type)
    if qt in F16_SCALES:
        fields = F16_SCALES[qt]
        what = f"f16 scale{'s' if len(fields) > 1 else ''} " + ", ".join(
            f"{name} = {float(blk[o:o + 2].view('<f2')[0])}" for name, o in fields)
    elif qt == _T.Q8_K:
        what = f"f32 scale d = {float(blk[0:4].view('<f4')[0])}"
    else:
        what = "E8M0 exponent 0xFF (NaN)"
    per_row = t.ne[0] // block_elems
    c0 = b % per_row * block_elems
    raise FormatError(f"{where}: block {b} (row {b // per_row}, columns {c0}..{c0 + block_elems - 1}) has a "
                      f"non-finite {what}")


def type_size(qtype: int) -> tuple[int, int]:
    """(block size, bytes per block) of a ggml type id (gguf-py's table)."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
