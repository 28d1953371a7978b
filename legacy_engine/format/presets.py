"""The model family's presets as data: the hyperparameters of each Qwen3.5 / Qwen3.6 shape (spec §1.2), the quant
mixes by name, and the type llama.cpp gives each tensor in a mix (llama-quant.cpp's rules) -> the file's tensor
plan (`plan_tensors`), and each preset's vision tower (`VISION_PRESETS`, `preset_vision_hparams`: what
make-model --mmproj-out writes). make-model writes these files; the planner describes them without writing
(`DescribedFile`, `plan --preset`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..core.errors import EngineError
from .gguf_file import TensorInfo
from .gguf_model import Hparams, expected_tensors
from .mmproj import VisionHparams

T = GGMLQuantizationType

N_VOCAB = 248_320

_COMMON = dict(n_ctx_train=262_144, head_dim=256, n_rot=64, rms_eps=1e-6, rope_theta=1e7,
               ssm_conv_kernel=4, ssm_d_state=128, full_attention_interval=4)

# Real configs: spec §1.2. Tiny ones keep the real structure (head_dim 256, 64 rotary dims,
# [L,L,L,F], d_k = d_v = 128; H_v = 2·H_k for tiny-moe as in 9B/35B, H_v = H_k for tiny-dense as in 0.8B)
# with small widths, tied embeddings (the 248,320-row table dominates their size) and Q8_0.
PRESETS: dict[str, dict] = {
    "tiny-moe": dict(_COMMON, arch="qwen35moe", name="Qwen3.5 tiny MoE", n_layer=8, n_embd=256,
                     n_head=4, n_head_kv=2, ssm_n_group=2, ssm_dt_rank=4, n_expert=16, n_expert_used=4,
                     n_ff_exp=256, n_ff_shexp=256, tied=True, quant="q8_0"),
    "tiny-dense": dict(_COMMON, arch="qwen35", name="Qwen3.5 tiny dense", n_layer=4, n_embd=256,
                       n_head=4, n_head_kv=1, ssm_n_group=2, ssm_dt_rank=2, n_ff=768, tied=True,
                       quant="q8_0"),
    "qwen3.5-0.8b": dict(_COMMON, arch="qwen35", name="Qwen3.5 0.8B", n_layer=24, n_embd=1024,
                         n_head=8, n_head_kv=2, ssm_n_group=16, ssm_dt_rank=16, n_ff=3584, tied=True,
                         quant="q4_k_m"),
    "qwen3.5-9b": dict(_COMMON, arch="qwen35", name="Qwen3.5 9B", n_layer=32, n_embd=4096,
                       n_head=16, n_head_kv=4, ssm_n_group=16, ssm_dt_rank=32, n_ff=12288, tied=False,
                       quant="q4_k_m"),
    "qwen3.6-35b-a3b": dict(_COMMON, arch="qwen35moe", name="Qwen3.6 35B A3B", n_layer=40, n_embd=2048,
                            n_head=16, n_head_kv=2, ssm_n_group=16, ssm_dt_rank=32, n_expert=256,
                            n_expert_used=8, n_ff_exp=512, n_ff_shexp=512, tied=False, quant="q4_k_m"),
}

# Vision towers (spec §2.7, transformers' Qwen3_5VisionConfig field names in the comments): what make-model
# --mmproj-out writes. Every size shares patch 16, temporal patch 2, merge 2, 2304 = 48x48 positions, LayerNorm eps
# 1e-6 (the converter writes the text config's rms_norm_eps) and mean = std = 0.5; out_hidden = the preset's n_embd.
#   small: 0.8B's first-party config.json (spec §2.7); Qwen3.5-2B/4B assumed the same (not checked).
#   large: 35B-A3B (spec §2.7) and the transformers class defaults; 9B: the same in third-party copies of its
#          config.json (out_hidden_size 4096), not read from the first-party file.
#   tiny:  tests/fixtures/tiny_vision.py's tower (depth 2, hidden 64, 2 heads, 8x8 positions), for fast tests.
_VISION_COMMON = dict(patch_size=16, temporal_patch=2, merge=2, n_pos=2304, eps=1e-6, image_mean=(0.5, 0.5, 0.5),
                      image_std=(0.5, 0.5, 0.5))
_VISION_SMALL = dict(_VISION_COMMON, depth=12, hidden=768, n_head=12, ffn=3072)      # depth, hidden_size, num_heads,
_VISION_LARGE = dict(_VISION_COMMON, depth=27, hidden=1152, n_head=16, ffn=4304)     # intermediate_size
_VISION_TINY = dict(_VISION_COMMON, depth=2, hidden=64, n_head=2, ffn=128, n_pos=64)
VISION_PRESETS: dict[str, dict] = {
    "tiny-moe": _VISION_TINY, "tiny-dense": _VISION_TINY, "qwen3.5-0.8b": _VISION_SMALL,
    "qwen3.5-9b": _VISION_LARGE, "qwen3.6-35b-a3b": _VISION_LARGE,
}

# --quant name -> (LLAMA_FTYPE value, default tensor type, mix). mix None = pure.
QUANTS: dict[str, tuple[int, T, str | None]] = {
    "f32": (0, T.F32, None), "f16": (1, T.F16, None), "bf16": (32, T.BF16, None),
    "q8_0": (7, T.Q8_0, None), "q4_0": (2, T.Q4_0, None), "q4_1": (3, T.Q4_1, None),
    "q5_0": (8, T.Q5_0, None), "q5_1": (9, T.Q5_1, None),
    "q2_k": (10, T.Q2_K, None), "q3_k": (11, T.Q3_K, None), "q4_k": (14, T.Q4_K, None),
    "q5_k": (16, T.Q5_K, None), "q6_k": (18, T.Q6_K, None),
    "q4_k_m": (15, T.Q4_K, "q4_k_m"), "q5_k_m": (17, T.Q5_K, "q5_k_m"),
    "iq4_nl": (25, T.IQ4_NL, None), "iq4_xs": (30, T.IQ4_XS, None),
    "mxfp4_moe": (38, T.MXFP4, "mxfp4_moe"),
}


class MakeModelError(ValueError, EngineError):
    """A bad make-model request (unknown preset or quant, bad layer count): make-model's flags, `plan --preset`."""


# ---- hyperparameters ------------------------------------------------------------------------------

def _rope_sections(n_rot: int) -> tuple[int, int, int, int]:
    """Qwen3.5's mrope_section [11, 11, 10] (for 32 rotary pairs) scaled to n_rot/2 pairs, padded to 4."""
    pairs = n_rot // 2
    t = h = round(11 * pairs / 32)
    return (t, h, pairs - t - h, 0)


def preset_hparams(preset: str, layers: int | None = None) -> Hparams:
    """The Hparams of a preset (spec §1.2), optionally cut to `layers` layers ([L,L,L,F] from layer 0)."""
    if preset not in PRESETS:
        raise MakeModelError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    p = PRESETS[preset]
    n_layer = p["n_layer"] if layers is None else int(layers)
    if n_layer < 1:
        raise MakeModelError(f"--layers must be at least 1, got {n_layer}")
    interval = p["full_attention_interval"]
    kw = dict(n_ff=p["n_ff"]) if p["arch"] == "qwen35" else dict(
        n_expert=p["n_expert"], n_expert_used=p["n_expert_used"], n_ff_exp=p["n_ff_exp"],
        n_ff_shexp=p["n_ff_shexp"])
    return Hparams(
        arch=p["arch"], n_layer_all=n_layer, n_nextn=0, n_ctx_train=p["n_ctx_train"], n_embd=p["n_embd"],
        n_head=p["n_head"], n_head_kv=p["n_head_kv"], head_dim=p["head_dim"], head_dim_v=p["head_dim"],
        rms_eps=p["rms_eps"], rope_theta=p["rope_theta"], n_rot=p["n_rot"],
        rope_sections=_rope_sections(p["n_rot"]), ssm_conv_kernel=p["ssm_conv_kernel"],
        ssm_d_state=p["ssm_d_state"], ssm_n_group=p["ssm_n_group"], ssm_dt_rank=p["ssm_dt_rank"],
        ssm_d_inner=p["ssm_dt_rank"] * p["ssm_d_state"],
        recurrent=tuple((i + 1) % interval != 0 for i in range(n_layer)), n_vocab=N_VOCAB,
        tied_embeddings=p["tied"], **kw)


def preset_vision_hparams(preset: str, depth: int | None = None) -> VisionHparams:
    """The VisionHparams of a preset's vision tower (VISION_PRESETS), optionally cut to `depth` blocks."""
    if preset not in VISION_PRESETS:
        raise MakeModelError(f"unknown preset {preset!r} for a vision tower; choose one of {', '.join(VISION_PRESETS)}")
    v = dict(VISION_PRESETS[preset])
    if depth is not None:
        if depth < 1:
            raise MakeModelError(f"--mmproj-depth must be at least 1, got {depth}")
        v["depth"] = int(depth)
    return VisionHparams(**v, out_hidden=PRESETS[preset]["n_embd"],
                         image_size=math.isqrt(v["n_pos"]) * v["patch_size"])


# ---- tensor types: llama.cpp's rules ---------------------------------------------------------------

def layer_of(name: str) -> int:
    """Block index of a tensor name, -1 outside blocks (llama.cpp's sscanf("blk.%d."))."""
    if name.startswith("blk."):
        return int(name.split(".", 2)[1])
    return -1


def llama_order(names) -> list[str]:
    """llama-quantize's output order (llama_model_loader::weight_name_comparer): by layer, non-block
    tensors (-1) first, then by name (byte order)."""
    return sorted(names, key=lambda n: (layer_of(n), n.encode()))


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quant.cpp: the layers whose attn_v-like / ffn_down tensors get more bits in *_K_M mixes."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def forced_f32(name: str, ne: tuple[int, ...]) -> bool:
    """Tensors the converter writes as F32 and llama-quantize never quantises."""
    return (len(ne) < 2 or name.endswith("_norm.weight") or not name.endswith(".weight")
            or "ffn_gate_inp" in name or "ssm_conv1d" in name)


def fallback_type(qtype: T, ne0: int) -> T:
    """llama-quant.cpp `tensor_type_fallback`: a type whose block does not divide the row length."""
    block = GGML_QUANT_SIZES[qtype][0]
    if ne0 % block == 0:
        return qtype
    alt = {T.IQ4_XS: T.IQ4_NL, T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1,
           T.Q6_K: T.Q8_0}.get(qtype, qtype)
    return alt if ne0 % GGML_QUANT_SIZES[alt][0] == 0 else T.F16


def tensor_type(name: str, ne: tuple[int, ...], hp: Hparams, quant: str) -> T:
    """The ggml type llama.cpp gives this tensor in a `quant` file (before the block-size fallback).

    Mixes follow llama_tensor_get_type_impl for Q4_K_M / Q5_K_M / MXFP4_MOE. Its attn_v counter
    (i_attention_wv, over every attn_v / attn_qkv tensor in file order) equals the layer index here,
    since each layer has exactly one of them (GDN attn_qkv or attention attn_v) and files are in
    layer order; ffn_down uses the layer index (parsed from the name for MoE, counted for dense)."""
    if forced_f32(name, ne):
        return T.F32
    _, default, mix = QUANTS[quant]
    if mix is None:
        return default
    n_layer, n_expert = hp.n_layer_all, hp.n_expert
    is_output = name == "output.weight" or (hp.tied_embeddings and name == "token_embd.weight")
    if is_output:
        if mix == "mxfp4_moe" or ne[0] % GGML_QUANT_SIZES[default][0]:
            return T.Q8_0
        return T.Q6_K
    if mix == "mxfp4_moe":
        return T.MXFP4 if len(ne) > 2 and ne[2] > 1 else T.Q8_0
    if name == "token_embd.weight":
        return default
    il = layer_of(name)
    if name.endswith(("attn_v.weight", "attn_qkv.weight")):
        qtype = T.Q6_K if use_more_bits(il, n_layer) else default
        return T.Q8_0 if n_expert == 8 else qtype       # llama.cpp's Mixtral-8x rule
    if name.endswith("attn_k.weight"):
        return T.Q8_0 if n_expert == 8 else default
    if "ffn_down" in name:
        return T.Q6_K if use_more_bits(il, n_layer) else default
    if name.endswith("attn_output.weight") and n_expert == 8:
        return T.Q5_K
    return default


@dataclass(frozen=True)
class TensorSpec:
    name: str
    ne: tuple[int, ...]       # ggml order
    qtype: T

    @property
    def n_elements(self) -> int:
        return math.prod(self.ne)

    @property
    def n_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return self.n_elements // block * size


def plan_tensors(hp: Hparams, quant: str) -> tuple[list[TensorSpec], list[str]]:
    """Every tensor of the file, in file order, with its type; plus notes about fallbacks."""
    if quant not in QUANTS:
        raise MakeModelError(f"unknown quant {quant!r}; choose one of {', '.join(QUANTS)}")
    schema = expected_tensors(hp)
    specs, fallbacks = [], {}
    for name in llama_order(schema):
        ne = schema[name]
        want = tensor_type(name, ne, hp, quant)
        got = fallback_type(want, ne[0])
        if got != want:
            fallbacks.setdefault((want, got), []).append(name)
        specs.append(TensorSpec(name, ne, got))
    notes = [f"{len(v)} tensor(s) ({v[0]}{', …' if len(v) > 1 else ''}) have rows that are not a whole "
             f"number of {a.name} blocks ({GGML_QUANT_SIZES[a][0]}): written as {b.name}"
             for (a, b), v in fallbacks.items()]
    return specs, notes


# ---- a preset's file, described ------------------------------------------------------------------

class DescribedFile:
    """A model file described, not read: make-model's tensor plan for a preset and quant (what `plan --preset`
    and the planner tests use; the planner needs only hparams and tensor types/shapes)."""

    def __init__(self, preset: str, quant: str | None = None, layers: int | None = None):
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        self.hparams = preset_hparams(preset, layers)
        quant = quant or PRESETS[preset].get("quant", "q4_k_m")
        specs, _ = plan_tensors(self.hparams, quant)
        self.tensors = {s.name: TensorInfo(s.name, int(s.qtype), tuple(s.ne), s.n_bytes, 0) for s in specs}
        self.name = f"{preset} {quant}" + (f" ({layers} layers)" if layers else "")
