"""The vision projector ("mmproj") GGUF that llama.cpp's converter writes for Qwen3.5 / Qwen3.6 (spec §2.7):
`clip.projector_type = "qwen3vl_merger"`, a Qwen3-VL-style ViT without deepstack plus its 2×2 patch merger.

`MmprojFile.open(path)` reads the file with gguf_file (structure, truncation), checks that it is such a projector,
reads `VisionHparams` from the `clip.*` keys (and the sizes only the tensors carry), and checks every tensor against
the schema below: names, ggml `ne` shapes and types, and no tensor the tower would not read. Every violation is a
FormatError naming the key or tensor.

Tensors (H = hidden, F = ffn, P = patch size, M = merge, O = out_hidden; ne in ggml order, ne[0] fastest). The
converter (conversion/qwen3vl.py `Qwen3VLVisionModel`) copies every tensor unchanged except the Conv3d, which it
cuts along time into two 2-D kernels; 1-D tensors are written F32, matrices per --outtype (F32/F16/BF16):

  role            GGUF name                  ne            HF (model.visual.*)
  patch_w0 / _w1  v.patch_embd.weight(.1)    {P, P, 3, H}  patch_embed.proj.weight[:, :, t] (t = 0 / 1) of [H,3,2,P,P]
  patch_b         v.patch_embd.bias          {H}           patch_embed.proj.bias
  pos_embd        v.position_embd.weight     {H, n_pos}    pos_embed.weight (row = y·side + x, side² = n_pos)
  ln1_w / ln1_b   v.blk.N.ln1.weight/.bias   {H}           blocks.N.norm1 (LayerNorm)
  qkv_w / qkv_b   v.blk.N.attn_qkv.*         {H, 3H} {3H}  blocks.N.attn.qkv (fused: rows q | k | v, each head-major)
  o_w / o_b       v.blk.N.attn_out.*         {H, H} {H}    blocks.N.attn.proj
  ln2_w / ln2_b   v.blk.N.ln2.weight/.bias   {H}           blocks.N.norm2
  fc1_w / fc1_b   v.blk.N.ffn_up.*           {H, F} {F}    blocks.N.mlp.linear_fc1 (then gelu, tanh form)
  fc2_w / fc2_b   v.blk.N.ffn_down.*         {F, H} {H}    blocks.N.mlp.linear_fc2
  merger_norm_*   v.post_ln.weight/.bias     {H}           merger.norm (per patch, before the 2×2 grouping)
  merger_fc1_*    mm.0.weight/.bias          {M²H, M²H}    merger.linear_fc1 (then exact erf gelu)
  merger_fc2_*    mm.2.weight/.bias          {M²H, O}      merger.linear_fc2
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from ..core.errors import FormatError
from .gguf_file import GGUFFile, TensorInfo
from .gguf_model import meta_value, positive, same_shape
from .schema import ARCHITECTURES, Group

PROJECTOR_TYPE = "qwen3vl_merger"
CLIP_ARCH = "clip"
# Not in the file (spec §2.7: llama.cpp hard-codes them), so constants here:
ROPE_THETA = 10000.0          # base of the ViT's 2-D axial RoPE (transformers Qwen3_5VisionConfig.rope_parameters)
MIN_PIXELS = 65_536           # Qwen2VLImageProcessor size.shortest_edge of the real Qwen3.5 preprocessor_config.json
MAX_PIXELS = 16_777_216       # ... and size.longest_edge; transformers' preprocessing is the one the model saw
IN_CHANNELS = 3               # RGB: the Conv3d's input channels
# ggml types the tower reads (each row dequantised to f32 as a matmul reads it): the converter's f32/f16/bf16
# outtypes, and Q8_0 (the quantised mmproj files people share)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0")

_V = "clip.vision."


@dataclass(frozen=True)
class VisionHparams:
    """The vision tower of one mmproj file. Sizes as in transformers' Qwen3_5VisionConfig."""
    depth: int                # clip.vision.block_count
    hidden: int               # clip.vision.embedding_length
    n_head: int               # clip.vision.attention.head_count
    ffn: int                  # clip.vision.feed_forward_length (intermediate_size)
    patch_size: int           # clip.vision.patch_size
    temporal_patch: int       # 2 when v.patch_embd.weight.1 is present, else 1
    merge: int                # clip.vision.spatial_merge_size
    n_pos: int                # rows of v.position_embd.weight (num_position_embeddings), a square
    out_hidden: int           # clip.vision.projection_dim = columns of mm.2 = the LM's n_embd
    eps: float                # clip.vision.attention.layer_norm_epsilon (every LayerNorm of the tower)
    image_size: int           # clip.vision.image_size = sqrt(n_pos) * patch_size
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rope_theta: float = ROPE_THETA
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_head

    @property
    def pos_side(self) -> int:
        """Side of the learned position grid (48 in the real models)."""
        return math.isqrt(self.n_pos)

    @property
    def merged_hidden(self) -> int:
        """Width of one LM token before the merger's projection: merge² patches side by side."""
        return self.merge * self.merge * self.hidden

    @property
    def patch_pixels(self) -> int:
        """Values of one flattened patch (channel, time, y, x): 1536 for 3·2·16·16."""
        return IN_CHANNELS * self.temporal_patch * self.patch_size * self.patch_size

    @property
    def max_patches(self) -> int:
        """Patches of the largest image the processor makes (format/image.smart_resize): at most max_pixels pixels
        in whole merge blocks of (patch·merge)² pixels, merge² patches each (65,536 at 4096x4096)."""
        block = (self.patch_size * self.merge) ** 2
        return max(self.max_pixels // block, 1) * self.merge * self.merge


def encode_flops(hp: VisionHparams, n_patches: int) -> int:
    """2 × the multiply-adds of one encode of an image of n_patches patches (N), with H hidden, F ffn, D blocks,
    M² = merge², O out: patch embedding 2·N·(3·T·P·P)·H; per block 2·N·H·3H (qkv) + 4·N²·H (QKᵀ and AV, full
    attention over the image) + 2·N·H² (proj) + 4·N·H·F (fc1, fc2); merger 2·(N/M²)·(M²H)² + 2·(N/M²)·M²H·O."""
    n, h, f = n_patches, hp.hidden, hp.ffn
    patch = 2 * n * hp.patch_pixels * h
    block = 2 * n * h * 3 * h + 4 * n * n * h + 2 * n * h * h + 4 * n * h * f
    m = hp.merge ** 2
    merger = 2 * (n // m) * (m * h) ** 2 + 2 * (n // m) * m * h * hp.out_hidden
    return patch + hp.depth * block + merger


def is_mmproj(meta: dict) -> bool:
    """True when GGUF metadata (GGUFFile.metadata) describes a multimodal projector rather than a text model."""
    return (meta.get("general.architecture") == CLIP_ARCH or meta.get("general.type") == "mmproj"
            or any(k.startswith("clip.") for k in meta))


def check_not_mmproj(meta: dict, path: str = "<model>") -> None:
    """For the text loader: a clear FormatError when an mmproj file is given where a text model is expected."""
    if is_mmproj(meta):
        raise FormatError(f"{path}: is a vision projector (mmproj, general.architecture = "
                          f"{meta.get('general.architecture')!r}), not a text model: give it as the mmproj and the "
                          f"text GGUF as the model")


def _expect_projector(meta: dict, path: str) -> None:
    arch = meta.get("general.architecture")
    if arch in ARCHITECTURES:
        raise FormatError(f"{path}: is a text model GGUF (general.architecture = {arch!r}), not a vision projector "
                          f"(mmproj): convert the vision tower with llama.cpp's convert_hf_to_gguf.py --mmproj")
    if arch != CLIP_ARCH:
        raise FormatError(f"{path}: general.architecture = {arch!r:.60}, expected {CLIP_ARCH!r} for an mmproj file")
    key = "clip.projector_type" if "clip.projector_type" in meta else "clip.vision.projector_type"
    ptype = meta.get(key)
    if ptype is None:
        raise FormatError(f"{path}: required key 'clip.projector_type' is missing")
    if ptype != PROJECTOR_TYPE:
        raise FormatError(f"{path}: {key} = {ptype!r:.60} is not supported: legacy_engine runs Qwen3.5/3.6's "
                          f"{PROJECTOR_TYPE!r} vision tower")
    if meta.get("clip.has_vision_encoder") is not True:
        raise FormatError(f"{path}: clip.has_vision_encoder = {meta.get('clip.has_vision_encoder')!r:.20}: "
                          f"the file holds no vision encoder")


def _triple(meta: dict, path: str, key: str, positive: bool) -> tuple[float, float, float]:
    v = meta_value(meta, path, key, list)
    if len(v) != 3 or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                              for x in v):
        raise FormatError(f"{path}: key {key!r} = {v!r:.80}, expected 3 finite numbers (R, G, B)")
    if positive and min(v) <= 0:
        raise FormatError(f"{path}: key {key!r} = {v}, expected 3 numbers > 0")
    return (float(v[0]), float(v[1]), float(v[2]))


def _pos_count(tensors: dict[str, TensorInfo], path: str) -> int:
    t = tensors.get("v.position_embd.weight")
    if t is None:
        raise FormatError(f"{path}: required tensor 'v.position_embd.weight' is missing (learned position grid)")
    if len(t.ne) != 2:
        raise FormatError(f"{path}: tensor 'v.position_embd.weight' has ne={list(t.ne)}, expected [hidden, n_pos]")
    n_pos = t.ne[1]
    if math.isqrt(n_pos) ** 2 != n_pos:
        raise FormatError(f"{path}: tensor 'v.position_embd.weight' holds {n_pos} positions, not a square "
                          f"grid (side × side)")
    return n_pos


def _sizes(meta: dict, path: str) -> dict:
    """The integer clip.vision.* keys, each > 0."""
    keys = dict(depth="block_count", hidden="embedding_length", n_head="attention.head_count",
                ffn="feed_forward_length", patch_size="patch_size", merge="spatial_merge_size",
                out_hidden="projection_dim", image_size="image_size")
    return {f: positive(path, _V + k, meta_value(meta, path, _V + k, int)) for f, k in keys.items()}


def read_vision_hparams(meta: dict, tensors: dict[str, TensorInfo], path: str = "<mmproj>") -> VisionHparams:
    """VisionHparams from an mmproj's metadata, with every consistency check the tower relies on."""
    _expect_projector(meta, path)
    s = _sizes(meta, path)
    if s["hidden"] % s["n_head"]:
        raise FormatError(f"{path}: {_V}embedding_length = {s['hidden']} is not a multiple of "
                          f"{_V}attention.head_count = {s['n_head']}")
    if (s["hidden"] // s["n_head"]) % 4:
        raise FormatError(f"{path}: head size {s['hidden'] // s['n_head']} is not a multiple of 4: the 2-D RoPE "
                          f"rotates pairs in a y half and an x half")
    eps = meta_value(meta, path, _V + "attention.layer_norm_epsilon", float)
    if not 0 < eps < 1:
        raise FormatError(f"{path}: {_V}attention.layer_norm_epsilon = {eps}, expected in (0, 1)")
    deep = meta_value(meta, path, _V + "is_deepstack_layers", list, [], required=False)
    if any(deep):
        raise FormatError(f"{path}: {_V}is_deepstack_layers = {deep!r:.80}: deepstack (Qwen3-VL) towers are not "
                          f"supported; Qwen3.5/3.6 have none")
    if meta.get("clip.use_gelu", True) is not True:
        raise FormatError(f"{path}: clip.use_gelu = {meta['clip.use_gelu']!r:.20}; the qwen3vl_merger MLPs use GELU")
    n_pos = _pos_count(tensors, path)
    if math.isqrt(n_pos) * s["patch_size"] != s["image_size"]:
        raise FormatError(f"{path}: {_V}image_size = {s['image_size']} disagrees with the position grid: "
                          f"sqrt({n_pos}) × patch_size {s['patch_size']} = {math.isqrt(n_pos) * s['patch_size']}")
    return VisionHparams(**s, eps=eps, n_pos=n_pos, temporal_patch=2 if "v.patch_embd.weight.1" in tensors else 1,
                         image_mean=_triple(meta, path, _V + "image_mean", False),
                         image_std=_triple(meta, path, _V + "image_std", True))


# ---- the tensor schema --------------------------------------------------------------

# role -> (GGUF name, or a template with {i} for the block index; ne from VisionHparams)
GLOBAL_TENSORS = {
    "patch_w0": ("v.patch_embd.weight", lambda h: (h.patch_size, h.patch_size, IN_CHANNELS, h.hidden)),
    "patch_w1": ("v.patch_embd.weight.1", lambda h: (h.patch_size, h.patch_size, IN_CHANNELS, h.hidden)),
    "patch_b": ("v.patch_embd.bias", lambda h: (h.hidden,)),
    "pos_embd": ("v.position_embd.weight", lambda h: (h.hidden, h.n_pos)),
    "merger_norm_w": ("v.post_ln.weight", lambda h: (h.hidden,)),
    "merger_norm_b": ("v.post_ln.bias", lambda h: (h.hidden,)),
    "merger_fc1_w": ("mm.0.weight", lambda h: (h.merged_hidden, h.merged_hidden)),
    "merger_fc1_b": ("mm.0.bias", lambda h: (h.merged_hidden,)),
    "merger_fc2_w": ("mm.2.weight", lambda h: (h.merged_hidden, h.out_hidden)),
    "merger_fc2_b": ("mm.2.bias", lambda h: (h.out_hidden,)),
}
BLOCK_TENSORS = {
    "ln1_w": ("v.blk.{i}.ln1.weight", lambda h: (h.hidden,)),
    "ln1_b": ("v.blk.{i}.ln1.bias", lambda h: (h.hidden,)),
    "qkv_w": ("v.blk.{i}.attn_qkv.weight", lambda h: (h.hidden, 3 * h.hidden)),
    "qkv_b": ("v.blk.{i}.attn_qkv.bias", lambda h: (3 * h.hidden,)),
    "o_w": ("v.blk.{i}.attn_out.weight", lambda h: (h.hidden, h.hidden)),
    "o_b": ("v.blk.{i}.attn_out.bias", lambda h: (h.hidden,)),
    "ln2_w": ("v.blk.{i}.ln2.weight", lambda h: (h.hidden,)),
    "ln2_b": ("v.blk.{i}.ln2.bias", lambda h: (h.hidden,)),
    "fc1_w": ("v.blk.{i}.ffn_up.weight", lambda h: (h.hidden, h.ffn)),
    "fc1_b": ("v.blk.{i}.ffn_up.bias", lambda h: (h.ffn,)),
    "fc2_w": ("v.blk.{i}.ffn_down.weight", lambda h: (h.ffn, h.hidden)),
    "fc2_b": ("v.blk.{i}.ffn_down.bias", lambda h: (h.hidden,)),
}
_GLOBAL_GROUPS = {"patch embedding": ("patch_w0", "patch_b"), "position embedding": ("pos_embd",),
                  "merger": ("merger_norm_w", "merger_norm_b", "merger_fc1_w", "merger_fc1_b", "merger_fc2_w",
                             "merger_fc2_b")}


def tensor_name(role: str, block: int | None = None) -> str:
    """The GGUF name of a role: a GLOBAL_TENSORS role, or a BLOCK_TENSORS role with its block index."""
    if block is None:
        return GLOBAL_TENSORS[role][0]
    return BLOCK_TENSORS[role][0].format(i=block)


def vision_schema(hp: VisionHparams) -> list[Group]:
    """What the file must hold, grouped as gguf_model's schema (one alternative per group)."""
    groups = []
    for what, roles in _GLOBAL_GROUPS.items():
        if what == "patch embedding" and hp.temporal_patch == 2:
            roles = roles + ("patch_w1",)
        groups.append(Group(what, [{GLOBAL_TENSORS[r][0]: GLOBAL_TENSORS[r][1](hp) for r in roles}]))
    for i in range(hp.depth):
        groups.append(Group(f"block {i}", [{n.format(i=i): f(hp) for n, f in BLOCK_TENSORS.values()}]))
    return groups


def expected_tensors(hp: VisionHparams) -> dict[str, tuple[int, ...]]:
    """Every tensor name -> ne that an mmproj of these hparams holds."""
    out: dict[str, tuple[int, ...]] = {}
    for g in vision_schema(hp):
        out.update(g.alternatives[0])
    return out


def tensor_roles(hp: VisionHparams) -> dict[str, tuple[str, int | None]]:
    """GGUF name -> (role, block index or None) for every tensor of the schema."""
    out: dict[str, tuple[str, int | None]] = {n: (r, None) for r, (n, _) in GLOBAL_TENSORS.items()
                                              if r != "patch_w1" or hp.temporal_patch == 2}
    for i in range(hp.depth):
        out.update({n.format(i=i): (r, i) for r, (n, _) in BLOCK_TENSORS.items()})
    return out


def check_vision_schema(hp: VisionHparams, tensors: dict[str, TensorInfo], path: str = "<mmproj>") -> None:
    """Every expected tensor present, with its shape and a supported type; no other tensor. FormatError otherwise."""
    for grp in vision_schema(hp):
        for name, want in grp.alternatives[0].items():
            t = tensors.get(name)
            if t is None:
                raise FormatError(f"{path}: {grp.what}: required tensor {name!r} is missing")
            if not same_shape(t.ne, want):
                raise FormatError(f"{path}: tensor {name!r} has ne={list(t.ne)}, expected {list(want)} "
                                  f"(from the hyperparameters)")
            if t.type_name not in SUPPORTED_TYPES:
                raise FormatError(f"{path}: tensor {name!r} has ggml type {t.type_name}, which the vision tower "
                                  f"does not read (it reads {', '.join(SUPPORTED_TYPES)})")
    extra = sorted(set(tensors) - set(expected_tensors(hp)))
    if extra:
        raise FormatError(f"{path}: unexpected tensor {extra[0]!r} ({len(extra)} in all) is not part of a "
                          f"{PROJECTOR_TYPE} tower of depth {hp.depth}")


def check_compatible(vision: VisionHparams, text, path: str = "<mmproj>") -> None:
    """The projector's output width must be the LM's embedding width (text: gguf_model.Hparams or its n_embd)."""
    n_embd = text if isinstance(text, int) else text.n_embd
    if vision.out_hidden != n_embd:
        raise FormatError(f"{path}: the vision projector outputs {vision.out_hidden}-wide embeddings "
                          f"(clip.vision.projection_dim) but the text model's embedding_length is {n_embd}: "
                          f"this mmproj belongs to another model")


@dataclass
class MmprojFile:
    """A validated Qwen3.5/3.6 vision projector GGUF: file, hyperparameters and schema all checked."""
    path: str
    gguf: GGUFFile = field(repr=False)
    hparams: VisionHparams
    roles: dict[str, tuple[str, int | None]] = field(repr=False)

    @classmethod
    def open(cls, path: str | os.PathLike) -> "MmprojFile":
        f = GGUFFile(path)
        hp = read_vision_hparams(f.metadata, f.tensors, f.path)
        check_vision_schema(hp, f.tensors, f.path)
        return cls(f.path, f, hp, tensor_roles(hp))

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        return self.gguf.tensors

    def tensor(self, role: str, block: int | None = None) -> TensorInfo:
        """The TensorInfo of a role (see GLOBAL_TENSORS / BLOCK_TENSORS); gguf.data(name) gives its bytes."""
        return self.gguf.tensors[tensor_name(role, block)]
