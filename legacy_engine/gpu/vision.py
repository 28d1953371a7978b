"""The Qwen3.5/3.6 vision tower on the GPU, every tier (spec §2.7): the CPU tower's math (native/vision.c) with the
matmuls on gemm_f32 (f32 weights; F16/BF16/Q8_0 dequantised at upload) and the row ops on cuda8/layernorm.cu,
gelu.cu, rope_vision.cu and attention_bidir.cu.

`GpuVisionTower(tower, kernels)` uploads a loaded VisionTower's weights; `encode(image)` returns what
`tower.encode(image)` returns (float32 [n_tokens, out_hidden]) within tests/tolerances.py GPU_VISION_TOWER_ABS, through
the same input checks (cpu/vision.py ImageEncoder). The two per-image tables come from the C core's own ops on the
host, so the GPU uses the CPU's very values: the position grid resampled to the image (le_vision_op_pos_embed,
[t*h*w, H]) and the RoPE's cos/sin of one frame ([h*w, hd/2], le_vision_op_rope).
VRAM: the weights in one allocation (`weight_layout`), the scratch in another, grown when an image needs more than any
before (`scratch_layout`): two allocations rather than ~350 (the driver rounds each to its 2 MiB page: ~0.7 GiB of
small vectors for the 35B's tower). `tower_footprint` is what the planner reserves (plan/vision.py).
Widths the f32 GEMM cannot take (a multiple of 32 columns) are padded with zeros at upload: the patch rows (a patch
size of 14: 1176 values) and the MLP width (Qwen3.5's 4304): fc1's extra rows give gelu(0 + 0) = 0, which fc2's zero
columns then multiply, so the padding changes no sum.
"""
from __future__ import annotations

import numpy as np

from ..core import _native
from ..core.errors import UnavailableError
from ..cpu.vision import ImageEncoder, VisionTower
from ..format.mmproj import VisionHparams
from .kernels import Kernels
from .launch import F32
from .layout import WEIGHT_ALIGN, VramFootprint, _round, align_up
from .runtime import Buffer, BufferView
from .vision_kernels import ATTNB_MAX_HD

BLOCK_MATRICES = ("qkv_w", "o_w", "fc1_w", "fc2_w")
BLOCK_VECTORS = ("ln1_w", "ln1_b", "qkv_b", "o_b", "ln2_w", "ln2_b", "fc1_b", "fc2_b")
MERGER = ("merger_norm_w", "merger_norm_b", "merger_fc1_w", "merger_fc1_b", "merger_fc2_w", "merger_fc2_b")


def _pad32(n: int) -> int:
    return -(-n // 32) * 32


def _padded(a: np.ndarray, rows: int | None = None, cols: int | None = None) -> np.ndarray:
    """a [r, c] (or [c]) with zeros appended up to rows x cols."""
    a = np.asarray(a, np.float32)
    if a.ndim == 1:
        out = np.zeros(rows if rows is not None else a.shape[0], np.float32)
        out[:a.shape[0]] = a
        return out
    out = np.zeros((rows or a.shape[0], cols or a.shape[1]), np.float32)
    out[:a.shape[0], :a.shape[1]] = a
    return out


def patch_positions(h: int, w: int, merge: int) -> np.ndarray:
    """int32 [h*w, 2] (row, col) of a frame's patches in the processor's order (h/M blocks, w/M blocks, M x M group
    row-major): native/le_vision_ops.h le_vision_patch_pos."""
    i = np.arange(h * w, dtype=np.int64)
    mm, blocks_w = merge * merge, w // merge
    row = i // (mm * blocks_w) * merge + (i // merge) % merge
    col = (i // mm) % blocks_w * merge + i % merge
    return np.stack([row, col], axis=1).astype(np.int32)


def vision_rope_table(h: int, w: int, merge: int, head_dim: int, theta: float) -> np.ndarray:
    """float32 [h*w, head_dim/2, 2] (cos, sin) of a frame's patches: the C core's own values (le_rope2d_table, through
    le_vision_op_rope on rows (1 … 1 | 0 … 0), which it turns into exactly (cos | sin))."""
    half = head_dim // 2
    x = np.zeros((h * w, head_dim), np.float32)
    x[:, :half] = 1.0
    y = _native.vision_rope(x, patch_positions(h, w, merge), 1, theta)
    return np.ascontiguousarray(np.stack([y[:, :half], y[:, half:]], axis=-1))


def tower_unsupported(hp: VisionHparams) -> str | None:
    """Why the GPU tower cannot run a tower of hp (None: it can)."""
    if hp.hidden % 32:
        return f"hidden {hp.hidden} is not a multiple of 32 (the f32 GEMM's rows)"
    if hp.head_dim > ATTNB_MAX_HD:
        return f"head size {hp.head_dim} > {ATTNB_MAX_HD} (attention_bidir.cu)"
    return None


def weight_shapes(hp: VisionHparams) -> dict[str, tuple[int, ...]]:
    """Every f32 array the GPU tower uploads -> its shape (HF order, padded for the GEMM): the patch kernel as one
    [H, C*T*P*P] matrix, the merger, and per block i the BLOCK_VECTORS and BLOCK_MATRICES as 'role.i'. The position
    grid stays on the host (it is resampled there per image)."""
    H, MH, O, k_patch, F = hp.hidden, hp.merged_hidden, hp.out_hidden, _pad32(hp.patch_pixels), _pad32(hp.ffn)
    out = {"patch_w": (H, k_patch), "patch_b": (H,), "merger_norm_w": (H,), "merger_norm_b": (H,),
           "merger_fc1_w": (MH, MH), "merger_fc1_b": (MH,), "merger_fc2_w": (O, MH), "merger_fc2_b": (O,)}
    block = {"ln1_w": (H,), "ln1_b": (H,), "qkv_b": (3 * H,), "o_b": (H,), "ln2_w": (H,), "ln2_b": (H,), "fc1_b": (F,),
             "fc2_b": (H,), "qkv_w": (3 * H, H), "o_w": (H, H), "fc1_w": (F, H), "fc2_w": (H, F)}
    for i in range(hp.depth):
        out.update({f"{r}.{i}": shape for r, shape in block.items()})
    return out


def scratch_floats(hp: VisionHparams, n: int, hw: int) -> dict[str, int]:
    """The scratch arrays of an image of n patches in frames of hw -> floats each: the padded patches, the residual
    stream x and its normed copy xn [n, H], qkv [n, 3H] (also the merger's [n/M², M²H]), the attention output and
    MLP output att [n, H], the MLP's ff [n, F padded], the position rows pos [n, H], one frame's RoPE table cs
    [hw, hd] and the merged output [n/M², O]. attention_bidir keeps its scores on chip (O(tile)): no n² array."""
    H = hp.hidden
    return {"patches": n * _pad32(hp.patch_pixels), "x": n * H, "xn": n * H, "qkv": 3 * n * H, "att": n * H,
            "ff": n * _pad32(hp.ffn), "pos": n * H, "cs": hw * hp.head_dim,
            "out": n // (hp.merge * hp.merge) * hp.out_hidden}


def _layout(floats: dict[str, int]) -> tuple[dict[str, tuple[int, int]], int]:
    """name -> (offset, bytes) of f32 arrays in one allocation, each WEIGHT_ALIGN-aligned; -> (that, total)."""
    out, at = {}, 0
    for name, n in floats.items():
        nb = 4 * max(int(n), 1)
        out[name] = (at, nb)
        at += align_up(nb, WEIGHT_ALIGN)
    return out, at


def weight_layout(hp: VisionHparams) -> tuple[dict[str, tuple[int, int]], int]:
    """The one weight allocation of a GPU tower of hp: {weight_shapes key: (offset, bytes)}, total bytes."""
    return _layout({k: int(np.prod(s)) for k, s in weight_shapes(hp).items()})


def scratch_layout(hp: VisionHparams, n: int, hw: int) -> tuple[dict[str, tuple[int, int]], int]:
    """The one scratch allocation for images of up to n patches in frames of up to hw: as weight_layout."""
    return _layout(scratch_floats(hp, n, hw))


def tower_footprint(hp: VisionHparams, n_patches: int | None = None) -> VramFootprint:
    """The VRAM of a GPU tower of hp that has encoded images of up to n_patches patches (one frame each; default
    hp.max_patches, the largest image the processor makes): its two allocations, each rounded as the driver
    allocates."""
    n = hp.max_patches if n_patches is None else int(n_patches)
    return VramFootprint({"weights": _round(weight_layout(hp)[1]), "scratch": _round(scratch_layout(hp, n, n)[1])},
                         {}, 0)


class GpuVisionTower(ImageEncoder):
    """The vision tower of a loaded VisionTower (its mmproj file) on the GPU with `kernels` (any tier)."""

    def __init__(self, tower: VisionTower, kernels: Kernels):
        self.tower, self.k = tower, kernels
        self.hparams = hp = tower.hparams
        why = tower_unsupported(hp)
        if why:
            raise UnavailableError(f"GPU vision tower: {why}; run the tower on the CPU")
        self.k_patch, self.ffn_p = _pad32(hp.patch_pixels), _pad32(hp.ffn)
        self.pos_table = self._f32("pos_embd")
        at, total = weight_layout(hp)
        self._weights = Buffer(total, "vision weights")
        self._scratch_buf, self._cap, self._bufs = None, (0, 0), {}
        try:
            up = lambda key, a: self._up(at, key, a)      # noqa: E731
            self.g = {"patch_w": up("patch_w", _padded(self._patch_kernel(), cols=self.k_patch)),
                      "patch_b": up("patch_b", self._f32("patch_b"))}
            self.g.update({r: up(r, self._f32(r)) for r in MERGER})
            self.blocks = [self._upload_block(up, i) for i in range(hp.depth)]
        except BaseException:
            self.close()
            raise

    # ---- upload
    def _f32(self, role: str, block: int | None = None) -> np.ndarray:
        """A tensor of the mmproj as f32 in HF order (ne reversed), dequantised by the C reference when F16/BF16."""
        f = self.tower.file
        t = f.tensor(role, block)
        n = int(np.prod(t.ne))
        return _native.dequantize_row(t.type, f.gguf.data(t.name), n).reshape(tuple(reversed(t.ne)))

    def _up(self, at: dict, key: str, a: np.ndarray) -> BufferView:
        """a into its place of the weight allocation (weight_layout) -> a view of it."""
        a = np.ascontiguousarray(a, np.float32)
        off, nb = at[key]
        if a.nbytes != nb:
            raise ValueError(f"vision {key}: {a.nbytes} bytes, the layout planned {nb}")
        view = BufferView(self._weights, off, nb, f"vision {key}")
        view.upload(a)
        return view

    def _patch_kernel(self) -> np.ndarray:
        """The Conv3d kernel as one [H, C*T*P*P] matrix, rows (c, t, y, x) like a patch (vision.c join_patch_kernel)."""
        w0 = self._f32("patch_w0")                                   # [H, C, P, P]
        w = np.stack([w0, self._f32("patch_w1")], axis=2) if self.hparams.temporal_patch == 2 else w0[:, :, None]
        return w.reshape(w.shape[0], -1)

    def _upload_block(self, up, i: int) -> dict:
        b = {r: up(f"{r}.{i}", self._f32(r, i)) for r in BLOCK_VECTORS + ("qkv_w", "o_w") if r != "fc1_b"}
        b["fc1_w"] = up(f"fc1_w.{i}", _padded(self._f32("fc1_w", i), rows=self.ffn_p))
        b["fc1_b"] = up(f"fc1_b.{i}", _padded(self._f32("fc1_b", i), rows=self.ffn_p))
        b["fc2_w"] = up(f"fc2_w.{i}", _padded(self._f32("fc2_w", i), cols=self.ffn_p))
        return b

    def close(self) -> None:
        """Frees the weights and the scratch (also done when the object is collected)."""
        for buf in (getattr(self, "_weights", None), self._scratch_buf):
            if buf is not None:
                buf.free()
        self._weights, self._scratch_buf = None, None
        self.g, self.blocks, self._bufs, self._cap = {}, [], {}, (0, 0)

    # ---- scratch
    def _scratch(self, n: int, hw: int) -> dict:
        """The VRAM of an image of n patches (frames of hw): one allocation (scratch_layout), made again only when
        an image is larger than any before."""
        if n <= self._cap[0] and hw <= self._cap[1]:
            return self._bufs
        n, hw = max(n, self._cap[0]), max(hw, self._cap[1])
        if self._scratch_buf is not None:
            self._scratch_buf.free()
            self._scratch_buf, self._bufs, self._cap = None, {}, (0, 0)
        at, total = scratch_layout(self.hparams, n, hw)
        self._scratch_buf = Buffer(total, "vision scratch")
        self._bufs = {k: BufferView(self._scratch_buf, off, nb, f"vision scratch {k}") for k, (off, nb) in at.items()}
        self._cap = (n, hw)
        return self._bufs

    # ---- encode (encode / encode_patches: cpu/vision.py ImageEncoder, the CPU tower's checks)
    def _encode(self, patches: np.ndarray, grid: tuple[int, int, int]) -> np.ndarray:
        t, h, w = grid
        hp = self.hparams
        n, hw, H = t * h * w, h * w, hp.hidden
        b = self._scratch(n, hw)
        b["patches"].upload(np.ascontiguousarray(_padded(patches, cols=self.k_patch)))
        b["pos"].upload(_native.vision_pos_embed(self.pos_table, (t, h, w), hp.merge))
        b["cs"].upload(vision_rope_table(h, w, hp.merge, hp.head_dim, hp.rope_theta))
        self.k.gemm_f32(F32, self.g["patch_w"], b["patches"], b["x"], H, self.k_patch, n)
        self.k.bias_add(b["x"], self.g["patch_b"], b["pos"], n * H, H)          # (conv + bias) + pos, torch's order
        for blk in self.blocks:
            self._block(blk, b, n, hw)
        rows = self._merger(b, n)
        return b["out"].download(dtype=np.float32, count=rows * hp.out_hidden).reshape(rows, hp.out_hidden)

    def _block(self, w: dict, b: dict, n: int, hw: int) -> None:
        """One pre-LN ViT block on b['x'] [n, H] (vision.c vision_block)."""
        hp, k = self.hparams, self.k
        H, F = hp.hidden, self.ffn_p
        k.layernorm(b["x"], w["ln1_w"], w["ln1_b"], b["xn"], H, n, hp.eps)
        k.gemm_f32(F32, w["qkv_w"], b["xn"], b["qkv"], 3 * H, H, n)
        k.rope_vision(b["qkv"], w["qkv_b"], b["cs"], n, hw, hp.n_head, hp.head_dim)
        k.attention_bidir(b["qkv"], b["att"], n, hw, hp.n_head, hp.head_dim)
        k.gemm_f32(F32, w["o_w"], b["att"], b["xn"], H, H, n)
        k.bias_residual(b["x"], b["xn"], w["o_b"], n * H, H)
        k.layernorm(b["x"], w["ln2_w"], w["ln2_b"], b["xn"], H, n, hp.eps)
        k.gemm_f32(F32, w["fc1_w"], b["xn"], b["ff"], F, H, n)
        k.gelu(b["ff"], w["fc1_b"], n * F, F, "tanh")
        k.gemm_f32(F32, w["fc2_w"], b["ff"], b["att"], H, F, n)
        k.bias_residual(b["x"], b["att"], w["fc2_b"], n * H, H)

    def _merger(self, b: dict, n: int) -> int:
        """LN per patch, M² consecutive patches as one row [M² H], fc1, GELU (erf), fc2 -> b['out']; -> its rows."""
        hp, k, g = self.hparams, self.k, self.g
        MH, rows, O = hp.merged_hidden, n // (hp.merge * hp.merge), hp.out_hidden
        k.layernorm(b["x"], g["merger_norm_w"], g["merger_norm_b"], b["xn"], hp.hidden, n, hp.eps)
        k.gemm_f32(F32, g["merger_fc1_w"], b["xn"], b["qkv"], MH, MH, rows)     # xn [n, H] is [n / M², M² H]
        k.gelu(b["qkv"], g["merger_fc1_b"], rows * MH, MH, "erf")
        k.gemm_f32(F32, g["merger_fc2_w"], b["qkv"], b["out"], O, MH, rows)
        k.bias_add(b["out"], g["merger_fc2_b"], None, rows * O, O)
        return rows
