"""The Qwen3.5/3.6 vision tower on the GPU, every tier (spec §2.7): the CPU tower's math (native/vision.c) with the
matmuls on gemm_f32 (f32 weights; F16/BF16 dequantised at upload) and the row ops on cuda8/layernorm.cu, gelu.cu,
rope_vision.cu and attention_bidir.cu.

`GpuVisionTower(tower, kernels)` uploads a loaded VisionTower's weights; `encode(image)` returns what
`tower.encode(image)` returns (float32 [n_tokens, out_hidden]) within tests/tolerances.py GPU_VISION_TOWER_ABS. The
two per-image tables come from the C core's own ops on the host, so the GPU uses the CPU's very values: the position
grid resampled to the image (le_vision_op_pos_embed, [t*h*w, H]) and the RoPE's cos/sin of one frame
([h*w, hd/2], le_vision_op_rope). Scratch lives in VRAM, allocated when an image needs more than any before.
Widths the f32 GEMM cannot take (a multiple of 32 columns) are padded with zeros at upload: the patch rows (a patch
size of 14: 1176 values) and the MLP width (Qwen3.5's 4304): fc1's extra rows give gelu(0 + 0) = 0, which fc2's zero
columns then multiply, so the padding changes no sum.
"""
from __future__ import annotations

import numpy as np

from ..core import _native
from ..core.errors import FormatError, UnavailableError
from ..cpu.vision import VisionTower
from ..format.image import ImageInput
from .kernels import Kernels
from .launch import F32
from .runtime import Buffer
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


class GpuVisionTower:
    """The vision tower of a loaded VisionTower (its mmproj file) on the GPU with `kernels` (any tier)."""

    def __init__(self, tower: VisionTower, kernels: Kernels):
        self.tower, self.k = tower, kernels
        self.hparams = hp = tower.hparams
        if hp.hidden % 32:
            raise UnavailableError(f"GPU vision tower: hidden {hp.hidden} is not a multiple of 32 (the f32 GEMM's "
                                   f"rows); run the tower on the CPU")
        if hp.head_dim > ATTNB_MAX_HD:
            raise UnavailableError(f"GPU vision tower: head size {hp.head_dim} > {ATTNB_MAX_HD} (attention_bidir.cu)")
        self.k_patch, self.ffn_p = _pad32(hp.patch_pixels), _pad32(hp.ffn)
        self.pos_table = self._f32("pos_embd")
        self.g = {"patch_w": self._up(_padded(self._patch_kernel(), cols=self.k_patch), "patch_w"),
                  "patch_b": self._up(self._f32("patch_b"), "patch_b")}
        self.g.update({r: self._up(self._f32(r), r) for r in MERGER})
        self.blocks = [self._upload_block(i) for i in range(hp.depth)]
        self._cap, self._bufs = (0, 0), {}

    # ---- upload
    def _f32(self, role: str, block: int | None = None) -> np.ndarray:
        """A tensor of the mmproj as f32 in HF order (ne reversed), dequantised by the C reference when F16/BF16."""
        f = self.tower.file
        t = f.tensor(role, block)
        n = int(np.prod(t.ne))
        return _native.dequantize_row(t.type, f.gguf.data(t.name), n).reshape(tuple(reversed(t.ne)))

    @staticmethod
    def _up(a: np.ndarray, what: str) -> Buffer:
        return Buffer.from_array(np.ascontiguousarray(a, np.float32), f"vision {what}")

    def _patch_kernel(self) -> np.ndarray:
        """The Conv3d kernel as one [H, C*T*P*P] matrix, rows (c, t, y, x) like a patch (vision.c join_patch_kernel)."""
        w0 = self._f32("patch_w0")                                   # [H, C, P, P]
        w = np.stack([w0, self._f32("patch_w1")], axis=2) if self.hparams.temporal_patch == 2 else w0[:, :, None]
        return w.reshape(w.shape[0], -1)

    def _upload_block(self, i: int) -> dict:
        b = {r: self._up(self._f32(r, i), f"{r}.{i}") for r in BLOCK_VECTORS + ("qkv_w", "o_w") if r != "fc1_b"}
        b["fc1_w"] = self._up(_padded(self._f32("fc1_w", i), rows=self.ffn_p), f"fc1_w.{i}")
        b["fc1_b"] = self._up(_padded(self._f32("fc1_b", i), rows=self.ffn_p), f"fc1_b.{i}")
        b["fc2_w"] = self._up(_padded(self._f32("fc2_w", i), cols=self.ffn_p), f"fc2_w.{i}")
        return b

    def close(self) -> None:
        """Frees the weights and the scratch (also done when the object is collected)."""
        for buf in [*self.g.values(), *(v for b in self.blocks for v in b.values()), *self._bufs.values()]:
            buf.free()
        self.g, self.blocks, self._bufs, self._cap = {}, [], {}, (0, 0)

    # ---- scratch
    def _scratch(self, n: int, hw: int) -> dict:
        """The VRAM of an image of n patches (frames of hw), allocated only when larger than any before."""
        if n <= self._cap[0] and hw <= self._cap[1]:
            return self._bufs
        hp = self.hparams
        n, hw = max(n, self._cap[0]), max(hw, self._cap[1])
        for buf in self._bufs.values():
            buf.free()
        H, O, m2 = hp.hidden, hp.out_hidden, hp.merge * hp.merge
        floats = {"patches": n * self.k_patch, "x": n * H, "xn": n * H, "qkv": 3 * n * H, "att": n * H,
                  "ff": n * self.ffn_p, "pos": n * H, "cs": hw * hp.head_dim, "out": n // m2 * O}
        self._bufs = {k: Buffer(4 * max(v, 1), f"vision scratch {k}") for k, v in floats.items()}
        self._cap = (n, hw)
        return self._bufs

    # ---- encode
    def encode(self, image: ImageInput) -> np.ndarray:
        """The merged embeddings of one preprocessed image: float32 [image.n_tokens, out_hidden]."""
        out = self.encode_patches(image.patches, image.grid_thw)
        if out.shape[0] != image.n_tokens:
            raise FormatError(f"image: n_tokens = {image.n_tokens} but its grid {tuple(image.grid_thw)} gives "
                              f"{out.shape[0]} tokens with merge {self.hparams.merge}")
        return out

    def encode_patches(self, patches: np.ndarray, grid_thw) -> np.ndarray:
        """patches float32 [t*h*w, C*T*P*P] in the processor's order, grid_thw (t, h, w) -> float32
        [t*h*w / merge², out_hidden], as VisionTower.encode_patches (the same checks, the same FormatErrors)."""
        t, h, w = self._check(patches, grid_thw)
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

    def _check(self, patches, grid_thw) -> tuple[int, int, int]:
        hp = self.hparams
        grid = tuple(int(x) for x in np.asarray(grid_thw).reshape(-1))
        if len(grid) != 3 or min(grid) < 1:
            raise FormatError(f"grid_thw = {grid_thw!r}: expected one (t, h, w) of positive patch counts")
        t, h, w = grid
        if h % hp.merge or w % hp.merge:
            raise FormatError(f"grid {grid}: h and w must be multiples of the spatial merge {hp.merge}")
        patches = np.asarray(patches)
        if patches.dtype != np.float32 or patches.ndim != 2 or patches.shape != (t * h * w, hp.patch_pixels):
            raise FormatError(f"patches: {patches.dtype} {patches.shape}, expected float32 [{t * h * w}, "
                              f"{hp.patch_pixels}] for grid {grid}")
        return t, h, w

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
