"""The Qwen3.5/3.6 vision projector GGUF (legacy_engine.format.mmproj) against llama.cpp's own conversion of tiny
seeded transformers checkpoints (tests/fixtures/tiny_vision.py): hyperparameters, schema, the tensors' relation to the
HF weights, and a clear FormatError for every malformed file (corrupted copies written with gguf-py's GGUFWriter or
by patching bytes; 200 seeded byte flips / truncations)."""
from __future__ import annotations

import dataclasses
import json
import struct

import numpy as np
import pytest

from legacy_engine.core.errors import FormatError
from legacy_engine.format.gguf_file import GGUFFile
from legacy_engine.format.gguf_model import ModelFile
from legacy_engine.format.mmproj import (MmprojFile, check_compatible, check_not_mmproj, expected_tensors,
                                         is_mmproj, tensor_name, tensor_roles)

pytestmark = pytest.mark.cpu
gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def dense_f32(tiny_vision_gguf):
    return tiny_vision_gguf("dense", "f32")


# ---------------------------------------------------------------------------------------------- the real files
@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("kind,outtype", [("dense", "f32"), ("dense", "f16"), ("moe", "f32"), ("moe", "f16")])
def test_hparams_equal_the_hf_config(tiny_vision_gguf, kind, outtype):
    hf, text, mmproj = tiny_vision_gguf(kind, outtype)
    cfg = json.loads((hf / "config.json").read_text())
    v, pre = cfg["vision_config"], json.loads((hf / "preprocessor_config.json").read_text())
    hp = MmprojFile.open(mmproj).hparams
    assert (hp.depth, hp.hidden, hp.n_head, hp.ffn) == (v["depth"], v["hidden_size"], v["num_heads"],
                                                        v["intermediate_size"])
    assert (hp.patch_size, hp.temporal_patch, hp.merge) == (v["patch_size"], v["temporal_patch_size"],
                                                            v["spatial_merge_size"])
    assert hp.n_pos == v["num_position_embeddings"] and hp.pos_side ** 2 == hp.n_pos
    assert hp.out_hidden == v["out_hidden_size"] == cfg["text_config"]["hidden_size"]
    assert hp.head_dim == v["hidden_size"] // v["num_heads"]
    assert hp.eps == pytest.approx(1e-6, rel=1e-6)            # transformers' LayerNorm(eps=1e-6) throughout
    assert hp.rope_theta == v["rope_parameters"]["rope_theta"]
    assert hp.image_mean == pytest.approx(pre["image_mean"]) and hp.image_std == pytest.approx(pre["image_std"])
    assert (hp.min_pixels, hp.max_pixels) == (pre["size"]["shortest_edge"], pre["size"]["longest_edge"])
    check_compatible(hp, ModelFile.open(text).hparams)


@pytest.mark.oracle
@pytest.mark.parametrize("outtype", ["f32", "f16"])
def test_schema_is_exactly_the_file(tiny_vision_gguf, outtype):
    m = MmprojFile.open(tiny_vision_gguf("dense", outtype)[2])
    want = expected_tensors(m.hparams)
    assert set(want) == set(m.tensors)
    assert {n: m.tensors[n].ne for n in want} == want
    assert set(m.roles) == set(m.tensors) == set(tensor_roles(m.hparams))
    for name, (role, block) in m.roles.items():
        assert tensor_name(role, block) == name and m.tensor(role, block).name == name


@pytest.mark.oracle
def test_tensors_are_the_hf_weights(dense_f32):
    """The converter's transforms: the Conv3d cut in two along time, everything else copied."""
    from safetensors.numpy import load_file
    hf, _, mmproj = dense_f32
    w = {k.removeprefix("model.visual."): v for k, v in load_file(str(hf / "model.safetensors")).items()}
    m = MmprojFile.open(mmproj)

    def get(role, block=None):
        t = m.tensor(role, block)
        return np.asarray(m.gguf.data(t.name).view("<f4").reshape(t.ne[::-1]))
    pw = w["patch_embed.proj.weight"]
    np.testing.assert_array_equal(get("patch_w0"), pw[:, :, 0])
    np.testing.assert_array_equal(get("patch_w1"), pw[:, :, 1])
    hf_names = {"patch_b": "patch_embed.proj.bias", "pos_embd": "pos_embed.weight",
                "merger_norm_w": "merger.norm.weight", "merger_norm_b": "merger.norm.bias",
                "merger_fc1_w": "merger.linear_fc1.weight", "merger_fc1_b": "merger.linear_fc1.bias",
                "merger_fc2_w": "merger.linear_fc2.weight", "merger_fc2_b": "merger.linear_fc2.bias"}
    for role, hf_name in hf_names.items():
        np.testing.assert_array_equal(get(role), w[hf_name], err_msg=role)
    block = {"ln1": "norm1", "qkv": "attn.qkv", "o": "attn.proj", "ln2": "norm2", "fc1": "mlp.linear_fc1",
             "fc2": "mlp.linear_fc2"}
    for i in range(m.hparams.depth):
        for role, hf_name in block.items():
            for suf, hsuf in (("_w", "weight"), ("_b", "bias")):
                np.testing.assert_array_equal(get(role + suf, i), w[f"blocks.{i}.{hf_name}.{hsuf}"])


@pytest.mark.oracle
def test_reference_embeddings_shape(dense_f32):
    from fixtures.tiny_vision import reference_vision_embeddings, sample_image
    pixels, grid = sample_image((4, 6))
    e = reference_vision_embeddings(dense_f32[0], pixels, grid)
    assert e.shape == (4 * 6 // 4, 64) and e.dtype == np.float32
    assert np.isfinite(e).all() and 0.1 < e.std() < 10


# ---------------------------------------------------------------------------------------------- corrupted copies
def rewrite(src, dst, meta=None, drop=(), tensors=None) -> str:
    """A copy of GGUF src at dst with metadata keys changed (meta: key -> value, or -> (value, vtype[, elem type])),
    keys/tensors named in drop left out, and tensors replaced or added (name -> (array in HF order, ggml type))."""
    f = GGUFFile(src)
    md = dict(f.metadata)
    md.update(meta or {})
    w = gguf.GGUFWriter(str(dst), md["general.architecture"])
    for key, val in md.items():
        if key == "general.architecture" or key in drop:
            continue
        if isinstance(val, tuple):
            w.add_key_value(key, val[0], *val[1:])
        elif key in f.metadata:
            w.add_key_value(key, val, gguf.GGUFValueType.ARRAY if f.is_array(key) else f.value_type(key),
                            sub_type=f.value_type(key) if f.is_array(key) else None)
        else:
            raise AssertionError(f"give the value type of the new key {key}")
    new = dict(tensors or {})
    for name, t in f.tensors.items():
        if name in drop:
            continue
        if name in new:
            arr, qtype = new.pop(name)
            w.add_tensor(name, arr, raw_dtype=qtype)
        else:
            qt = gguf.GGMLQuantizationType(t.type)
            block, size = gguf.GGML_QUANT_SIZES[qt]
            byte_shape = (*t.ne[:0:-1], t.ne[0] // block * size)            # gguf-py takes quantised data as bytes
            w.add_tensor(name, np.array(f.data(name)).reshape(byte_shape), raw_dtype=qt)
    for name, (arr, qtype) in new.items():
        w.add_tensor(name, arr, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(dst)


F32, Q2_K = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q2_K
U32, F32V, STR, BOOL, ARR = (gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.STRING,
                             gguf.GGUFValueType.BOOL, gguf.GGUFValueType.ARRAY)


def _zeros(*shape):
    return np.zeros(shape, np.float32), F32


BAD = {   # case -> (rewrite kwargs, what the message must contain)
    "projector type": (dict(meta={"clip.projector_type": "qwen2vl_merger"}), "'qwen2vl_merger' is not supported"),
    "no projector type": (dict(drop=("clip.projector_type",)), "'clip.projector_type' is missing"),
    "not clip": (dict(meta={"general.architecture": "llava"}), "expected 'clip'"),
    "no vision encoder": (dict(meta={"clip.has_vision_encoder": False}), "no vision encoder"),
    "missing merge": (dict(drop=("clip.vision.spatial_merge_size",)), "'clip.vision.spatial_merge_size' is missing"),
    "missing depth": (dict(drop=("clip.vision.block_count",)), "'clip.vision.block_count' is missing"),
    "missing eps": (dict(drop=("clip.vision.attention.layer_norm_epsilon",)), "layer_norm_epsilon' is missing"),
    "missing mean": (dict(drop=("clip.vision.image_mean",)), "'clip.vision.image_mean' is missing"),
    "missing proj dim": (dict(drop=("clip.vision.projection_dim",)), "'clip.vision.projection_dim' is missing"),
    "string size": (dict(meta={"clip.vision.embedding_length": ("64", STR)}), "should be an integer"),
    "zero depth": (dict(meta={"clip.vision.block_count": 0}), "block_count = 0, expected > 0"),
    "heads do not divide": (dict(meta={"clip.vision.attention.head_count": 3}), "not a multiple of"),
    "head size not /4": (dict(meta={"clip.vision.attention.head_count": 32}), "head size 2 is not a multiple of 4"),
    "eps out of range": (dict(meta={"clip.vision.attention.layer_norm_epsilon": 0.0}), "expected in (0, 1)"),
    "std zero": (dict(meta={"clip.vision.image_std": ([0.5, 0.0, 0.5], ARR, F32V)}), "expected 3 numbers > 0"),
    "mean of 2": (dict(meta={"clip.vision.image_mean": ([0.5, 0.5], ARR, F32V)}), "expected 3 finite numbers"),
    "deepstack": (dict(meta={"clip.vision.is_deepstack_layers": ([True, False], ARR, BOOL)}), "deepstack"),
    "no gelu": (dict(meta={"clip.use_gelu": False}), "clip.use_gelu"),
    "image size": (dict(meta={"clip.vision.image_size": 96}), "image_size = 96 disagrees"),
    "n_pos not square": (dict(tensors={"v.position_embd.weight": _zeros(60, 64)}), "60 positions, not a square"),
    "no position embd": (dict(drop=("v.position_embd.weight",)), "'v.position_embd.weight' is missing"),
    "missing tensor": (dict(drop=("v.blk.1.attn_qkv.bias",)), "'v.blk.1.attn_qkv.bias' is missing"),
    "missing merger": (dict(drop=("mm.2.weight",)), "merger: required tensor 'mm.2.weight' is missing"),
    "misshapen ffn": (dict(tensors={"v.blk.0.ffn_up.weight": _zeros(96, 64)}),
                      "'v.blk.0.ffn_up.weight' has ne=[64, 96]"),
    "misshapen kernel": (dict(tensors={"v.patch_embd.weight.1": _zeros(64, 3, 14, 14)}),
                         "'v.patch_embd.weight.1' has ne=[14, 14, 3, 64], expected [16, 16, 3, 64]"),
    "out width": (dict(tensors={"mm.2.weight": _zeros(32, 256)}), "'mm.2.weight' has ne=[256, 32], expected [256, 64]"),
    "more blocks than the depth": (dict(meta={"clip.vision.block_count": 3}), "'v.blk.2.ln1.weight' is missing"),
    "extra tensor": (dict(tensors={"v.deepstack.0.norm.weight": _zeros(64)}), "unexpected tensor 'v.deepstack.0.norm"),
    "Q2_K weight": (dict(tensors={"mm.0.weight": (np.zeros((256, 84), np.uint8), Q2_K)}), "ggml type Q2_K"),
}


@pytest.mark.oracle
@pytest.mark.parametrize("case", BAD)
def test_bad_file_is_a_clear_error(dense_f32, tmp_path, case):
    kw, msg = BAD[case]
    path = rewrite(dense_f32[2], tmp_path / "bad.gguf", **kw)
    with pytest.raises(FormatError) as e:
        MmprojFile.open(path)
    assert msg in str(e.value) and str(path) in str(e.value)


@pytest.mark.oracle
def test_rewrite_of_a_good_file_opens(dense_f32, tmp_path):
    """The corrupting writer itself keeps a good file good (so each BAD case tests its one change)."""
    a = MmprojFile.open(dense_f32[2])
    b = MmprojFile.open(rewrite(dense_f32[2], tmp_path / "same.gguf"))
    assert a.hparams == b.hparams and {n: t.ne for n, t in a.tensors.items()} == {n: t.ne for n, t in b.tensors.items()}


@pytest.mark.oracle
def test_temporal_patch_1_without_the_second_kernel(dense_f32, tmp_path):
    m = MmprojFile.open(rewrite(dense_f32[2], tmp_path / "t1.gguf", drop=("v.patch_embd.weight.1",)))
    assert m.hparams.temporal_patch == 1 and m.hparams.patch_pixels == 3 * 16 * 16
    assert "v.patch_embd.weight.1" not in m.roles


def _type_field(data: bytes, name: str) -> int:
    """Offset of the u32 ggml type in the tensor info of `name`."""
    key = struct.pack("<Q", len(name)) + name.encode()
    pos = data.index(key) + len(key)
    n_dims = struct.unpack_from("<I", data, pos)[0]
    return pos + 4 + 8 * n_dims


@pytest.mark.oracle
def test_unknown_ggml_type(dense_f32, tmp_path):
    data = bytearray(dense_f32[2].read_bytes())
    struct.pack_into("<I", data, _type_field(bytes(data), "mm.0.weight"), 999)
    (tmp_path / "t.gguf").write_bytes(data)
    with pytest.raises(FormatError, match="'mm.0.weight' has unknown ggml type id 999"):
        MmprojFile.open(tmp_path / "t.gguf")


@pytest.mark.oracle
def test_text_model_is_refused_as_mmproj(dense_f32):
    with pytest.raises(FormatError, match=r"is a text model GGUF \(general.architecture = 'qwen35'\), not a vision"):
        MmprojFile.open(dense_f32[1])


@pytest.mark.oracle
def test_mmproj_is_refused_as_text_model(dense_f32):
    _, text, mmproj = dense_f32
    assert is_mmproj(GGUFFile(mmproj).metadata) and not is_mmproj(GGUFFile(text).metadata)
    check_not_mmproj(GGUFFile(text).metadata, str(text))
    with pytest.raises(FormatError, match="is a vision projector .mmproj.*not a text model"):
        check_not_mmproj(GGUFFile(mmproj).metadata, str(mmproj))
    with pytest.raises(FormatError):                                        # the text loader refuses it as well
        ModelFile.open(mmproj)


@pytest.mark.oracle
def test_check_compatible(dense_f32):
    _, text, mmproj = dense_f32
    hp, thp = MmprojFile.open(mmproj).hparams, ModelFile.open(text).hparams
    check_compatible(hp, thp)
    check_compatible(hp, 64)
    with pytest.raises(FormatError, match="outputs 64-wide embeddings .* embedding_length is 128"):
        check_compatible(hp, dataclasses.replace(thp, n_embd=128))


@pytest.mark.oracle
def test_fuzzed_files_fail_cleanly(dense_f32, tmp_path):
    """200 seeded corruptions (1-8 byte flips, most in the header, or a truncation): each opens or is a
    FormatError, never another exception."""
    good = dense_f32[2].read_bytes()
    header = GGUFFile(dense_f32[2]).data_start
    rng = np.random.default_rng(20261126)
    outcomes = {"ok": 0, "FormatError": 0}
    for i in range(200):
        data = bytearray(good)
        if rng.random() < 0.2:
            data = data[:int(rng.integers(0, len(good)))]
        else:
            for _ in range(int(rng.integers(1, 9))):
                pos = int(rng.integers(0, header if rng.random() < 0.8 else len(good)))
                data[pos] ^= 1 << int(rng.integers(0, 8))
        path = tmp_path / f"fuzz{i}.gguf"
        path.write_bytes(bytes(data))
        try:
            MmprojFile.open(path)
            outcomes["ok"] += 1
        except FormatError:
            outcomes["FormatError"] += 1
        path.unlink()
    assert outcomes["FormatError"] > 50, outcomes                 # the corruptions do reach the checks
