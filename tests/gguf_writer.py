"""Small valid GGUFs for the reader's tests: any Hparams, tensors from the schema, no tokenizer.

Written with gguf-py's GGUFWriter (not with our make-model) so the reader is tested against
a writer we did not write.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from legacy_engine.format.gguf_model import Hparams, expected_tensors


def small_hparams(arch: str = "qwen35moe", **kw) -> Hparams:
    base = dict(arch=arch, n_layer_all=4, n_nextn=0, n_ctx_train=4096, n_embd=64, n_head=2, n_head_kv=1,
                head_dim=32, head_dim_v=32, rms_eps=1e-6, rope_theta=1e7, n_rot=16,
                rope_sections=(3, 3, 2, 0) if arch != "qwen3next" else (0, 0, 0, 0),
                ssm_conv_kernel=4, ssm_d_state=16, ssm_n_group=2, ssm_dt_rank=4, ssm_d_inner=64,
                recurrent=(True, True, True, False), n_vocab=96, tied_embeddings=True)
    if arch == "qwen35":
        base.update(n_ff=96)
    else:
        base.update(n_expert=4, n_expert_used=2, n_ff_exp=32, n_ff_shexp=32)
    base.update(kw)
    return Hparams(**base)


def hparam_metadata(hp: Hparams) -> dict:
    a = hp.arch
    m = {f"{a}.block_count": hp.n_layer_all, f"{a}.context_length": hp.n_ctx_train,
         f"{a}.embedding_length": hp.n_embd, f"{a}.attention.head_count": hp.n_head,
         f"{a}.attention.head_count_kv": hp.n_head_kv, f"{a}.attention.key_length": hp.head_dim,
         f"{a}.attention.value_length": hp.head_dim_v, f"{a}.attention.layer_norm_rms_epsilon": hp.rms_eps,
         f"{a}.rope.freq_base": hp.rope_theta, f"{a}.rope.dimension_count": hp.n_rot,
         f"{a}.ssm.conv_kernel": hp.ssm_conv_kernel, f"{a}.ssm.state_size": hp.ssm_d_state,
         f"{a}.ssm.group_count": hp.ssm_n_group, f"{a}.ssm.time_step_rank": hp.ssm_dt_rank,
         f"{a}.ssm.inner_size": hp.ssm_d_inner, f"{a}.full_attention_interval": 4}
    if a != "qwen3next":
        m[f"{a}.rope.dimension_sections"] = list(hp.rope_sections)
    if hp.n_nextn:
        m[f"{a}.nextn_predict_layers"] = hp.n_nextn
    if hp.is_moe:
        m.update({f"{a}.expert_count": hp.n_expert, f"{a}.expert_used_count": hp.n_expert_used,
                  f"{a}.expert_feed_forward_length": hp.n_ff_exp,
                  f"{a}.expert_shared_feed_forward_length": hp.n_ff_shexp})
    else:
        m[f"{a}.feed_forward_length"] = hp.n_ff
    return m


def add_key(w: GGUFWriter, k: str, v) -> None:
    """One metadata key, typed as the engine's loader reads it (bool, uint32, float32, string, array)."""
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


def write_gguf(path, hp: Hparams, *, drop=(), reshape=None, extra_tensors=None, drop_keys=(),
               extra_keys=None, seed=0) -> str:
    """Writes an f32 model of hp. drop: tensor names to leave out; reshape: name -> ne to write
    instead; extra_tensors: name -> ne to add; drop_keys / extra_keys: metadata edits."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), hp.arch)
    meta = hparam_metadata(hp)
    meta.update(extra_keys or {})
    for k, v in meta.items():
        if k not in drop_keys:
            add_key(w, k, v)
    tensors = dict(expected_tensors(hp))
    for name in drop:
        tensors.pop(name)
    tensors.update(reshape or {})
    tensors.update(extra_tensors or {})
    for name, ne in tensors.items():
        w.add_tensor(name, rng.standard_normal(tuple(reversed(ne))).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


SMALL_VOCAB = 512    # small_quantized files: a small head keeps the reference tier quick


def small_quantized(preset: str, quant: str, path: Path, layers: int = 4, seed: int = 0) -> Path:
    """A make-model file of `preset` cut to `layers` layers ([L,L,L,F]) with a vocabulary of SMALL_VOCAB: the
    tensor plan and random blocks are make-model's (llama.cpp's type rules), written with gguf-py's GGUFWriter."""
    from gguf import GGML_QUANT_SIZES
    from legacy_engine.format.presets import plan_tensors, preset_hparams
    from legacy_engine.tools.make_model import tensor_chunks

    hp = dataclasses.replace(preset_hparams(preset, layers), n_vocab=SMALL_VOCAB)
    specs, _ = plan_tensors(hp, quant)
    w = GGUFWriter(str(path), hp.arch)
    for k, v in hparam_metadata(hp).items():
        add_key(w, k, v)
    for s in specs:
        data = np.concatenate(list(tensor_chunks(s, hp, seed, tame=True))).view(np.uint8)
        block, size = GGML_QUANT_SIZES[s.qtype]
        shape = tuple(reversed(s.ne))
        raw = shape[:-1] + (shape[-1] // block * size,)
        w.add_tensor(s.name, data.reshape(raw), raw_shape=raw, raw_dtype=s.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
