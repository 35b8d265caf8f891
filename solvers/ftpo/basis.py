"""FTPO's parameterisation of ΔW: the phrases' key directions (`key_basis`, `background_scales`), the
special-vs-word gap directions (`gap_basis`) and the turn-end directions (`turn_end_basis`) it is kept off."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from l47.model.weights import TailWeights
from l47.solvers.batch import Batch, batch_rows, ys_grad_mix
from l47.solvers.fisher import fisher_factors
from l47.solvers.ftpo.config import FtpoConfig, FtpoProblem
from l47.solvers.ftpo.objective import special_word_pairs
from l47.tail.forward import logits_at, logp_at


def key_basis(hh_ev: torch.Tensor, group: torch.Tensor, hh_bg: torch.Tensor, k: int, rel_ridge: float = 1e-3):
    """Orthonormal basis Q [f, ≤ k·phrases] (f64) of the directions where each phrase's train keys have the most
    energy relative to the background's: per phrase the top-k generalized eigenvectors of
    (C_p = mean_{e ∈ p} h hᵀ, B = mean_bg h hᵀ + ρI), ρ = rel_ridge · tr(B)/f; all of them orthonormalised (QR).
    An edit ΔW = U Qᵀ leaves every key orthogonal to Q untouched (a JSON document the background never showed
    keeps its logits), and spends its change where the phrase differs from the background."""
    H = hh_bg.double()  # [B, f]
    f = H.shape[1]
    Bm = H.T @ H / H.shape[0]  # [f, f]
    Bm = Bm + rel_ridge * torch.trace(Bm) / f * torch.eye(f, dtype=Bm.dtype, device=Bm.device)
    L = torch.linalg.cholesky(Bm)  # [f, f] lower
    cols = []
    for g in torch.unique(group):
        Hp = hh_ev[group == g].double()  # [E_p, f]
        X = torch.linalg.solve_triangular(L, Hp.T, upper=False)  # [f, E_p] = L⁻¹ hᵀ
        Y, S, _ = torch.linalg.svd(X, full_matrices=False)  # eigvecs of L⁻¹ C L⁻ᵀ, descending
        Y = Y[:, : min(k, int((S > S[0] * 1e-6).sum()))]  # [f, k_p]
        cols.append(torch.linalg.solve_triangular(L.T, Y, upper=True))  # [f, k_p] = L⁻ᵀ y
    Q, R = torch.linalg.qr(torch.cat(cols, 1))  # [f, K]
    keep = R.diagonal().abs() > R.diagonal().abs().max() * 1e-8
    return Q[:, keep]


SCALE_CAP = 4.0


def background_scales(hh_bg: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """s_k = rms‖h‖/√f ÷ rms_b (Qᵀh_b)_k  [K] (f64 inside, f32 out): with ΔW = U·(Q·diag s)ᵀ a step of one size in
    any column of U moves the background's ys alike (the background KL, the stiffest term, is then about
    isotropic in U; Adam steps in parameter units). Measured on the demo: the same removal ~20 % sooner."""
    H = hh_bg.double()  # [B, f]
    e = (H @ Q.double()).pow(2).mean(0).sqrt()  # [K]
    ref = H.pow(2).sum(1).mean().sqrt() / math.sqrt(H.shape[1])
    return (ref / e.clamp_min(ref / SCALE_CAP)).float()  # a direction the background hardly uses is NOT blown up:
    # uncapped, model2's unused directions were scaled ~10³× and the held-out chats (which use them) diverged


METRIC_ROWS = 2048  # background rows the output metric is estimated on (a strided sample; G is [n, n])


def output_metric(bg: Batch, w: TailWeights, cap: float, rows: int = METRIC_ROWS, seed: int = 0) -> torch.Tensor:
    """S [n, n] (f32, symmetric): the gains of ΔW's output directions, S = U_G diag(s) U_Gᵀ with
    s_i = clip(√(mean γ / γ_i), 1/cap, cap), γ_i, U_G the eigenpairs of G = mean_b J_bᵀ F_b J_b, the background
    KL's Gauss–Newton factor on the output side (solvers/fisher.py: K-FAC, top-32 exact + 32 sampled tail tokens
    per row, f64) at ≤ `rows` background rows (strided). With ΔW = S·U·Mᵀ a step of one size in U costs about the
    same background KL in every output direction: Adam's normalised step, which moves every entry of U by about
    the same amount, no longer spends most of its KL on the few directions the head is sharpest in (with U = ΔW's
    own coordinates, those directions take a full step like any other). The gains are capped both ways for the
    reason background_scales caps its own: a direction the background hardly feels is one unseen text may use."""
    idx = torch.linspace(0, bg.P - 1, min(rows, bg.P), device=bg.hh.device).round().long().unique()
    G = fisher_factors(batch_rows(bg, idx), w, w.W_sd, K=min(32, w.V), tail_samples_n=32, seed=seed).G  # [n, n]
    gam, U = torch.linalg.eigh(G)  # ascending
    gam = gam.clamp_min(0)
    s = (gam.mean() / gam.clamp_min(gam.mean() * 1e-12)).sqrt().clamp(1.0 / cap, cap)  # [n]
    return ((U * s) @ U.T).float()


def gap_jacobians(b: Batch, w: TailWeights, ids: torch.Tensor) -> torch.Tensor:
    """J [N, n] = ∂(z_t1 − z_t2)/∂ys at ΔW = 0, ys = W·hh the shared expert's output (f32 autograd through the
    tail; rows are independent, so one backward of the sum gives every row's gradient). ids [N, 2]."""
    with torch.enable_grad():
        ys, mix = ys_grad_mix(b, w, w.W_sd)
        z = logits_at(mix, w, ids)  # [N, 2]
        (z[:, 0] - z[:, 1]).sum().backward()
    return ys.grad.detach()


def turn_end_basis(b: Batch, w: TailWeights, energy: float, max_rank: int) -> torch.Tensor | None:
    """B [n, k] orthonormal (f32): the directions of the shared expert's output ys along which log p(<|im_end|>)
    moves at real turn ends. G [N, n] = ∂ log p(target)/∂ys at the turn-end rows b (target <|im_end|>; the
    first-order change under Δys is G·Δys, f32 autograd through the tail and the streamed log-sum-exp); B = the
    fewest leading right singular vectors of G holding `energy` of ‖G‖²_F (f64 SVD), at most max_rank. With ΔW's
    output kept off B (ΔW ← (I − B Bᵀ) ΔW) log p(<|im_end|>) is unmoved to first order at those rows — and at
    turn ends the solver never sees, as far as their gradients lie in span B: on the demo (n 256) 4 directions
    hold 99.6 % of the energy at the solver's turn ends and 98.2–99.5 % at held-out and blind ones."""
    if b is None or not b.P or energy <= 0 or max_rank <= 0:
        return None
    with torch.enable_grad():
        ys, mix = ys_grad_mix(b, w, w.W_sd)
        logp_at(mix, w, b.target).sum().backward()  # rows are independent: one backward gives each row's gradient
    G = ys.grad.detach().double()  # [N, n]
    _, S, Vh = torch.linalg.svd(G, full_matrices=False)  # S [min(N, n)], Vh [min(N, n), n]
    tot = float(S.pow(2).sum())
    if tot <= 0:
        return None
    share = S.pow(2).cumsum(0) / tot  # [min(N, n)] ascending to 1
    k = min(int((share < energy).sum()) + 1, max_rank, S.numel())
    return Vh[:k].T.contiguous().float()  # [n, k]


def off_span(U: torch.Tensor, B: torch.Tensor | None) -> torch.Tensor:
    """(I − B Bᵀ) U [n, K]: U's columns without their part in span B (B [n, k] orthonormal); U itself if B is None."""
    return U if B is None else U - B @ (B.T @ U)


@dataclass(frozen=True)
class GapBasis:
    """The span of V_i = Σ_b C_bi G_b, G_b = J_b k_bᵀ (orthonormal in ⟨·,·⟩ over [n, K]), held implicitly: the
    projector Σ_i V_i ⟨V_i, U⟩ = Σ_{b,b'} G_b (C Cᵀ)_{bb'} ⟨G_b', U⟩ costs 2·N·n·K per call, never an [r, n·K] V.
    f64 (C Cᵀ spans 1/σ² over the kept range: in f32 the projector left ~1 % of a row's coordinate)."""

    J: torch.Tensor  # [N, n] weighted gap Jacobians (f64)
    k: torch.Tensor  # [N, K] keys in the parameter basis (f64)
    CC: torch.Tensor  # [N, N] C Cᵀ (f64)
    rank: int

    def coords(self, U: torch.Tensor) -> torch.Tensor:
        """⟨G_b, U⟩ per row [N] (f64): J_bᵀ U k_b (the first-order gap change at row b, times its weight)."""
        return ((self.J @ U.double()) * self.k).sum(1)

    def project(self, U: torch.Tensor) -> torch.Tensor:
        """Σ_i V_i ⟨V_i, U⟩ [n, K] (U's dtype)."""
        c = self.CC @ self.coords(U)  # [N]
        return (self.J.T @ (c[:, None] * self.k)).to(U.dtype)


def gap_basis(J: torch.Tensor, k: torch.Tensor, weight: torch.Tensor, max_rank: int,
              rel_tol: float = 1e-3) -> GapBasis:
    """The first-order special-vs-word gap changes' directions: under ΔW = U·Mᵀ (U [n, K], k_b = Mᵀ hh_b) row b's
    gap moves by J_bᵀ U k_b = ⟨G_b, U⟩, G_b = J_b k_bᵀ. The span of the top right singular vectors of the weighted
    stack [ω_b G_b] (from its Gram (ω J Jᵀ ω) ⊙ (k kᵀ) [N, N], f64: no [N, n·K] stack), the singular values above
    rel_tol × the largest, at most max_rank. J [N, n], k [N, K], weight [N]."""
    Jw = J.double() * weight.double()[:, None]  # [N, n]
    Kd = k.double()  # [N, K]
    ev, A = torch.linalg.eigh((Jw @ Jw.T) * (Kd @ Kd.T))  # ascending [N], [N, N]
    ev, A = ev.flip(0), A.flip(1)
    r = min(int((ev > rel_tol ** 2 * ev[0]).sum()), max_rank) if float(ev[0]) > 0 else 0
    C = A[:, :r] / ev[:r].sqrt()  # [N, r]: V_i = Σ_b C_bi ω_b G_b orthonormal
    return GapBasis(Jw, Kd, C @ C.T, r)


def project_out(U: torch.Tensor, V: GapBasis) -> torch.Tensor:
    """U − proj_V U [n, K]: U without its part in the span of V."""
    return U - V.project(U)


def _parameterise(w: TailWeights, pb: FtpoProblem, cfg: FtpoConfig, ev_group: torch.Tensor):
    """(parameter, ΔW of it, notes): U [n, K] with ΔW = P(U)·(Q·diag s)ᵀ on the phrases' key directions Q, scaled
    (background_scales), P = project_out of the special-vs-word gap directions (gap_basis) at the background and
    anchor rows with a special token within gap_margin of a word (key_rank > 0), else ΔW itself [n, f]; zeros
    at the start."""
    if cfg.key_rank <= 0:
        return torch.zeros(w.n, w.f, device=w.device, requires_grad=True), (lambda p: p), []
    Q = key_basis(pb.events.hh, ev_group, pb.background.hh, cfg.key_rank, cfg.key_ridge).float()  # [f, K]
    Q = Q * background_scales(pb.background.hh, Q)  # [f, K]
    B, notes = _turn_end_directions(w, pb, cfg)
    V, gap_notes = _gap_directions(w, pb, cfg, Q, B)
    U0 = torch.zeros(w.n, Q.shape[1], device=w.device, requires_grad=True)
    S = output_metric(pb.background, w, cfg.metric_cap, seed=cfg.seed) if cfg.metric_cap > 0 else None  # [n, n]
    if S is not None:
        notes = notes + [f"output metric: ΔW's output directions scaled by the background KL's curvature, gains "
                         f"within [1/{cfg.metric_cap:g}, {cfg.metric_cap:g}]"]
    gain = (lambda p: p) if S is None else (lambda p: S @ p)
    if V is None:
        return U0, (lambda p: off_span(gain(p), B) @ Q.T), notes + gap_notes
    # off span B first, then off the gap directions built from (I − B Bᵀ)J: the result stays off span B, and
    # each gap row's first-order change J_bᵀ Y k_b = ((I − B Bᵀ)J_b)ᵀ Y k_b is 0 (both hold exactly)
    return U0, (lambda p: project_out(off_span(gain(p), B), V) @ Q.T), notes + gap_notes


def _turn_end_directions(w: TailWeights, pb: FtpoProblem, cfg: FtpoConfig):
    """(B [n, k] or None, notes): turn_end_basis at the solver's real turn ends (its turn-end anchors: the
    background and train documents' rows whose target is <|im_end|>), at most n // 8 directions."""
    if pb.anchors is None or not pb.anchors.P or cfg.turn_end_energy <= 0:
        return None, []
    ends = pb.turn_end_rows()
    if not ends:
        return None, []
    b = batch_rows(pb.anchors, torch.as_tensor(ends, device=pb.anchors.hh.device))
    B = turn_end_basis(b, w, cfg.turn_end_energy, max(1, w.n // 8))
    if B is None:
        return None, []
    return B, [f"turn-end directions: {B.shape[1]} of n = {w.n} kept off ΔW's output ({cfg.turn_end_energy:g} of "
               f"the ∂ log p(<|im_end|>)/∂ys energy at {b.P} turn ends)"]


def _gap_directions(w: TailWeights, pb: FtpoProblem, cfg: FtpoConfig, M: torch.Tensor, B: torch.Tensor | None = None):
    """(GapBasis or None, notes): gap_basis at the background and anchor rows whose base top two are one special
    token and one word within gap_margin nats (the gap_rows smallest gaps), weighted 1/max(gap, 0.05) (the
    near-tie guard's scale); rank at most half of n·K (the rest is the edit's). B: the output directions ΔW is
    already kept off (the Jacobians are taken without their part in span B)."""
    special = pb.terms.special.to(w.device)
    if cfg.gap_margin <= 0 or not special.numel():
        return None, []
    rows = [pb.background] + ([pb.anchors] if pb.anchors is not None and pb.anchors.P else [])
    b, ids, gap = special_word_pairs(rows, w, special, cfg.gap_margin)
    if b is None:
        return None, ["gap directions: no row with a special token within gap_margin of a word"]
    if b.P > cfg.gap_rows:
        keep = torch.argsort(gap)[: cfg.gap_rows]
        b, ids, gap = batch_rows(b, keep), ids[keep], gap[keep]
    J = off_span(gap_jacobians(b, w, ids).T, B).T  # [N, n]
    V = gap_basis(J, b.hh @ M, 1.0 / gap.clamp_min(0.05), max_rank=w.n * M.shape[1] // 2)
    return (V if V.rank else None), [f"gap directions: {V.rank} of {w.n * M.shape[1]} (n·K) removed, from "
                                         f"{b.P} rows within {cfg.gap_margin:g} nats of a special token"]
