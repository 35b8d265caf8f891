"""FTPO trainer on the exact tail forward (torch; CPU / CUDA / MPS): solve to a target within a KL budget.

Objective minimised over ΔW [n, f] by Adam with a floor (ℓ = log p, z = logits, Δ = edited − base, r the rejected final
token of event e, p⁰ base probabilities; every term is dimensionless, scaled by a quantity of the data or a bar):

    L(ΔW) =  mean_phrase mean_{e ∈ phrase} τ·softplus((Δo_e + d_e) / τ)                     target hinge (nats)
           + λ · mean_{b ∈ background} KL(p⁰_b ‖ p_b) / budget                              exact, full vocabulary
           + λ_cond · mean_{e ∈ events ∪ near misses} KL(q⁰_e ‖ q_e) / budget               only r's mass moves
           + λ_coll · mean_group mean_{a ∈ group} (min(Δℓ_a, 0) / tol_group)²                soft anchors
           + λ_special · mean_e max(Δ Σ_s p_s, 0) / tol_special                               no special-token rise
           + λ_special · mean_{b ∈ background} max(Δ log Σ_s p_s, 0)                         ... anywhere (flips)
           + λ_ridge · ‖ΔW‖² / ‖W‖²
  o_e = z_r − log Σ_{v ∈ S_e} exp z_v, the log-odds of r against S_e (the base top-K without r and the special
  tokens): it never saturates (∂o/∂z_r = 1 where ∂ℓ_r/∂z_r = 1 − p_r ≈ 0 at a near-certain token), and as
  S_e ⊂ V∖{r} it bounds the exact log-odds from above, so its drop tracks theirs while the tether below keeps
  the shares inside V∖{r}. d_e = logit(p⁰_e) − logit(aim·t·p⁰_e) ≥ 0 is the log-odds drop the aim needs (f64).
  t = target_residual, aim < 1 (train events aim beyond the target: held-out events follow train only in part);
  budget = the solve's mean background KL budget; q = p restricted to the base top-K at the row without the
  banned token(s) and the special tokens, renormalised (at a near miss the natural continuation keeps its share,
  at an event the freed mass spreads as the base spreads it); groups are the collateral words, tol_word = |bar
  (d)'s word mean|, and the real turn ends, tol = |bar (f)'s mean Δlog p(<|im_end|>)|; tol_special is bar (f)'s
  allowed rise of Σ p(special) at slop positions (a hinge on the log-probs instead held the special tokens'
  SHARE of the freed mass at zero: a near-certain token could then not lose its mass at all).
  The "margin" objective (expert option) replaces the target hinge by the seed's preference term
  τ·softplus((Δ(ℓ_r − ℓ_c) + margin·scale_e)/τ) against chosen natural alternatives c.

The step is Adam's with ε = floor × RMS over the matrix of √v̂: scale-free like Adam where the gradient is large,
gradient descent where it is far below the matrix's RMS (plain Adam moves an entry whose gradient is noise by a
full step, in directions of hh unseen contexts use: on the second model its KLD on JSON documents was 25× the
background KL; one second moment for the whole matrix kept ΔW in the gradient's span but was too slow).
Each step uses a rotating subset of the background (`background_batch` positions); every `eval_every` steps the
candidate ΔW is re-quantised (when a `shipped` map is given, as it ships) and measured EXACTLY: mean KL over the
whole background, train and dev residual per phrase. λ doubles whenever the exact KL exceeds the budget (it is
never lowered: a budget far from binding is no licence to spend it; the KLD domains and the held-out chat are
not in the background, and on the second model they moved 100–300× more than it). Kept:
the candidate within the budget with the most dev removal (mean over phrases of log max(residual, t)); among
those reaching t on every phrase, the least KL. Stops when every phrase's dev (else train) residual reaches t
within the budget (converged), at the step cap, or at the time budget. Precision: f32 forward/backward, f64
vocabulary reductions (l47.tail.stream), f64 means of the measured figures.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from l47.data import record as rec
from l47.model.weights import TailWeights
from l47.solvers.batch import Batch, EventTerms, batch_mix, event_logps
from l47.tail.forward import head_stats, logits_at, logp_at, streamed_kl, streamed_lse

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
    key_rank: int = 8  # per phrase: ΔW = U·Qᵀ acts on the phrase's key directions only (0: every direction of f)
    steps: int = 400
    lambda_kl: float = 1.0  # initial λ on background KL / budget; doubled whenever the exact KL exceeds the budget
    lambda_cond: float = 1.0  # weight of the conditional tether KL / budget at events and near misses
    lambda_coll: float = 4.0
    lambda_special: float = 1.0
    lambda_ridge: float = 0.0
    tether_topk: int = 32  # K of the conditional tether at events and near misses
    background_batch: int = 512  # background positions per step (rotating); the exact KL uses all of them
    eval_every: int = 10
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
    special_tol: float = 1e-6  # rise of Σ p(special) at an event that costs λ_special (bar (f)'s tolerance)
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

    def summary(self) -> dict:
        return {"best_step": self.best_step, "stopped": self.stopped, "kl_exact": self.kl_exact,
                "dev_residual": self.dev_residual, "train_residual": self.train_residual, "history": self.history,
                "notes": self.notes}

    def convergence(self, target: float) -> rec.Convergence:
        """Max violation: nats by which the worst phrase's dev (else train) residual exceeds the target."""
        res = self.dev_residual or self.train_residual
        worst = max((math.log(max(v, 1e-300) / target) for v in res.values()), default=0.0)
        return rec.Convergence(stop_reason=self.stopped, max_violation=max(0.0, worst), violation_tol=0.0,
                               iterations=len(self.history) and self.history[-1]["step"])


# ----------------------------------------------------------------------------------------------------------
# terms (pure functions of logits / log-probs)


def needed_drop(p0: np.ndarray, ratio: float) -> np.ndarray:
    """d = logit(p⁰) − logit(ratio·p⁰) [E] (nats, f64): the log-odds drop that takes p⁰ to ratio·p⁰. 1 − p⁰ is
    floored at 1e-6 (the f32 logits resolve p⁰ no closer to 1)."""
    p0 = np.asarray(p0, dtype=np.float64)
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


def _phrase_residuals(p0: np.ndarray, p1: np.ndarray, phrase: list[str]) -> dict[str, float]:
    """phrase -> Σ p1 / Σ p0 over its events (f64)."""
    out: dict[str, float] = {}
    for ph in sorted(set(phrase)):
        m = np.array([x == ph for x in phrase])
        out[ph] = float(p1[m].sum() / max(p0[m].sum(), 1e-300))
    return out


def _removal_score(res: dict[str, float], target: float) -> float:
    """Mean over phrases of log max(residual, target): lower is more removal; every phrase at target = log t."""
    return float(np.mean([math.log(max(v, target)) for v in res.values()])) if res else 0.0


def train_ftpo(w: TailWeights, pb: FtpoProblem, cfg: FtpoConfig = FtpoConfig(), progress=None) -> FtpoResult:
    """Minimise L(ΔW) (module docstring) by Adam with a floor; keep the best dev candidate within the KL budget."""
    if cfg.objective not in OBJECTIVES:
        from l47.errors import L47Error

        raise L47Error("solver.ftpo", "objective", f"one of {OBJECTIVES}", repr(cfg.objective))
    t_start = time.monotonic()
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    dev_ = w.device
    W_rms = float(w.W_sd.pow(2).mean().sqrt())
    W_sq = float(w.W_sd.pow(2).sum())
    ev, terms, t, budget = pb.events, pb.terms, pb.target_residual, pb.kl_budget
    ph_ids = {p: i for i, p in enumerate(sorted(set(pb.phrase)))}
    ev_group = torch.as_tensor([ph_ids[p] for p in pb.phrase], device=dev_)
    if cfg.key_rank > 0:
        Q = key_basis(ev.hh, ev_group, pb.background.hh, cfg.key_rank).float()  # [f, K]
        param = torch.zeros(w.n, Q.shape[1], device=dev_, requires_grad=True)  # U [n, K]

        def dW_of(p):
            return p @ Q.T  # [n, f]
    else:
        param = torch.zeros(w.n, w.f, device=dev_, requires_grad=True)

        def dW_of(p):
            return p
    mom, vv = torch.zeros_like(param), torch.zeros_like(param)
    with torch.no_grad():
        mix0_ev = batch_mix(ev, w)
        base = event_logps(mix0_ev, w, terms)
        p0_ev = base["rejected"].double().exp().cpu().numpy()  # [E]
        need = torch.as_tensor(needed_drop(p0_ev, cfg.aim * t), device=dev_)  # [E] f64
        mass0_special = base["special"].exp().sum(1)  # [E] Σ_s p⁰_s
        mix0_bg = batch_mix(pb.background, w)
        lm0_special = (torch.logsumexp(logits_at(mix0_bg, w, terms.special.to(dev_).expand(pb.background.P, -1)), 1)
                       - streamed_lse(mix0_bg, w)) if terms.special.numel() else None  # [B] log Σ_s p⁰_s
        dev_p0 = None
        if pb.dev is not None:
            dev_p0 = np.exp(head_stats(batch_mix(pb.dev, w), w, pb.dev_final.cpu().numpy()).logp_target)
        lp0_an = an_group = an_tol = None
        if pb.anchors is not None and pb.anchors.P:
            lp0_an = logp_at(batch_mix(pb.anchors, w), w, pb.anchors.target)
            gi = {g: i for i, g in enumerate(sorted(set(pb.anchor_group)))}
            an_group = torch.as_tensor([gi[g] for g in pb.anchor_group], device=dev_)
            an_tol = torch.as_tensor(pb.anchor_tol, dtype=torch.float32, device=dev_)
    special = terms.special.to(dev_)
    teth_ev = _Tether(ev, w, terms.rejected, special, cfg.tether_topk)
    with torch.no_grad():
        o0 = log_odds(logits_at(mix0_ev, w, terms.rejected[:, None])[:, 0], teth_ev.z0, teth_ev.keep)  # [E]
    teth_near = (_Tether(pb.near, w, pb.near_banned, special, cfg.tether_topk)
                 if pb.near is not None and pb.near.P else None)
    P_bg = pb.background.P
    lam = cfg.lambda_kl
    best = None  # (key, step, dW, kl, dev_res, train_res)
    history: list[dict] = []
    stopped = rec.STOP_ITERATION_CAP
    step = 0
    perm = torch.randperm(P_bg, generator=gen)
    cursor = 0

    def bg_rows() -> torch.Tensor:
        nonlocal perm, cursor
        m = min(cfg.background_batch, P_bg)
        if cursor + m > P_bg:
            perm, cursor = torch.randperm(P_bg, generator=gen), 0
        rows = perm[cursor: cursor + m]
        cursor += m
        return rows.to(dev_)

    def sub(b: Batch, rows: torch.Tensor) -> Batch:
        return Batch(R=b.R[rows], inj=b.inj[rows], hh=b.hh[rows], sgv=b.sgv[rows], yr=b.yr[rows],
                     target=b.target[rows], doc=(), pos=())

    for step in range(0, cfg.steps + 1):
        # ---- evaluate the current ΔW exactly (as shipped) every eval_every steps, before updating it
        if step % cfg.eval_every == 0 or step == cfg.steps:
            with torch.no_grad():
                dWd = dW_of(param.detach())
                Wq = pb.shipped(dWd) if pb.shipped is not None else w.W_sd + dWd
                kl = float(streamed_kl(batch_mix(pb.background, w, W_sd=Wq), mix0_bg, w).double().mean())
                p1_ev = np.exp(head_stats(batch_mix(ev, w, W_sd=Wq), w, terms.rejected.cpu().numpy()).logp_target)
                tr = _phrase_residuals(p0_ev, p1_ev, pb.phrase)
                dv = {}
                if pb.dev is not None:
                    p1 = np.exp(head_stats(batch_mix(pb.dev, w, W_sd=Wq), w, pb.dev_final.cpu().numpy()).logp_target)
                    dv = _phrase_residuals(dev_p0, p1, pb.dev_phrase)
            judge = {**tr, **dv}  # dev where a phrase has dev events, else train
            key = (_removal_score(judge, t), kl)
            info = {"step": step, "kl_exact": kl, "lambda": lam, "train_residual": tr, "dev_residual": dv}
            if history and "loss" in history[-1] and history[-1]["step"] == step:
                info["loss"] = history[-1]["loss"]
            history.append(info)  # no wall time in the record: the same inputs write the same bytes
            if progress is not None:
                progress({**info, "elapsed_s": round(time.monotonic() - t_start, 2)})
            if kl <= budget and (best is None or key < best[0]):
                best = (key, step, dWd.clone(), kl, dv, tr)
            if kl > budget:
                lam = min(lam * 2.0, 1e6)

            reached = all(v <= t for v in judge.values())
            if reached and kl <= budget and step > 0:
                stopped = rec.STOP_CONVERGED
                break
            if cfg.time_budget_s > 0 and time.monotonic() - t_start > cfg.time_budget_s:
                stopped = rec.STOP_TIME
                break
        if step == cfg.steps:
            break
        # ---- one Adam step
        param.grad = None
        dW = dW_of(param)
        mix = batch_mix(ev, w, dW=dW)
        lp = event_logps(mix, w, terms)
        z_s = logits_at(mix, w, teth_ev.ids)  # [E, K]
        if cfg.objective == "target":
            o = log_odds(logits_at(mix, w, terms.rejected[:, None])[:, 0], z_s, teth_ev.keep)
            pref = per_group_mean(target_hinge(o - o0, need, cfg.taper), ev_group).float()
        else:
            gap = (lp["rejected"] - base["rejected"])[:, None] - (lp["chosen"] - base["chosen"])  # [E, kc]
            pref = (cfg.taper * F.softplus((gap + cfg.margin * terms.scale[:, None]) / cfg.taper)).mean()
        rows = bg_rows()
        mix_bg = batch_mix(sub(pb.background, rows), w, dW=dW)
        kl_bg = streamed_kl(mix_bg, mix0_bg[rows], w).mean()
        if special.numel():  # no rise of the special tokens' total log-probability anywhere in the background
            lm = torch.logsumexp(logits_at(mix_bg, w, special.expand(len(rows), -1)), 1) - streamed_lse(mix_bg, w)
            bg_special = F.relu(lm - lm0_special[rows]).mean()
        else:
            bg_special = mix.new_zeros(())
        cond = teth_ev.kl(mix, w, z_s)  # [E]
        if teth_near is not None:
            cond = torch.cat([cond, teth_near.kl(batch_mix(pb.near, w, dW=dW), w)])
        kl_term = kl_bg / budget
        coll = mix.new_zeros(())
        if lp0_an is not None:
            dlp = logp_at(batch_mix(pb.anchors, w, dW=dW), w, pb.anchors.target) - lp0_an
            coll = per_group_mean(soft_anchor(dlp, an_tol), an_group)
        special_t = (F.relu(lp["special"].exp().sum(1) - mass0_special).mean() / pb.special_tol
                     if lp["special"].numel() else mix.new_zeros(())) + bg_special
        loss = (pref + lam * kl_term + cfg.lambda_cond * cond.mean().float() / budget + cfg.lambda_coll * coll + cfg.lambda_special * special_t
                + cfg.lambda_ridge * dW.pow(2).sum() / W_sq)
        loss.backward()
        with torch.no_grad():  # Adam with a floor: entries whose gradient is far below the matrix's RMS move
            g = param.grad  # in proportion to it (gradient descent) instead of by a full step
            k = step + 1
            mom.mul_(0.9).add_(g, alpha=0.1)
            vv.mul_(0.999).addcmul_(g, g, value=0.001)
            v_hat = vv / (1 - 0.999 ** k)
            floor = float(v_hat.double().mean().sqrt()) * cfg.floor
            lr = cfg.lr * W_rms * min(1.0, k / max(cfg.warmup, 1))
            param.sub_(lr * (mom / (1 - 0.9 ** k)) / (v_hat.sqrt() + floor + 1e-30))
        history.append({"step": step + 1, "loss": float(loss.detach()), "pref": float(pref.detach()),
                        "kl_step": float(kl_bg.detach()), "cond_kl": float(cond.mean().detach()),
                        "coll": float(coll.detach()), "special": float(special_t.detach())})
    history = [h for h in history if "kl_exact" in h or h["step"] % cfg.eval_every == 0]
    notes = []
    if best is None:
        notes.append("convergence: no candidate within the KL budget; ΔW = 0")
        return FtpoResult(torch.zeros(w.n, w.f, device=dev_), 0, history, rec.STOP_BUDGET, 0.0, {}, {}, notes)
    _, bstep, bdW, bkl, bdv, btr = best
    if stopped != rec.STOP_CONVERGED:
        short = [p for p, v in {**btr, **bdv}.items() if v > t]
        notes.append(f"convergence: stopped by {stopped} at step {step}; kept the candidate of step {bstep} "
                     f"(exact KL {bkl:.3g} ≤ budget {budget:.3g}); phrases short of the target residual {t:g}: "
                     f"{short or 'none'}")
    return FtpoResult(bdW, bstep, history, stopped, bkl, bdv, btr, notes)
