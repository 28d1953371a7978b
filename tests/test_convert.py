"""`legacy-engine convert` against llama.cpp's own converter on the tiny real-structure checkpoints.

Oracle tests convert each tiny kind with ours and with llama.cpp's convert_hf_to_gguf.py (--no-mtp) and demand the
same file content: tensor names, shapes, types, values; every metadata key. The rest needs no llama.cpp: other
checkpoint layouts (VLM names, fused experts, shards, BF16) must convert to the same tensors, and bad inputs must
raise FormatError.
"""
from __future__ import annotations

import json
import shutil
from hashlib import sha256
from pathlib import Path

import numpy as np
import pytest
import tolerances as tol

from legacy_engine.tools.convert import convert, main, tile_v_heads
from legacy_engine.core.errors import FormatError

gguf = pytest.importorskip("gguf")

pytestmark = pytest.mark.cpu

KINDS = ("moe", "moe_hv_eq_hk", "dense", "dense_tied")


def _kv(r) -> dict:
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def _tensors(r) -> dict:
    return {t.name: t for t in r.tensors}


def assert_same_gguf(ours: Path, theirs: Path, f32_rtol: float = tol.CONVERT_F32_REL) -> None:
    """Same keys and values, same tensor names/shapes/types; quantised bytes identical, float values within rtol."""
    a, b = gguf.GGUFReader(ours), gguf.GGUFReader(theirs)
    ka, kb = _kv(a), _kv(b)
    assert sorted(ka) == sorted(kb)
    for k in kb:
        assert ka[k] == kb[k], k
    ta, tb = _tensors(a), _tensors(b)
    assert sorted(ta) == sorted(tb)
    for name, y in tb.items():
        x = ta[name]
        assert (x.tensor_type, list(x.shape)) == (y.tensor_type, list(y.shape)), name
        dx, dy = np.asarray(x.data), np.asarray(y.data)
        if y.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            np.testing.assert_allclose(dx, dy, rtol=f32_rtol, atol=0, err_msg=name)
        else:                                   # BF16 / Q8_0: raw bytes
            assert np.array_equal(dx, dy), name


@pytest.fixture(scope="module")
def ours(tiny_hf, tmp_path_factory):
    """ours(kind, outtype="f32") -> our GGUF of the tiny checkpoint, made once per module."""
    made, root = {}, tmp_path_factory.mktemp("ours")

    def get(kind: str, outtype: str = "f32") -> Path:
        if (kind, outtype) not in made:
            made[kind, outtype] = convert(tiny_hf(kind), root / f"{kind}.{outtype}.gguf", outtype, progress=False)
        return made[kind, outtype]
    return get


@pytest.fixture(scope="module")
def theirs(tiny_hf, llama_cpp_convert, tmp_path_factory):
    """theirs(kind, outtype="f32") -> llama.cpp's GGUF of the tiny checkpoint, made once per module."""
    made, root = {}, tmp_path_factory.mktemp("theirs")

    def get(kind: str, outtype: str = "f32") -> Path:
        if (kind, outtype) not in made:
            made[kind, outtype] = llama_cpp_convert(tiny_hf(kind), root / f"{kind}.{outtype}.gguf", outtype)
        return made[kind, outtype]
    return get


# ------------------------------------------------------------------------------------------------ against llama.cpp

@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_f32_matches_llama_cpp(kind, ours, theirs):
    assert_same_gguf(ours(kind), theirs(kind))


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["moe", "dense_tied"])
def test_q8_0_matches_llama_cpp_bit_exact(kind, ours, theirs):
    assert_same_gguf(ours(kind, "q8_0"), theirs(kind, "q8_0"))
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(ours(kind, "q8_0")).tensors}
    q8 = gguf.GGMLQuantizationType.Q8_0
    assert types["token_embd.weight"] == q8 and types["blk.0.attn_qkv.weight"] == q8
    # forced F32 whatever --outtype says
    for name in ("blk.0.ssm_conv1d.weight", "blk.0.ssm_a", "blk.0.ssm_dt.bias", "blk.0.attn_norm.weight"):
        assert types[name] == gguf.GGMLQuantizationType.F32, name
    if kind == "moe":
        assert types["blk.0.ffn_gate_exps.weight"] == q8
        assert types["blk.0.ffn_gate_inp.weight"] == gguf.GGMLQuantizationType.F32
        assert types["blk.0.ffn_gate_inp_shexp.weight"] == gguf.GGMLQuantizationType.F32


# ------------------------------------------------------------------------------------------------ ours alone

@pytest.mark.oracle
def test_metadata_of_moe(ours):
    kv = _kv(gguf.GGUFReader(ours("moe")))
    a = "qwen35moe"
    assert kv["general.architecture"] == a
    expect = {"block_count": 8, "embedding_length": 64, "attention.head_count": 2, "attention.head_count_kv": 1,
              "attention.key_length": 256, "rope.dimension_count": 64, "rope.dimension_sections": [11, 11, 10, 0],
              "ssm.group_count": 2, "ssm.time_step_rank": 4, "ssm.state_size": 128, "ssm.inner_size": 512,
              "ssm.conv_kernel": 4, "full_attention_interval": 4, "expert_count": 16, "expert_used_count": 4,
              "expert_feed_forward_length": 32, "expert_shared_feed_forward_length": 32,
              "attention.recurrent_layers": [True, True, True, False] * 2}
    for k, v in expect.items():
        assert kv[f"{a}.{k}"] == v, k
    assert f"{a}.nextn_predict_layers" not in kv and f"{a}.feed_forward_length" not in kv
    assert kv["tokenizer.ggml.pre"] == "qwen35" and kv["tokenizer.ggml.model"] == "gpt2"
    tokens = kv["tokenizer.ggml.tokens"]
    assert kv["tokenizer.ggml.eos_token_id"] == tokens.index("<|im_end|>")
    assert kv["tokenizer.ggml.padding_token_id"] == tokens.index("<|endoftext|>")
    assert tokens[-1].startswith("[PAD") and kv["tokenizer.ggml.token_type"][-1] == gguf.TokenType.UNUSED


def test_tile_v_heads_order():
    # H_k = 2, r = 2, head_dim 1: HF v-heads [g0s0, g0s1, g1s0, g1s1] → GGUF [g0s0, g1s0, g0s1, g1s1]
    x = np.array([0, 1, 2, 3])
    assert tile_v_heads(x, 0, 2, 1).tolist() == [0, 2, 1, 3]
    # GGUF v-head j uses k-head j mod H_k
    h_k, r, d = 3, 4, 2
    hf = np.repeat(np.arange(h_k * r) // r, d)            # k-head of each HF v-head channel (grouped)
    assert (tile_v_heads(hf, 0, h_k, d)[::d] == np.arange(h_k * r) % h_k).all()
    m = np.arange(2 * h_k * r * d).reshape(2, -1)          # columns permuted the same way
    assert (tile_v_heads(m, 1, h_k, d)[1] == tile_v_heads(m[1], 0, h_k, d)).all()


def _rewrite(src: Path, dst: Path, rename, config_fn, bf16: bool = False, shards: int = 1, extra=None) -> Path:
    """Copy checkpoint src to dst with tensors renamed/regrouped, an edited config, optional BF16 and shards."""
    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    tensors = rename(load_file(src / "model.safetensors"))
    tensors.update(extra or {})
    if bf16:
        tensors = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, dst / fname)
        weight_map.update({k: fname for k in part})
    if shards > 1:
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config_fn(config)))
    return dst


def _fuse_experts_vlm(t: dict) -> dict:
    """transformers' in-memory layout (fused experts) under VLM names (model.language_model.*)."""
    import torch
    out, experts = {}, {}
    for k, v in t.items():
        parts = k.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            experts.setdefault(".".join(parts[:i + 1]), {}).setdefault(parts[i + 2], {})[int(parts[i + 1])] = v
        else:
            out[k] = v
    for prefix, by_kind in experts.items():
        stack = {kind: torch.stack([d[e] for e in sorted(d)]) for kind, d in by_kind.items()}
        out[f"{prefix}.gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1)
        out[f"{prefix}.down_proj"] = stack["down_proj"]
    return {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
            for k, v in out.items()}


def _as_vlm_config(c: dict) -> dict:
    text = {k: v for k, v in c.items() if k not in ("architectures", "transformers_version")}
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "text_config": text, "vision_config": {"model_type": "qwen3_5_moe_vision", "depth": 1},
            "tie_word_embeddings": False}


@pytest.mark.oracle
def test_vlm_fused_sharded_layout_converts_the_same(tiny_hf, ours, tmp_path):
    import torch
    ref = ours("moe")
    extra = {"model.visual.blocks.0.attn.qkv.weight": torch.zeros(8, 8), "mtp.fc.weight": torch.zeros(4, 8),
             "mtp.layers.0.input_layernorm.weight": torch.zeros(64)}
    vlm = _rewrite(tiny_hf("moe"), tmp_path / "vlm", _fuse_experts_vlm, _as_vlm_config, shards=3, extra=extra)
    ours = convert(vlm, tmp_path / "vlm.gguf", outtype="f32", progress=False)
    ta, tb = _tensors(gguf.GGUFReader(ours)), _tensors(gguf.GGUFReader(ref))
    assert sorted(ta) == sorted(tb)
    for name, y in tb.items():
        assert list(ta[name].shape) == list(y.shape) and np.array_equal(ta[name].data, y.data), name


@pytest.mark.oracle
def test_bf16_checkpoint_widens_exactly(tiny_hf, tmp_path):
    import torch
    src = tiny_hf("moe")
    # the same values once as BF16 and once as F32 must give the same f32 GGUF (widening is exact); fused experts
    # so that the sliced BF16 read of gate_up_proj is exercised too
    rounded = _rewrite(src, tmp_path / "rounded",
                       lambda t: {k: v.to(torch.bfloat16).float() for k, v in _fuse_experts_vlm(t).items()},
                       _as_vlm_config)
    bf16 = _rewrite(src, tmp_path / "bf16", _fuse_experts_vlm, _as_vlm_config, bf16=True)
    a = convert(rounded, tmp_path / "a.gguf", outtype="f32", progress=False)
    b = convert(bf16, tmp_path / "b.gguf", outtype="f32", progress=False)
    ta, tb = _tensors(gguf.GGUFReader(a)), _tensors(gguf.GGUFReader(b))
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert np.array_equal(ta[name].data, tb[name].data), name


@pytest.mark.oracle
def test_cli_main_writes_bf16(tiny_hf, tmp_path):
    out = tmp_path / "t.gguf"
    assert main([str(tiny_hf("dense_tied")), str(out), "--outtype", "bf16", "--no-progress"]) == 0
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(out).tensors}
    assert types["token_embd.weight"] == gguf.GGMLQuantizationType.BF16 and "output.weight" not in types
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.gguf"]     # no temporary file left


@pytest.mark.oracle
def test_tiny_tokenizer_loads_in_transformers(tiny_hf):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer
    d = tiny_hf("moe")
    hf = AutoTokenizer.from_pretrained(d)
    assert type(hf).__name__ == "Qwen3_5Tokenizer"
    text = "<|im_start|>user\nhi 毕老师！1 + 1 = 2 <think>\n"
    assert hf.encode(text) == Tokenizer.from_file(str(d / "tokenizer.json")).encode(text).ids


@pytest.mark.slow
def test_full_vocab_tokenizer_hashes_as_qwen35(tmp_path):
    # the fixture's tokenizer.json writer with the whole real vocabulary gives llama.cpp's Qwen3.5 pre-tokenizer hash
    # (so tiny models differ from the real tokenizer only by truncation), and our hash check recognises it
    from tokenizers import Tokenizer

    from fixtures.tiny_models import write_tokenizer
    from legacy_engine.tools.convert import _CHKTXT, _PRE_BY_HASH
    from legacy_engine.format.vocab import qwen_vocab
    write_tokenizer(qwen_vocab(), tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert _PRE_BY_HASH[sha256(str(tok.encode(_CHKTXT).ids).encode()).hexdigest()] == "qwen35"


@pytest.mark.oracle
def test_tiny_model_logits_are_order_one(tiny_hf):
    # oracle pitfall 5: re-drawn weights give logit std ≈ 3, not transformers' near-flat default
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_hf("moe"), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.arange(100, 132)[None]).logits
    assert 1.0 < float(logits.std()) < 10.0


# ------------------------------------------------------------------------------------------------ negative

def test_missing_config_is_format_error(tmp_path):
    with pytest.raises(FormatError, match="config.json"):
        convert(tmp_path, tmp_path / "x.gguf", progress=False)


def test_unknown_model_type_is_format_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(FormatError, match="model_type 'llama'"):
        convert(tmp_path, tmp_path / "x.gguf", progress=False)


@pytest.mark.oracle
def test_missing_tensor_is_format_error(tiny_hf, tmp_path):
    bad = _rewrite(tiny_hf("dense"), tmp_path / "bad",
                   lambda t: {k: v for k, v in t.items() if k != "model.layers.5.linear_attn.A_log"}, lambda c: c)
    with pytest.raises(FormatError, match="blk.5.ssm_a"):
        convert(bad, tmp_path / "x.gguf", progress=False)
    assert not [p for p in tmp_path.iterdir() if p.name != "bad"]      # neither the file nor its temporary


@pytest.mark.oracle
def test_missing_tokenizer_is_format_error(tiny_hf, tmp_path):
    bad = _rewrite(tiny_hf("dense_tied"), tmp_path / "bad", lambda t: t, lambda c: c)
    (bad / "tokenizer.json").unlink()
    with pytest.raises(FormatError, match="tokenizer.json"):
        convert(bad, tmp_path / "x.gguf", progress=False)
    assert not [p for p in tmp_path.iterdir() if p.name != "bad"]      # neither the file nor its temporary
