"""make-model --mmproj-out: a random-weight Qwen3.5 / Qwen3.6 vision projector ("mmproj") GGUF of a preset's real size,
in exactly the layout llama.cpp's converter writes (convert_hf_to_gguf.py --mmproj, conversion/qwen3vl.py
`Qwen3VLVisionModel`), for speed work on the vision tower without the real weights.

* Sizes: format/presets.py VISION_PRESETS (spec §2.7); out_hidden = the preset's n_embd.
* Metadata: the keys, types and order of the converter's file, written through gguf-py's GGUFWriter with the
  converter's own add_* calls: general.architecture "clip", general.type "mmproj", clip.has_vision_encoder,
  clip.vision.* (projection_dim, image_size, patch_size, embedding_length, feed_forward_length, block_count,
  attention.head_count, image_mean, image_std), clip.projector_type "qwen3vl_merger", clip.use_gelu,
  clip.vision.spatial_merge_size, clip.vision.attention.layer_norm_epsilon, clip.vision.is_deepstack_layers (all
  False), general.quantization_version.
* Tensors: exactly format/mmproj.expected_tensors(hp), in the converter's order: that of the HF names
  (model.visual.*) in byte order, as a single-file checkpoint lists them (blocks.0, blocks.1, blocks.10, …, merger.*,
  patch_embed.*, pos_embed), the Conv3d's two time halves as v.patch_embd.weight then .weight.1.
* Types (the converter's rules per --outtype): 1-D tensors and v.position_embd.weight F32; the patch kernels F16 for
  f16, else F32 (its tensor_force_quant); every other matrix the outtype (F32 / F16 / BF16).
* Values: tests/fixtures/tiny_vision.py's rules, so the tower's activations stay O(1) and encodes are finite:
  patch kernels N(0, 1/(3·2·P·P)), positions N(0, 0.25), LayerNorm weights 1 + N(0, 0.04), every bias N(0, 0.01),
  other matrices N(0, 1/fan_in).
* Determinism: a tensor's values depend only on (seed, tensor name) through numpy PCG64.

Written tensor by tensor (the largest, mm.0 of a 27-block tower, is 85 MB in f32) to a temporary file that is renamed
into place.
"""
from __future__ import annotations

import hashlib
import math
import os
import sys
import time

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, VisionProjectorType, size_label
from gguf.quants import quantize

from ..core.paths import written_atomically
from ..format.mmproj import GLOBAL_TENSORS, VisionHparams, expected_tensors, tensor_roles
from ..format.presets import PRESETS, MakeModelError, preset_vision_hparams

T = GGMLQuantizationType

# --mmproj-type -> (LLAMA_FTYPE the converter writes as general.file_type, matrix type); MmprojFile reads these
MMPROJ_TYPES = {"f32": (0, T.F32), "f16": (1, T.F16), "bf16": (32, T.BF16)}

# role -> the HF parameter under model.visual. (blocks.{i}.… for block roles): the converter's input names
HF_NAMES = {
    "patch_w0": "patch_embed.proj.weight", "patch_w1": "patch_embed.proj.weight", "patch_b": "patch_embed.proj.bias",
    "pos_embd": "pos_embed.weight", "merger_norm_w": "merger.norm.weight", "merger_norm_b": "merger.norm.bias",
    "merger_fc1_w": "merger.linear_fc1.weight", "merger_fc1_b": "merger.linear_fc1.bias",
    "merger_fc2_w": "merger.linear_fc2.weight", "merger_fc2_b": "merger.linear_fc2.bias",
    "ln1_w": "norm1.weight", "ln1_b": "norm1.bias", "qkv_w": "attn.qkv.weight", "qkv_b": "attn.qkv.bias",
    "o_w": "attn.proj.weight", "o_b": "attn.proj.bias", "ln2_w": "norm2.weight", "ln2_b": "norm2.bias",
    "fc1_w": "mlp.linear_fc1.weight", "fc1_b": "mlp.linear_fc1.bias",
    "fc2_w": "mlp.linear_fc2.weight", "fc2_b": "mlp.linear_fc2.bias",
}
_PATCH = (GLOBAL_TENSORS["patch_w0"][0], GLOBAL_TENSORS["patch_w1"][0])
_POS = GLOBAL_TENSORS["pos_embd"][0]


def hf_name(role: str, block: int | None) -> str:
    return "model.visual." + (HF_NAMES[role] if block is None else f"blocks.{block}.{HF_NAMES[role]}")


def tensor_order(hp: VisionHparams) -> list[str]:
    """The converter's tensor order: by HF name (byte order), the Conv3d's halves w0 then w1."""
    roles = tensor_roles(hp)
    return sorted(roles, key=lambda n: (hf_name(*roles[n]).encode(), n))


def tensor_type(name: str, ne: tuple[int, ...], outtype: str) -> T:
    """The ggml type the converter gives this tensor for --outtype `outtype`."""
    if len(ne) == 1 or name == _POS:
        return T.F32
    if name in _PATCH:
        return T.F16 if outtype == "f16" else T.F32
    return MMPROJ_TYPES[outtype][1]


def _rng(seed: int, name: str) -> np.random.Generator:
    key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, key, 0])))


def tensor_values(role: str, ne: tuple[int, ...], hp: VisionHparams, rng: np.random.Generator) -> np.ndarray:
    """float32 values of one tensor, numpy shape ne[::-1] (the module docstring's rules)."""
    x = rng.standard_normal(ne[::-1], dtype=np.float32)
    if role in ("patch_w0", "patch_w1"):
        x *= np.float32(1.0 / math.sqrt(hp.patch_pixels))
    elif role == "pos_embd":
        x *= np.float32(0.5)
    elif role in ("ln1_w", "ln2_w", "merger_norm_w"):
        x = 1.0 + np.float32(0.2) * x
    elif role.endswith("_b"):
        x *= np.float32(0.1)
    else:                                   # Linear weights [out, in]: fan_in = ne[0]
        x *= np.float32(1.0 / math.sqrt(ne[0]))
    return x


def _metadata(w: GGUFWriter, hp: VisionHparams, ftype: int, name: str, desc: str, n_params: int) -> None:
    """The converter's keys in its order (MmprojModel + Qwen3VLVisionModel.set_gguf_parameters)."""
    w.add_type("mmproj")
    w.add_name(name)
    w.add_description(desc)
    w.add_size_label(size_label(n_params, 0, 0, 0))
    w.add_file_type(ftype)
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(hp.out_hidden)
    w.add_vision_image_size(hp.image_size)
    w.add_vision_patch_size(hp.patch_size)
    w.add_vision_embedding_length(hp.hidden)
    w.add_vision_feed_forward_length(hp.ffn)
    w.add_vision_block_count(hp.depth)
    w.add_vision_head_count(hp.n_head)
    w.add_vision_image_mean(list(hp.image_mean))
    w.add_vision_image_std(list(hp.image_std))
    w.add_clip_projector_type(VisionProjectorType.QWEN3VL)
    w.add_vision_use_gelu(True)
    w.add_vision_spatial_merge_size(hp.merge)
    w.add_vision_attention_layernorm_eps(hp.eps)
    w.add_vision_is_deepstack_layers([False] * hp.depth)
    w.add_quantization_version(2)


def plan_mmproj(hp: VisionHparams, outtype: str) -> list[tuple[str, tuple[int, ...], T]]:
    """(name, ne, type) of every tensor of the file, in file order."""
    if outtype not in MMPROJ_TYPES:
        raise MakeModelError(f"--mmproj-type {outtype!r}: the vision tower reads {', '.join(MMPROJ_TYPES)}")
    shapes = expected_tensors(hp)
    return [(n, shapes[n], tensor_type(n, shapes[n], outtype)) for n in tensor_order(hp)]


def mmproj_nbytes(ne: tuple[int, ...], qtype: T) -> int:
    return math.prod(ne) * (4 if qtype == T.F32 else 2)


def make_mmproj(preset: str, out: str, *, outtype: str = "f16", depth: int | None = None, seed: int = 0,
                progress: bool = True) -> str:
    """Writes a random-weight mmproj GGUF of `preset`'s vision tower to `out` (atomically); returns its path.

    outtype: f16 (default, like llama.cpp's common files), f32 or bf16. depth: keep only the first N ViT blocks
    (tests; the real depth otherwise). seed: the data depend only on (seed, tensor name)."""
    hp = preset_vision_hparams(preset, depth)
    outtype = outtype.lower()
    if not 0 <= seed < 2**63:
        raise MakeModelError(f"--seed must be in [0, 2^63), got {seed}")
    specs = plan_mmproj(hp, outtype)
    roles = tensor_roles(hp)
    total = sum(mmproj_nbytes(ne, t) for _, ne, t in specs)
    name = f"{PRESETS[preset]['name']} vision" + (f" ({hp.depth} blocks)" if depth is not None else "")
    desc = (f"random weights by legacy-engine make-model: vision tower of preset {preset}, depth {hp.depth}, "
            f"type {outtype}, seed {seed}")
    out = os.fspath(out)
    t0 = time.perf_counter()
    with written_atomically(out) as tmp:
        _write(tmp, hp, specs, roles, seed, (MMPROJ_TYPES[outtype][0], name, desc), total, progress,
               os.path.basename(out))
    if progress:
        dt = time.perf_counter() - t0
        print(f"make-model: wrote {out}: vision tower {hp.depth} blocks × {hp.hidden}, {outtype}, "
              f"{os.path.getsize(out):,} bytes in {dt:.1f} s", file=sys.stderr)
    return out


def _write(path, hp, specs, roles, seed, meta, total, progress, desc) -> None:
    from tqdm import tqdm

    ftype, name, description = meta
    w = GGUFWriter(path, "clip", use_temp_file=False)
    n_params = sum(math.prod(ne) for _, ne, _ in specs)
    _metadata(w, hp, ftype, name, description, n_params)
    for n, ne, t in specs:
        w.add_tensor_info(n, ne[::-1], np.dtype(np.float32), mmproj_nbytes(ne, t), raw_dtype=t)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=not progress,
              file=sys.stderr, mininterval=0.5) as bar:
        for n, ne, t in specs:
            x = tensor_values(roles[n][0], ne, hp, _rng(seed, n))
            data = x if t == T.F32 else quantize(x, t)
            w.write_tensor_data(data)
            bar.update(data.nbytes)
    w.fout[0].flush()
    os.fsync(w.fout[0].fileno())
    w.close()
