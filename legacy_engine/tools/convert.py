"""`legacy-engine convert`: Hugging Face Qwen3.5 / Qwen3.6 text checkpoints → GGUF.

Writes the file llama.cpp's own converter writes (conversion/qwen.py + base.py of the llama.cpp vendored in
llama-cpp-python 0.3.36, run with --no-mtp), so either tool's output works with either engine:
names and transforms of ../shared/spec/qwen35.md §3.3 (+1 norms, ssm_a = −exp(A_log), V heads in tiled order,
conv squeeze, forced-F32 tensors), the hparams of §3.2 and the tokenizer keys of §5.
tests/test_convert.py holds it to llama.cpp's converter tensor by tensor.

The checkpoint is streamed: tensor infos are planned from the safetensors headers, then each tensor is loaded,
transformed, quantised and written on its own, so peak memory is about one layer's expert stack.
Pure Python (numpy, safetensors, tokenizers, gguf); no torch.
"""
from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..core.errors import FormatError
from ..core.paths import written_atomically
from ..format.vocab import QWEN35_PATTERN  # Qwen3.5's pre-tokenizer split regex (llama.cpp "qwen35")
from .checkpoint import Checkpoint
from .convert_mmproj import MMPROJ_OUTTYPES, convert_mmproj

# model_type (top level or text_config) → GGUF architecture
ARCHS = {
    "qwen3_5_text": "qwen35",
    "qwen3_5": "qwen35",
    "qwen3_5_moe_text": "qwen35moe",
    "qwen3_5_moe": "qwen35moe",
}

# --outtype → (GGMLQuantizationType name for quantisable tensors, LlamaFileType name for general.file_type)
OUTTYPES = {
    "f32": ("F32", "ALL_F32"),
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0"),    # gguf-py's reference quantiser (llama-quantize's Q4_0 without imatrix)
}

# llama.cpp identifies BPE pre-tokenizers by hashing the ids of this text (conversion/base.py get_vocab_base_pre).
_CHKTXT = (
    '\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 333 '
    '3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на '
    'Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, \'RE you sure? \'M not sure I\'ll '
    'make it, \'D you like some tea? We\'Ve a\'lL'
)
_PRE_BY_HASH = {
    "d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4": "qwen35",  # Qwen/Qwen3.5-9B-Instruct
    "1444df51289cfa8063b96f0e62b1125440111bc79a52003ea14b6eac7016fd5f": "qwen35",  # openbmb/MiniCPM-V-4_6
}

# HF tensor name after "model.layers.N." → GGUF name after "blk.N." (llama.cpp gguf-py tensor_mapping + qwen.py).
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# GGUF per-layer names in the order they are written
_LAYER_ORDER = [
    "attn_norm.weight", "attn_qkv.weight", "attn_gate.weight", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a",
    "ssm_beta.weight", "ssm_alpha.weight", "ssm_norm.weight", "ssm_out.weight",
    "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_q_norm.weight", "attn_k_norm.weight", "attn_output.weight",
    "post_attention_norm.weight",
    "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight",
    "ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
    "ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight",
]
# HF stores zero-centred RMSNorm weights (y = x̂·(1+w)); GGUF stores 1+w. The gated GDN norm is a plain w.
_PLUS_ONE = {"attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight",
             "output_norm.weight"}
# Kept F32 whatever --outtype says (llama.cpp base.py prepare_tensors), besides every 1-D tensor.
_FORCE_F32 = {"ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight"}

_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


# ---------------------------------------------------------------------------------------------------- config

_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
             "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
             "linear_num_value_heads")


def load_hparams(hf_dir: Path) -> tuple[dict, str]:
    """config.json with `text_config` merged into the root (as llama.cpp does) and the GGUF arch string."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FormatError(f"{path} not found: pass the directory of a Hugging Face checkpoint (config.json, "
                          f"*.safetensors, tokenizer.json)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise FormatError(f"{path} is not valid JSON: {e}") from None
    text = config.get("text_config") or {}
    for model_type in (config.get("model_type"), text.get("model_type")):
        if model_type in ARCHS:
            hp = {**config, **text}
            if hp.get("quantization_config"):
                raise FormatError(f"{path}: quantised checkpoints ({hp['quantization_config'].get('quant_method')}) "
                                  f"are not supported; convert the BF16 release")
            missing = [k for k in _REQUIRED if hp.get(k) is None]
            if missing:
                raise FormatError(f"{path}: missing {', '.join(missing)} (needed for the GGUF hparams)")
            return hp, ARCHS[model_type]
    raise FormatError(f"{path}: model_type {config.get('model_type')!r} is not supported; convert handles "
                      f"{', '.join(sorted(ARCHS))} (Qwen3.5 / Qwen3.6 checkpoints)")


def _rope_params(hp: dict) -> dict:
    rope = dict(hp.get("rope_parameters") or hp.get("rope_scaling") or {})
    for key in ("rope_theta", "partial_rotary_factor"):
        if key not in rope and hp.get(key) is not None:
            rope[key] = hp[key]
    return rope


# ---------------------------------------------------------------------------------------------------- transforms

def tile_v_heads(x: np.ndarray, axis: int, h_k: int, head_dim: int) -> np.ndarray:
    """Reorder the V heads along `axis` from HF grouped order (v-head m = g·r + s, g = k-head) to GGUF tiled order
    (index s·H_k + g), so that GGUF v-head j uses k-head j mod H_k. x.shape[axis] = H_v·head_dim."""
    axis %= x.ndim
    r = x.shape[axis] // (h_k * head_dim)
    shape = x.shape
    x = x.reshape(shape[:axis] + (h_k, r, head_dim) + shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(x, axis, axis + 1)).reshape(shape)


@dataclass
class _Out:
    name: str                     # GGUF tensor name
    shape: tuple[int, ...]        # numpy (HF) order: ne reversed
    load: Callable[[], np.ndarray]
    qtype: object = None          # gguf.GGMLQuantizationType, filled in by _plan


def _tensor(ck: Checkpoint, hp: dict, src: str, gname: str) -> _Out:
    """One HF tensor → one GGUF tensor (gname without the "blk.N." prefix), with llama.cpp's transforms."""
    shape = ck.shape(src)
    h_k, h_v = hp.get("linear_num_key_heads", 0), hp.get("linear_num_value_heads", 0)
    reorder = h_k > 0 and h_v > 0 and h_k != h_v
    if reorder and h_v % h_k:
        raise FormatError(f"config.json: linear_num_value_heads {h_v} is not a multiple of linear_num_key_heads {h_k}")
    d_k, d_v = hp.get("linear_key_head_dim", 0), hp.get("linear_value_head_dim", 0)
    if gname == "ssm_conv1d.weight":
        shape = tuple(n for n in shape if n != 1)        # [C, 1, K] → [C, K] (torch squeeze)

    def load() -> np.ndarray:
        x = ck.load(src)
        if gname in _PLUS_ONE:
            x = x + x.dtype.type(1)
        elif gname == "ssm_a":
            # why: float64 exp rounded once; torch's f32 exp (llama.cpp) is within 1 ulp of this
            x = (-np.exp(x.astype(np.float64))).astype(x.dtype)
        elif gname == "ssm_conv1d.weight":
            x = x.reshape(shape)
        if reorder:
            qk = 2 * h_k * d_k
            if gname == "attn_qkv.weight" or gname == "ssm_conv1d.weight":
                x = np.concatenate([x[:qk], tile_v_heads(x[qk:], 0, h_k, d_v)], axis=0)
            elif gname == "attn_gate.weight":
                x = tile_v_heads(x, 0, h_k, d_v)
            elif gname in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_a", "ssm_dt.bias"):
                x = tile_v_heads(x, 0, h_k, 1)
            elif gname == "ssm_out.weight":
                x = tile_v_heads(x, 1, h_k, d_v)
        return x
    return _Out(gname, shape, load)


def _expert_tensors(ck: Checkpoint, n_expert: int, bid: int, fused: dict[str, str],
                    split: dict[str, dict[int, str]]) -> list[_Out]:
    """ffn_{gate,up,down}_exps [E, out, in] from fused gate_up_proj/down_proj or per-expert tensors."""
    outs = []
    if "gate_up" in fused:
        src = fused["gate_up"]
        e, two_i, h = ck.shape(src)
        if two_i % 2:
            raise FormatError(f"{src}: odd gate_up_proj rows {two_i}")
        i = two_i // 2
        outs.append(_Out("ffn_gate_exps.weight", (e, i, h), lambda: ck.load(src, (slice(None), slice(0, i)))))
        outs.append(_Out("ffn_up_exps.weight", (e, i, h), lambda: ck.load(src, (slice(None), slice(i, 2 * i)))))
    if "down" in fused:
        src_d = fused["down"]
        outs.append(_Out("ffn_down_exps.weight", ck.shape(src_d), lambda: ck.load(src_d)))
    for kind, per in split.items():
        missing = sorted(set(range(n_expert)) - set(per))
        if missing or len(per) != n_expert:
            raise FormatError(f"layer {bid}: expert {kind}_proj tensors missing for experts {missing[:8]} "
                              f"(num_experts = {n_expert})")
        names = [per[e] for e in range(n_expert)]
        outs.append(_Out(f"ffn_{kind}_exps.weight", (n_expert,) + ck.shape(names[0]),
                         lambda names=names: np.stack([ck.load(n) for n in names])))
    return outs


def _expected_names(hp: dict, arch: str, n_layer: int, tied: bool) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight"] + ([] if tied else ["output.weight"])
    for bid, kind in enumerate(_layer_types(hp, n_layer)):
        layer = ["attn_norm.weight", "post_attention_norm.weight"]
        if kind == "linear_attention":
            layer += ["attn_qkv.weight", "attn_gate.weight", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a",
                      "ssm_beta.weight", "ssm_alpha.weight", "ssm_norm.weight", "ssm_out.weight"]
        else:
            layer += ["attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_q_norm.weight",
                      "attn_k_norm.weight", "attn_output.weight"]
        if arch == "qwen35moe":
            layer += ["ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"]
            if hp.get("shared_expert_intermediate_size"):
                layer += ["ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight",
                          "ffn_down_shexp.weight"]
        else:
            layer += ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
        names += [f"blk.{bid}.{n}" for n in layer]
    return names


def _layer_types(hp: dict, n_layer: int) -> list[str]:
    types = hp.get("layer_types")
    if types is None:
        interval = hp.get("full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layer)]
    if len(types) != n_layer:
        raise FormatError(f"config.json: layer_types has {len(types)} entries, num_hidden_layers is {n_layer}")
    return list(types)


def _plan(ck: Checkpoint, hp: dict, arch: str, outtype: str) -> list[_Out]:
    """Every GGUF tensor (name, shape, type, loader) in write order, from the checkpoint's headers alone."""
    import gguf

    n_layer = hp["num_hidden_layers"]
    n_expert = hp.get("num_experts", 0)
    glob: dict[str, _Out] = {}
    layers: list[dict[str, _Out]] = [{} for _ in range(n_layer)]
    fused: list[dict[str, str]] = [{} for _ in range(n_layer)]
    split: list[dict[str, dict[int, str]]] = [{} for _ in range(n_layer)]

    for raw in ck.names():
        name = raw.replace("language_model.", "")           # VLM checkpoints: model.language_model.* → model.*
        if name.startswith(("mtp.", "model.mtp.")) or "visual." in name or name.endswith(".rotary_emb.inv_freq"):
            continue                                         # MTP head and vision tower are not part of the LM
        if name in _GLOBAL_NAMES:
            glob[_GLOBAL_NAMES[name]] = _tensor(ck, hp, raw, _GLOBAL_NAMES[name])
            continue
        m = _LAYER_RE.match(name)
        if m is None or int(m.group(1)) >= n_layer:
            raise FormatError(f"cannot map tensor {raw!r} to a GGUF name (not a Qwen3.5 text-model tensor)")
        bid, rest = int(m.group(1)), m.group(2)
        if rest in _LAYER_NAMES:
            layers[bid][_LAYER_NAMES[rest]] = _tensor(ck, hp, raw, _LAYER_NAMES[rest])
        elif rest.removesuffix(".weight") in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            fused[bid][rest.removesuffix(".weight").split(".")[-1].removesuffix("_proj")] = raw
        elif (e := _EXPERT_RE.match(rest)) is not None:
            split[bid].setdefault(e.group(2), {})[int(e.group(1))] = raw
        else:
            raise FormatError(f"cannot map tensor {raw!r} to a GGUF name (not a Qwen3.5 text-model tensor)")

    for bid in range(n_layer):
        if fused[bid] or split[bid]:
            for out in _expert_tensors(ck, n_expert, bid, fused[bid], split[bid]):
                layers[bid][out.name] = out

    outs = [glob[n] for n in ("token_embd.weight",) if n in glob]
    for bid, layer in enumerate(layers):
        for n in _LAYER_ORDER:
            if n in layer:
                out = layer[n]
                out.name = f"blk.{bid}.{n}"
                outs.append(out)
    outs += [glob[n] for n in ("output_norm.weight", "output.weight") if n in glob]

    tied = bool(hp.get("tie_word_embeddings", False)) and "output.weight" not in glob
    have = {o.name for o in outs}
    missing = [n for n in _expected_names(hp, arch, n_layer, tied) if n not in have]
    if missing:
        raise FormatError(f"checkpoint lacks {len(missing)} tensor(s) the config implies, e.g. {missing[:5]}; "
                          f"is the download complete?")

    default = gguf.GGMLQuantizationType[OUTTYPES[outtype][0]]
    for out in outs:
        suffix = out.name.split(".", 2)[-1] if out.name.startswith("blk.") else out.name
        if (len(out.shape) <= 1 or out.name.endswith("_norm.weight") or suffix in _FORCE_F32
                or not out.name.endswith(".weight")):
            out.qtype = gguf.GGMLQuantizationType.F32
        else:
            out.qtype = default
            block, _ = gguf.GGML_QUANT_SIZES[default]
            if out.shape[-1] % block:
                out.qtype = gguf.GGMLQuantizationType.F16   # llama.cpp: QuantError → "falling back to F16"
    return outs


# ---------------------------------------------------------------------------------------------------- metadata

def _add_general(w, hf_dir: Path) -> None:
    """general.* (name, size label, model-card fields, sampling defaults from generation_config.json) through
    gguf-py's Metadata heuristics, as llama.cpp does; call after the tensor infos are added."""
    import gguf

    total, shared, expert, n_expert = w.get_total_parameter_count()
    meta = gguf.Metadata.load(None, hf_dir, None, total)
    if meta.name is None:
        meta.name = hf_dir.resolve().name
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, expert, n_expert)
    w.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(w)


def _add_hparams(w, hp: dict, arch: str, file_type) -> None:
    """Model keys as llama.cpp writes them (TextModel + Qwen2MoeModel + Qwen3NextModel + _Qwen35MRopeMixin)."""
    n_layer = hp["num_hidden_layers"]
    rope = _rope_params(hp)
    w.add_block_count(n_layer)                              # --no-mtp: the MTP block is not converted
    if (v := hp.get("max_position_embeddings")) is not None:
        w.add_context_length(v)
    w.add_embedding_length(hp["hidden_size"])
    if (v := hp.get("intermediate_size")) is not None:
        w.add_feed_forward_length(v)
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    sections = list(rope.get("mrope_section") or [11, 11, 10, 0])
    w.add_rope_dimension_sections((sections + [0, 0, 0, 0])[:4])
    if (v := rope.get("rope_theta")) is not None:
        w.add_rope_freq_base(v)
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if (v := hp.get("num_experts")) is not None:
        w.add_expert_count(v)
    if (v := hp.get("num_experts_per_tok")) is not None:
        w.add_expert_used_count(v)
    head_dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    if hp.get("head_dim") is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(file_type)
    if (v := hp.get("moe_intermediate_size")) is not None:
        w.add_expert_feed_forward_length(v)
    if (v := hp.get("shared_expert_intermediate_size")) is not None:
        w.add_expert_shared_feed_forward_length(v)
    w.add_ssm_conv_kernel(hp["linear_conv_kernel_dim"])
    w.add_ssm_state_size(hp["linear_key_head_dim"])
    w.add_ssm_group_count(hp["linear_num_key_heads"])
    w.add_ssm_time_step_rank(hp["linear_num_value_heads"])
    w.add_ssm_inner_size(hp["linear_value_head_dim"] * hp["linear_num_value_heads"])
    if hp.get("layer_types") is not None:
        # gguf 0.19.0 has no add_recurrent_layers; llama.cpp's gguf-py writes this bool array
        w.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in _layer_types(hp, n_layer)])
    w.add_full_attention_interval(hp.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))


_SPECIAL_TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")


def _added_token_text(tok, content: str, normalized: bool) -> str:
    # llama.cpp assumes control/user-defined tokens are pre-normalised: it round-trips non-normalised ones
    if normalized:
        return content
    return tok.decode(tok.encode(content, add_special_tokens=False).ids, skip_special_tokens=False)


def _looks_special(text: str) -> bool:
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<｜") and text.endswith("｜>")) or (text.startswith("<unused") and text.endswith(">")))


def _pre_tokenizer(tj: dict, tok) -> str:
    """tokenizer.ggml.pre: llama.cpp's hash of the ids of _CHKTXT, or the split regex itself (which is what lets
    a truncated test vocabulary through, oracle pitfall 3)."""
    chkhsh = sha256(str(tok.encode(_CHKTXT).ids).encode()).hexdigest()
    if chkhsh in _PRE_BY_HASH:
        return _PRE_BY_HASH[chkhsh]
    pre = tj.get("pre_tokenizer") or {}
    for p in pre.get("pretokenizers", [pre]):
        if p.get("type") == "Split" and (p.get("pattern") or {}).get("Regex") == QWEN35_PATTERN:
            return "qwen35"
    raise FormatError(f"tokenizer.json: unrecognised BPE pre-tokenizer (ids hash {chkhsh}); Qwen3.5/3.6 "
                      f"tokenizers split with {QWEN35_PATTERN!r}")


def _add_tokenizer(w, hf_dir: Path, hp: dict) -> None:
    """tokenizer.ggml.* and the chat template, as llama.cpp's _set_vocab_gpt2 + gguf.SpecialVocab write them."""
    import gguf
    from tokenizers import Tokenizer

    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        raise FormatError(f"{path} not found: Qwen3.5/3.6 checkpoints ship a tokenizers-format tokenizer.json")
    text = path.read_text(encoding="utf-8")
    tj = json.loads(text)
    if (tj.get("model") or {}).get("type") != "BPE":
        raise FormatError(f"{path}: expected a BPE model, got {(tj.get('model') or {}).get('type')!r}")
    tok = Tokenizer.from_str(text)
    added = tj.get("added_tokens") or []
    vocab: dict[str, int] = dict(tj["model"]["vocab"])
    vocab.update({a["content"]: a["id"] for a in added})
    n_vocab = hp.get("vocab_size", len(vocab))
    if max(vocab.values()) >= n_vocab:
        raise FormatError(f"{path}: token id {max(vocab.values())} ≥ vocab_size {n_vocab} of config.json")

    reverse = {i: t for t, i in vocab.items()}
    added_by_id = {a["id"]: a for a in added}
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added_by_id:
            a = added_by_id[i]
            t = _added_token_text(tok, a["content"], a.get("normalized", True))
            if a.get("special") or _looks_special(t):
                types.append(gguf.TokenType.CONTROL)
            else:
                t = t.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
            tokens.append(t)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(_pre_tokenizer(tj, tok))
    w.add_token_list(tokens)
    w.add_token_types(types)

    merges = tj["model"].get("merges") or []
    if merges and isinstance(merges[0], list):          # tokenizers ≥ 0.20 pair format; spaces become U+0120
        merges = [" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in pair)
                  for pair in merges]
    if merges:
        w.add_token_merges(merges)

    ids, add = _special_tokens(hf_dir, tj, added)
    for typ, tid in ids.items():
        if (fn := getattr(w, f"add_{typ}_token_id", None)) is not None:
            fn(tid)
    for typ, value in add.items():
        if (fn := getattr(w, f"add_add_{typ}_token", None)) is not None:
            fn(value)
    if (template := _chat_template(hf_dir)) is not None:
        w.add_chat_template(template)
    lower, strip = _normalizer_flags(tj.get("normalizer"))
    if lower is not None:
        w.add_bool("tokenizer.ggml.normalizer.lowercase", lower)
    if strip is not None:
        w.add_bool("tokenizer.ggml.normalizer.strip_accents", strip)


def _normalizer_flags(norm: dict | None) -> tuple[bool | None, bool | None]:
    lower = strip = None
    for n in ((norm or {}).get("normalizers") or [norm or {}]):
        if n.get("type") == "Lowercase":
            lower = True
        elif n.get("type") == "StripAccents":
            strip = True
        elif n.get("type") == "BertNormalizer":
            lower, strip = n.get("lowercase", lower), n.get("strip_accents", strip)
    return lower, strip


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _special_tokens(hf_dir: Path, tj: dict, added: list[dict]) -> tuple[dict[str, int], dict[str, bool]]:
    """Special ids from tokenizer_config.json (by added-token content), then config.json *_token_id; add_*_token
    from the post-processor (ByteLevel: no BOS/EOS) then tokenizer_config.json. First value found wins.
    (TemplateProcessing/RobertaProcessing post-processors are not used by Qwen and not handled.)"""
    ids: dict[str, int] = {}
    add: dict[str, bool] = {}
    post = tj.get("post_processor") or {}
    for p in post.get("processors", [post]) if post else []:
        if p.get("type") == "ByteLevel":
            add.setdefault("bos", False)
            add.setdefault("eos", False)
    tc = _read_json(hf_dir / "tokenizer_config.json") or {}
    for typ in _SPECIAL_TYPES:
        if isinstance(v := tc.get(f"add_{typ}_token"), bool):
            add.setdefault(typ, v)
        entry = tc.get(f"{typ}_token")
        content = entry.get("content") if isinstance(entry, dict) else entry
        if isinstance(content, str):
            tid = next((a["id"] for a in added if a["content"] == content), None)
            if isinstance(tid, int):
                ids.setdefault(typ, tid)
    config = _read_json(hf_dir / "config.json") or {}
    for typ in _SPECIAL_TYPES:
        tid = config.get(f"{typ}_token_id")
        if tid is None:
            tid = (config.get("text_config") or {}).get(f"{typ}_token_id")
        if isinstance(tid, int) and not isinstance(tid, bool):
            if tid < 0:
                raise FormatError(f"config.json: invalid {typ}_token_id {tid}")
            ids.setdefault(typ, tid)
    return ids, add


def _chat_template(hf_dir: Path):
    """tokenizer_config.json's chat_template, else chat_template.jinja (transformers 5 writes it there)."""
    tc = _read_json(hf_dir / "tokenizer_config.json")
    if tc is None:
        return None
    alt = None
    jinja, js = hf_dir / "chat_template.jinja", hf_dir / "chat_template.json"
    if jinja.is_file():
        alt = jinja.read_text(encoding="utf-8")
        extra = sorted((hf_dir / "additional_chat_templates").glob("*.jinja"))
        if extra:
            alt = [{"name": "default", "template": alt}] + [
                {"name": p.stem, "template": p.read_text(encoding="utf-8")} for p in extra]
    elif js.is_file():
        alt = json.loads(js.read_text(encoding="utf-8")).get("chat_template")
    template = tc.get("chat_template", alt)
    return template if isinstance(template, (str, list)) else None


# ---------------------------------------------------------------------------------------------------- convert

def _write(path, arch: str, outs, hf_dir: Path, hp, outtype: str, progress: bool, desc: str) -> None:
    """The GGUF of `outs` (the converter's plan) and its metadata, tensor by tensor, to path."""
    import gguf
    from tqdm import tqdm

    w = gguf.GGUFWriter(path, arch)
    try:
        total = 0
        for out in outs:
            block, size = gguf.GGML_QUANT_SIZES[out.qtype]
            nbytes = int(np.prod(out.shape, dtype=np.int64)) // block * size
            w.add_tensor_info(out.name, out.shape, np.dtype(np.float32), nbytes, raw_dtype=out.qtype)
            total += nbytes
        _add_general(w, hf_dir)
        _add_hparams(w, hp, arch, gguf.LlamaFileType[OUTTYPES[outtype][1]])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _add_tokenizer(w, hf_dir, hp)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        with tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not progress) as bar:
            for out in outs:
                x = out.load()
                if x.shape != out.shape:
                    raise FormatError(f"{out.name}: planned shape {out.shape}, loaded {x.shape}")
                data = gguf.quants.quantize(np.ascontiguousarray(x), out.qtype)
                w.write_tensor_data(data)
                bar.update(data.nbytes)
    finally:
        w.close()


def convert(hf_dir, out_path, outtype: str = "f16", progress: bool = True) -> Path:
    """Convert a Hugging Face Qwen3.5 / Qwen3.6 text checkpoint to a GGUF file llama.cpp would also write.

    hf_dir:   directory with config.json (model_type qwen3_5_text, qwen3_5_moe_text, or the VLM qwen3_5 /
              qwen3_5_moe, whose vision tower and MTP head are skipped), *.safetensors (sharded index supported;
              F32/F16/BF16) and tokenizer.json (+ tokenizer_config.json for special tokens and chat template).
    out_path: the .gguf to write; written to a temporary file beside it and renamed when complete.
    outtype:  type of the large matrices: "f32", "f16" (default: lossless for BF16 checkpoints' range in
              practice, and what pre-Ampere GPUs compute in), "bf16" (lossless for BF16 checkpoints), "q8_0" or
              "q4_0" (gguf-py's quantisers; for K-quant mixes run llama-quantize on an f16 file).
              Norms, 1-D tensors, ssm_conv1d, ssm_a, ssm_dt and the routers stay F32 whatever is asked.
    progress: show a tqdm progress bar (bytes written).
    Returns out_path. Raises FormatError for a missing config/tensor/tokenizer or an unsupported model_type.
    """
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {', '.join(OUTTYPES)}, got {outtype!r}")
    hp, arch = load_hparams(hf_dir)
    ck = Checkpoint(hf_dir)
    outs = _plan(ck, hp, arch, outtype)

    try:
        with written_atomically(out_path) as tmp:
            _write(tmp, arch, outs, hf_dir, hp, outtype, progress, out_path.name)
    finally:
        ck.close()
    return out_path


def main(argv: Sequence[str] | None = None) -> int:
    """legacy-engine convert HF_DIR OUT.gguf [--outtype f32|f16|bf16|q8_0|q4_0] [--no-progress]"""
    ap = argparse.ArgumentParser(prog="legacy-engine convert",
                                 description="Convert a Hugging Face Qwen3.5/3.6 text checkpoint to GGUF "
                                             "(same layout as llama.cpp's convert_hf_to_gguf.py --no-mtp).")
    ap.add_argument("hf_dir", type=Path, help="checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    ap.add_argument("out", type=Path, help="output .gguf path")
    ap.add_argument("--outtype", choices=list(OUTTYPES), default="f16",
                    help="type of the weight matrices (default f16); norms/routers/conv/ssm_a/dt stay f32")
    ap.add_argument("--mmproj", type=Path, default=None, metavar="MMPROJ.gguf",
                    help="also write the checkpoint's vision tower as llama.cpp's mmproj GGUF (run/chat/serve "
                         "--mmproj read it)")
    ap.add_argument("--mmproj-outtype", choices=list(MMPROJ_OUTTYPES), default="f16",
                    help="type of the vision tower's matrices (default f16, as llama.cpp's common files)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    convert(args.hf_dir, args.out, outtype=args.outtype, progress=not args.no_progress)
    if args.mmproj is not None:
        convert_mmproj(args.hf_dir, args.mmproj, outtype=args.mmproj_outtype, progress=not args.no_progress)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
