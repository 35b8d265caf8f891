"""The KL against fixed base rows in one pass over the new rows (l47.tail.forward `KlReference`, `kl_reference`,
`kl_against`, `kl_from`): KL(p⁰ ‖ p) = lse(x) − lse⁰ − μ⁰·(x − x⁰), checked against the f64 full softmax of the
same f32 mixer outputs (the tiny transformers Qwen4Exp: V 1024, n 256, |z| ≤ 6, lse ≈ 7.6) beside the pair pass
(`stream_head(..., pairs=)`, what `streamed_kl` runs), at a realistic ΔW (mean KL ~2e-4, the judge's budgets are
1e-3..1e-2) and a large one (mean KL ~2e-2).

Tolerances, and why. The pair pass sees both rows' f32 logits in its A = Σ e⁰(z⁰ − z) and in its two lse's, so the
logits' f32 rounding δ cancels to Σ_v (p_v − p⁰_v) δ_v (measured here: max 2e-8 nats per row, at ΔW ×10: 8e-8).
`kl_against` takes lse and lse⁰ from two separate f32 GEMMs: nothing cancels, its error IS the two lse's own,
Σ_v p_v δ_v − Σ_v p⁰_v δ⁰_v (~ε₃₂·|z|): measured max 2.2e-7 per row here (10× the pair pass's; on the demo solve's
background, lse ≈ 14: max 1.0e-5, mean |error| 1.55e-6, l47.tail.forward `kl_against`). So, per row: ≤ ROW_TOL = 1e-6
(4× the measured worst), the error equal to the two lse's errors against the f64 lse within DECOMP_REL = 5e-7 ×
max_v |z_v − z⁰_v| (what is left: μ⁰'s own f32 rounding, of its logits and of its e·W_out GEMM, times the logit
change; measured ≤ 9e-8 ×), and no larger than the pair pass's plus those two; the mean over the rows
(what the judge compares with the budget): the lse errors are unbiased, so ≤ MEAN_TOL = 2e-8 (measured ≤ 4e-9:
~1e-7/√249). Each check fails with μ⁰ of the wrong rows (test_kl_against_catches_mu0_of_other_rows).
"""

from __future__ import annotations

import pytest
import torch

from l47.tail import forward
from l47.tail.forward import kl_against, kl_from, kl_reference, tail_mix
from l47.tail.stream import stream_head
from test_solvers import tiny_rows

ROW_TOL = 1e-6
DECOMP_REL = 5e-7
MEAN_TOL = 2e-8


@pytest.fixture(scope="module")
def tiny():
    w, _, _, mk = tiny_rows()
    bg = mk(list(range(150, 399)))
    return w, bg


def _mix(b, w, **kw):
    return tail_mix(b.R, b.inj, b.hh, b.sgv, b.yr, w, **kw)


def _dW(w, scale, seed=3):
    return scale * w.W_sd.std() * torch.randn(w.n, w.f, generator=torch.Generator().manual_seed(seed))


def _f64(mix0, mix, w):
    """(KL(p⁰ ‖ p) [R], lse(x) [R], lse(x⁰) [R]) from f64 logits of the f32 mixer outputs (full softmax)."""
    z0, z = mix0.double() @ w.head.double().T, mix.double() @ w.head.double().T  # [R, V] f64
    l0, l1 = torch.log_softmax(z0, -1), torch.log_softmax(z, -1)
    return (l0.exp() * (l0 - l1)).sum(-1), torch.logsumexp(z, -1), torch.logsumexp(z0, -1)


@pytest.mark.parametrize("scale,kl_lo,kl_hi", [(0.03, 1e-4, 1e-3), (0.3, 1e-2, 1e-1)])
def test_kl_against_matches_f64_full_softmax(tiny, scale, kl_lo, kl_hi):
    w, bg = tiny
    mix0, mix = _mix(bg, w), _mix(bg, w, dW=_dW(w, scale))
    ref, lse64, lse0_64 = _f64(mix0, mix, w)
    assert kl_lo < float(ref.mean()) < kl_hi  # the ΔW size the case is about
    kr, _ = kl_reference(mix0, w)
    got, st = kl_against(kr, mix, w)
    pair = stream_head(torch.cat([mix0, mix]), w.head, w.numerics, pairs=mix.shape[0]).kl
    err, err_pair = got - ref, pair - ref
    assert got.dtype == torch.float64 and got.shape == ref.shape
    assert float(err.abs().max()) <= ROW_TOL
    # its whole error is the two f32 lse's own (the identity itself holds to μ⁰'s f64 rounding)
    lse_err = (st.lse - lse64) - (kr.lse0 - lse0_64)  # [R]
    dz = ((mix.double() - mix0.double()) @ w.head.double().T).abs().max(-1).values  # [R] max_v |z_v − z⁰_v|
    assert bool(((err - lse_err).abs() <= DECOMP_REL * dz).all())
    bound = err_pair.abs() + (st.lse - lse64).abs() + (kr.lse0 - lse0_64).abs() + DECOMP_REL * dz  # [R]
    assert bool((err.abs() <= bound).all())
    assert abs(float(err.mean())) <= MEAN_TOL
    assert float(err_pair.abs().max()) <= 1e-7  # the pair pass: the logits' rounding cancels (module docstring)


def test_kl_against_catches_mu0_of_other_rows(tiny):
    """The checks above can fail: μ⁰ of the neighbouring rows misses by orders of magnitude more than ROW_TOL."""
    w, bg = tiny
    mix0, mix = _mix(bg, w), _mix(bg, w, dW=_dW(w, 0.03))
    ref = _f64(mix0, mix, w)[0]
    kr, _ = kl_reference(mix0, w)
    bad = forward.KlReference(mix0=kr.mix0, lse0=kr.lse0, mu0=kr.mu0.roll(1, 0))
    err = kl_against(bad, mix, w)[0] - ref
    assert float(err.abs().max()) > 1e3 * ROW_TOL and abs(float(err.mean())) > 1e3 * MEAN_TOL


def test_kl_against_is_zero_at_the_base_and_returns_the_new_rows_pass(tiny):
    """At x = x⁰ the KL is exactly 0 (lse⁰ by the same plain pass as the new rows' lse: the same rounding); the
    Streamed is the new rows' own pass (top-k, lse), and row blocks change no bit."""
    w, bg = tiny
    mix0, mix = _mix(bg, w), _mix(bg, w, dW=_dW(w, 0.3))
    kr, st0 = kl_reference(mix0, w, topk=1)
    assert torch.equal(kl_against(kr, mix0.clone(), w)[0], torch.zeros(mix0.shape[0], dtype=torch.float64))
    assert torch.equal(st0.top_i, stream_head(mix0, w.head, w.numerics, topk=1).top_i)
    got, st = kl_against(kr, mix, w, topk=3)
    own = stream_head(mix, w.head, w.numerics, topk=3)
    assert torch.equal(st.top_i, own.top_i) and torch.equal(st.lse, own.lse)
    old = forward.KL_ROW_BLOCK
    forward.KL_ROW_BLOCK = 7
    try:
        assert torch.equal(kl_against(kr, mix, w)[0], got)
    finally:
        forward.KL_ROW_BLOCK = old
    # kl_from is the same expression for the trainer's step (differentiable in mix: ∂/∂x = μ − μ⁰ through lse)
    assert torch.equal(kl_from(st.lse, mix, kr.lse0, kr.mix0, kr.mu0), got)
