"""The exact tail forward against transformers' own Qwen4Exp, a float64 numpy re-derivation, and finite
differences; plus negative tests showing the parity test detects each plausible convention mistake.

Tolerances: f32 end to end on a 1024-vocab model whose logits are O(10): the two implementations order their
sums differently, so agreement is ~1e-6 relative; we assert max |Δlogit| ≤ 1e-4 (the issue's bar), and ≥ 1e-2
for every deliberately wrong convention (they move logits by O(0.1–10)).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from l47.tail.forward import (full_logits, head_stats, logp_at, mix_from_ys, mixer_parts, mixer_vjp, paired_stats,
                              streamed_kl, streamed_lse, tail_mix)
from l47.model.weights import TailWeights
from tiny_hf import capture, tiny_model

TOL = 1e-4


def weights_from_hf(model) -> TailWeights:
    """TailWeights straight from the HF state dict (norm folded 1 + w, as GGUF stores it)."""
    c = model.config
    L = c.num_hidden_layers - 1
    mixer = model.model.hyper_connection_mixer
    down = mixer.input_mix_weight_down.weight.detach().float()
    return TailWeights(
        layer=L, n=c.hidden_size, f=c.shared_expert_intermediate_size, hc=c.hc_count, r=c.hc_lowrank,
        V=c.vocab_size, eps=c.rms_norm_eps,
        W_sd=model.model.layers[L].mlp.shared_expert.down_proj.weight.detach().float().clone(),
        onorm=(1.0 + mixer.hc_norm.weight.detach().float()).reshape(c.hc_count, c.hidden_size),
        odown=down, oup=mixer.input_mix_weight_up.weight.detach().float(),
        head=model.lm_head.weight.detach().float(), target="blk.2.ffn_down_shexp.weight",
        target_type=8, model_sha256="hf", policy="exact", path="hf",
    )


@pytest.fixture(scope="module")
def hf():
    torch.manual_seed(0)
    m = tiny_model(seed=0)
    ids = torch.randint(0, m.config.vocab_size, (48,), generator=torch.Generator().manual_seed(1))
    states, logits = capture(m, ids)
    return m, ids, states, logits


def _mix(states, w, **kw):
    return tail_mix(states["R"], states["inj"], states["hh"], states["sgv"], states["yr"], w, **kw)


def test_inject_logits_are_large(hf):
    _, _, s, _ = hf
    assert s["inj"].abs().mean() > 4, "perturbation too small: the /hc convention would not be tested"


def test_parity_with_transformers(hf):
    m, _, s, logits = hf
    w = weights_from_hf(m)
    ours = full_logits(_mix(s, w), w)
    assert (ours - logits).abs().max().item() <= TOL
    assert logits.abs().max() > 1.0  # not trivially near zero


def test_parity_with_dW_edit(hf):
    m, ids, s, logits = hf
    w = weights_from_hf(m)
    dW = torch.randn(w.n, w.f, generator=torch.Generator().manual_seed(3)) * 0.05
    m2 = tiny_model(seed=0)
    with torch.no_grad():
        m2.model.layers[w.layer].mlp.shared_expert.down_proj.weight += dW
    _, logits_edit = capture(m2, ids)
    assert (logits_edit - logits).abs().max() > 1e-2  # the edit really moves the model
    ours = full_logits(_mix(s, w, dW=dW), w)
    assert (ours - logits_edit).abs().max().item() <= TOL
    ours2 = full_logits(_mix(s, w, W_sd=w.W_sd + dW), w)
    assert (ours2 - logits_edit).abs().max().item() <= TOL


def _wrong_no_div4(w, s):
    return _mix({**s, "inj": s["inj"] * w.hc}, w)  # σ(inj) instead of σ(inj/4)


def _wrong_unfolded_norm(w, s):
    return _mix(s, dataclasses.replace(w, onorm=w.onorm - 1.0))  # HF's w used as if it were the folded 1+w


def _wrong_flatten_order(w, s):
    # weights are stream-major (c·n + d); reading them as dim-major (d·hc + c) is the classic port bug
    r, hc, n = w.r, w.hc, w.n
    down = w.odown.reshape(r, n, hc).transpose(1, 2).reshape(r, hc * n)
    up = w.oup.reshape(n, hc, r).transpose(0, 1).reshape(hc * n, r)
    return _mix(s, dataclasses.replace(w, odown=down, oup=up))


def _wrong_down_rows(w, s):
    # the file carries 2 rows beyond r (allowed); slicing rows 1..r instead of 0..r-1 is wrong
    in_file = torch.cat([w.odown, torch.randn(2, w.odown.shape[1], generator=torch.Generator().manual_seed(9))], 0)
    return _mix(s, dataclasses.replace(w, odown=in_file[1 : w.r + 1]))


@pytest.mark.parametrize("wrong", [_wrong_no_div4, _wrong_unfolded_norm, _wrong_flatten_order, _wrong_down_rows])
def test_each_convention_mistake_breaks_parity(hf, wrong):
    m, _, s, logits = hf
    w = weights_from_hf(m)
    bad = full_logits(wrong(w, s), w)
    assert (bad - logits).abs().max().item() > 1e-2


def _numpy_f64_forward(s, w, dW):
    """Independent float64 re-derivation of DESIGN §1 in numpy."""
    g = {k: v.double().numpy() for k, v in s.items()}
    W = (w.W_sd.double() + dW.double()).numpy()
    sig = lambda x: 1 / (1 + np.exp(-x))
    T, hc, n = g["R"].shape
    bo = g["yr"] + sig(g["sgv"])[:, None] * (g["hh"] @ W.T)
    Rp = g["R"] + bo[:, None, :] * 2 * sig(g["inj"] / hc)[:, :, None]
    xn = Rp / np.sqrt((Rp**2).mean(-1, keepdims=True) + w.eps) * w.onorm.double().numpy()
    a = xn.reshape(T, hc * n) @ w.odown.double().numpy().T / hc
    lo = a * sig(a)
    gate = sig(lo @ w.oup.double().numpy().T).reshape(T, hc, n)
    mix = (gate * xn).mean(1)
    return mix @ w.head.double().numpy().T


def test_numpy_float64_reference(hf):
    m, _, s, _ = hf
    w = weights_from_hf(m)
    dW = torch.randn(w.n, w.f, generator=torch.Generator().manual_seed(4)) * 0.05
    ref = _numpy_f64_forward(s, w, dW)
    ours = full_logits(_mix(s, w, dW=dW), w).double().numpy()
    assert np.abs(ours - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max() / 10)


def test_streaming_stats_match_dense(hf):
    m, ids, s, _ = hf
    w = weights_from_hf(m)
    mix = _mix(s, w)
    tgt = ids[1:].numpy()
    mix = mix[:-1]
    z = full_logits(mix, w).double()
    lsm = torch.log_softmax(z, -1)
    st = head_stats(mix, w, tgt, token_sets={"sp": [1, 5, 7]}, topk=4, chunk=100)  # 100: chunks cross the V=1024
    assert np.allclose(st.lse, torch.logsumexp(z, -1).numpy(), atol=1e-5)
    assert np.allclose(st.logp_target, lsm[torch.arange(len(tgt)), tgt].numpy(), atol=1e-5)
    assert (st.argmax == z.argmax(-1).numpy()).all()
    assert (st.top_ids == torch.topk(z, 4, -1).indices.numpy()).all()
    ent = -(lsm.exp() * lsm).sum(-1).numpy()
    assert np.allclose(st.entropy, ent, atol=1e-5)
    assert np.allclose(st.set_logp["sp"], lsm[:, [1, 5, 7]].numpy(), atol=1e-5)


def test_paired_stats_match_dense(hf):
    m, ids, s, _ = hf
    w = weights_from_hf(m)
    dW = torch.randn(w.n, w.f, generator=torch.Generator().manual_seed(5)) * 0.1
    mb, mn = _mix(s, w)[:-1], _mix(s, w, dW=dW)[:-1]
    tgt = ids[1:].numpy()
    ps = paired_stats(mb, mn, w, tgt, chunk=77)
    lb = torch.log_softmax(full_logits(mb, w).double(), -1)
    ln = torch.log_softmax(full_logits(mn, w).double(), -1)
    kl = (lb.exp() * (lb - ln)).sum(-1).numpy()
    assert kl.mean() > 1e-4  # a real change
    assert np.allclose(ps.kld, kl, atol=1e-6, rtol=1e-4)
    ar = torch.arange(len(tgt))
    assert np.allclose(ps.dlogp, (ln[ar, tgt] - lb[ar, tgt]).numpy(), atol=1e-5)
    assert (ps.same_top == (lb.argmax(-1) == ln.argmax(-1)).numpy()).all()


def test_gradients_match_finite_differences(hf):
    m, ids, s, _ = hf
    w = weights_from_hf(m)
    w64 = dataclasses.replace(w, **{f.name: getattr(w, f.name).double() for f in dataclasses.fields(w)
                                    if isinstance(getattr(w, f.name), torch.Tensor)})
    s64 = {k: v.double()[:8] for k, v in s.items()}
    tgt = ids[1:9]
    dW = torch.zeros(w.n, w.f, dtype=torch.float64, requires_grad=True)
    base_mix = _mix(s64, w64).detach()

    def loss(d):
        mix = _mix(s64, w64, dW=d)
        return -logp_at(mix, w64, tgt, chunk=300).sum() + 3.0 * streamed_kl(mix, base_mix, w64, chunk=300).sum()

    d0 = (torch.randn(w.n, w.f, generator=torch.Generator().manual_seed(6), dtype=torch.float64) * 0.02)
    d0.requires_grad_(True)
    loss(d0).backward()
    g = d0.grad
    rng = np.random.default_rng(0)
    for _ in range(6):
        i, j = rng.integers(w.n), rng.integers(w.f)
        e = torch.zeros_like(d0)
        h = 1e-5
        e[i, j] = h
        with torch.no_grad():
            fd = (loss(d0 + e) - loss(d0 - e)) / (2 * h)
        assert abs(fd.item() - g[i, j].item()) <= 1e-6 + 1e-4 * abs(fd.item()), (i, j, fd.item(), g[i, j].item())
    assert dW.grad is None


def test_streamed_lse_matches_logsumexp(hf):
    m, _, s, _ = hf
    w = weights_from_hf(m)
    mix = _mix(s, w)
    assert torch.allclose(streamed_lse(mix, w, chunk=200), torch.logsumexp(full_logits(mix, w), -1), atol=1e-5)


def test_mixer_vjp_matches_central_differences(hf):
    """The hand-written backward of the output mixer (`mixer_vjp`, what the Fisher factors apply 64 times per
    position) against central differences of the f64 forward: ⟨u, mix(ys + h e) − mix(ys − h e)⟩ / 2h along random
    directions e at every position. Tolerance 1e-7 relative: the f64 difference quotient's truncation error at
    h = 1e-5 (O(h²) times the mixer's third derivative, ~1e-9 here) plus its rounding (~1e-11 / h)."""
    m, _, s, _ = hf
    w = weights_from_hf(m)
    w64 = dataclasses.replace(w, **{f.name: getattr(w, f.name).double() for f in dataclasses.fields(w)
                                    if isinstance(getattr(w, f.name), torch.Tensor)})
    s64 = {k: v.double() for k, v in s.items()}
    ys = s64["hh"] @ w64.W_sd.T  # [T, n]
    args = (s64["R"], s64["inj"], s64["sgv"], s64["yr"], w64)
    g = torch.Generator().manual_seed(7)
    u = torch.randn(ys.shape, generator=g, dtype=torch.float64)  # [T, n] cotangents
    vjp = mixer_vjp(mixer_parts(ys, *args), s64["sgv"], w64)(u)  # [T, n]
    h = 1e-5
    for _ in range(4):
        e = torch.randn(ys.shape, generator=g, dtype=torch.float64)  # [T, n] one direction per position
        fd = ((mix_from_ys(ys + h * e, *args) - mix_from_ys(ys - h * e, *args)) * u).sum(1) / (2 * h)  # [T]
        got = (vjp * e).sum(1)  # [T]
        assert float((got - fd).abs().max()) <= 1e-7 * float(fd.abs().max()), float((got - fd).abs().max())
