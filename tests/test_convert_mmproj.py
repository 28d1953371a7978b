"""`convert --mmproj` (tools/convert_mmproj.py) against llama.cpp's own converter on the tiny vision checkpoints: the
same tensors (names, types, shapes, bytes) and the same keys; the engine's reader opens both alike; bad checkpoints
give a FormatError."""
from __future__ import annotations

import json
import shutil

import pytest

from legacy_engine.core.errors import FormatError
from legacy_engine.format.mmproj import MmprojFile
from legacy_engine.tools.convert_mmproj import convert_mmproj

pytestmark = [pytest.mark.cpu, pytest.mark.oracle]

# keys llama.cpp derives from the checkpoint's directory name or writes for its own bookkeeping
NAMING_KEYS = {"general.name", "general.size_label", "general.basename", "general.finetune"}


def _fields(path):
    from gguf import GGUFReader
    r = GGUFReader(str(path))
    keys = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.") and k not in NAMING_KEYS}
    tensors = {t.name: (t.tensor_type.name, tuple(int(x) for x in t.shape), bytes(t.data.tobytes())) for t in r.tensors}
    return keys, tensors


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("outtype", ["f32", "f16"])
def test_equals_llama_cpp_converter(tiny_vision_gguf, tmp_path, kind, outtype):
    hf, _, theirs = tiny_vision_gguf(kind, outtype)
    ours = convert_mmproj(hf, tmp_path / "ours.gguf", outtype, progress=False)
    k_ours, t_ours = _fields(ours)
    k_theirs, t_theirs = _fields(theirs)
    assert sorted(t_ours) == sorted(t_theirs)
    for name in t_theirs:
        assert t_ours[name] == t_theirs[name], name
    assert k_ours == k_theirs
    assert MmprojFile.open(ours).hparams == MmprojFile.open(theirs).hparams


def test_bad_checkpoints(tiny_vision_gguf, tmp_path):
    hf, _, _ = tiny_vision_gguf("dense", "f32")
    text_only = tmp_path / "text"
    shutil.copytree(hf, text_only)
    cfg = json.loads((text_only / "config.json").read_text())
    cfg.pop("vision_config")
    (text_only / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match="no vision_config"):
        convert_mmproj(text_only, tmp_path / "a.gguf", progress=False)
    no_pre = tmp_path / "nopre"
    shutil.copytree(hf, no_pre)
    (no_pre / "preprocessor_config.json").unlink()
    with pytest.raises(FormatError, match="preprocessor_config"):
        convert_mmproj(no_pre, tmp_path / "b.gguf", progress=False)
    with pytest.raises(ValueError, match="outtype"):
        convert_mmproj(hf, tmp_path / "c.gguf", "q4_0", progress=False)
    assert not list(tmp_path.glob("*.gguf*"))         # nothing half-written is left
