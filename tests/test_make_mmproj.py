"""make-model --mmproj-out: random-weight vision projectors of the presets' real sizes, in llama.cpp's converter layout
(legacy_engine/tools/make_mmproj.py). The real-size files are written with --mmproj-depth 1 where the test encodes or
reads values (a 12-block f16 tower is 205 MB and a 448x448 encode takes seconds on 2 cores)."""
from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
from gguf import GGUFReader
from PIL import Image

from legacy_engine.cpu.vision import VisionTower
from legacy_engine.format import presets
from legacy_engine.format.image import preprocess
from legacy_engine.format.mmproj import PROJECTOR_TYPE, MmprojFile, expected_tensors
from legacy_engine.tools import make_mmproj as mp
from legacy_engine.tools import make_model as mm

pytestmark = pytest.mark.cpu

REAL = ("qwen3.5-0.8b", "qwen3.5-9b", "qwen3.6-35b-a3b")


@pytest.fixture(scope="module")
def mmproj_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("make_mmproj")
    made: dict[tuple, str] = {}

    def get(preset: str, outtype: str = "f16", depth: int | None = 1, seed: int = 0) -> str:
        key = (preset, outtype, depth, seed)
        if key not in made:
            made[key] = mp.make_mmproj(preset, str(root / f"{preset}-{outtype}-{depth}-{seed}.gguf"),
                                       outtype=outtype, depth=depth, seed=seed, progress=False)
        return made[key]
    return get


def test_vision_presets_match_spec():
    """Spec §2.7: 0.8B depth 12 / 768 / 12 heads / 3072; 35B-A3B (and 9B, third-party) 27 / 1152 / 16 / 4304."""
    for preset, want in {"qwen3.5-0.8b": (12, 768, 12, 3072), "qwen3.5-9b": (27, 1152, 16, 4304),
                         "qwen3.6-35b-a3b": (27, 1152, 16, 4304)}.items():
        hp = presets.preset_vision_hparams(preset)
        assert (hp.depth, hp.hidden, hp.n_head, hp.ffn) == want
        assert (hp.patch_size, hp.temporal_patch, hp.merge, hp.n_pos, hp.pos_side) == (16, 2, 2, 2304, 48)
        assert hp.out_hidden == presets.PRESETS[preset]["n_embd"] and hp.image_size == 768
    assert presets.preset_vision_hparams("qwen3.5-0.8b", depth=1).depth == 1
    with pytest.raises(presets.MakeModelError):
        presets.preset_vision_hparams("qwen3.5-0.8b", depth=0)
    assert set(presets.VISION_PRESETS) == set(presets.PRESETS)


@pytest.mark.parametrize("preset", REAL + ("tiny-dense",))
def test_file_opens_with_the_preset_hparams_and_schema(mmproj_file, preset):
    path = mmproj_file(preset, depth=None if preset == "tiny-dense" else 2)
    m = MmprojFile.open(path)
    want = presets.preset_vision_hparams(preset, None if preset == "tiny-dense" else 2)
    assert dataclasses.replace(m.hparams, eps=want.eps) == want
    assert m.hparams.eps == pytest.approx(1e-6, rel=1e-6)          # stored as f32, as the converter does
    shapes = expected_tensors(m.hparams)
    assert {n: t.ne for n, t in m.tensors.items()} == shapes
    assert list(m.tensors) == mp.tensor_order(m.hparams)


@pytest.mark.parametrize("outtype", ["f16", "f32", "bf16"])
def test_gguf_py_reads_it_with_the_converters_keys_and_types(mmproj_file, outtype):
    path = mmproj_file("qwen3.5-0.8b", outtype)
    r = GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert meta["general.architecture"] == "clip" and meta["general.type"] == "mmproj"
    assert meta["clip.projector_type"] == PROJECTOR_TYPE and meta["clip.has_vision_encoder"] is True
    assert meta["general.file_type"] == mp.MMPROJ_TYPES[outtype][0]
    assert meta["clip.vision.is_deepstack_layers"] == [False]
    assert meta["clip.vision.projection_dim"] == 1024 and meta["clip.vision.embedding_length"] == 768
    types = {t.name: t.tensor_type.name for t in r.tensors}
    mat = {"f16": "F16", "f32": "F32", "bf16": "BF16"}[outtype]
    assert types["v.patch_embd.weight"] == types["v.patch_embd.weight.1"] == ("F16" if outtype == "f16" else "F32")
    assert types["v.position_embd.weight"] == "F32" and types["v.blk.0.ln1.weight"] == "F32"
    assert types["v.blk.0.attn_qkv.weight"] == types["mm.0.weight"] == mat
    assert all(types[n] == "F32" for n, t in zip(types, r.tensors) if len(t.shape) == 1)
    for t in r.tensors:
        x = np.asarray(t.data)
        if t.tensor_type.name == "BF16":
            x = (x.reshape(-1).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        assert np.isfinite(x).all(), t.name


def test_order_is_the_converters_hf_name_order():
    hp = presets.preset_vision_hparams("qwen3.5-0.8b")
    order = mp.tensor_order(hp)
    assert order[:2] == ["v.blk.0.attn_out.bias", "v.blk.0.attn_out.weight"]
    assert order.index("v.blk.10.ln1.weight") < order.index("v.blk.2.attn_out.bias")     # byte order of HF names
    assert order[-4:] == ["v.patch_embd.bias", "v.patch_embd.weight", "v.patch_embd.weight.1",
                          "v.position_embd.weight"]


@pytest.mark.slow
def test_cpu_tower_encodes_a_small_image_to_finite_values(mmproj_file):
    """The real 0.8B widths, one block: a 256x256 image -> 64 tokens of n_embd 1024, O(1) and finite."""
    tower = VisionTower(mmproj_file("qwen3.5-0.8b"), n_threads=2)
    rgb = np.random.default_rng(0).integers(0, 256, (256, 256, 3), dtype=np.uint8)
    out = tower.encode(preprocess(Image.fromarray(rgb)))
    assert out.shape == (64, 1024) and out.dtype == np.float32
    assert np.isfinite(out).all() and 0.05 < out.std() < 20


def test_same_seed_same_bytes_other_seed_other_bytes(mmproj_file, tmp_path):
    a = mmproj_file("tiny-dense", depth=None)
    b = mp.make_mmproj("tiny-dense", str(tmp_path / "b.gguf"), progress=False)
    c = mp.make_mmproj("tiny-dense", str(tmp_path / "c.gguf"), seed=1, progress=False)
    digest = [hashlib.sha256(open(p, "rb").read()).hexdigest() for p in (a, b, c)]
    assert digest[0] == digest[1] != digest[2]


def test_cli_writes_the_mmproj_alone_and_refuses_bad_flags(tmp_path, capsys):
    out = tmp_path / "v.gguf"
    assert mm.main(["--preset", "tiny-moe", "--mmproj-out", str(out), "--mmproj-type", "f32", "--quiet"]) == 0
    m = MmprojFile.open(out)
    assert m.hparams.out_hidden == presets.PRESETS["tiny-moe"]["n_embd"]
    assert m.tensors["mm.0.weight"].type_name == "F32"
    assert mm.main(["--preset", "tiny-moe", "--mmproj-out", str(out), "--mmproj-depth", "0", "--quiet"]) == 1
    assert "--mmproj-depth" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mm.main(["--preset", "tiny-moe", "--mmproj-out", str(out), "--mmproj-type", "q8_0"])
    with pytest.raises(SystemExit):
        mm.main(["--preset", "tiny-moe"])
    assert mm.main(["--preset", "qwen3.5-0.8b", "--dry-run", "--mmproj-out", str(out)]) == 0
    assert "vision tower (f16): 154 tensors" in capsys.readouterr().out
