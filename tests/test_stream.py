"""The one streaming accumulator (l47.tail.stream) and `output.scale` folded into the head.

References and tolerances:
  - output.scale: transformers' own Qwen4Exp whose lm_head rows are multiplied by the same scale (what the GGUF's
    `output.scale` means: it multiplies the logits, one value or one per vocabulary row) vs our forward loaded from
    a GGUF carrying that tensor. f32 both, logits O(10): max |Δlogit| ≤ 1e-4 (the forward's parity bar,
    tests/test_forward.py); a forward that ignored the scale is off by ≥ 1e-1.
  - every streamed figure (lse, KL, μ = E_p[W_out], top-K, Fisher's p) against dense float64 computations over the
    full [T, V] logits of the same f32 values: f32 logits with f64 sums agree to ~1e-6; asserted at 1e-5.
  - gradients of the streamed lse and KL (in f64) against central finite differences: |Δ| ≤ 1e-6 + 1e-4·|fd|.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from l47.model.weights import Numerics, load_tail_weights
from l47.tail.forward import full_logits, head_stats, paired_stats, streamed_kl, streamed_lse, tail_mix
from l47.tail.stream import stream_head
from tiny_hf import capture, tiny_model

F32 = 0  # ggml type id


def _gguf_with_scale(m, path, scale: torch.Tensor):
    """The tiny HF model as an all-F32 qwen4exp GGUF plus an `output.scale` tensor (F32, shape of `scale`)."""
    from l47.engine.gguf_export import export_gguf
    from l47.model import names
    from l47.model.gguf_io import open_gguf, write_gguf

    table = names.hf_to_gguf_map(m.config.num_hidden_layers)
    plain = export_gguf(m, path.with_suffix(".plain.gguf"), types={table[k]: "F32" for k in m.state_dict()})
    g = open_gguf(plain)
    tensors = [(t, g.info(t).ggml_type, g.info(t).shape, g.raw(t)) for t in g.tensors]
    tensors.append((names.OUTPUT_SCALE.gguf, F32, tuple(scale.shape), scale.float().numpy().view(np.uint8)))
    return write_gguf(path, dict(g.kv), None, tensors)


@pytest.fixture(scope="module")
def hf_run():
    m = tiny_model(seed=0)
    ids = torch.randint(0, m.config.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    states, _ = capture(m, ids)
    return m, ids, states


@pytest.mark.parametrize("kind", ["per_row", "scalar"])
def test_output_scale_matches_transformers(tmp_path, hf_run, kind):
    m, ids, s = hf_run
    V = m.config.vocab_size
    g = torch.Generator().manual_seed(7)
    scale = (0.5 + torch.rand(V, generator=g)) if kind == "per_row" else torch.tensor([0.37])
    path = _gguf_with_scale(m, tmp_path / "scaled.gguf", scale)
    w = load_tail_weights(path, policy="exact")
    assert w.folded_scale == scale.numel()
    m2 = tiny_model(seed=0)  # HF with the scale applied to lm_head rows (what output.scale means)
    with torch.no_grad():
        m2.lm_head.weight.mul_(scale[:, None])
    _, ref = capture(m2, ids)
    mix = tail_mix(s["R"], s["inj"], s["hh"], s["sgv"], s["yr"], w)
    ours = full_logits(mix, w)
    assert (ours - ref).abs().max().item() <= 1e-4
    _, unscaled = capture(m, ids)
    assert (unscaled - ref).abs().max().item() >= 1e-1  # ignoring the scale would be caught

    # every consumer sees the scaled head: KL and Fisher μ vs dense f64 over the scaled HF logits
    from l47.solvers.fisher import mu_lse

    dW = torch.randn(w.n, w.f, generator=torch.Generator().manual_seed(8)) * 0.1
    mix_n = tail_mix(s["R"], s["inj"], s["hh"], s["sgv"], s["yr"], w, dW=dW)
    lb = torch.log_softmax(ref.double(), -1)
    ln = torch.log_softmax(full_logits(mix_n, w).double(), -1)
    kl = (lb.exp() * (lb - ln)).sum(-1)
    assert kl.mean() > 1e-3
    assert torch.allclose(streamed_kl(mix_n, mix, w, chunk=100).double(), kl, atol=1e-5)
    mu, lse = mu_lse(mix, w)
    head_scaled = m2.lm_head.weight.detach().double()
    assert torch.allclose(mu, lb.exp() @ head_scaled, atol=1e-5)
    assert torch.allclose(lse, torch.logsumexp(ref.double(), -1), atol=1e-5)


def test_solve_accepts_a_model_with_output_scale(tmp_path, hf_run):
    """The solver's refusal of output.scale is gone: its building blocks run on the folded head and match dense."""
    from l47.solvers.batch import Batch
    from l47.solvers.fisher import fisher_factors

    m, ids, s = hf_run
    path = _gguf_with_scale(m, tmp_path / "scaled.gguf", 0.5 + torch.rand(m.config.vocab_size))
    w = load_tail_weights(path, policy="exact")
    T = 6
    s = {k: v[:T] for k, v in s.items()}
    b = Batch(R=s["R"], inj=s["inj"], hh=s["hh"], sgv=s["sgv"], yr=s["yr"], target=torch.zeros(T, dtype=torch.long),
              doc=("d",) * T, pos=tuple(range(T)))
    K = 8
    ff = fisher_factors(b, w, w.W_sd, K=K, tail_samples_n=0)  # the top-K part exactly (the sampled tail: test_kl_model)
    # dense reference in f64: G = mean_t Σ_{v ∈ top-K(p_t)} p_v s_v s_vᵀ, s_v = (∂mix/∂ys)ᵀ (W_out[v] − E_p[W_out]),
    # with the scaled head, p from the full [V] softmax, Jacobians by autograd
    w64 = dataclasses.replace(w, **{f.name: getattr(w, f.name).double() for f in dataclasses.fields(w)
                                    if isinstance(getattr(w, f.name), torch.Tensor)})
    from l47.tail.forward import mix_from_ys

    G = torch.zeros(w.n, w.n, dtype=torch.float64)
    ys0 = s["hh"].double() @ w64.W_sd.T
    mass = 0.0
    for t in range(T):
        def mix_of(y, t=t):
            return mix_from_ys(y[None], s["R"][t:t + 1].double(), s["inj"][t:t + 1].double(),
                               s["sgv"][t:t + 1].double(), s["yr"][t:t + 1].double(), w64)[0]
        Jm = torch.autograd.functional.jacobian(mix_of, ys0[t], vectorize=True)  # [n, n] ∂mix/∂ys
        p = torch.softmax(w64.head @ mix_of(ys0[t]), 0)  # [V]
        top = torch.sort(p, descending=True, stable=True).indices[:K]
        S = (w64.head[top] - p @ w64.head) @ Jm  # [K, n]
        G += S.T @ (p[top, None] * S)
        mass += 1 - float(p[top].sum())
    G /= T
    assert ff.tail_mass == pytest.approx(mass / T, abs=1e-6)
    assert 0.01 < ff.tail_mass < 0.99  # the truncation is real: the test would see a wrong top-K or μ
    assert torch.allclose(ff.G, G, rtol=1e-4, atol=1e-6 * G.abs().max().item())


def _dense(z: torch.Tensor, k: int):
    """Reference top-k with the documented tie-break (value desc, then lower id) by a stable sort in f64."""
    o = torch.sort(z.double(), dim=1, descending=True, stable=True).indices[:, :k]
    return o


def test_topk_tie_break_is_lowest_id_across_chunks():
    # integer-valued logits: many exact ties, inside chunks and across chunk borders
    g = torch.Generator().manual_seed(0)
    V, n, T = 300, 8, 8
    head = torch.randint(-3, 4, (V, n), generator=g).float()
    mix = torch.randint(-2, 3, (T, n), generator=g).float()
    z = mix @ head.T
    for chunk in (7, 300):
        for k in (1, 3, 9):
            st = stream_head(mix, head, chunk=chunk, topk=k)
            ref = _dense(z, k)
            assert torch.equal(st.top_i, ref), (chunk, k)
            assert torch.equal(st.top_v, torch.gather(z, 1, ref))


@pytest.mark.parametrize("no_f64", [False, True])
def test_stream_reductions_match_dense(no_f64):
    """lse, entropy, KL, μ and top-k from one pass vs dense f64; `no_f64` (the MPS mode, forced on the CPU) must
    agree with the dense f64 figures within the audit's own tolerances: |Δlse|, |Δlog p| ≤ 1e-5 nats (the
    zero-proxy bar for an f32 engine is 1e-4), |ΔKL| ≤ 1e-6 + 1e-4·KL (the audit's KL bars are ≥ 1e-3 nats)."""
    rng = np.random.default_rng(3)
    T, V, n = 50, 5000, 32
    head = torch.from_numpy(rng.standard_normal((V, n), dtype=np.float32) * np.float32(0.7))
    mb = torch.from_numpy(rng.standard_normal((T, n), dtype=np.float32))
    mn = mb + torch.from_numpy(rng.standard_normal((T, n), dtype=np.float32) * np.float32(0.05))
    both = torch.cat([mb, mn])
    num = Numerics(no_f64=no_f64)
    st = stream_head(both, head, num, chunk=777, topk=4, entropy=True, pairs=T, mu=True)
    z = both.double() @ head.double().T
    ls = torch.log_softmax(z, -1)
    p = ls.exp()
    tol = 1e-5
    assert torch.allclose(st.lse.cpu(), torch.logsumexp(z, -1), atol=tol)
    # entropy: Σ e·z per chunk is an f32 row-dot (speed), |z| ~ 20 here -> ~3e-5; the audit reports it, no bar uses it
    assert torch.allclose(st.entropy.cpu(), -(p * ls).sum(-1), atol=1e-4)
    kl = (p[:T] * (ls[:T] - ls[T:])).sum(-1)
    assert kl.mean() > 1e-3
    assert torch.allclose(st.kl.cpu(), kl, atol=1e-6, rtol=1e-4)
    assert torch.allclose(st.mu.cpu(), p @ head.double(), atol=tol)
    assert torch.equal(st.top_i.cpu(), _dense(z, 4))
    if no_f64:
        assert st.lse.device.type == "cpu"


def test_paired_stats_no_f64_mode_matches_f64_path():
    """paired_stats / head_stats in the forced no-float64 mode against the f64 path on the same inputs (the audit's
    tolerances as in test_stream_reductions_match_dense)."""
    m = tiny_model(seed=1)
    ids = torch.randint(0, m.config.vocab_size, (32,), generator=torch.Generator().manual_seed(4))
    s, _ = capture(m, ids)
    from test_forward import weights_from_hf

    w = weights_from_hf(m)
    w_nf = dataclasses.replace(w, numerics=Numerics(no_f64=True))
    dW = torch.randn(w.n, w.f, generator=torch.Generator().manual_seed(5)) * 0.1
    mb = tail_mix(s["R"], s["inj"], s["hh"], s["sgv"], s["yr"], w)[:-1]
    mn = tail_mix(s["R"], s["inj"], s["hh"], s["sgv"], s["yr"], w, dW=dW)[:-1]
    tgt = ids[1:].numpy()
    a = paired_stats(mb, mn, w, tgt, chunk=100)
    b = paired_stats(mb, mn, w_nf, tgt, chunk=100)
    assert a.kld.mean() > 1e-3
    np.testing.assert_allclose(b.kld, a.kld, atol=1e-6, rtol=1e-4)
    np.testing.assert_allclose(b.dlogp, a.dlogp, atol=1e-5)
    np.testing.assert_allclose(b.base.logp_target, a.base.logp_target, atol=1e-5)
    np.testing.assert_allclose(b.new.entropy, a.new.entropy, atol=1e-5)
    assert (b.same_top == a.same_top).all() and (b.base.top_ids == a.base.top_ids).all()
    h = head_stats(mb, w_nf, tgt, chunk=64)
    np.testing.assert_allclose(h.lse, a.base.lse, atol=1e-5)


def test_streamed_gradients_match_finite_differences_with_scaled_head():
    """∂lse/∂mix (= μ) and ∂KL/∂mix_new (= μ_new − μ_base) from the accumulator's backward vs central differences
    (f64 inputs, so the differences are accurate to ~1e-9)."""
    g = torch.Generator().manual_seed(11)
    V, n, T = 700, 12, 5
    head = torch.randn(V, n, generator=g, dtype=torch.float64) * (0.5 + torch.rand(V, 1, generator=g,
                                                                                    dtype=torch.float64))
    mb = torch.randn(T, n, generator=g, dtype=torch.float64)
    x = (mb + 0.3 * torch.randn(T, n, generator=g, dtype=torch.float64)).requires_grad_(True)
    from l47.tail import stream

    def f(y):
        return (stream.streamed_lse(y, head, None, 128) * torch.arange(1, T + 1)).sum() + \
            3.0 * stream.streamed_kl(y, mb, head, None, 128).sum()

    f(x).backward()
    h = 1e-6
    for i, j in [(0, 0), (1, 5), (4, 11), (2, 3)]:
        e = torch.zeros_like(x)
        e[i, j] = h
        with torch.no_grad():
            fd = (f(x + e) - f(x - e)) / (2 * h)
        assert abs(fd.item() - x.grad[i, j].item()) <= 1e-6 + 1e-4 * abs(fd.item())


def test_lse_without_dropped_ids_matches_the_masked_dense_sum_and_its_gradient():
    """streamed_lse_without: log Σ over each row's vocabulary without its ids `drop` (ids in different chunks, one
    repeated) against the f64 masked logsumexp of the dense logits, and its gradient (μ over the kept tokens) against
    central differences of that reference (f64 inputs: ~1e-9); drop with entropy or pair KL is refused (they need
    every token)."""
    from l47.tail import stream

    g = torch.Generator().manual_seed(21)
    V, n, T = 700, 12, 4
    head = torch.randn(V, n, generator=g, dtype=torch.float64)
    x = torch.randn(T, n, generator=g, dtype=torch.float64).requires_grad_(True)
    drop = torch.tensor([[0, 127, 128], [699, 5, 5], [300, 301, 650], [1, 2, 3]])  # chunk 128: ids across chunks

    def ref(y):
        z = y @ head.T
        keep = torch.ones_like(z, dtype=torch.bool)
        keep[torch.arange(T)[:, None].expand_as(drop), drop] = False
        return torch.logsumexp(z.masked_fill(~keep, -math.inf), -1)

    out = stream.streamed_lse_without(x, head, drop, None, 128)
    assert out.dtype == torch.float64
    assert torch.allclose(out, ref(x.detach()), atol=1e-10)
    assert (out < stream.streamed_lse(x.detach(), head, None, 128)).all()  # the dropped mass is gone
    wts = torch.arange(1, T + 1, dtype=torch.float64)
    (out * wts).sum().backward()
    h = 1e-6
    for i, j in [(0, 0), (1, 5), (3, 11), (2, 3)]:
        e = torch.zeros_like(x)
        e[i, j] = h
        with torch.no_grad():
            fd = float(((ref(x + e) - ref(x - e)) * wts).sum()) / (2 * h)
        assert abs(fd - x.grad[i, j].item()) <= 1e-6 + 1e-4 * abs(fd)
    for bad in (dict(entropy=True), dict(pairs=2)):
        with pytest.raises(ValueError):
            stream.stream_head(x.detach(), head, drop=drop, **bad)


def test_streamed_lse_f32_matches_dense():
    g = torch.Generator().manual_seed(12)
    head, mix = torch.randn(900, 16, generator=g), torch.randn(7, 16, generator=g)
    ref = torch.logsumexp(mix.double() @ head.double().T, -1)
    from l47.tail import stream

    assert torch.allclose(stream.streamed_lse(mix, head, None, 100).double(), ref, atol=1e-5)


def test_split_bf16_head_error_bound_and_check():
    """Split-bf16 (hi·hi + hi·lo + lo·hi, f32 accumulation; emulated exactly in f32 off CUDA) against f64: each
    operand is represented to ≤ 2⁻¹⁶ relative by hi + lo and the dropped lo·lo term is ≤ 2⁻¹⁶ of |x_i h_i|, so
    |Δz| ≤ 2⁻¹⁴ Σ_i |x_i h_i| (with the f32 accumulation's share) — a plain bf16 GEMM (error ~2⁻⁸) breaks the bound."""
    from l47.tail.stream import check_precision, head_logits, split_bf16

    g = torch.Generator().manual_seed(13)
    head, x = torch.randn(3000, 256, generator=g) * 0.06, torch.randn(40, 256, generator=g) * 2
    bound = 2.0 ** -14 * (x.double().abs() @ head.double().abs().T)  # [R, V]
    ref = x.double() @ head.double().T
    num = Numerics(precision="split-bf16")
    check_precision(x, head, num, chunk=1000)
    assert num.used == "split-bf16" and 0 < num.err_f32 < num.err_split  # both measured on the check rows
    z = head_logits(x, head, 0, 3000, num)
    assert ((z.double() - ref).abs() <= bound).all()
    assert float((z.double() - ref).abs().max()) == pytest.approx(num.err_split, rel=1e-6)  # CHECK_ROWS ≥ 40
    plain = (x.bfloat16().float() @ head.bfloat16().float().T).double()
    assert not ((plain - ref).abs() <= bound).all()
    hi, lo = split_bf16(x)
    assert ((hi.double() + lo.double() - x.double()).abs() <= 2.0 ** -16 * x.double().abs()).all()
    # "auto" off CUDA is f32 without a check; the rule falls back when split's error exceeds 2x f32's
    auto = Numerics(precision="auto")
    check_precision(x, head, auto)
    assert auto.used == "f32" and auto.err_split is None
    from l47.tail.stream import decide_precision

    assert decide_precision("auto", 1e-5, 2.1e-5, 64)[0] == "f32"
    assert decide_precision("auto", 1e-5, 1.9e-5, 64, "split-bf16") == ("split-bf16", "")
    assert decide_precision("auto", 1e-5, 1.9e-5, 64) == ("split-fp16", "")  # what "auto" tries on CUDA
    assert decide_precision("split-bf16", 1e-5, 9e-5, 64, "split-bf16")[0] == "split-bf16"


@pytest.mark.parametrize("shape", [(37, 1000), (300, 8192), (5, 200_000)])
def test_cpu_row_sums_are_the_f64_sums_bit_for_bit(shape):
    """The accumulator's CPU row sums (cast block by block into an f64 buffer, l47.tail.stream.SUM_BLOCK) are
    exactly torch's f64 sums of the f64-cast rows: the reference is the f64 sum of x.double() (tolerance 0: the
    change is a faster cast, not another sum). Rows of a non-contiguous view too (the pair term sums z[:P])."""
    from l47.tail.stream import VocabAccumulator

    g = torch.Generator().manual_seed(shape[0])
    x = torch.randn(*shape, generator=g).mul_(8.0).exp_()  # [R, C] f32, finite, wide dynamic range (e^±40)
    acc = VocabAccumulator(shape[0], "cpu")
    threads = torch.get_num_threads()
    try:  # bit for bit on one thread: with several, torch splits a long row's sum by thread count and block shape
        torch.set_num_threads(1)
        assert torch.equal(acc._sum(x), x.double().sum(1))
        view = x[:, 1:]
        assert torch.equal(acc._sum(view), view.double().sum(1))
    finally:
        torch.set_num_threads(threads)
    # on the default threads: the same sums to f64 rounding (C·ε relative, C ≤ 2e5 terms of one sign)
    torch.testing.assert_close(acc._sum(x), x.double().sum(1), rtol=shape[1] * 2.3e-16, atol=0)


def test_two_head_precisions_in_one_process_each_keep_their_own_numbers(tmp_path, hf_run):
    """The head precision travels with the weights (`load_tail_weights(precision=...)` -> TailWeights.numerics),
    not in process state: weights loaded with split-bf16, then f32, then the default, evaluated interleaved in one
    process, each give the logits of their own precision. Reference: the same mixes times the same head in f64.
    Tolerances (S = Σ_i |mix_i · head_vi|, n = 256 terms): f32 ≤ n·2⁻²⁴·S (the dot-product rounding bound γ_n);
    split-bf16 ≤ 2⁻¹⁴·S (test_split_bf16_head_error_bound_and_check). Split-bf16 drops terms of ~2⁻¹⁷ relative
    per product, f32 rounds at 2⁻²⁴: its measured error is the larger (a shared precision would make them equal)."""
    from l47.engine.gguf_export import export_gguf
    from l47.errors import L47Error
    from l47.model import names

    m, _, s = hf_run
    table = names.hf_to_gguf_map(m.config.num_hidden_layers)
    path = export_gguf(m, tmp_path / "f32.gguf", types={table[k]: "F32" for k in m.state_dict()})
    wa = load_tail_weights(path, policy="exact", precision="split-bf16")
    wb = load_tail_weights(path, policy="exact", precision="f32")
    wc = load_tail_weights(path, policy="exact")  # the default: "auto", f32 off CUDA
    mix = tail_mix(s["R"], s["inj"], s["hh"], s["sgv"], s["yr"], wb)  # [T, n]
    ref = mix.double() @ wb.head.double().T  # [T, V] f64
    S = mix.double().abs() @ wb.head.double().abs().T  # [T, V]
    za1 = full_logits(mix, wa)
    zb = full_logits(mix, wb)
    za2 = full_logits(mix, wa)  # after the f32 weights were loaded and used
    zc = full_logits(mix, wc)
    assert torch.equal(za1, za2)
    err_a, err_b = float((za1.double() - ref).abs().max()), float((zb.double() - ref).abs().max())
    assert ((za1.double() - ref).abs() <= 2.0 ** -14 * S).all()
    assert ((zb.double() - ref).abs() <= wb.n * 2.0 ** -24 * S).all()
    assert ((zc.double() - ref).abs() <= wb.n * 2.0 ** -24 * S).all()
    assert err_a > err_b > 0 and not torch.equal(za1, zb)
    assert wa.numerics.record()["precision"] == "split-bf16" and wb.numerics.record()["precision"] == "f32"
    # and through the head statistics: lse is 1-Lipschitz in the max norm, so each row's bound is its logits' worst
    lse_ref = torch.logsumexp(ref, -1)
    tgt = torch.zeros(mix.shape[0], dtype=torch.long)
    la, lb = head_stats(mix, wa, tgt).lse, head_stats(mix, wb, tgt).lse
    Smax = S.max(1).values.numpy()  # [T]
    assert (np.abs(la - lse_ref.numpy()) <= 2.0 ** -14 * Smax).all()
    assert (np.abs(lb - lse_ref.numpy()) <= wb.n * 2.0 ** -24 * Smax).all()
    head_stats(mix, wc, tgt)  # the first streamed pass resolves "auto" (f32 off CUDA)
    assert wc.numerics.record()["requested"] == "auto" and wc.numerics.record()["precision"] == "f32"
    with pytest.raises(L47Error, match="--precision"):
        load_tail_weights(path, policy="exact", precision="fp8")
