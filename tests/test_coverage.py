"""The background-coverage warning of `l47 sets` (l47/data/coverage.py) against a direct re-derivation on the rows."""

import numpy as np
import pytest

from l47.data.coverage import ENERGY, FLOOR, RATIO, KeyGrams, coverage_warnings, outside_share, span_basis


def _rows(rng, basis, T, noise=0.02):
    """T keys mostly in span(basis) [f, k], plus a little isotropic noise (no set of real text is exactly low-rank)."""
    f, k = basis.shape
    return rng.normal(size=(T, k)) @ basis.T + noise * rng.normal(size=(T, f))


def test_outside_share_matches_the_rows_projected_directly():
    """outside_share(Σ hh hhᵀ, P) equals Σ‖h − PPᵀh‖² / Σ‖h‖² computed on the rows themselves (f64; 1e-9: only
    the order of the sums differs), and span_basis keeps the fewest leading directions holding ENERGY of the
    background's trace (re-derived from numpy's SVD of the rows)."""
    rng = np.random.default_rng(0)
    f = 48
    Q = np.linalg.qr(rng.normal(size=(f, f)))[0]
    bg = _rows(rng, Q[:, :12], 900)
    x = _rows(rng, Q[:, 6:20], 300)  # half of its directions are the background's
    g = KeyGrams()
    g.add("background", bg)
    g.add("x", x)
    P = span_basis(g.C["background"])
    s = np.linalg.svd(bg, compute_uv=False) ** 2  # eigenvalues of bgᵀbg, descending
    held = np.cumsum(s) / s.sum()
    assert P.shape[1] == int(np.argmax(held >= ENERGY)) + 1
    assert np.allclose(P.T @ P, np.eye(P.shape[1]), atol=1e-10)
    r = x - (x @ P) @ P.T
    want = float((r ** 2).sum() / (x ** 2).sum())
    assert outside_share(g.C["x"], P) == pytest.approx(want, rel=1e-6)
    assert 0.2 < want < 0.8  # a real partial overlap, not a 0-vs-0 comparison


def test_a_scored_set_the_background_never_shows_is_named():
    """Background, the solver's own documents and one KLD domain drawn from the same 16 of 64 directions: no
    warning. A second domain with its keys in 10 other directions as well: named, with its share and the
    reference share. Without the solver's own documents there is nothing to compare: no line."""
    rng = np.random.default_rng(1)
    f = 64
    Q = np.linalg.qr(rng.normal(size=(f, f)))[0]
    common, other = Q[:, :16], Q[:, 16:26]
    g = KeyGrams()
    g.add("background", _rows(rng, common, 2000))
    g.add("pool", _rows(rng, common, 800))
    g.add("collateral_anchor", _rows(rng, common, 400))
    g.add("kld.prose", _rows(rng, common, 400))
    g.add("kld.json", np.concatenate([_rows(rng, common, 300), _rows(rng, other, 100)]))
    w = coverage_warnings(g, ["kld.prose", "kld.json", "kld.absent"])
    assert len(w) == 1 and w[0].startswith("set 'kld.json': ")
    P = span_basis(g.C["background"])
    share, ref = outside_share(g.C["kld.json"], P), outside_share(g.pooled(("pool", "collateral_anchor")), P)
    assert share > max(FLOOR, RATIO * ref) and f"{share:.1%}" in w[0] and f"{ref:.1%}" in w[0]
    assert outside_share(g.C["kld.prose"], P) < RATIO * ref
    g2 = KeyGrams()
    g2.add("background", _rows(rng, common, 500))
    g2.add("kld.json", _rows(rng, other, 100))
    assert coverage_warnings(g2, ["kld.json"]) == []
