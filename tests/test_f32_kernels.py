"""The f32 kernels (native/f32_ref.c, cpu_simd/f32_<isa>.c; gelu_tanh's reference native/gelu.c): every tier this
CPU runs against f64 math, within Higham-style bounds (tolerances.GDN_STEP_*, DOT_F32_EXTRA, GEMM_*_EXTRA), the
vector exp against the reference's expf in ulps (EXP_SUB_SUM_ULP), plus negative controls showing each bound
catches a kernel that loses a term. Tiers the CPU lacks are skipped with the reason."""
from __future__ import annotations

import numpy as np
import pytest
import tolerances as tol

from legacy_engine.core import _native

pytestmark = pytest.mark.cpu

U = 2.0**-24
SHAPES = [(128, 128), (16, 16), (32, 64), (64, 24), (256, 8), (8, 1000)]  # (dk, dv): real, tiny, odd tails


tiers = pytest.mark.parametrize("forced_isa", _native.ISA_NAMES, indirect=True)


def gdn_f64(S, q, k, v, decay, beta):
    """The reference recurrence in f64, with the magnitudes the bound needs."""
    S, q, k, v = (a.astype(np.float64) for a in (S, q, k, v))
    Sd = decay * S
    delta = beta * (v - Sd.T @ k)
    Md = abs(beta) * (np.abs(v) + np.abs(Sd).T @ np.abs(k))
    S2 = Sd + np.outer(k, delta)
    M_S = np.abs(Sd) + np.outer(np.abs(k), Md)
    o = S2.T @ q
    M_o = np.abs(q) @ M_S + abs(k @ q) * Md
    return S2, o, M_S, M_o


def random_case(rng, dk, dv):
    S = rng.standard_normal((dk, dv)).astype(np.float32) * 0.3
    q = rng.standard_normal(dk).astype(np.float32)
    k = rng.standard_normal(dk).astype(np.float32)
    q /= np.linalg.norm(q) * np.sqrt(dk)  # l2-normalised and scaled, as the model feeds them
    k /= np.linalg.norm(k)
    v = rng.standard_normal(dv).astype(np.float32)
    return S, q, k, v, float(np.exp(-rng.uniform(0.0, 2.0))), float(rng.uniform(0.05, 0.95))


def bound(dk, M):
    return tol.GDN_STEP_CHAIN * (dk + tol.GDN_STEP_EXTRA) * U * M


@tiers
@pytest.mark.parametrize("dk,dv", SHAPES)
def test_gdn_step_matches_f64(forced_isa, dk, dv):
    rng = np.random.default_rng([dk, dv, 7])
    for _ in range(3):
        S, q, k, v, decay, beta = random_case(rng, dk, dv)
        S2_ref, o_ref, M_S, M_o = gdn_f64(S, q, k, v, decay, beta)
        S_run = S.copy()
        o = _native.gdn_step(S_run, q, k, v, decay, beta)
        assert np.all(np.abs(S_run - S2_ref) <= bound(dk, M_S)), f"{forced_isa}: state off by {np.abs(S_run - S2_ref).max()}"
        assert np.all(np.abs(o - o_ref) <= bound(dk, M_o)), f"{forced_isa}: output off by {np.abs(o - o_ref).max()}"


def test_gdn_step_bound_catches_a_lost_row_and_column():
    """Negative controls: the bound of test_gdn_step_matches_f64 must reject a state that missed one row's update or
    an output that missed one column."""
    rng = np.random.default_rng(3)
    dk = dv = 128
    S, q, k, v, decay, beta = random_case(rng, dk, dv)
    S2_ref, o_ref, M_S, M_o = gdn_f64(S, q, k, v, decay, beta)
    S_run = S.copy()
    o = _native.gdn_step(S_run, q, k, v, decay, beta)
    bad_S = S_run.copy()
    bad_S[5] = decay * S[5]  # row 5 without its k delta^T update
    assert not np.all(np.abs(bad_S - S2_ref) <= bound(dk, M_S))
    bad_o = o.copy()
    bad_o[7] = o[8]
    assert not np.all(np.abs(bad_o - o_ref) <= bound(dk, M_o))


def test_gdn_step_tiers_serve_it():
    """Which tier serves the f32 kernels follows the selected tier (ssse3 has a row of its own: gemm_nn on SSE, the
    references for the rest)."""
    before = _native.get_isa()
    try:
        for name in _native.ISA_NAMES:
            if _native.isa_supported(name):
                _native.set_isa(name)
                assert _native.f32_isa() == name
    finally:
        _native.set_isa(before)


@tiers
@pytest.mark.parametrize("n", [0, 1, 7, 8, 63, 64, 65, 2048, 4099])
def test_dot_f32_matches_f64(forced_isa, n):
    rng = np.random.default_rng(n)
    a, b = rng.standard_normal((2, n)).astype(np.float32)
    ref = float(a.astype(np.float64) @ b.astype(np.float64))
    M = float(np.abs(a.astype(np.float64) * b).sum())
    assert abs(_native.dot_f32(a, b) - ref) <= (n + tol.DOT_F32_EXTRA) * U * M + 1e-30


def test_gdn_step_rejects_bad_input():
    with pytest.raises(ValueError):
        _native.gdn_step(np.zeros((4, 4), np.float64), np.zeros(4), np.zeros(4), np.zeros(4), 1.0, 0.5)
    with pytest.raises(_native.NativeError):
        _native.gdn_step(np.zeros((4, 2000), np.float32), np.zeros(4), np.zeros(4), np.zeros(2000), 1.0, 0.5)


GEMM_SHAPES = [(1, 1, 1), (3, 5, 7), (4, 4, 16), (7, 9, 33), (64, 16, 768), (32, 784, 64), (5, 13, 3072), (2, 3, 0)]


def gemm_bound(a, b):
    """Per-element bound of gemm_tile against f64: (K + extra) u sum |a_ik b_jk|."""
    M = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)).T
    return (a.shape[1] + tol.GEMM_TILE_F32_EXTRA) * U * M + 1e-30


@tiers
@pytest.mark.parametrize("m,n,k", GEMM_SHAPES)
def test_gemm_tile_matches_f64_and_ref(forced_isa, m, n, k):
    rng = np.random.default_rng([m, n, k])
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((n, k)).astype(np.float32)
    c = _native.gemm_f32(a, b)
    exact = a.astype(np.float64) @ b.astype(np.float64).T
    bnd = gemm_bound(a, b)
    assert np.all(np.abs(c - exact) <= bnd), f"{forced_isa}: off by {np.abs(c - exact).max()}"
    before = _native.get_isa()
    try:
        _native.set_isa("ref")
        c_ref = _native.gemm_f32(a, b)
    finally:
        _native.set_isa(before)
    assert np.all(np.abs(c - c_ref) <= 2 * bnd), f"{forced_isa}: off the reference by {np.abs(c - c_ref).max()}"


@tiers
def test_gemm_tile_cut_changes_no_bit(forced_isa):
    """gemm_tile's contract: an element's sum depends on K alone, so any block of C computed alone (tails, odd
    offsets) has the same bits as in the whole product (what makes the vision tower thread-count invariant)."""
    rng = np.random.default_rng(11)
    a = rng.standard_normal((13, 771)).astype(np.float32)
    b = rng.standard_normal((10, 771)).astype(np.float32)
    whole = _native.gemm_f32(a, b)
    for i0, i1, j0, j1 in [(0, 1, 0, 1), (1, 6, 3, 10), (5, 13, 1, 4), (12, 13, 7, 10)]:
        assert np.array_equal(_native.gemm_f32(a[i0:i1], b[j0:j1]), whole[i0:i1, j0:j1])


def test_gemm_tile_bound_catches_a_lost_term():
    """Negative control: an element missing one of its K products is outside the bound."""
    rng = np.random.default_rng(5)
    a = rng.standard_normal((8, 768)).astype(np.float32)
    b = rng.standard_normal((8, 768)).astype(np.float32)
    c = _native.gemm_f32(a, b)
    bad = c.copy()
    bad[3, 2] -= a[3, 700] * b[2, 700]
    exact = a.astype(np.float64) @ b.astype(np.float64).T
    assert not np.all(np.abs(bad - exact) <= gemm_bound(a, b))


# ---- gemm_nn: C = A B (the vision attention's QK^T with keys transposed, P V) ------------------------------------
GEMM_NN_SHAPES = [(1, 1, 1), (3, 5, 7), (6, 64, 128), (7, 9, 33), (48, 4096, 64), (48, 64, 4096), (13, 72, 257),
                  (5, 130, 300), (64, 64, 3072), (2, 3, 0)]  # tails in every dimension, the attention's real shapes


def gemm_nn_bound(a, b):
    """Per-element bound of gemm_nn against f64: (K + extra) u sum_k |a_ik b_kj|."""
    M = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
    return (a.shape[1] + tol.GEMM_NN_F32_EXTRA) * U * M + 1e-30


def _at_ref(fn, *args):
    before = _native.get_isa()
    try:
        _native.set_isa("ref")
        return fn(*args)
    finally:
        _native.set_isa(before)


@tiers
@pytest.mark.parametrize("m,n,k", GEMM_NN_SHAPES)
def test_gemm_nn_matches_f64_and_ref(forced_isa, m, n, k):
    rng = np.random.default_rng([m, n, k, 1])
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    c = _native.gemm_nn_f32(a, b)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    bnd = gemm_nn_bound(a, b)
    assert np.all(np.abs(c - exact) <= bnd), f"{forced_isa}: off by {np.abs(c - exact).max()}"
    c_ref = _at_ref(_native.gemm_nn_f32, a, b)
    assert np.all(np.abs(c - c_ref) <= 2 * bnd), f"{forced_isa}: off the reference by {np.abs(c - c_ref).max()}"


@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (6, 8, 128), (7, 13, 129), (64, 128, 64), (37, 61, 300)])
def test_gemm_nn_ssse3_has_the_reference_bits(m, n, k):
    """The SSSE3 gemm_nn rounds each product then adds (no FMA), in the reference's order: its bits, not just close."""
    from fixtures.isa import isa_forced
    rng = np.random.default_rng([m, n, k, 2])
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    with isa_forced("ssse3"):
        c = _native.gemm_nn_f32(a, b)
    assert c.tobytes() == _at_ref(_native.gemm_nn_f32, a, b).tobytes()


@tiers
def test_gemm_nn_cut_changes_no_bit(forced_isa):
    """gemm_nn's contract: an element's sum depends on K alone, so any block of C computed alone (row and column
    tails, odd offsets) has the same bits as in the whole product (the attention's tiles, any thread count)."""
    rng = np.random.default_rng(12)
    a = rng.standard_normal((13, 300)).astype(np.float32)
    b = rng.standard_normal((300, 150)).astype(np.float32)
    whole = _native.gemm_nn_f32(a, b)
    for i0, i1, j0, j1 in [(0, 1, 0, 1), (1, 8, 3, 70), (5, 13, 17, 150), (12, 13, 64, 129)]:
        assert np.array_equal(_native.gemm_nn_f32(a[i0:i1], b[:, j0:j1]), whole[i0:i1, j0:j1])


def test_gemm_nn_bound_catches_a_lost_term():
    """Negative control: an element missing one of its K products is outside the bound."""
    rng = np.random.default_rng(6)
    a = rng.standard_normal((8, 768)).astype(np.float32)
    b = rng.standard_normal((768, 8)).astype(np.float32)
    bad = _native.gemm_nn_f32(a, b)
    bad[3, 2] -= a[3, 700] * b[700, 2]
    assert not np.all(np.abs(bad - a.astype(np.float64) @ b.astype(np.float64)) <= gemm_nn_bound(a, b))


# ---- exp_sub_sum: the softmax's numerators (the vision attention) ------------------------------------------------
def _ulps(a, b):
    """|a - b| in units in the last place of f32 (bit patterns of non-negative floats: subnormal steps count too)."""
    return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


def exp_sweep():
    """x - max over the softmax's range: 0 (the max), geometric down to -110 (past expf's underflow to 0 at about
    -103.97), a dense linear sweep, and the edges: the subnormal threshold (-87.34), the last nonzero results,
    -inf and -1e30 (masked or far scores), -0."""
    edges = [-np.inf, -1e30, -87.33, -87.34, -103.96, -103.97, -103.98, -104.0, -126 * np.log(2), -149 * np.log(2),
             -0.0, -1e-30, -2.0**-24]
    return np.concatenate([[0.0], -np.geomspace(1e-8, 110, 100001), np.linspace(-110, 0, 100001), edges]
                          ).astype(np.float32)


@tiers
def test_exp_sub_sum_within_ulps_of_expf(forced_isa):
    x = exp_sweep()
    y, s = _native.exp_sub_sum_f32(x)
    y_ref, s_ref = _at_ref(_native.exp_sub_sum_f32, x)
    u = _ulps(y, y_ref)
    assert u.max() <= tol.EXP_SUB_SUM_ULP, f"{forced_isa}: {u.max()} ulps at x = {x[u.argmax()]}"
    assert np.all(y[x <= -104] == 0) and np.all(y_ref[x <= -104] == 0)   # -inf and far below: 0 exactly
    assert y[0] == 1.0                                                      # the max itself
    assert abs(s - s_ref) <= tol.EXP_SUB_SUM_ULP * 2.0**-23 * s_ref


@tiers
@pytest.mark.parametrize("n,scale", [(4096, 0.125), (4099, 1 / np.sqrt(72)), (7, 0.125), (1, 1.0), (17, 0.3)])
def test_exp_sub_sum_scaled_rows(forced_isa, n, scale):
    """Rows of scores as the attention gives them (std 20, so the scaled row spans ~-30 .. 0): every length's tail,
    the argument rounded as the reference rounds it (the max gives exactly 1), the sum in double."""
    x = (20 * np.random.default_rng([n, 3]).standard_normal(n)).astype(np.float32)
    y, s = _native.exp_sub_sum_f32(x, scale)
    y_ref, s_ref = _at_ref(_native.exp_sub_sum_f32, x, scale)
    assert _ulps(y, y_ref).max() <= tol.EXP_SUB_SUM_ULP
    assert y[np.argmax(x)] == 1.0
    assert abs(s - s_ref) <= tol.EXP_SUB_SUM_ULP * 2.0**-23 * s_ref
    x64 = x.astype(np.float64) * scale
    assert np.allclose(y, np.exp(x64 - x64.max()), rtol=4 * 2.0**-24 * (1 + np.abs(x64).max()), atol=0)


def test_exp_sub_sum_bound_catches_a_few_ulps():
    """Negative control: a result 3 ulps off (a polynomial one degree short is ~1e3) fails the ulp gate."""
    x = exp_sweep()
    y_ref, _ = _at_ref(_native.exp_sub_sum_f32, x)
    bad = y_ref.copy()
    bad[1000] = np.nextafter(np.nextafter(np.nextafter(bad[1000], 2), 2), 2)
    assert _ulps(bad, y_ref).max() > tol.EXP_SUB_SUM_ULP


def test_exp_sub_sum_rejects_bad_input():
    with pytest.raises(_native.NativeError):
        _native.exp_sub_sum_f32(np.zeros(4, np.float32), 0.0)


# ---- silu: the SwiGLU gate and the GDN's activations ------------------------------------------------------------

@tiers
def test_silu_within_ulps_of_ref_and_position_free(forced_isa):
    """Each tier's silu against the reference (libm expf) within SILU_ULP ulps of its value, and f64 within the same;
    an element's bits do not depend on its neighbours (a slice, a one-element call, a different length): a token's
    gates are the same in a batch of any size."""
    x = np.concatenate([np.linspace(-120, 120, 240001), [0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 1e30, -1e30]])
    x = x.astype(np.float32)
    got = _native.silu_f32(x)
    ref = _at_ref(_native.silu_f32, x)
    x64 = x.astype(np.float64)
    with np.errstate(over="ignore"):
        exact = (x64 / (1 + np.exp(-x64))).astype(np.float32)
    u_ref = _ulps(got, ref)
    assert u_ref.max() <= tol.SILU_ULP, f"{forced_isa}: {u_ref.max()} ulps from the reference at x = {x[u_ref.argmax()]}"
    finite = x >= -88.5                   # beyond, exp(-x) overflows f32: this form (and the reference) gives -0
    u_exact = _ulps(got[finite], exact[finite])
    assert u_exact.max() <= tol.SILU_ULP, f"{forced_isa}: {u_exact.max()} ulps from f64 at x = {x[finite][u_exact.argmax()]}"
    assert np.all(got[x < -89] == 0)
    assert got[x == -1e30][0] == 0 and got[x == 1e30][0] == 1e30
    for a, b in ((5, 42), (7, 8), (100, 117), (3, 3 + 16 * 5 + 9)):
        assert np.array_equal(_native.silu_f32(x[a:b]), got[a:b])


# ---- gelu_tanh: the vision MLP's activation -----------------------------------------------------------------------
@tiers
def test_gelu_tanh_matches_f64_and_ref(forced_isa):
    x = np.concatenate([np.linspace(-12, 12, 48001), [-1e30, 1e30, 0.0, -0.0, 1e-30, -1e5, 1e5]]).astype(np.float32)
    x64 = x.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        exact = 0.5 * x64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64 ** 3)))
    exact = np.where(np.isnan(exact), 0.0, exact)    # x^3 overflows at +-1e30: the limits are x and -0
    got = _native.gelu_tanh_f32(x)
    err = np.abs(got - exact) / np.maximum(np.abs(exact), 1.0)
    assert err.max() <= tol.VISION_OP_REL, f"{forced_isa}: {err.max():.3g} at x = {x[err.argmax()]}"
    ref = _at_ref(_native.gelu_tanh_f32, x)
    assert np.max(np.abs(got - ref) / np.maximum(np.abs(ref), 1.0)) <= 2 * tol.VISION_OP_REL
    # the tail (a length no tier's vector divides) goes through the same code as the full vectors
    assert np.array_equal(_native.gelu_tanh_f32(x[5:42]), got[5:42])


def test_gelu_tanh_bound_catches_the_erf_form():
    """Negative control: the erf form (the merger's, a known bug in the blocks) is outside the gate."""
    x = np.linspace(-8, 8, 4001, dtype=np.float32)
    erf = np.asarray(_native.vision_gelu(x, "erf"), np.float64)
    x64 = x.astype(np.float64)
    exact = 0.5 * x64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64 ** 3)))
    assert np.max(np.abs(erf - exact) / np.maximum(np.abs(exact), 1.0)) > tol.VISION_OP_REL
