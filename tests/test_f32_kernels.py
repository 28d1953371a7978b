"""The f32 kernels of the decode step (native/f32_ref.c, cpu_simd/f32_<isa>.c): every tier this CPU runs against
f64 math, within Higham-style bounds (tolerances.GDN_STEP_*, DOT_F32_EXTRA), plus negative controls showing the
bound catches a kernel that loses a row or a column. Tiers the CPU lacks are skipped with the reason."""
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
    """Which tier serves the f32 kernels follows the selected tier (ssse3 uses the reference)."""
    before = _native.get_isa()
    try:
        for name in _native.ISA_NAMES:
            if _native.isa_supported(name):
                _native.set_isa(name)
                assert _native.f32_isa() == ("ref" if name in ("ref", "ssse3") else name)
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
