"""FTPO trainer on the exact tail forward (torch; CPU / CUDA / MPS): solve to a target within a KL budget.

Objective minimised over ΔW [n, f] by Adam with a floor (ℓ = log p, z = logits, Δ = edited − base, r the rejected final
token of event e, p⁰ base probabilities; every term is dimensionless, scaled by a quantity of the data or a bar):

    L(ΔW) =  mean_phrase mean_{e ∈ phrase} π_e · τ·softplus((Δo_e + d_e) / τ)               target hinge (nats)
           + λ · mean_{b ∈ background} KL(p⁰_b ‖ p_b) / budget                              exact, full vocabulary
           + λ_shape · mean_{e ∈ events} KL(q⁰_e ‖ q_e) / budget                             the freed mass's shape
           + λ_cond · mean_{m ∈ near misses} KL(q⁰_m ‖ q_m) / budget                         only r's mass moves
           + λ_coll · mean_group mean_{a ∈ group} (min(Δℓ_a, 0) / tol_group)²                soft anchors
                     [+ (Δo_a / end_odds_tol)² at the real and plausible turn ends]               their lead
                     [+ one group: Σ_r n_r (min(mean_{runner-up r} Δ(z_end − z_r), 0) / end_lead_tol)² / Σ_r n_r]
           + λ_special · mean_e max(Δ Σ_s p_s, 0) / tol_special                               no special-token rise
           + λ_special · mean_{b ∈ background} max(Δ log Σ_s p_s, 0)                         ... anywhere
           + λ_flip · Σ_{t ∈ near ties} (max(−Δ(z_t1 − z_t2), 0) / max(z⁰_t1 − z⁰_t2, 0.05))²   no flip (bar (f))
           + λ_ridge · ‖ΔW‖² / ‖W‖²
  o_e = z_r − log Σ_{v ∈ S_e} exp z_v, the log-odds of r against S_e (the base top-K without r and the special
  tokens): it never saturates (∂o/∂z_r = 1 where ∂ℓ_r/∂z_r = 1 − p_r ≈ 0 at a near-certain token), and as
  S_e ⊂ V∖{r} it bounds the exact log-odds from above, so its drop tracks theirs while the tether below keeps
  the shares inside V∖{r}. d_e = logit(p⁰_e) − logit(aim·t·p⁰_e) ≥ 0 is the log-odds drop the aim needs (f64).
  t = target_residual, aim < 1 (train events aim beyond the target: held-out events follow train only in part);
  π_e ∈ {0, 1} (`pulling`, set at each evaluation): 1 while e's phrase is short of t or e's own p/p⁰ is above t;
  budget = the solve's mean background KL budget; q = p restricted to the base top-K at the row without the
  banned token(s) and the special tokens, renormalised (at a near miss the natural continuation keeps its share,
  at an event the freed mass spreads as the base spreads it); groups are the collateral words, tol_word = |bar
  (d)'s word mean|, the real turn ends and (one more group) the background rows where the turn may end (base
  p(<|im_end|>) ≥ plausible_end_p), tol = |bar (f)'s mean Δlog p(<|im_end|>)|; o_a there is the log-odds of
  <|im_end|> against the rest of the row's base top-(K+1) (_EndOdds: Δℓ ≈ (1 − p)·Δo misses a lost lead at
  p ≈ 1); tol_special is bar (f)'s allowed rise of Σ p(special) at slop positions (a hinge on the log-probs
  instead held the special tokens' SHARE of the freed mass at zero: a near-certain token could then not lose
  its mass at all).
  Near ties are the background rows and real turn ends whose base top two tokens t1, t2 are one special token and
  one word within flip_margin nats: where bar (f) counts flips (to or away from a special token).
  The "margin" objective (expert option) replaces the target hinge by the seed's preference term
  τ·softplus((Δ(ℓ_r − ℓ_c) + margin·scale_e)/τ) against chosen natural alternatives c.

The step is Adam's with ε = floor × RMS over the matrix of √v̂, its update u = m̂/(√v̂ + ε) divided by max(1, RMS(u))
(Adafactor's update clipping, d = 1): when λ or the guard doubles, the gradient's scale jumps while v̂ (β₂ = 0.999)
lags, and plain Adam's steps grew ~30× — measured on the demo: the exact KL went 0.001 → 0.067 in 60 steps right
after the near-tie guard had doubled five times. Scale-free like Adam where the gradient is large,
gradient descent where it is far below the matrix's RMS (plain Adam moves an entry whose gradient is noise by a
full step, in directions of hh unseen contexts use: on the second model its KLD on JSON documents was 25× the
background KL; one second moment for the whole matrix kept ΔW in the gradient's span but was too slow).
Each step uses a rotating subset of the background (`background_batch` positions); every `eval_every` steps the
candidate ΔW is re-quantised (when a `shipped` map is given, as it ships) and measured EXACTLY: mean KL over the
whole background, train and dev residual per phrase. λ doubles whenever the exact KL exceeds the budget (it is
never lowered: a budget far from binding is no licence to spend it; the KLD domains and the held-out chat are
not in the background, and on the second model they moved 100–300× more than it). When `recover_after`
evaluations in a row are over the budget, λ has not brought the KL back: the step is too long for the valley the
edit is in, so the parameter returns to the kept candidate with fresh Adam moments and half the step (λ as it
stands; the record's history holds each restart). Without it one model2 seed of 13 left the budget at step ~240,
λ climbed to 1e6 and the edit collapsed; its kept candidate failed bar (d) (docs/BENCHMARKS.md, "Recovering from
a KL blow-up"). Kept:
the candidate within the budget with the most removal (mean over phrases of log max(residual, t), the residual
as `at_target_residuals` reads it: the larger of dev and train, the rule that stops the solve and that the record's convergence
reports — a key on dev alone kept candidates whose train residual was still above t after a "converged" stop); among
those reaching t on every phrase, the least KL. Stops when every phrase's dev and train residuals reach t
within the budget (converged), at the step cap, or at the time budget. Precision: f32 forward/backward, f64
vocabulary reductions (l47.tail.stream), f64 means of the measured figures.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from l47.data import record as rec
from l47.model import names
from l47.model.weights import TailWeights
from l47.solvers.batch import Batch, EventTerms, batch_cat, batch_mix, batch_rows, event_logps, ys_grad_mix
from l47.tail.forward import head_stats, logits_at, logp_at, streamed_kl, streamed_lse
from l47.tail.stream import stream_head

OBJECTIVES = ("target", "margin")


@dataclass(frozen=True)
class FtpoConfig:
    objective: str = "target"  # target | margin (the seed's preference term; expert option)
    aim: float = 0.5  # train events aim at aim × target_residual × p⁰ (target objective)
    margin: float = 2.0  # nats (margin objective)
    taper: float = 0.25  # τ, nats
    lr: float = 0.2  # Adam step, relative to the RMS of W's entries
    warmup: int = 20  # steps of linear step-size warm-up
    floor: float = 0.0  # Adam's ε as this × the RMS over the matrix of √v (0: plain Adam)
    key_ridge: float = 1e-3  # ρ/(tr B/f) of the key basis: larger trusts less the directions the background lacks
    key_rank: int = 8  # per phrase: ΔW = U·Qᵀ acts on the phrase's key directions only (0: every direction of f)
    steps: int = 1000
    lambda_kl: float = 1.0  # initial λ on background KL / budget; doubled whenever the exact KL exceeds the budget
    lambda_cond: float = 1.0  # weight of the conditional tether KL / budget at near misses
    lambda_shape: float = 0.0  # ... at events (the freed mass's shape; no bar judges it). Off by default: at 0.1
    # the tether spread the freed mass as the base spreads it, onto sentence starters (" The", " I") that take
    # held-out turn ends at near ties — model2 lost one at 14 of 15 solver seeds and every solve hit the step cap;
    # at 0 both models passed every bar at 10 of 10 seeds (docs/BENCHMARKS.md); at 1.0 it slowed removal ~3×
    lambda_coll: float = 4.0
    lambda_special: float = 1.0
    lambda_flip: float = 1.0  # weight of the near-tie guard (bar (f)'s flips; _NearTies)
    flip_margin: float = 1.0  # nats: a special token this close to the argmax (or the turn end to a word) is guarded
    gap_margin: float = 4.0  # nats: rows whose base top two are one special token and one word within this define
    # the special-vs-word gap directions ΔW is kept off to first order (gap_basis; 0: off; key_rank > 0 only)
    gap_rows: int = 2048  # ... at most this many of them (the smallest base gaps first)
    turn_end_energy: float = 0.0  # > 0: ΔW's output is kept off the directions holding this share of the solver's
    # turn ends' ∂ log p(<|im_end|>)/∂ys energy (turn_end_basis), at most n // 8 of them. Off by default: measured
    # (docs/SOLVERS.md) it holds unseen turn ends better but costs removal on the demo and bar (d) on model2
    lambda_ridge: float = 0.0
    tether_topk: int = 32  # K of the conditional tether at events and near misses
    background_batch: int = 512  # background positions per step (rotating); the exact KL uses all of them
    kl_rows: int = 65536  # background (and dev) positions at most: every row of the documents up to this cap
    anchor_batch: int = 256  # soft anchors per step (rotating; 0: all)
    plausible_end_p: float = 0.05  # background rows whose base p(<|im_end|>) is at least this (the turn may end
    # there) hold log p(<|im_end|>) like the real turn ends (one more anchor group; 0: off). Real turn ends are ~1
    # per chat, and where the model is unsure whether to end (p 0.01–0.4) unseen ones moved ±0.13 nats
    plausible_end_rows: int = 4096  # ... at most this many (the largest base p first)
    end_odds_tol: float = 0.0  # nats of Δ log-odds of <|im_end|> against its base top-K rivals that cost λ_coll at
    # the real and plausible turn ends, beside their Δlog p (0: off). Where p(<|im_end|>) ≈ 1, Δlog p ≈ (1 − p)·Δodds
    # hides any drop of its lead: measured on model2 (seed 1) the turn ends' lead over the runner-up fell 0.08 nats
    # on average (sd 0.18) while their mean Δlog p was −0.0003. Off by default: at 0.01 the mean drop vanished
    # (+0.024) but pooled held-out removal fell 0.21 → 0.45 and the 0.004-nat tie was still lost (docs/SOLVERS.md)
    end_lead_tol: float = 0.0  # nats by which a runner-up word may gain on <|im_end|> on average over the turn ends
    # (real and plausible) where it is the base runner-up, at a cost of λ_coll (_EndLeads; 0: off)
    eval_every: int = 10
    recover_after: int = 3  # after this many evaluations in a row over the KL budget, restart from the kept
    # candidate with fresh Adam moments and half the step (λ as it stands); 0: off (λ alone)
    relax: float = 0.5  # the multipliers follow their constraints both ways (`next_multiplier`): λ halves (never
    # below lambda_kl) after an evaluation whose KLs all hold with this share of their limits to spare, λ_flip
    # (never below lambda_flip) after `relax_after` evaluations in a row with no flip and no lost turn end; 0: they
    # only ever rise (the old behaviour: a constraint met once too closely held the edit back for the rest of the
    # solve; docs/SOLVERS.md "Multipliers that come back down")
    relax_after: int = 3
    time_budget_s: float = 0.0  # > 0: stop after this many seconds (the best candidate so far is kept)
    seed: int = 0


@dataclass
class FtpoProblem:
    """Everything the trainer acts on (batches on the weights' device)."""

    events: Batch  # train events
    terms: EventTerms
    phrase: list[str]  # per train event
    background: Batch  # background positions (prefix rows excluded: they are the edit's own rows)
    target_residual: float
    kl_budget: float
    anchors: Batch | None = None  # collateral anchors, then turn ends
    anchor_group: list[str] = field(default_factory=list)  # per anchor: its word, or the turn-end token's name
    anchor_tol: list[float] = field(default_factory=list)  # per anchor: nats of Δℓ that cost λ_coll
    near: Batch | None = None  # prefix rows whose target is not the banned final (near misses)
    near_banned: torch.Tensor | None = None  # [N] the banned final token at each near miss
    dev: Batch | None = None  # dev events
    dev_final: torch.Tensor | None = None  # [D]
    dev_phrase: list[str] = field(default_factory=list)
    dev_rows: Batch | None = None  # dev documents' rows but the phrases' prefix rows (bar (g)'s rows): exact KL, flips
    # and turn ends per candidate
    dev_kl_limit: float | None = None  # bar (g)'s limit: admissible while the dev rows' mean KL is within it at 95 %
    # confidence (its upper bound over documents); None: the dev mean within kl_budget
    special_tol: float = 1e-6  # rise of Σ p(special) at an event that costs λ_special (bar (f)'s tolerance)
    im_end: int | None = None  # the turn-end token: the judge counts turn ends (dev rows, anchors) that lose its argmax
    im_end_tol: float = 0.005  # nats of Δlog p(<|im_end|>) that cost λ_coll at a plausible turn end (bar (f)'s)
    shipped: object = None  # callable ΔW -> runtime W_sd as shipped (re-quantised); None: W_sd + ΔW


@dataclass(frozen=True)
class FtpoResult:
    dW: torch.Tensor
    best_step: int
    history: list[dict] = field(default_factory=list)
    stopped: str = ""  # one of record.STOP_REASONS
    kl_exact: float | None = None  # of the kept candidate (as measured: shipped when a map was given)
    dev_residual: dict = field(default_factory=dict)  # phrase -> residual of the kept candidate
    train_residual: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    info: list[str] = field(default_factory=list)  # what the parameterisation kept off (gap directions)
    phrase_stops: dict = field(default_factory=dict)  # phrase -> why it stands where it stopped (`phrase_stops`)

    def summary(self) -> dict:
        return {"best_step": self.best_step, "stopped": self.stopped, "kl_exact": self.kl_exact,
                "dev_residual": self.dev_residual, "train_residual": self.train_residual, "history": self.history,
                "notes": self.notes, "info": self.info, "phrase_stops": self.phrase_stops}

    def convergence(self, target: float) -> rec.Convergence:
        """Max violation: nats by which the worst phrase's at-target residual (at_target_residuals: the larger of
        dev and train) exceeds the target."""
        res = at_target_residuals(self.train_residual, self.dev_residual)
        worst = max((math.log(max(v, 1e-300) / target) for v in res.values()), default=0.0)
        return rec.Convergence(stop_reason=self.stopped, max_violation=max(0.0, worst), violation_tol=0.0,
                               iterations=len(self.history) and self.history[-1]["step"])


# ----------------------------------------------------------------------------------------------------------
# terms (pure functions of logits / log-probs)


def needed_drop(p0: np.ndarray, ratio: float) -> np.ndarray:
    """d = logit(p⁰) − logit(ratio·p⁰) [E] (nats, f64): the log-odds drop that takes p⁰ to ratio·p⁰. 1 − p⁰ is
    floored at 1e-6 (the f32 logits resolve p⁰ no closer to 1; a p⁰ that f32 rounds to ≥ 1 asks the same). The
    feasibility plan's `needed_gap` is this function."""
    p0 = np.clip(np.asarray(p0, dtype=np.float64), 1e-12, 1.0)
    q = ratio * p0
    return np.log(p0) - np.log(np.maximum(1.0 - p0, 1e-6)) - np.log(q) + np.log1p(-q)


def log_odds(z_r: torch.Tensor, z_s: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """o = z_r − log Σ_{keep} exp z_s per row [P] (f64). z_r [P], z_s, keep [P, K]."""
    neg = torch.finfo(torch.float64).min
    return z_r.double() - torch.logsumexp(z_s.double().masked_fill(~keep, neg), -1)


def target_hinge(drop: torch.Tensor, need: torch.Tensor, tau: float) -> torch.Tensor:
    """τ·softplus((Δo + d)/τ) per event [E]: ≈ the log-odds still to lose above the aim, → 0 past it (nats).
    drop = Δo (edited − base log-odds, ≤ 0 when it fell), need = d."""
    return tau * F.softplus((drop + need) / tau)  # [E]


def per_group_mean(x: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Mean over groups of the mean of x within each group (every group weighs the same). x, group [P]."""
    return torch.stack([x[group == g].mean() for g in torch.unique(group)]).mean()


def conditional_kl(z0: torch.Tensor, z: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """KL(q⁰ ‖ q) per row [P] of the distributions restricted to `keep` and renormalised. z0, z, keep [P, K]
    (logits of the same ids; keep bool). f32 in, f64 inside."""
    neg = torch.finfo(torch.float64).min
    l0 = torch.log_softmax(z0.double().masked_fill(~keep, neg), -1)  # [P, K]
    l1 = torch.log_softmax(z.double().masked_fill(~keep, neg), -1)  # [P, K]
    q0 = l0.exp() * keep
    return torch.where(keep, q0 * (l0 - l1), torch.zeros_like(l0)).sum(-1)  # [P]


def soft_anchor(dlp: torch.Tensor, tol: torch.Tensor) -> torch.Tensor:
    """(Δℓ/tol)² per anchor [P]: a change of one tolerance costs 1 (both ways: a turn end that rises makes the
    turn-end token rise at the near-ties around it, seed §6.1)."""
    return (dlp / tol) ** 2


# ----------------------------------------------------------------------------------------------------------
# the trainer


class _EndOdds:
    """The log-odds of <|im_end|> against its base top-K rivals (every other token of the row's base top-K) at a set
    of rows: o = z_end − log Σ_rivals exp z (log_odds); it does not saturate where p(<|im_end|>) ≈ 1."""

    def __init__(self, b: Batch, w: TailWeights, im_end: int, K: int):
        with torch.no_grad():
            mix0 = batch_mix(b, w)
            st = head_stats(mix0, w, b.target.cpu().numpy(), topk=K + 1)
            self.ids = torch.as_tensor(st.top_ids, device=mix0.device)  # [P, K+1]
            self.keep = self.ids != im_end  # [P, K+1]
            self.end = torch.full((b.P, 1), im_end, device=mix0.device)
            self.o0 = self.odds(mix0, w, torch.arange(b.P, device=mix0.device))  # [P]

    def odds(self, mix: torch.Tensor, w: TailWeights, rows: torch.Tensor) -> torch.Tensor:
        """o [r] at the rows `rows` [r] of the set, given their mix [r, n]."""
        return log_odds(logits_at(mix, w, self.end[rows])[:, 0], logits_at(mix, w, self.ids[rows]), self.keep[rows])


class _EndLeads:
    """The lead of <|im_end|> over each row's base runner-up r (its strongest other token), d = z_end − z_r, at a set of
    turn-end rows, grouped by r. A word that gains on <|im_end|> wherever it is the runner-up takes turn ends the
    solver never sees (a held-out near tie is lost to the drift, not to its own row's noise): the cost is the
    one-sided square of each runner-up's mean Δd, rows weighted alike, so the spread within a group stays free."""

    def __init__(self, b: Batch, w: TailWeights, im_end: int):
        with torch.no_grad():
            mix0 = batch_mix(b, w)
            top = torch.as_tensor(head_stats(mix0, w, b.target.cpu().numpy(), topk=2).top_ids, device=mix0.device)
            r = torch.where(top[:, 0] == im_end, top[:, 1], top[:, 0])  # [P] the base runner-up
            self.b, self.ids = b, torch.stack([torch.full_like(r, im_end), r], 1)  # [P, 2]
            self.group = torch.unique(r, return_inverse=True)[1]  # [P] 0..G−1
            self.n = torch.bincount(self.group).double()  # [G]
            self.d0 = self.lead(mix0, w)  # [P] f64

    def lead(self, mix: torch.Tensor, w: TailWeights) -> torch.Tensor:
        """d [P] f64 given the rows' mix [P, n]."""
        z = logits_at(mix, w, self.ids).double()  # [P, 2]
        return z[:, 0] - z[:, 1]

    def drift(self, w: TailWeights, dW: torch.Tensor) -> torch.Tensor:
        """Mean Δd per runner-up [G] f64 (nats; < 0: the runner-up gained on <|im_end|>)."""
        dd = self.lead(batch_mix(self.b, w, dW=dW), w) - self.d0  # [P]
        return torch.zeros_like(self.n).index_add(0, self.group, dd) / self.n

    def cost(self, w: TailWeights, dW: torch.Tensor, tol: float) -> torch.Tensor:
        """Σ_g n_g (min(drift_g, 0) / tol)² / Σ_g n_g (f32 scalar)."""
        return ((F.relu(-self.drift(w, dW)) / tol) ** 2 * self.n).sum().float() / float(self.n.sum())


class _Tether:
    """The conditional tether at a set of rows: the base top-K ids without the banned and special tokens."""

    def __init__(self, b: Batch, w: TailWeights, banned: torch.Tensor, special: torch.Tensor, K: int):
        with torch.no_grad():
            mix0 = batch_mix(b, w)
            st = head_stats(mix0, w, b.target.cpu().numpy(), topk=K)
            self.ids = torch.as_tensor(st.top_ids, device=mix0.device)  # [P, K]
            bad = (self.ids == banned[:, None]) | torch.isin(self.ids, special.to(mix0.device))
            self.keep = ~bad  # [P, K]
            self.z0 = logits_at(mix0, w, self.ids)  # [P, K]

    def kl(self, mix: torch.Tensor, w: TailWeights, z: torch.Tensor | None = None) -> torch.Tensor:
        return conditional_kl(self.z0, logits_at(mix, w, self.ids) if z is None else z, self.keep)  # [P]


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


def _phrase_residuals(p0: np.ndarray, p1: np.ndarray, phrase: list[str]) -> dict[str, float]:
    """phrase -> Σ p1 / Σ p0 over its events (f64)."""
    out: dict[str, float] = {}
    for ph in sorted(set(phrase)):
        m = np.array([x == ph for x in phrase])
        out[ph] = float(p1[m].sum() / max(p0[m].sum(), 1e-300))
    return out


def at_target_residuals(train: dict[str, float], dev: dict[str, float]) -> dict[str, float]:
    """phrase -> the residual that says whether it is at its target: the larger of its dev and train residuals
    (train alone without dev events). Dev decides, train is a floor: a phrase whose own train events are still
    above the target is not done on unseen ones, however few dev events agree — measured on the demo: "rather
    than" (3 dev events) read 0.087 on dev at train 0.354, stopped pulling, and ended at 0.364 held out."""
    return {p: max(v, dev.get(p, v)) for p, v in train.items()} | {p: v for p, v in dev.items() if p not in train}


def pulling(ratio: np.ndarray, phrase: list[str], at: dict[str, float], target: float) -> np.ndarray:
    """Which train events pull [E] (bool): every event of a phrase short of its target (`at`: at_target_residuals),
    and in a phrase at its target each event whose own residual p/p⁰ (`ratio` [E]) is still above the target.
    A phrase's mean reaches the target while a context of its own stays whole; when the phrase stopped pulling as
    a whole, model2's "The seller went above and" (9 of 123 train events, p⁰ ≈ 1) stayed at p/p⁰ = 1.000, held
    28 % of the held-out events and left the phrase at 0.33–0.37 held out; pulling per event, 0.06–0.12 at
    nine seeds, every bar passing (docs/BENCHMARKS.md, "Every context pulls"); of 13 later model2 seeds one
    diverged (the KL left the budget and λ only doubles: "The per-event rule on the landed code"), which
    `recover_after` mends ("Recovering from a KL blow-up")."""
    return np.array([at[p] > target or r > target for p, r in zip(phrase, np.asarray(ratio))], dtype=bool)


def next_multiplier(lam: float, floor: float, violated: bool, slack: bool, relax: float, cap: float = 1e6) -> float:
    """The penalty multiplier after one exact evaluation: doubled (at most `cap`) when its constraint is violated,
    halved (never below `floor`, its initial value) when the constraint holds with slack and `relax` > 0, else
    kept. One rule for λ (the KLs) and λ_flip (flips and turn ends): a multiplier that only rises turns a limit
    met once, early and briefly, into a weight that outlasts the reason for it; under Adam's normalised step the
    hinge's share of every later step then shrinks by that factor."""
    if violated:
        return min(lam * 2.0, cap)
    if slack and relax > 0:
        return max(lam * 0.5, floor)
    return lam


def removal_score(res: dict[str, float], target: float) -> float:
    """Mean over phrases of log max(residual, target): lower is more removal; every phrase at target = log t."""
    return float(np.mean([math.log(max(v, target)) for v in res.values()])) if res else 0.0


def candidate_key(train: dict[str, float], dev: dict[str, float], target: float, kl: float) -> tuple[float, float]:
    """How the judge ranks admissible candidates (lower first): the removal score of each phrase's residual as
    `at_target_residuals` reads it (the larger of dev and train: the rule that stops the solve and that the
    record's convergence reports), then the exact background KL."""
    return removal_score(at_target_residuals(train, dev), target), kl


def special_word_pairs(rows: list[Batch], w: TailWeights, special: torch.Tensor, margin: float):
    """(Batch, ids [N, 2], gap [N]) of the rows whose base top two tokens are one special token and one not, within
    `margin` nats (gap = base log-prob of the first − the second, f64 reduction, f32 out); (None, None, None) if none.
    Where bar (f) counts flips (to or away from a special token). Only one top-2 pass per batch."""
    keep_b, keep_ids, keep_gap = [], [], []
    with torch.no_grad():
        for b in rows:
            mix0 = batch_mix(b, w)
            st = head_stats(mix0, w, b.target.cpu().numpy(), topk=2)
            top = torch.as_tensor(st.top_ids[:, :2], device=mix0.device)  # [P, 2]
            is_sp = torch.isin(top, special.to(mix0.device))  # [P, 2]
            gap = torch.as_tensor(st.top_logp[:, 0] - st.top_logp[:, 1], device=mix0.device)  # [P] ≥ 0
            m = (is_sp[:, 0] != is_sp[:, 1]) & (gap < margin)
            if m.any():
                idx = torch.nonzero(m)[:, 0]
                keep_b.append(batch_rows(b, idx))
                keep_ids.append(top[idx])
                keep_gap.append(gap[idx].float())
    if not keep_b:
        return None, None, None
    return (keep_b[0] if len(keep_b) == 1 else batch_cat(keep_b)), torch.cat(keep_ids), torch.cat(keep_gap)


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


class _NearTies:
    """Bar (f)'s flips, guarded where they can happen: the background rows and real turn ends whose base top two
    tokens are one special and one not, within `margin` nats (a special token next to the argmax, or the turn end
    next to a word). The guard costs (shrink of the gap / its base size)² per row, summed: a flip costs about 1,
    a small shrink of a wide gap next to nothing. Only gathered logits: no pass over the vocabulary."""

    def __init__(self, rows: list[Batch], w: TailWeights, special: torch.Tensor, margin: float):
        self.b, self.ids, gap = special_word_pairs(rows, w, special, margin)
        if self.b is not None:
            self.gap0 = gap.clamp_min(0.05)  # [N]
            with torch.no_grad():
                z = logits_at(batch_mix(self.b, w), w, self.ids)  # [N, 2]
                self.d0 = z[:, 0] - z[:, 1]  # [N]

    @property
    def n(self) -> int:
        return 0 if self.b is None else self.b.P

    def cost(self, w: TailWeights, dW: torch.Tensor) -> torch.Tensor:
        z = logits_at(batch_mix(self.b, w, dW=dW), w, self.ids)  # [N, 2]
        shrink = F.relu(self.d0 - (z[:, 0] - z[:, 1]))  # [N]
        return ((shrink / self.gap0) ** 2).sum()


class _Objective:
    """L(ΔW) of the module docstring at chosen background rows; every base-model quantity computed once (f32
    forward, f64 vocabulary reductions)."""

    def __init__(self, w: TailWeights, pb: FtpoProblem, cfg: FtpoConfig, ev_group: torch.Tensor):
        self.w, self.pb, self.cfg, self.ev_group = w, pb, cfg, ev_group
        dev_, ev, terms = w.device, pb.events, pb.terms
        self.W_sq = float(w.W_sd.pow(2).sum())
        self.lam_flip = cfg.lambda_flip  # doubled whenever a candidate flips a dev row to a special token
        self.event_on = torch.ones(ev_group.numel(), device=w.device)  # [E] 0 where an event stopped pulling (pulling)
        self.special = terms.special.to(dev_)
        with torch.no_grad():
            mix0_ev = batch_mix(ev, w)
            self.base = event_logps(mix0_ev, w, terms)
            self.p0_ev = self.base["rejected"].double().exp().cpu().numpy()  # [E]
            self.need = torch.as_tensor(needed_drop(self.p0_ev, cfg.aim * pb.target_residual), device=dev_)  # [E]
            self.mass0_special = self.base["special"].exp().sum(1)  # [E] Σ_s p⁰_s
            self.mix0_bg = batch_mix(pb.background, w)  # [B, n]
            st = stream_head(self.mix0_bg, w.head, w.numerics, entropy=True, mu=True)
            self.mu0_bg = st.mu.to(dev_)  # [B, n] f64  E_p⁰[W_out]: the step's KL needs one pass, not four
            self.negH0_bg = -st.entropy.to(dev_)  # [B] f64  Σ p⁰ log p⁰
            self.lse0_bg = st.lse.to(dev_)  # [B] f64
            self.lm0_special = (self._log_special_mass(self.mix0_bg, self.lse0_bg)
                                if self.special.numel() else None)  # [B]
            self.pe_rows, self.lp0_pe, self.notes = self._plausible_ends(w, pb, cfg)
            self.lp0_an = self.an_group = self.an_tol = None
            if pb.anchors is not None and pb.anchors.P:
                self.lp0_an = logp_at(batch_mix(pb.anchors, w), w, pb.anchors.target)  # [A]
                gi = {g: i for i, g in enumerate(sorted(set(pb.anchor_group)))}
                self.an_group = torch.as_tensor([gi[g] for g in pb.anchor_group], device=dev_)
                self.an_tol = torch.as_tensor(pb.anchor_tol, dtype=torch.float32, device=dev_)
        self.odds_an, self.odds_pe, self.an_end_pos = self._end_odds(w, pb, cfg)
        self.leads = self._end_leads(w, pb, cfg)
        self.an_rows = _Rotation(0 if self.lp0_an is None else pb.anchors.P, cfg.anchor_batch, cfg.seed + 1, dev_)
        self.pe_rot = _Rotation(0 if self.pe_rows is None else self.pe_rows.numel(), cfg.anchor_batch, cfg.seed + 2, dev_)
        self.teth_ev = _Tether(ev, w, terms.rejected, self.special, cfg.tether_topk)
        with torch.no_grad():
            self.o0 = log_odds(logits_at(mix0_ev, w, terms.rejected[:, None])[:, 0], self.teth_ev.z0,
                               self.teth_ev.keep)  # [E]
        self.teth_near = (_Tether(pb.near, w, pb.near_banned, self.special, cfg.tether_topk)
                          if pb.near is not None and pb.near.P else None)
        ends = [i for i, g in enumerate(pb.anchor_group) if g == names.IM_END]
        tie_rows = [pb.background] + ([batch_rows(pb.anchors, torch.as_tensor(ends, device=dev_))] if ends else [])
        self.ties = (_NearTies(tie_rows, w, self.special, cfg.flip_margin)
                     if self.special.numel() and cfg.lambda_flip > 0 else None)

    def _plausible_ends(self, w: TailWeights, pb: FtpoProblem, cfg: FtpoConfig):
        """(rows [N] into the background, their base log p(<|im_end|>) [N] f32, notes): the background rows where
        the turn may end — base p(<|im_end|>) ≥ plausible_end_p, the target not <|im_end|> itself (those are the real
        turn ends) — at most plausible_end_rows of them, the most likely first. (None, None, []) when off or none."""
        if pb.im_end is None or cfg.plausible_end_p <= 0 or cfg.plausible_end_rows <= 0:
            return None, None, []
        ids = torch.full((self.mix0_bg.shape[0], 1), int(pb.im_end), device=self.mix0_bg.device)
        lp = (logits_at(self.mix0_bg, w, ids)[:, 0].double() - self.lse0_bg)  # [B] f64
        ok = (lp >= math.log(cfg.plausible_end_p)) & (pb.background.target.to(lp.device) != int(pb.im_end))
        rows = torch.nonzero(ok)[:, 0]  # [N]
        if not rows.numel():
            return None, None, []
        rows = rows[torch.argsort(lp[rows], descending=True)[: cfg.plausible_end_rows]]
        return rows, lp[rows].float(), [f"plausible turn ends: {rows.numel()} background rows with base "
                                        f"p(<|im_end|>) ≥ {cfg.plausible_end_p:g} hold log p(<|im_end|>) (tol "
                                        f"{pb.im_end_tol:g} nats)"]

    def _end_odds(self, w: TailWeights, pb: FtpoProblem, cfg: FtpoConfig):
        """(_EndOdds at the turn-end anchors or None, _EndOdds at the plausible turn ends or None, per anchor its
        row in the first [A] (−1: not a turn end) or None); all None when end_odds_tol is 0."""
        if pb.im_end is None or cfg.end_odds_tol <= 0:
            return None, None, None
        odds_an = pos = odds_pe = None
        if self.lp0_an is not None:
            ends = [i for i, g in enumerate(pb.anchor_group) if g == names.IM_END]
            if ends:
                e = torch.as_tensor(ends, device=w.device)
                odds_an = _EndOdds(batch_rows(pb.anchors, e), w, int(pb.im_end), cfg.tether_topk)
                pos = torch.full((pb.anchors.P,), -1, dtype=torch.long, device=w.device)
                pos[e] = torch.arange(len(ends), device=w.device)
        if self.pe_rows is not None:
            odds_pe = _EndOdds(batch_rows(pb.background, self.pe_rows), w, int(pb.im_end), cfg.tether_topk)
        return odds_an, odds_pe, pos

    def _end_leads(self, w: TailWeights, pb: FtpoProblem, cfg: FtpoConfig) -> _EndLeads | None:
        """_EndLeads at the real turn-end anchors and the plausible turn ends, or None when end_lead_tol is 0."""
        if pb.im_end is None or cfg.end_lead_tol <= 0:
            return None
        parts = [batch_rows(pb.background, self.pe_rows)] if self.pe_rows is not None else []
        ends = [i for i, g in enumerate(pb.anchor_group) if g == names.IM_END] if self.lp0_an is not None else []
        if ends:
            parts.append(batch_rows(pb.anchors, torch.as_tensor(ends, device=w.device)))
        return _EndLeads(batch_cat(parts), w, int(pb.im_end)) if parts else None

    def _odds_cost(self, odds: _EndOdds | None, mix: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """(Δo / end_odds_tol)² at `rows` [r] of an _EndOdds set (mix [r, n]); 0 where off."""
        if odds is None or not rows.numel():
            return mix.new_zeros(())
        return soft_anchor(odds.odds(mix, self.w, rows) - odds.o0[rows], self.cfg.end_odds_tol).float()

    def _anchor_cost(self, dW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cost [a] per anchor of a rotating subset, its rows [a]): soft_anchor of Δℓ, plus at the turn ends the
        cost of their log-odds (_odds_cost)."""
        pb, a = self.pb, self.an_rows()
        mix = batch_mix(batch_rows(pb.anchors, a), self.w, dW=dW)  # [a, n]
        cost = soft_anchor(logp_at(mix, self.w, pb.anchors.target[a]) - self.lp0_an[a], self.an_tol[a])  # [a]
        if self.an_end_pos is not None:
            pos = self.an_end_pos[a]
            m = pos >= 0
            if bool(m.any()):
                cost = cost.index_add(0, torch.nonzero(m)[:, 0], self._odds_cost(self.odds_an, mix[m], pos[m]))
        return cost, a

    def _log_special_mass(self, mix: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """log Σ_s p_s per row [B] given the rows' log-sum-exp."""
        ids = self.special.expand(mix.shape[0], -1)
        return torch.logsumexp(logits_at(mix, self.w, ids), 1).double() - lse

    def step_kl(self, mix: torch.Tensor, rows: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """KL(p⁰ ‖ p) per background row [m] for the step (f64): Σ p⁰ log p⁰ − μ⁰·mix + lse(mix), since
        Σ_v p⁰_v z_v = μ⁰·mix. Its gradient −μ⁰ + μ is exact; its value is a difference of O(lse) terms (f32 lse:
        ~1e-6 absolute), so the exact KL that judges candidates is `streamed_kl`, never this."""
        return self.negH0_bg[rows] - (self.mu0_bg[rows] * mix.double()).sum(1) + lse.double()

    def __call__(self, dW: torch.Tensor, rows: torch.Tensor, lam: float) -> tuple[torch.Tensor, dict]:
        """(loss, its parts as floats) at ΔW [n, f] with the background rows `rows` [m]."""
        w, pb, cfg, terms = self.w, self.pb, self.cfg, self.pb.terms
        mix = batch_mix(pb.events, w, dW=dW)  # [E, n]
        lp = event_logps(mix, w, terms)
        z_s = logits_at(mix, w, self.teth_ev.ids)  # [E, K]
        if cfg.objective == "target":
            o = log_odds(logits_at(mix, w, terms.rejected[:, None])[:, 0], z_s, self.teth_ev.keep)  # [E]
            pref = per_group_mean(target_hinge(o - self.o0, self.need, cfg.taper) * self.event_on,
                                  self.ev_group).float()
        else:
            gap = (lp["rejected"] - self.base["rejected"])[:, None] - (lp["chosen"] - self.base["chosen"])  # [E, kc]
            pref = (cfg.taper * F.softplus((gap + cfg.margin * terms.scale[:, None]) / cfg.taper)).mean()
        mix_bg = batch_mix(batch_rows(pb.background, rows), w, dW=dW)  # [m, n]
        lse_bg = streamed_lse(mix_bg, w)  # [m] the one vocabulary pass of the background rows
        kl_bg = self.step_kl(mix_bg, rows, lse_bg).mean().float()
        special_t = mix.new_zeros(())
        if self.special.numel():  # no rise of Σ p(special) at events, nor of its log anywhere in the background
            special_t = (F.relu(lp["special"].exp().sum(1) - self.mass0_special).mean() / pb.special_tol
                         + F.relu(self._log_special_mass(mix_bg, lse_bg) - self.lm0_special[rows]).mean().float())
        cond = (cfg.lambda_shape * self.teth_ev.kl(mix, w, z_s).mean().float() if cfg.lambda_shape
                else mix.new_zeros(()))  # events: the freed mass's shape
        if self.teth_near is not None:  # near misses: the natural continuation keeps its share
            cond = cond + cfg.lambda_cond * self.teth_near.kl(batch_mix(pb.near, w, dW=dW), w).mean().float()
        coll, ng = mix.new_zeros(()), 0  # mean over anchor groups; ng groups so far
        if self.lp0_an is not None:
            cost, a = self._anchor_cost(dW)  # a rotating subset of the anchors
            coll, ng = per_group_mean(cost, self.an_group[a]), int(torch.unique(self.an_group[a]).numel())
        if self.pe_rows is not None:  # the plausible turn ends: one more group of the soft anchors
            k = self.pe_rot()
            r = self.pe_rows[k]
            mix_pe = batch_mix(batch_rows(pb.background, r), w, dW=dW)
            dlp = logp_at(mix_pe, w, torch.full_like(r, int(pb.im_end))) - self.lp0_pe[k]  # [k]
            pe = soft_anchor(dlp, torch.full_like(dlp, pb.im_end_tol)) + self._odds_cost(self.odds_pe, mix_pe, k)
            coll, ng = (coll * ng + pe.mean()) / (ng + 1), ng + 1
        if self.leads is not None:  # no runner-up gains on <|im_end|> on average: one more group
            coll, ng = (coll * ng + self.leads.cost(w, dW, cfg.end_lead_tol)) / (ng + 1), ng + 1
        flip = self.ties.cost(w, dW) if self.ties is not None and self.ties.n else mix.new_zeros(())
        loss = (pref + lam * kl_bg / pb.kl_budget + cond / pb.kl_budget + self.lam_flip * flip
                + cfg.lambda_coll * coll + cfg.lambda_special * special_t
                + cfg.lambda_ridge * dW.pow(2).sum() / self.W_sq)
        parts = {"loss": loss, "pref": pref, "kl_step": kl_bg, "cond_kl": cond, "coll": coll,
                 "special": special_t, "flip": flip}
        return loss, {k: float(v.detach()) for k, v in parts.items()}


# why a candidate is inadmissible (the judge's conditions), and so what may bind a phrase short of its target
BIND_KL = "KL budget"  # the exact background KL over the solve's budget
BIND_DEV_KL = "bar (g) KL on dev chats"  # the dev documents' rows' KL (upper bound) over bar (g)'s limit
BIND_FLIPS = "bar (f) flips"  # a dev row's argmax flipped to a special token
BIND_ENDS = "bar (f) turn ends"  # a real turn end lost its argmax (dev rows or the solver's anchors)


class _Judge:
    """Every `eval_every` steps: the candidate re-quantised as shipped and measured EXACTLY (mean KL over the
    whole background, train and dev residual per phrase); keeps the best candidate within the budget."""

    def __init__(self, w: TailWeights, pb: FtpoProblem, obj: _Objective):
        self.w, self.pb, self.obj = w, pb, obj
        self.dev_p0 = None
        if pb.dev is not None:
            with torch.no_grad():
                self.dev_p0 = np.exp(head_stats(batch_mix(pb.dev, w), w, pb.dev_final.cpu().numpy()).logp_target)
        self.best = None  # (key, step, dW, kl, dev_res, train_res)
        self.special = pb.terms.special.to(w.device)
        if pb.dev_rows is not None:
            with torch.no_grad():
                self.mix0_dev = batch_mix(pb.dev_rows, w)  # [D, n]
                self.arg0_dev = stream_head(self.mix0_dev, w.head, w.numerics, topk=1).top_i[:, 0].to(w.device)  # [D]
        self.ends = _TurnEnds(w, pb, self.arg0_dev if pb.dev_rows is not None else None)

    def __call__(self, step: int, dW: torch.Tensor, lam: float) -> dict:
        w, pb, t = self.w, self.pb, self.pb.target_residual
        with torch.no_grad():
            Wq = pb.shipped(dW) if pb.shipped is not None else w.W_sd + dW
            kl = float(streamed_kl(batch_mix(pb.background, w, W_sd=Wq), self.obj.mix0_bg, w).double().mean())
            p1 = np.exp(head_stats(batch_mix(pb.events, w, W_sd=Wq), w, pb.terms.rejected.cpu().numpy()).logp_target)
            tr = _phrase_residuals(self.obj.p0_ev, p1, pb.phrase)
            self.ratio_ev = p1 / np.maximum(self.obj.p0_ev, 1e-300)  # [E] each train event's own residual
            dv = {}
            if pb.dev is not None:
                p1 = np.exp(head_stats(batch_mix(pb.dev, w, W_sd=Wq), w, pb.dev_final.cpu().numpy()).logp_target)
                dv = _phrase_residuals(self.dev_p0, p1, pb.dev_phrase)
            kl_dev, flips, arg_dev, kl_role, kl_dev_hi = self._dev_rows(Wq)
            ends_lost = self.ends.lost(Wq, arg_dev)
        at = at_target_residuals(tr, dv)  # the rule `reached` and the record's convergence use: one per phrase
        key = candidate_key(tr, dv, t, kl)
        dev_ok = kl_dev is None or (kl_dev <= pb.kl_budget if pb.dev_kl_limit is None else
                                    kl_dev_hi <= pb.dev_kl_limit)
        over = [name for name, bad in ((BIND_KL, kl > pb.kl_budget), (BIND_DEV_KL, not dev_ok),
                                       (BIND_FLIPS, bool(flips)),
                                       (BIND_ENDS, bool(ends_lost["dev"] or ends_lost["anchors"]))) if bad]
        ok = not over
        if ok and (self.best is None or key < self.best[0]):
            self.best = (key, step, dW.clone(), kl, dv, tr)
        dev_limit = pb.kl_budget if pb.dev_kl_limit is None else pb.dev_kl_limit
        dev_used = None if kl_dev is None else (kl_dev if pb.dev_kl_limit is None else kl_dev_hi) / dev_limit
        return {"step": step, "kl_exact": kl, "kl_dev": kl_dev, "kl_dev_hi": kl_dev_hi, "kl_dev_role": kl_role,
                "dev_flips": flips,
                "turn_ends_lost": ends_lost,
                "lambda": lam, "lambda_flip": self.obj.lam_flip, "train_residual": tr, "dev_residual": dv,
                "inadmissible": over, "kl_used": kl / pb.kl_budget, "kl_dev_used": dev_used,
                "reached": ok and all(v <= t for v in at.values())}

    def _dev_rows(self, Wq: torch.Tensor) -> tuple[float | None, int, torch.Tensor | None, dict, float | None]:
        """(mean exact KL, argmax flips to a special token, the edited argmax [D], role -> mean KL, the mean's 95 %
        upper bound over documents) at the dev documents' rows: bars (g) and (f) measured on chats of the held-out
        kind that the trainer never sees (None, 0, None, {}, None without dev documents)."""
        pb, w = self.pb, self.w
        if pb.dev_rows is None:
            return None, 0, None, {}, None
        mix = batch_mix(pb.dev_rows, w, W_sd=Wq)  # [D, n]
        st = stream_head(torch.cat([self.mix0_dev, mix]), w.head, w.numerics, topk=1, pairs=mix.shape[0])  # one pass
        kl = float(st.kl.double().mean())
        arg = st.top_i[mix.shape[0]:, 0].to(w.device)  # [D]
        flips = int((torch.isin(arg, self.special) & ~torch.isin(self.arg0_dev, self.special)).sum())
        return kl, flips, arg, _by_role(st.kl.double(), pb.dev_rows.role), _ratio_upper(st.kl, pb.dev_rows.doc)


def ratio_upper(x: np.ndarray, doc: np.ndarray, z: float = 1.645) -> float:
    """One-sided upper bound of the row mean of x [P] over documents drawn at random (cluster ratio estimator,
    f64): R + z·SE, R = Σx / P, SE² = D/(D−1) · Σ_d (S_d − R·n_d)² / P² (S_d, n_d: a document's sum and rows).
    With one document, R itself."""
    x = np.asarray(x, dtype=np.float64)
    _, inv = np.unique(np.asarray(doc), return_inverse=True)
    S, n = np.bincount(inv, weights=x), np.bincount(inv).astype(np.float64)  # [D]
    R, D = float(x.mean()), len(S)
    if D < 2:
        return R
    se = math.sqrt(D / (D - 1) * float(((S - R * n) ** 2).sum())) / len(x)
    return R + z * se


def _ratio_upper(kl: torch.Tensor, doc: tuple[str, ...]) -> float | None:
    return ratio_upper(kl.double().cpu().numpy(), np.asarray(doc)) if len(doc) == kl.shape[0] else None


def _by_role(x: torch.Tensor, role: torch.Tensor | None) -> dict[str, float]:
    """role name -> mean of x [P] over the rows of that role ({} when the batch has no roles)."""
    if role is None:
        return {}
    role = role.to(x.device)
    return {names.ROLES[int(r)]: float(x[role == r].mean()) for r in torch.unique(role)}


class _TurnEnds:
    """Bar (f)'s turn-end argmax, judged per candidate: the real turn ends (target <|im_end|>) where <|im_end|> is
    the base argmax — at the dev documents' rows (never trained on: the held-out kind) and at the trainer's
    turn-end anchors (in-sample) — counted when it is no longer the argmax."""

    def __init__(self, w: TailWeights, pb: FtpoProblem, arg0_dev: torch.Tensor | None):
        self.w, self.dev_idx, self.an = w, None, None
        if pb.im_end is None:
            return
        if arg0_dev is not None:
            tg = pb.dev_rows.target.to(arg0_dev.device)
            self.dev_idx = torch.nonzero((tg == pb.im_end) & (arg0_dev == pb.im_end))[:, 0]  # [Td]
        ends = [i for i, g in enumerate(pb.anchor_group) if g == names.IM_END]
        if ends and pb.anchors is not None:
            b = batch_rows(pb.anchors, torch.as_tensor(ends, device=w.device))
            with torch.no_grad():
                a0 = stream_head(batch_mix(b, w), w.head, w.numerics, topk=1).top_i[:, 0].to(w.device)
            keep = torch.nonzero(a0 == pb.im_end)[:, 0]
            self.an = batch_rows(b, keep) if keep.numel() else None
        self.im_end = pb.im_end

    def lost(self, Wq: torch.Tensor, arg_dev: torch.Tensor | None) -> dict[str, int]:
        """{"dev": n, "anchors": n} turn ends whose argmax is no longer <|im_end|> under the shipped W."""
        out = {"dev": 0, "anchors": 0}
        if self.dev_idx is not None and arg_dev is not None and self.dev_idx.numel():
            out["dev"] = int((arg_dev[self.dev_idx] != self.im_end).sum())
        if self.an is not None:
            a1 = stream_head(batch_mix(self.an, self.w, W_sd=Wq), self.w.head, self.w.numerics, topk=1).top_i[:, 0]
            out["anchors"] = int((a1.to(self.w.device) != self.im_end).sum())
        return out


class _Rotation:
    """Rows 0..n−1 in rotating random subsets of m (a fresh permutation when one is used up)."""

    def __init__(self, n: int, m: int, seed: int, device):
        self.n, self.m, self.device = n, min(m, n) if m > 0 else n, device
        self.gen = torch.Generator().manual_seed(seed)
        self.perm, self.cursor = torch.randperm(n, generator=self.gen), 0

    def __call__(self) -> torch.Tensor:
        if self.cursor + self.m > self.n:
            self.perm, self.cursor = torch.randperm(self.n, generator=self.gen), 0
        rows = self.perm[self.cursor: self.cursor + self.m]
        self.cursor += self.m
        return rows.to(self.device)


class _Adam:
    """Adam with a floor (module docstring) on one parameter; a rotating subset of the background per step."""

    def __init__(self, param: torch.Tensor, cfg: FtpoConfig, W_rms: float, n_bg: int):
        self.param, self.cfg, self.W_rms = param, cfg, W_rms
        self.mom, self.vv = torch.zeros_like(param), torch.zeros_like(param)
        self.k, self.scale = 0, 1.0
        self._bg_rows = _Rotation(n_bg, cfg.background_batch, cfg.seed, param.device)

    def restart(self, value: torch.Tensor) -> None:
        """Back to `value` with fresh moments (and warm-up) and half the step."""
        with torch.no_grad():
            self.param.copy_(value)
        self.mom.zero_(), self.vv.zero_()
        self.k, self.scale = 0, self.scale * 0.5

    def run(self, n: int, loss_of) -> list[dict]:
        """n steps; loss_of(rows) -> (loss, parts). Returns the parts of each step."""
        cfg, out = self.cfg, []
        for _ in range(n):
            self.param.grad = None
            loss, parts = loss_of(self._bg_rows())
            loss.backward()
            with torch.no_grad():  # entries whose gradient is far below the matrix's RMS move in proportion to it
                g, self.k = self.param.grad, self.k + 1
                self.mom.mul_(0.9).add_(g, alpha=0.1)
                self.vv.mul_(0.999).addcmul_(g, g, value=0.001)
                v_hat = self.vv / (1 - 0.999 ** self.k)
                floor = float(v_hat.double().mean().sqrt()) * cfg.floor
                lr = cfg.lr * self.scale * self.W_rms * min(1.0, self.k / max(cfg.warmup, 1))
                u = (self.mom / (1 - 0.9 ** self.k)) / (v_hat.sqrt() + floor + 1e-30)
                self.param.sub_(lr * u / max(1.0, float(u.double().pow(2).mean().sqrt())))  # update clipping
            out.append(parts)
        return out


def train_ftpo(w: TailWeights, pb: FtpoProblem, cfg: FtpoConfig = FtpoConfig(), progress=None) -> FtpoResult:
    """Minimise L(ΔW) (module docstring) by Adam with a floor; keep the best dev candidate within the
    KL budget. Steps: parameterise ΔW -> base quantities -> (judge exactly, stop?, λ, optimise) every eval_every
    steps -> the kept candidate."""
    if cfg.objective not in OBJECTIVES:
        from l47.errors import L47Error

        raise L47Error("solver.ftpo", "objective", f"one of {OBJECTIVES}", repr(cfg.objective))
    t_start = time.monotonic()
    torch.manual_seed(cfg.seed)
    ph_ids = {p: i for i, p in enumerate(sorted(set(pb.phrase)))}
    ev_group = torch.as_tensor([ph_ids[p] for p in pb.phrase], device=w.device)
    param, dW_of, pnotes = _parameterise(w, pb, cfg, ev_group)
    obj = _Objective(w, pb, cfg, ev_group)
    judge = _Judge(w, pb, obj)
    opt = _Adam(param, cfg, float(w.W_sd.pow(2).mean().sqrt()), pb.background.P)
    lam, history, stopped, step = cfg.lambda_kl, [], rec.STOP_ITERATION_CAP, 0
    over, kept, restarts = 0, None, []  # evaluations in a row over the KL budget; the kept candidate's parameter
    clean = 0  # evaluations in a row with no flip and no lost turn end
    while True:
        info = judge(step, dW_of(param.detach()), lam)
        reached = info.pop("reached")
        history.append(info)  # no wall time in the record: the same inputs write the same bytes
        if progress is not None:
            progress({**info, "elapsed_s": round(time.monotonic() - t_start, 2)})
        if reached and step > 0:
            stopped = rec.STOP_CONVERGED
            break
        if step >= cfg.steps:
            break
        if cfg.time_budget_s > 0 and time.monotonic() - t_start > cfg.time_budget_s:
            stopped = rec.STOP_TIME
            break
        bad = info["inadmissible"]
        kl_bad = BIND_KL in bad or BIND_DEV_KL in bad  # the background KL is the trainer's handle on both KLs
        kl_slack = info["kl_used"] < cfg.relax and (info["kl_dev_used"] is None or info["kl_dev_used"] < cfg.relax)
        lam = next_multiplier(lam, cfg.lambda_kl, kl_bad, kl_slack, cfg.relax)
        over = over + 1 if info["kl_exact"] > pb.kl_budget else 0
        if judge.best is not None and judge.best[1] == step:
            kept = param.detach().clone()
        if cfg.recover_after > 0 and over >= cfg.recover_after and kept is not None:
            opt.restart(kept)  # λ alone did not bring the KL back: the step is too long for the valley
            over = 0
            history.append({"step": step, "restart_from": judge.best[1], "lr_scale": opt.scale})
            restarts.append(f"FTPO: exact KL over the budget {cfg.recover_after} evaluations in a row at step "
                             f"{step}: restarted from the kept candidate (step {judge.best[1]}), step × {opt.scale:g}")
        tie_bad = BIND_FLIPS in bad or BIND_ENDS in bad
        clean = 0 if tie_bad else clean + 1
        obj.lam_flip = next_multiplier(obj.lam_flip, cfg.lambda_flip, tie_bad, clean >= cfg.relax_after, cfg.relax)
        judged = at_target_residuals(info["train_residual"], info["dev_residual"])
        obj.event_on = torch.as_tensor(pulling(judge.ratio_ev, pb.phrase, judged, pb.target_residual),
                                       dtype=torch.float32, device=w.device)  # the budget goes to what is short
        n = min(cfg.eval_every, cfg.steps - step)
        loss_of = lambda rows, lam=lam: obj(dW_of(param), rows, lam)  # noqa: E731
        parts = opt.run(n, loss_of)
        step += n
        history.append({"step": step, **parts[-1]})
    return dataclasses.replace(_result(judge, history, stopped, step, pb, w), info=pnotes + obj.notes + restarts)


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
    if V is None:
        return U0, (lambda p: off_span(p, B) @ Q.T), notes + gap_notes
    # off span B first, then off the gap directions built from (I − B Bᵀ)J: the result stays off span B, and
    # each gap row's first-order change J_bᵀ Y k_b = ((I − B Bᵀ)J_b)ᵀ Y k_b is 0 (both hold exactly)
    return U0, (lambda p: project_out(off_span(p, B), V) @ Q.T), notes + gap_notes


def _turn_end_directions(w: TailWeights, pb: FtpoProblem, cfg: FtpoConfig):
    """(B [n, k] or None, notes): turn_end_basis at the solver's real turn ends (its turn-end anchors: the
    background and train documents' rows whose target is <|im_end|>), at most n // 8 directions."""
    if pb.anchors is None or not pb.anchors.P or cfg.turn_end_energy <= 0:
        return None, []
    ends = [i for i, g in enumerate(pb.anchor_group) if g == names.IM_END]
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


STOP_TARGET = "target met"
TREND_EVALS = 10  # evaluations the trend at a step cap is fitted on


def residual_trend(steps: list[int], res: list[float]) -> float:
    """d log(residual) / d step over the last TREND_EVALS evaluations (least squares, f64; 0 with fewer than 3)."""
    x, y = np.asarray(steps[-TREND_EVALS:], float), np.log(np.maximum(np.asarray(res[-TREND_EVALS:], float), 1e-300))
    if len(x) < 3 or np.ptp(x) == 0:
        return 0.0
    return float(np.polyfit(x, y, 1)[0])


def phrase_stops(history: list[dict], best_step: int, best_res: dict[str, float], target: float, stopped: str,
                 kl_used: float, near: float = 0.8) -> dict[str, str]:
    """phrase -> why it stands where the kept candidate left it: `target met`; else the judge's condition that
    rejected the later candidates which had removed more of it (the most frequent; BIND_*), else the KL budget when
    the kept candidate used ≥ `near` of it, else the stop (step cap / time budget) with the residual's trend over
    the last evaluations and, when it still falls, the steps it would take at that rate. history: the judge's
    evaluations (with train/dev residuals and `inadmissible`), in order."""
    evals = [h for h in history if "train_residual" in h]
    out = {}
    for ph, r_best in best_res.items():
        if r_best <= target:
            out[ph] = STOP_TARGET
            continue
        why: dict[str, int] = {}
        for h in evals:
            r = at_target_residuals(h["train_residual"], h["dev_residual"]).get(ph, 1.0)
            if h["step"] > best_step and r < r_best:
                for b in h.get("inadmissible", ()):
                    why[b] = why.get(b, 0) + 1
        if why:
            b = max(sorted(why), key=why.get)
            out[ph] = f"{b} binds ({why[b]} later candidates with more removal rejected)"
            continue
        if kl_used >= near:
            out[ph] = f"{BIND_KL} binds (kept candidate at {kl_used:.0%} of it)"
            continue
        xs = [h["step"] for h in evals]
        ys = [at_target_residuals(h["train_residual"], h["dev_residual"]).get(ph, 1.0) for h in evals]
        slope = residual_trend(xs, ys)
        if math.expm1(100 * slope) < -1e-3:  # falling by more than 0.1 % per 100 steps
            more = math.log(target / r_best) / slope
            out[ph] = (f"{stopped}: still falling ({math.expm1(100 * slope):+.1%} per 100 steps; about "
                       f"{more:.0f} more steps to the target at that rate); no constraint binds")
        else:
            out[ph] = f"{stopped}: no longer falling; no constraint binds"
    return out


def _result(judge: _Judge, history: list[dict], stopped: str, step: int, pb: FtpoProblem, w: TailWeights):
    t = pb.target_residual
    if judge.best is None:
        return FtpoResult(torch.zeros(w.n, w.f, device=w.device), 0, history, rec.STOP_BUDGET, 0.0, {}, {},
                          ["convergence: no candidate within the KL budget; ΔW = 0"])
    _, bstep, bdW, bkl, bdv, btr = judge.best
    at = at_target_residuals(btr, bdv)
    stops = phrase_stops(history, bstep, at, t, stopped, bkl / pb.kl_budget)
    notes = []
    if stopped != rec.STOP_CONVERGED:
        short = {p: round(v, 4) for p, v in at.items() if v > t}
        notes.append(f"convergence: stopped by {stopped} at step {step}; kept the candidate of step {bstep} "
                     f"(exact KL {bkl:.3g} ≤ budget {pb.kl_budget:.3g}); phrases short of the target residual {t:g} "
                     f"(residual at the stop): {short or 'none'}")
        notes += [f"convergence: {p!r} at {at[p]:.3g}: {stops[p]}" for p in short]
    return FtpoResult(bdW, bstep, history, stopped, bkl, bdv, btr, notes, phrase_stops=stops)
