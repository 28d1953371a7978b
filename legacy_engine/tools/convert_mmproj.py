"""`legacy-engine convert HF_DIR OUT.gguf --mmproj MMPROJ.gguf`: a Qwen3.5 / Qwen3.6 checkpoint's vision tower to the
mmproj GGUF llama.cpp's converter writes (conversion/qwen3vl.py `Qwen3VLVisionModel` over base.py `MmprojModel`,
`clip.projector_type = qwen3vl_merger`), so either tool's file works with either engine; format/mmproj.py reads it
and its docstring lists every tensor. tests/test_convert_mmproj.py holds it to llama.cpp's converter tensor by
tensor and key by key.

Transforms: none but the Conv3d patch kernel [H, 3, 2, P, P], cut along time into two 2-D kernels
(v.patch_embd.weight and .weight.1). Matrices take --outtype (f32 / f16 / bf16); 1-D tensors and the learned
position table stay F32 (as llama.cpp writes them).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..core.errors import FormatError
from ..core.paths import written_atomically
from .checkpoint import Checkpoint

MMPROJ_OUTTYPES = {"f32": ("F32", "ALL_F32"), "f16": ("F16", "MOSTLY_F16"), "bf16": ("BF16", "MOSTLY_BF16")}

# HF name after "visual." -> GGUF name ({} = the block)
_BLOCK = {"norm1": "ln1", "norm2": "ln2", "attn.qkv": "attn_qkv", "attn.proj": "attn_out",
          "mlp.linear_fc1": "ffn_up", "mlp.linear_fc2": "ffn_down"}
_GLOBAL = {"patch_embed.proj.bias": "v.patch_embd.bias", "pos_embed.weight": "v.position_embd.weight",
           "merger.norm.weight": "v.post_ln.weight", "merger.norm.bias": "v.post_ln.bias",
           "merger.linear_fc1.weight": "mm.0.weight", "merger.linear_fc1.bias": "mm.0.bias",
           "merger.linear_fc2.weight": "mm.2.weight", "merger.linear_fc2.bias": "mm.2.bias"}
_F32_ALWAYS = ("v.position_embd.weight",)


def _gguf_name(rest: str) -> str | None:
    """A vision tensor's HF name after "visual." -> its GGUF name (None: not a tensor of this tower)."""
    if rest in _GLOBAL:
        return _GLOBAL[rest]
    parts = rest.split(".")
    if parts[0] == "blocks" and len(parts) >= 4:
        key, tail = ".".join(parts[2:-1]), parts[-1]
        if key in _BLOCK:
            return f"v.blk.{parts[1]}.{_BLOCK[key]}.{tail}"
    return None


def _plan(ck: Checkpoint) -> list[tuple[str, str, tuple | None]]:
    """[(GGUF name, HF name, index into it or None)], the patch kernel's two time halves included."""
    out = []
    for name in ck.names():
        prefix = next((p for p in ("model.visual.", "visual.") if name.startswith(p)), None)
        if prefix is None:
            continue
        rest = name[len(prefix):]
        if rest == "patch_embed.proj.weight":
            if len(ck.shape(name)) != 5 or ck.shape(name)[2] != 2:
                raise FormatError(f"{name}: shape {ck.shape(name)}, expected [H, 3, 2, P, P] (temporal patch 2)")
            out += [("v.patch_embd.weight", name, (slice(None), slice(None), 0)),
                    ("v.patch_embd.weight.1", name, (slice(None), slice(None), 1))]
        elif rest.startswith("deepstack_merger_list."):
            raise FormatError(f"{name}: a deepstack tower (Qwen3-VL) is not a Qwen3.5/3.6 one")
        else:
            g = _gguf_name(rest)
            if g is None:
                raise FormatError(f"{name}: not a tensor of the Qwen3.5 vision tower")
            out.append((g, name, None))
    if not out:
        raise FormatError("the checkpoint has no vision tower (no model.visual.* tensors)")
    return out


def _config(hf_dir: Path) -> tuple[dict, dict, dict]:
    """(vision_config, text_config, preprocessor_config) of a checkpoint."""
    cfg = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    vision, text = cfg.get("vision_config"), cfg.get("text_config", cfg)
    if not vision:
        raise FormatError(f"{hf_dir}/config.json has no vision_config: a text-only checkpoint")
    pre = hf_dir / "preprocessor_config.json"
    if not pre.is_file():
        raise FormatError(f"{pre} is missing: the image mean/std come from it")
    return vision, text, json.loads(pre.read_text(encoding="utf-8"))


def _add_keys(w, vision: dict, text: dict, pre: dict, file_type) -> None:
    import gguf
    depth, n_pos, patch = int(vision["depth"]), int(vision.get("num_position_embeddings", 2304)), vision["patch_size"]
    w.add_type("mmproj")
    w.add_file_type(file_type)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_uint32("clip.vision.projection_dim", int(text["hidden_size"]))
    w.add_uint32("clip.vision.image_size", int(vision.get("image_size", int(n_pos ** 0.5 * patch))))
    w.add_uint32("clip.vision.patch_size", int(patch))
    w.add_uint32("clip.vision.embedding_length", int(vision["hidden_size"]))
    w.add_uint32("clip.vision.feed_forward_length", int(vision["intermediate_size"]))
    w.add_uint32("clip.vision.block_count", depth)
    w.add_uint32("clip.vision.attention.head_count", int(vision["num_heads"]))
    w.add_array("clip.vision.image_mean", [float(x) for x in pre["image_mean"]])
    w.add_array("clip.vision.image_std", [float(x) for x in pre["image_std"]])
    w.add_string("clip.projector_type", gguf.VisionProjectorType.QWEN3VL)
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.spatial_merge_size", int(vision["spatial_merge_size"]))
    # llama.cpp takes the text config's rms_norm_eps for the tower's LayerNorms (transformers uses 1e-6 there)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", float(text.get("rms_norm_eps", 1e-6)))
    w.add_array("clip.vision.is_deepstack_layers", [False] * depth)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def convert_mmproj(hf_dir, out_path, outtype: str = "f16", progress: bool = True) -> Path:
    """Writes the vision tower of the checkpoint in hf_dir (config.json with a vision_config, *.safetensors with
    model.visual.*, preprocessor_config.json) to out_path as llama.cpp's mmproj GGUF (written to a temporary file beside
    it, renamed when complete). FormatError for a checkpoint without a Qwen3.5 vision tower."""
    import gguf
    from tqdm import tqdm

    hf_dir, out_path = Path(hf_dir), Path(out_path)
    if outtype not in MMPROJ_OUTTYPES:
        raise ValueError(f"the mmproj's outtype must be one of {', '.join(MMPROJ_OUTTYPES)}, got {outtype!r}")
    vision, text, pre = _config(hf_dir)
    ck = Checkpoint(hf_dir)
    plan = _plan(ck)
    big = gguf.GGMLQuantizationType[MMPROJ_OUTTYPES[outtype][0]]
    try:
        with written_atomically(out_path) as tmp:
            w = gguf.GGUFWriter(tmp, "clip")
            try:
                _add_keys(w, vision, text, pre, gguf.LlamaFileType[MMPROJ_OUTTYPES[outtype][1]])
                with tqdm(total=len(plan), unit="tensor", desc=out_path.name, disable=not progress) as bar:
                    for name, src, index in plan:
                        x = ck.load(src, index) if index else ck.load(src)
                        x = np.ascontiguousarray(x, dtype=np.float32)
                        qtype = big if x.ndim >= 2 and name not in _F32_ALWAYS else gguf.GGMLQuantizationType.F32
                        w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_shape=x.shape, raw_dtype=qtype)
                        bar.update(1)
                w.write_header_to_file()
                w.write_kv_data_to_file()
                w.write_tensors_to_file()
            finally:
                w.close()
    finally:
        ck.close()
    return out_path
