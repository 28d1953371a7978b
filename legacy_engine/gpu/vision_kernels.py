"""The vision tower's launchers (cuda8/layernorm.cu, gelu.cu, rope_vision.cu, attention_bidir.cu): a part of Kernels
(kernels.py), as MatmulLaunchers is. Each checks its buffers and shapes, then launches on `stream` (default stream when
None) without waiting; the geometry is each source's #defines (launch.py reads them)."""
from __future__ import annotations

from .launch import MAX_GRID, _D, _inv_sqrt_f32, _need, _ptr
from .runtime import Stream

LN_THREADS, GELU_THREADS, ROPEV_THREADS = _D["LN_THREADS"], _D["GELU_THREADS"], _D["ROPEV_THREADS"]
ATTNB_THREADS, ATTNB_QTILE, ATTNB_MAX_HD = _D["ATTNB_THREADS"], _D["ATTNB_QTILE"], _D["ATTNB_MAX_HD"]


class VisionLaunchers:
    """The vision ops of Kernels; every tensor f32, shapes as in each source's header. Needs the host class's
    modules and _grid."""

    def layernorm(self, x, w, b, y, ncols: int, nrows: int, eps: float, stream: Stream | None = None) -> None:
        """y[nrows, ncols] = (x - mean) / sqrt(var + eps) * w + b per row (y may be x; w, b None: none)."""
        if ncols <= 0 or nrows <= 0:
            raise ValueError(f"layernorm: ncols = {ncols}, nrows = {nrows}")
        for buf, nb, what in ((x, 4 * ncols * nrows, "x"), (y, 4 * ncols * nrows, "y"), (w, 4 * ncols, "w"),
                              (b, 4 * ncols, "b")):
            _need(buf, nb, f"layernorm {what}")
        self.modules["layernorm"].kernel("layernorm_f32").launch(
            (self._grid(nrows), 1, 1), (LN_THREADS, 1, 1),
            [("ptr", _ptr(x)), ("ptr", _ptr(w)), ("ptr", _ptr(b)), ("ptr", _ptr(y)), ("i32", ncols), ("i32", nrows),
             ("f32", eps)], stream=stream)

    def _rows_op(self, kernel: str, args: list, n: int, ncols: int, bufs: list, stream: Stream | None) -> None:
        if n <= 0 or ncols <= 0 or n % ncols:
            raise ValueError(f"{kernel}: n = {n} is not a positive multiple of ncols = {ncols}")
        for buf, nb, what in bufs:
            _need(buf, nb, f"{kernel} {what}")
        self.modules["gelu"].kernel(kernel).launch(
            (self._grid(-(-n // GELU_THREADS)), 1, 1), (GELU_THREADS, 1, 1), args + [("i32", n), ("i32", ncols)],
            stream=stream)

    def gelu(self, x, b, n: int, ncols: int, form: str = "tanh", stream: Stream | None = None) -> None:
        """In place on x [n / ncols, ncols]: x = gelu(x + b) (b [ncols], None: no bias); form 'tanh' (the ViT
        blocks' gelu_pytorch_tanh) or 'erf' (the merger's exact nn.GELU)."""
        if form not in ("tanh", "erf"):
            raise ValueError(f"gelu: form {form!r}, expected 'tanh' or 'erf'")
        self._rows_op(f"gelu_{form}_f32", [("ptr", _ptr(x)), ("ptr", _ptr(b))], n, ncols,
                      [(x, 4 * n, "x"), (b, 4 * ncols, "b")], stream)

    def bias_add(self, x, b, r, n: int, ncols: int, stream: Stream | None = None) -> None:
        """In place on x [n / ncols, ncols]: x = (x + b) + r (b [ncols], r [n]; either None: left out)."""
        self._rows_op("bias_add_f32", [("ptr", _ptr(x)), ("ptr", _ptr(b)), ("ptr", _ptr(r))], n, ncols,
                      [(x, 4 * n, "x"), (b, 4 * ncols, "b"), (r, 4 * n, "r")], stream)

    def bias_residual(self, x, y, b, n: int, ncols: int, stream: Stream | None = None) -> None:
        """In place on x [n / ncols, ncols]: x = x + (y + b) (a Linear's output y [n] and its bias b [ncols] or None
        into the residual stream)."""
        self._rows_op("bias_residual_f32", [("ptr", _ptr(x)), ("ptr", _ptr(y)), ("ptr", _ptr(b))], n, ncols,
                      [(x, 4 * n, "x"), (y, 4 * n, "y"), (b, 4 * ncols, "b")], stream)

    def rope_vision(self, qkv, b, cs, n: int, seg: int, n_head: int, hd: int, stream: Stream | None = None) -> None:
        """In place on qkv [n, 3 * n_head * hd]: += b [3H] (None: no bias), then every q and k head's NeoX pairs
        (i, i + hd/2) rotated by row t % seg of cs [seg, hd/2] (cos, sin) pairs (vision_rope_table)."""
        if n <= 0 or seg <= 0 or n % seg or n_head <= 0 or hd <= 0 or hd % 2:
            raise ValueError(f"rope_vision: n = {n}, seg = {seg} (n a multiple of it), n_head = {n_head}, hd = {hd}")
        H = n_head * hd
        _need(qkv, 4 * 3 * H * n, "rope_vision qkv")
        _need(b, 4 * 3 * H, "rope_vision b")
        _need(cs, 4 * seg * hd, "rope_vision cs")
        self.modules["rope_vision"].kernel("rope_vision_f32").launch(
            (self._grid(n), 1, 1), (ROPEV_THREADS, 1, 1),
            [("ptr", _ptr(qkv)), ("ptr", _ptr(b)), ("ptr", _ptr(cs)), ("i32", n), ("i32", seg), ("i32", n_head),
             ("i32", hd)], stream=stream)

    def attention_bidir(self, qkv, o, n: int, seg: int, n_head: int, hd: int, scale: float | None = None,
                        stream: Stream | None = None) -> None:
        """o [n, H] = softmax(scale q k^T) v per head within each segment of seg rows, q | k | v from the fused rows
        qkv [n, 3H] (H = n_head * hd); scale default 1/sqrt(hd) in f32, as the reference. O(tile) memory."""
        if not 0 < hd <= ATTNB_MAX_HD or n <= 0 or seg <= 0 or n % seg or n_head <= 0:
            raise ValueError(f"attention_bidir: hd = {hd} (1…{ATTNB_MAX_HD}), n = {n} (a multiple of seg = {seg}), "
                             f"n_head = {n_head}")
        if n_head > MAX_GRID:
            raise ValueError(f"attention_bidir: n_head = {n_head} > {MAX_GRID}")
        H = n_head * hd
        _need(qkv, 4 * 3 * H * n, "attention_bidir qkv")
        _need(o, 4 * H * n, "attention_bidir o")
        scale = _inv_sqrt_f32(hd) if scale is None else scale
        tiles = n // seg * -(-seg // ATTNB_QTILE)
        self.modules["attention_bidir"].kernel("attn_bidir_f32").launch(
            (n_head, self._grid(tiles), 1), (ATTNB_THREADS, 1, 1),
            [("ptr", _ptr(qkv)), ("ptr", _ptr(o)), ("i32", n), ("i32", seg), ("i32", n_head), ("i32", hd),
             ("f32", scale)], stream=stream)
