"""The vision tower on the GPU (legacy_engine/gpu/vision.py; cuda8/layernorm.cu, gelu.cu, rope_vision.cu,
attention_bidir.cu), every tier: each new kernel against a numpy / C-core reference on every variant of
tests/test_gpu.py, and GpuVisionTower against the CPU VisionTower (native/vision.c) on random mmproj files written
here with gguf-py's GGUFWriter (small towers on several grids, one of two frames, one with head size 72, an MLP width
that needs padding and F16 matrices, and one real-size layer: hidden 768, 12 heads, ffn 3072, grid 28 x 28).

Here (no GPU): the mmproj writer, the CPU tower on it, and GpuVisionTower's own Python on a host fake of the
driver and kernels (cpu); everything else skips.
GPU machine (gguf and cffi carried as wheels, PTX for the legacy variants built on the CPU box):
    LE_PTX_DIR=DIR LE_GPU_STRICT=1 python -m pytest tests/test_gpu_vision.py -m gpu
Tolerances: tests/tolerances.py GPU_LAYERNORM_REL, GPU_VISION_GELU_REL, GPU_ATTN_BIDIR_REL, GPU_VISION_TOWER_REL.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import tolerances as tol
from legacy_engine import gpu
from legacy_engine.core import _native
from legacy_engine.gpu.vision import patch_positions, vision_rope_table
from test_gpu import GPU_OK, GPU_WHY, VARIANTS, VIDS, gpu_device, kernels, variant_params  # noqa: F401

# tower configs: (hidden, n_head, ffn, depth, out_hidden, f16 matrices)
SMALL = dict(hidden=64, n_head=2, ffn=96, depth=2, out_hidden=48, f16=False)
ODD = dict(hidden=288, n_head=4, ffn=200, depth=2, out_hidden=64, f16=True)     # head size 72, ffn padded to 224
REAL = dict(hidden=768, n_head=12, ffn=3072, depth=1, out_hidden=1024, f16=False)


def _rel(got, ref) -> float:
    """max |got - ref| / max(|ref|, 1)."""
    ref = np.asarray(ref, np.float64)
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref) / np.maximum(np.abs(ref), 1.0)))


# ================================================================================================ the random mmproj

def write_mmproj(path, hidden: int, n_head: int, ffn: int, depth: int, out_hidden: int, f16: bool = False,
                 side: int = 8, patch: int = 16, merge: int = 2, seed: int = 0) -> str:
    """A random qwen3vl_merger mmproj as llama.cpp's converter lays it out (format/mmproj.py): matrices scaled by
    1/sqrt(fan in) (F16 with f16), 1-D tensors and the position grid F32."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_string("clip.projector_type", "qwen3vl_merger")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_gelu", True)
    V = "clip.vision."
    for key, val in dict(block_count=depth, embedding_length=hidden, feed_forward_length=ffn, patch_size=patch,
                         spatial_merge_size=merge, projection_dim=out_hidden, image_size=side * patch).items():
        w.add_uint32(V + key, val)
    w.add_uint32(V + "attention.head_count", n_head)
    w.add_float32(V + "attention.layer_norm_epsilon", 1e-6)
    w.add_array(V + "image_mean", [0.5, 0.5, 0.5])
    w.add_array(V + "image_std", [0.5, 0.5, 0.5])

    def mat(name, rows, cols, fan_in=None):
        a = (rng.standard_normal((rows, cols)) / math.sqrt(fan_in or cols)).astype(np.float32)
        w.add_tensor(name, a.astype(np.float16) if f16 else a)

    def vec(name, n, base=0.0, scale=0.1):
        w.add_tensor(name, (base + scale * rng.standard_normal(n)).astype(np.float32))

    for t in ("", ".1"):
        a = (rng.standard_normal((hidden, 3, patch, patch)) / math.sqrt(6 * patch * patch)).astype(np.float32)
        w.add_tensor("v.patch_embd.weight" + t, a.astype(np.float16) if f16 else a)
    vec("v.patch_embd.bias", hidden)
    w.add_tensor("v.position_embd.weight", (0.5 * rng.standard_normal((side * side, hidden))).astype(np.float32))
    for i in range(depth):
        p = f"v.blk.{i}."
        vec(p + "ln1.weight", hidden, 1.0), vec(p + "ln1.bias", hidden)
        mat(p + "attn_qkv.weight", 3 * hidden, hidden), vec(p + "attn_qkv.bias", 3 * hidden)
        mat(p + "attn_out.weight", hidden, hidden), vec(p + "attn_out.bias", hidden)
        vec(p + "ln2.weight", hidden, 1.0), vec(p + "ln2.bias", hidden)
        mat(p + "ffn_up.weight", ffn, hidden), vec(p + "ffn_up.bias", ffn)
        mat(p + "ffn_down.weight", hidden, ffn), vec(p + "ffn_down.bias", hidden)
    mh = merge * merge * hidden
    vec("v.post_ln.weight", hidden, 1.0), vec("v.post_ln.bias", hidden)
    mat("mm.0.weight", mh, mh), vec("mm.0.bias", mh)
    mat("mm.2.weight", out_hidden, mh), vec("mm.2.bias", out_hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


_TOWERS: dict = {}


@pytest.fixture(scope="module")
def cpu_tower(tmp_path_factory):
    """cpu_tower(config dict) -> the CPU VisionTower of a random mmproj of that config (one per config)."""
    from legacy_engine.cpu.vision import VisionTower

    def get(cfg: dict):
        key = tuple(sorted(cfg.items()))
        if key not in _TOWERS:
            path = write_mmproj(tmp_path_factory.mktemp("mmproj") / "mmproj.gguf", **cfg)
            _TOWERS[key] = VisionTower(path)
        return _TOWERS[key]
    return get


def sample_patches(tower, grid_thw, seed: int = 1) -> np.ndarray:
    t, h, w = grid_thw
    return np.random.default_rng(seed).standard_normal((t * h * w, tower.hparams.patch_pixels)).astype(np.float32)


@pytest.mark.cpu
@pytest.mark.parametrize("cfg", [SMALL, ODD], ids=["small", "odd"])
def test_random_mmproj_runs_on_the_cpu(cpu_tower, cfg):
    """The writer's file is a valid mmproj (the schema checks pass) and the CPU tower gives sane embeddings."""
    tower = cpu_tower(cfg)
    out = tower.encode_patches(sample_patches(tower, (1, 4, 6)), (1, 4, 6))
    assert out.shape == (6, cfg["out_hidden"]) and np.isfinite(out).all() and 0.05 < out.std() < 20


@pytest.mark.cpu
def test_host_tables_are_the_c_cores():
    """patch_positions is le_vision_patch_pos (through the position grid op: a table whose row r holds r), and the
    RoPE table's cos/sin are le_rope2d_table's (a rotation of (1, 0) pairs by the C op gives exactly (cos, sin))."""
    h, w, M, side = 6, 10, 2, 8
    table = np.repeat(np.arange(side * side, dtype=np.float32)[:, None], 4, axis=1)
    got = _native.vision_pos_embed(table, (1, side, side), M)[:, 0].astype(np.int64)   # same grid: no interpolation
    pos = patch_positions(side, side, M)
    np.testing.assert_array_equal(got, pos[:, 0] * side + pos[:, 1])
    cs = vision_rope_table(h, w, M, 72, 10000.0)
    pos = patch_positions(h, w, M).astype(np.float64)
    inv = 1.0 / 10000.0 ** (np.arange(0, 36, 2) / 36)
    ang = np.concatenate([pos[:, :1] * inv, pos[:, 1:] * inv], axis=1)
    assert np.max(np.abs(cs[..., 0] - np.cos(ang))) < 1e-5 and np.max(np.abs(cs[..., 1] - np.sin(ang))) < 1e-5


# ================================================================================================ the kernels

@pytest.mark.gpu
@variant_params()
def test_layernorm(kernels):
    rng = np.random.default_rng(10)
    for nrows, ncols, affine in ((3, 1152, True), (5, 1000, False), (70000, 64, True), (4, 4608, True)):
        x = (rng.standard_normal((nrows, ncols)) * 3 + 20).astype(np.float32)      # an offset mean
        w = (1 + 0.2 * rng.standard_normal(ncols)).astype(np.float32)
        b = (0.1 * rng.standard_normal(ncols)).astype(np.float32)
        xd = x.astype(np.float64)
        ref = (xd - xd.mean(1, keepdims=True)) / np.sqrt(xd.var(1, keepdims=True) + 1e-6)
        ref = ref * w + b if affine else ref
        with gpu.Buffer.from_array(x) as bx, gpu.Buffer.from_array(w) as bw, gpu.Buffer.from_array(b) as bb, \
                gpu.Buffer(x.nbytes) as by:
            kernels.layernorm(bx, bw if affine else None, bb if affine else None, by, ncols, nrows, 1e-6)
            y = by.download(dtype=np.float32).reshape(nrows, ncols)
            kernels.layernorm(bx, bw if affine else None, bb if affine else None, bx, ncols, nrows, 1e-6)
            y2 = bx.download(dtype=np.float32).reshape(nrows, ncols)
        assert _rel(y, ref) <= tol.GPU_LAYERNORM_REL, (nrows, ncols, _rel(y, ref))
        np.testing.assert_array_equal(y, y2)                                       # in place: the same bits


@pytest.mark.gpu
@variant_params()
@pytest.mark.parametrize("form", ["tanh", "erf"])
def test_gelu(kernels, form):
    """gelu(x + b) against the C core's le_gelu_*_ref on the f32 sum; without a bias, gelu(x)."""
    rng = np.random.default_rng(11)
    ncols, nrows = 4304, 3
    x = (3 * rng.standard_normal((nrows, ncols))).astype(np.float32)
    x[0, :2001] = np.linspace(-8, 8, 2001, dtype=np.float32)
    b = (0.5 * rng.standard_normal(ncols)).astype(np.float32)
    for bias in (True, False):
        v = (x + b).astype(np.float32) if bias else x
        ref = _native.vision_gelu(v, form).astype(np.float64)
        with gpu.Buffer.from_array(x) as bx, gpu.Buffer.from_array(b) as bb:
            kernels.gelu(bx, bb if bias else None, x.size, ncols, form)
            got = bx.download(dtype=np.float32).reshape(nrows, ncols)
        assert _rel(got, ref) <= tol.GPU_VISION_GELU_REL, (form, bias, _rel(got, ref))
    # the two forms differ (a wrong form would fail): by more than the bound
    assert np.max(np.abs(_native.vision_gelu(x, "tanh") - _native.vision_gelu(x, "erf"))) > 100 * tol.GPU_VISION_GELU_REL


@pytest.mark.gpu
@variant_params()
def test_bias_adds(kernels):
    """bias_add (x + b) + r, (x + b), and bias_residual x + (y + b): IEEE f32 in the reference's order, bit for bit."""
    rng = np.random.default_rng(12)
    nrows, ncols = 70, 1152
    x, y, r = (rng.standard_normal((3, nrows, ncols)) * [[[1.0]], [[5.0]], [[0.01]]]).astype(np.float32)
    b = rng.standard_normal(ncols).astype(np.float32)
    n = x.size
    with gpu.Buffer.from_array(x) as bx, gpu.Buffer.from_array(y) as by, gpu.Buffer.from_array(r) as br, \
            gpu.Buffer.from_array(b) as bb:
        kernels.bias_add(bx, bb, br, n, ncols)
        np.testing.assert_array_equal(bx.download(dtype=np.float32).reshape(x.shape), (x + b) + r)
        bx.upload(x)
        kernels.bias_add(bx, bb, None, n, ncols)
        np.testing.assert_array_equal(bx.download(dtype=np.float32).reshape(x.shape), x + b)
        bx.upload(x)
        kernels.bias_residual(bx, by, bb, n, ncols)
        np.testing.assert_array_equal(bx.download(dtype=np.float32).reshape(x.shape), x + (y + b))
        bx.upload(x)
        kernels.bias_residual(bx, by, None, n, ncols)
        np.testing.assert_array_equal(bx.download(dtype=np.float32).reshape(x.shape), x + y)


@pytest.mark.gpu
@variant_params()
@pytest.mark.parametrize("t,h,w,n_head,hd", [(1, 4, 6, 2, 32), (2, 6, 10, 4, 72), (1, 28, 28, 12, 64),
                                             (1, 2, 2, 1, 256)])
def test_rope_vision(kernels, t, h, w, n_head, hd):
    """The qkv bias then the 2-D RoPE of every q and k head, bit for bit the C core's (le_vision_op_rope on the
    biased rows, whose table the host hands the kernel): the v third gets only its bias."""
    rng = np.random.default_rng(13)
    n, H = t * h * w, n_head * hd
    qkv = (2 * rng.standard_normal((n, 3 * H))).astype(np.float32)
    b = rng.standard_normal(3 * H).astype(np.float32)
    ref = (qkv + b).astype(np.float32)
    pos = np.tile(patch_positions(h, w, 2), (t, 1))
    ref[:, :2 * H] = _native.vision_rope(ref[:, :2 * H], pos, 2 * n_head, 10000.0)   # q and k heads side by side
    cs = vision_rope_table(h, w, 2, hd, 10000.0)
    with gpu.Buffer.from_array(qkv) as bq, gpu.Buffer.from_array(b) as bb, gpu.Buffer.from_array(cs) as bc:
        kernels.rope_vision(bq, bb, bc, n, h * w, n_head, hd)
        got = bq.download(dtype=np.float32).reshape(n, 3 * H)
    np.testing.assert_array_equal(got, ref)


def _attention_ref(qkv, seg, n_head):
    """float64 numpy: softmax(q k^T / sqrt(hd)) v per head within segments of seg rows."""
    n, width = qkv.shape
    H = width // 3
    hd = H // n_head
    q, k, v = (qkv[:, i * H:(i + 1) * H].astype(np.float64).reshape(n, n_head, hd) for i in range(3))
    out = np.empty((n, n_head, hd))
    for s in range(0, n, seg):
        sl = slice(s, s + seg)
        sc = np.einsum("ihd,jhd->hij", q[sl], k[sl]) / math.sqrt(hd)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        out[sl] = np.einsum("hij,jhd->ihd", p / p.sum(-1, keepdims=True), v[sl])
    return out.reshape(n, H)


@pytest.mark.gpu
@variant_params()
@pytest.mark.parametrize("n,seg,n_head,hd", [(72, 24, 2, 32), (120, 60, 4, 72), (784, 784, 12, 64), (36, 36, 1, 256),
                                             (100, 100, 3, 20), (2048, 2048, 1, 64)])
def test_attention_bidir(kernels, n, seg, n_head, hd):
    """Against float64 numpy and the C core's le_vision_op_attention: segments of any size (tiles that do not divide
    them), head sizes not a multiple of 32, a long segment (no n² memory)."""
    rng = np.random.default_rng(14)
    qkv = (2 * rng.standard_normal((n, 3 * n_head * hd))).astype(np.float32)
    ref = _attention_ref(qkv, seg, n_head)
    with gpu.Buffer.from_array(qkv) as bq, gpu.Buffer(4 * n * n_head * hd) as bo:
        kernels.attention_bidir(bq, bo, n, seg, n_head, hd)
        got = bo.download(dtype=np.float32).reshape(n, n_head * hd)
    assert _rel(got, ref) <= tol.GPU_ATTN_BIDIR_REL, _rel(got, ref)
    cpu = _native.vision_attention(qkv, seg, n_head)
    assert _rel(got, cpu) <= 2 * tol.GPU_ATTN_BIDIR_REL
    if n > seg:   # negative control: one long segment is another answer
        assert _rel(got, _attention_ref(qkv, n, n_head)) > 100 * tol.GPU_ATTN_BIDIR_REL


# ================================================================================================ the tower

_GPU_TOWERS: dict = {}


def _gpu_tower(cpu, kernels):
    from legacy_engine.gpu.vision import GpuVisionTower
    key = (id(cpu), kernels.name)
    if key not in _GPU_TOWERS:
        _GPU_TOWERS[key] = GpuVisionTower(cpu, kernels)
    return _GPU_TOWERS[key]


@pytest.mark.gpu
@variant_params()
@pytest.mark.parametrize("cfg,grid", [(SMALL, (1, 4, 6)), (SMALL, (1, 8, 10)), (SMALL, (1, 6, 10)),
                                      (SMALL, (2, 4, 6)), (ODD, (1, 6, 10)), (ODD, (1, 8, 8))],
                         ids=["small-4x6", "small-8x10", "small-6x10", "small-2x4x6", "odd-6x10", "odd-8x8"])
def test_tower_matches_cpu(kernels, cpu_tower, cfg, grid):
    cpu = cpu_tower(cfg)
    patches = sample_patches(cpu, grid, seed=sum(grid))
    ref = cpu.encode_patches(patches, grid)
    got = _gpu_tower(cpu, kernels).encode_patches(patches, grid)
    assert got.shape == ref.shape
    assert _rel(got, ref) <= tol.GPU_VISION_TOWER_REL, f"grid {grid}: {_rel(got, ref):.3g}"


@pytest.mark.gpu
@variant_params()
def test_tower_real_size_layer(kernels, cpu_tower):
    """One real-size layer (hidden 768, 12 heads, ffn 3072) on a 28 x 28 grid (784 patches, 196 tokens); then a
    smaller image on the same scratch (planned for the larger) gives the CPU's answer too."""
    cpu = cpu_tower(REAL)
    tower = _gpu_tower(cpu, kernels)
    for grid in ((1, 28, 28), (1, 6, 10)):
        patches = sample_patches(cpu, grid, seed=7)
        ref = cpu.encode_patches(patches, grid)
        got = tower.encode_patches(patches, grid)
        assert _rel(got, ref) <= tol.GPU_VISION_TOWER_REL, f"grid {grid}: {_rel(got, ref):.3g}"
    assert tower._cap[0] == 784


@pytest.mark.gpu
@variant_params()
def test_tower_negative_control_and_bad_input(kernels, cpu_tower):
    """A GELU in the wrong form, in the merger or in the blocks' MLP (the CPU tower with that fault injected), fails
    the gate; bad patches are the CPU tower's FormatErrors."""
    from legacy_engine.core.errors import FormatError
    from legacy_engine.cpu.vision import VisionTower
    cpu = cpu_tower(SMALL)
    grid = (1, 4, 6)
    patches = sample_patches(cpu, grid)
    got = _gpu_tower(cpu, kernels).encode_patches(patches, grid)
    for fault in ("merger_gelu_tanh", "ffn_gelu_erf"):
        faulty = VisionTower(cpu.file, _faults={fault: True}).encode_patches(patches, grid)
        assert _rel(got, faulty) > 5 * tol.GPU_VISION_TOWER_REL, fault
    tower = _gpu_tower(cpu, kernels)
    with pytest.raises(FormatError, match="multiples of the spatial merge"):
        tower.encode_patches(patches, (1, 3, 8))
    with pytest.raises(FormatError, match="holds t\\*h\\*w = 24"):        # cpu/vision.py check_patches
        tower.encode_patches(patches[:-1], grid)
    with pytest.raises(FormatError, match="float32"):
        tower.encode_patches(patches.astype(np.float64), grid)


@pytest.mark.gpu
@variant_params()
def test_tower_vram_is_its_layout(kernels, cpu_tower):
    """The tower allocates what the planner reserves for it (gpu/vision.py tower_footprint): one weight allocation
    of weight_layout's bytes, one scratch allocation of scratch_layout's for the largest image so far (the driver
    layer's count); close() gives both back."""
    from legacy_engine.gpu.vision import GpuVisionTower, scratch_layout, weight_layout
    warm = cpu_tower(SMALL)                 # the kernels' first launches done (what they load is not ours to count)
    _gpu_tower(warm, kernels).encode_patches(sample_patches(warm, (1, 4, 6)), (1, 4, 6))
    cpu = cpu_tower(ODD)
    hp = cpu.hparams
    used0, allocs0 = gpu.mem_stats()["used"], gpu.mem_stats()["n_allocs"]
    tower = GpuVisionTower(cpu, kernels)
    assert gpu.mem_stats()["used"] - used0 == weight_layout(hp)[1]
    for grid in ((1, 6, 10), (1, 4, 6)):          # the second fits the first's scratch
        tower.encode_patches(sample_patches(cpu, grid), grid)
        st = gpu.mem_stats()
        assert st["used"] - used0 == weight_layout(hp)[1] + scratch_layout(hp, 60, 60)[1]
        assert st["n_allocs"] - allocs0 == 2
    tower.close()
    assert gpu.mem_stats()["used"] == used0


class _HostDevice:
    """A host fake of the driver layer (device memory as one numpy arena) and of the tower's Kernels (the C core's
    reference ops, numpy matmuls): GpuVisionTower's own Python — the layout of its two allocations, the views, the
    scratch's growth, the shared encode path — runs where there is no GPU."""
    BASE = 1 << 20

    def __init__(self, nbytes: int):
        self.arena, self.at, self.live = np.zeros(nbytes, np.uint8), 0, {}

    used = property(lambda self: sum(self.live.values()), doc="bytes allocated now (the driver layer's count)")

    # runtime._native()'s part that Buffer uses
    def gpu_alloc(self, nbytes, what):
        ptr, self.at = self.BASE + self.at, self.at + -(-nbytes // 256) * 256
        assert self.at <= self.arena.size, what
        self.live[ptr] = nbytes
        return ptr

    def gpu_free(self, ptr):
        del self.live[ptr]

    def gpu_copy_htod(self, ptr, src, n, stream):
        self.arena[ptr - self.BASE:ptr - self.BASE + n] = np.frombuffer(memoryview(src).cast("B"), np.uint8)[:n]

    def gpu_copy_dtoh(self, out, ptr, n, stream):
        np.frombuffer(memoryview(out).cast("B"), np.uint8)[:n] = self.arena[ptr - self.BASE:ptr - self.BASE + n]

    def a(self, buf, rows, cols):
        assert buf.nbytes >= 4 * rows * cols, buf.what
        return self.arena[buf.ptr - self.BASE:buf.ptr - self.BASE + 4 * rows * cols].view(np.float32).reshape(rows, cols)

    # the Kernels the tower calls
    def gemm_f32(self, qtype, w, x, y, rows, cols, n):
        self.a(y, n, rows)[:] = self.a(x, n, cols) @ self.a(w, rows, cols).T

    def bias_add(self, x, b, r, n, ncols):
        v = self.a(x, n // ncols, ncols)
        v += self.a(b, 1, ncols)
        if r is not None:
            v += self.a(r, n // ncols, ncols)

    def bias_residual(self, x, y, b, n, ncols):
        self.a(x, n // ncols, ncols)[:] += self.a(y, n // ncols, ncols) + self.a(b, 1, ncols)

    def layernorm(self, x, w, b, y, ncols, nrows, eps):
        self.a(y, nrows, ncols)[:] = _native.vision_layernorm(self.a(x, nrows, ncols), self.a(w, 1, ncols)[0],
                                                             self.a(b, 1, ncols)[0], eps)

    def gelu(self, x, b, n, ncols, form):
        v = self.a(x, n // ncols, ncols)
        v[:] = _native.vision_gelu(v + self.a(b, 1, ncols), form)

    def rope_vision(self, qkv, b, cs, n, seg, n_head, hd):
        q = self.a(qkv, n, 3 * n_head * hd)
        q += self.a(b, 1, 3 * n_head * hd)
        c = self.a(cs, seg, hd).reshape(seg, 1, hd // 2, 2)[np.arange(n) % seg]       # per row: (cos, sin) pairs
        x = q[:, :2 * n_head * hd].reshape(n, 2 * n_head, hd)                         # the q and k heads
        x1, x2 = x[..., :hd // 2].copy(), x[..., hd // 2:].copy()
        x[..., :hd // 2], x[..., hd // 2:] = x1 * c[..., 0] - x2 * c[..., 1], x2 * c[..., 0] + x1 * c[..., 1]

    def attention_bidir(self, qkv, o, n, seg, n_head, hd):
        self.a(o, n, n_head * hd)[:] = _native.vision_attention(self.a(qkv, n, 3 * n_head * hd).copy(), seg, n_head)


@pytest.mark.cpu
@pytest.mark.parametrize("cfg", [SMALL, ODD], ids=["small", "odd"])
def test_tower_on_a_host_fake(cpu_tower, cfg, monkeypatch):
    """GpuVisionTower on _HostDevice gives the CPU tower's embeddings (grids growing and shrinking, two frames; ODD:
    head size 72, ffn padded 200 -> 224, F16 matrices), in the two allocations its layouts plan (the bytes the
    planner reserves: tower_footprint); a wrong row count is the CPU tower's FormatError; close() frees both."""
    from legacy_engine.core.errors import FormatError
    from legacy_engine.gpu import runtime
    from legacy_engine.gpu.vision import GpuVisionTower, scratch_layout, weight_layout
    dev = _HostDevice(64 << 20)
    monkeypatch.setattr(runtime, "_native", lambda: dev)
    monkeypatch.setattr(runtime, "_ensure_open", lambda: None)
    cpu = cpu_tower(cfg)
    hp = cpu.hparams
    tower = GpuVisionTower(cpu, dev)
    assert (dev.used, len(dev.live)) == (weight_layout(hp)[1], 1)
    grids = [(1, 4, 6), (1, 8, 10), (2, 4, 6), (1, 4, 6)] if cfg is SMALL else [(1, 6, 10), (1, 8, 8)]
    for grid in grids:
        patches = sample_patches(cpu, grid, seed=sum(grid))
        ref = cpu.encode_patches(patches, grid)
        got = tower.encode_patches(patches, grid)
        assert got.shape == ref.shape and _rel(got, ref) <= 1e-4, (grid, _rel(got, ref))
    n = max(t * h * w for t, h, w in grids)
    hw = max(h * w for _, h, w in grids)
    assert tower._cap == (n, hw) and len(dev.live) == 2
    assert dev.used == weight_layout(hp)[1] + scratch_layout(hp, n, hw)[1]
    with pytest.raises(FormatError, match="holds t\\*h\\*w"):
        tower.encode_patches(patches[:-1], grids[-1])
    tower.close()
    assert not dev.live


# ================================================================================================ the engine

@pytest.mark.gpu
def test_engine_answers_an_image_on_the_gpu(gpu_device, tmp_path):
    """Engine(gpu=True, mmproj=...) end to end: the tower on the GPU beside the resident model, the image rows and
    M-RoPE in the GPU LM; its logits at every prompt position and its greedy answer against the CPU engine's."""
    from PIL import Image
    from fixtures.make_reference import tiny_gguf
    from legacy_engine.serve.generate import Engine
    text = tiny_gguf("moe", tmp_path / "moe.f32.gguf")
    ref = Engine(text, n_threads=2, pin=False)
    mm = write_mmproj(tmp_path / "mmproj.gguf", **dict(SMALL, out_hidden=ref.model.hparams.n_embd))
    png = tmp_path / "a.png"
    Image.fromarray(np.random.default_rng(5).integers(0, 256, (61, 97, 3), dtype=np.uint8)).save(png)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    out = {}
    for name, kw in (("cpu", {}), ("gpu", {"gpu": True})):
        eng = Engine(text, n_threads=2, pin=False, mmproj=mm, **kw)
        if name == "gpu":
            assert eng.vision_gpu is not None, eng.vision_where
        imgs = eng.load_images([png])
        ids, spans = eng.expand_images(eng.tokenizer.encode_prompt(*eng.chat_text(msgs, enable_thinking=False)), imgs)
        sess = eng.session()
        logits = sess.prefill(ids, all_logits=True, images=eng.encode_images(spans, imgs))
        steps = [sess.decode(int(np.argmax(logits[-1])))]
        out[name] = np.concatenate([logits, steps])
    d = float(np.abs(out["gpu"].astype(np.float64) - out["cpu"]).max())
    print(f"\nimage prompt, GPU engine vs CPU engine: max|Δ| {d:.2e} over {len(out['cpu'])} rows")
    assert d <= tol.LOGIT_ABS_F32, d


@pytest.mark.gpu
def test_engine_applies_the_vision_placement_beside_a_split(gpu_device, tmp_path, monkeypatch):
    """Engine(gpu=True, a budget below the resident footprint, mmproj): the planner's decision applied. With the
    tower's real footprint (the scratch of a 4096x4096 image is larger than this tiny split's whole budget) the tower
    stays on the CPU and says why; with its footprint cut to this image's size and a budget that holds the split beside
    it, it goes on the GPU: the split placement keeps its bytes (reserved), the driver's budget holds both, and the
    image's prompt gives the CPU engine's greedy answer."""
    from PIL import Image
    from fixtures.make_reference import tiny_gguf
    from legacy_engine.gpu import layout
    from legacy_engine.gpu.vision import tower_footprint
    from legacy_engine.plan import vision as plan_vision
    from legacy_engine.serve.generate import Engine
    from legacy_engine.serve.sampling import SamplingParams
    text = tiny_gguf("moe", tmp_path / "moe.f32.gguf")
    ref = Engine(text, n_threads=2, pin=False)
    mm = write_mmproj(tmp_path / "mmproj.gguf", **dict(SMALL, out_hidden=ref.model.hparams.n_embd))
    png = tmp_path / "a.png"
    Image.fromarray(np.random.default_rng(5).integers(0, 256, (61, 97, 3), dtype=np.uint8)).save(png)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    res = layout.vram_footprint(ref.cpu_model.file, n_ctx=256, int8=True)
    kw = dict(n_threads=2, n_ctx=256, pin=False, gpu=True, gpu_min_tokens=8, mmproj=mm)

    def answer(eng):
        ids = eng.tokenizer.encode_prompt(*eng.chat_text(msgs, enable_thinking=False))
        return eng.session().generate(ids, max_tokens=8, params=SamplingParams(temperature=0.0),
                                      images=eng.load_images([png])).tokens

    want = answer(Engine(text, n_threads=2, n_ctx=256, pin=False, mmproj=mm))
    eng = Engine(text, gpu_vram=res.total - 1, **kw)
    try:
        assert eng.placement.stream and eng.placement.reserved == 0 and eng.vision_gpu is None
        assert eng.vision_where.startswith("the CPU (on the GPU it needs"), eng.vision_where
        assert answer(eng) == want
    finally:
        eng.gpu.close()
    # the tower's footprint cut to this image's 308 patches (224x352); a budget that holds the split without pins
    # beside it (the vision planner's rule) but not the resident model
    small = tower_footprint(eng.vision.hparams, 320)
    monkeypatch.setattr(plan_vision, "tower_footprint", lambda hp, n=None: small)
    hp = ref.cpu_model.file.hparams
    split = layout.vram_footprint(ref.cpu_model.file, stream_experts=True, n_ctx=256, chunk=256, int8=True,
                                  link_experts=hp.n_expert_used)
    assert split.total + small.total < res.total
    eng = Engine(text, gpu_vram=split.total + small.total, **kw)
    try:
        assert eng.placement.stream and eng.placement.reserved == small.total, eng.placement.why
        assert eng.vision_gpu is not None and eng.vision_where.startswith("the GPU (it needs"), eng.vision_where
        assert "kept for the vision tower" in eng.placement.why
        assert answer(eng) == want
        assert gpu.mem_stats()["used"] <= gpu.mem_stats()["budget"]
    finally:
        eng.vision_gpu.close()
        eng.gpu.close()
