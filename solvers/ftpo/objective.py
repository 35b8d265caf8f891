"""FTPO's objective L(ΔW) (the package docstring): its terms as pure functions of logits / log-probs, the
base-model row sets they act on, and `_Objective`, their weighted sum at chosen background rows."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

from l47.model.weights import TailWeights
from l47.solvers.batch import Batch, batch_cat, batch_mix, batch_rows, event_logps
from l47.solvers.ftpo.config import FtpoConfig, FtpoProblem
from l47.tail.forward import (DEFAULT_CHUNK, head_stats, kl_from, kl_reference, logits_at, logp_at, streamed_lse,
                              streamed_lse_without)


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


def vocab_log_odds(mix: torch.Tensor, w: TailWeights, r: torch.Tensor, special: torch.Tensor,
                   chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """o = z_r − log Σ_{v ∉ {r} ∪ special} exp z_v per row [R] (f64): the log-odds of r against every ordinary
    token (mass that leaves r for a special token is no progress: bar (f)). mix [R, n], r [R], special [ks]."""
    drop = torch.cat([r[:, None], special.to(r.device).expand(r.shape[0], -1)], 1)  # [R, 1 + ks]
    return logits_at(mix, w, r[:, None])[:, 0].double() - streamed_lse_without(mix, w, drop, chunk)


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


def soft_anchor(dlp: torch.Tensor, tol: torch.Tensor, knee: float = math.inf) -> torch.Tensor:
    """Huber in tolerances per anchor [P]: x = Δℓ/tol costs x² within |x| ≤ knee, then 2·knee·|x| − knee² (linear,
    the same slope at the knee). A change of one tolerance costs 1, both ways (a turn end that rises makes the
    turn-end token rise at the near-ties around it, seed §6.1); knee = inf is the plain square."""
    x = dlp / tol
    if math.isinf(knee):
        return x ** 2
    a = x.abs()
    return torch.where(a <= knee, x ** 2, 2 * knee * a - knee * knee)


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
        self.terms = self._terms()  # the flip guard's weight doubles whenever a candidate flips a dev row
        self.event_on = torch.ones(ev_group.numel(), device=w.device)  # [E] 0 where an event stopped pulling (pulling)
        self.special = terms.special.to(dev_)
        with torch.no_grad():
            mix0_ev = batch_mix(ev, w)
            self.base = event_logps(mix0_ev, w, terms)
            self.p0_ev = self.base["rejected"].double().exp().cpu().numpy()  # [E]
            self.need = torch.as_tensor(needed_drop(self.p0_ev, cfg.aim * pb.target_residual), device=dev_)  # [E]
            self.lm0_special_ev = torch.logsumexp(self.base["special"], 1)  # [E] log Σ_s p⁰_s (−inf without specials)
            # the background's base rows x⁰ [B, n], lse⁰ [B] (by the pass the step's own lse takes: the fused one on
            # CUDA) and μ⁰ [B, n]: the step's and the judge's KL, the special-mass guard, the plausible turn ends
            self.ref_bg = kl_reference(batch_mix(pb.background, w), w)[0]
            self.lm0_special = (self._log_special_mass(self.ref_bg.mix0, self.ref_bg.lse0)
                                if self.special.numel() else None)  # [B]
            self.lm0_special_guard = self.log_special_at(pb.guard) if self.guards else None  # [G]
            self.pe_rows, self.lp0_pe, self.notes = self._plausible_ends(w, pb, cfg)
            self.lp0_an = self.an_group = self.an_tol = None
            if pb.anchors is not None and pb.anchors.P:
                self.lp0_an = logp_at(batch_mix(pb.anchors, w), w, pb.anchors.target)  # [A]
                gi = {g: i for i, g in enumerate(sorted(set(pb.anchor_group)))}
                self.an_group = torch.as_tensor([gi[g] for g in pb.anchor_group], device=dev_)
                self.an_tol = torch.as_tensor(pb.anchor_tol, dtype=torch.float32, device=dev_)
                self.an_word = torch.as_tensor(pb.word_anchors(), device=dev_)  # [A] bool
        self.odds_an, self.odds_pe, self.an_end_pos = self._end_odds(w, pb, cfg)
        self.leads = self._end_leads(w, pb, cfg)
        self.an_rows = _Rotation(0 if self.lp0_an is None else pb.anchors.P, cfg.anchor_batch, cfg.seed + 1, dev_)
        self.pe_rot = _Rotation(0 if self.pe_rows is None else self.pe_rows.numel(), cfg.anchor_batch, cfg.seed + 2, dev_)
        self.teth_ev = _Tether(ev, w, terms.rejected, self.special, cfg.tether_topk)
        with torch.no_grad():
            self.o0 = self.odds(mix0_ev, self.teth_ev.z0)  # [E]
        self.teth_near = (_Tether(pb.near, w, pb.near_banned, self.special, cfg.tether_topk)
                          if pb.near is not None and pb.near.P else None)
        ends = pb.turn_end_rows()
        tie_rows = [pb.background] + ([batch_rows(pb.anchors, torch.as_tensor(ends, device=dev_))] if ends else [])
        self.ties = (_NearTies(tie_rows, w, self.special, cfg.flip_margin)
                     if self.special.numel() and cfg.lambda_flip > 0 else None)

    def _plausible_ends(self, w: TailWeights, pb: FtpoProblem, cfg: FtpoConfig):
        """(rows [N] into the background, their base log p(<|im_end|>) [N] f32, notes): the background rows where
        the turn may end — base p(<|im_end|>) ≥ plausible_end_p, the target not <|im_end|> itself (those are the real
        turn ends) — at most plausible_end_rows of them, the most likely first. (None, None, []) when off or none."""
        if pb.im_end is None or cfg.plausible_end_p <= 0 or cfg.plausible_end_rows <= 0:
            return None, None, []
        mix0, lse0 = self.ref_bg.mix0, self.ref_bg.lse0  # [B, n], [B]
        ids = torch.full((mix0.shape[0], 1), int(pb.im_end), device=mix0.device)
        lp = (logits_at(mix0, w, ids)[:, 0].double() - lse0)  # [B] f64
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
            ends = pb.turn_end_rows()
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
        ends = pb.turn_end_rows() if self.lp0_an is not None else []
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
        dlp = logp_at(mix, self.w, pb.anchors.target[a]) - self.lp0_an[a]  # [a]
        word = self.an_word[a]  # [a] the collateral words' anchors: Huber past the knee; the turn ends: the square
        cost = torch.where(word, soft_anchor(dlp, self.an_tol[a], self.cfg.anchor_knee), soft_anchor(dlp, self.an_tol[a]))
        if self.an_end_pos is not None:
            pos = self.an_end_pos[a]
            m = pos >= 0
            if bool(m.any()):
                cost = cost.index_add(0, torch.nonzero(m)[:, 0], self._odds_cost(self.odds_an, mix[m], pos[m]))
        return cost, a

    @property
    def guards(self) -> bool:
        """Slop events of the background documents to hold Σ p(special) at (and special tokens to hold)."""
        return self.pb.guard is not None and self.pb.guard.P > 0 and self.special.numel() > 0

    def log_special_at(self, b: Batch, dW: torch.Tensor | None = None, W_sd: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """log Σ_s p_s per row [P] of a batch under ΔW (or the runtime W_sd), f64."""
        mix = batch_mix(b, self.w, dW=dW, W_sd=W_sd)  # [P, n]
        return self._log_special_mass(mix, streamed_lse(mix, self.w))

    def _log_special_mass(self, mix: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """log Σ_s p_s per row [B] given the rows' log-sum-exp."""
        ids = self.special.expand(mix.shape[0], -1)
        return torch.logsumexp(logits_at(mix, self.w, ids), 1).double() - lse

    def step_kl(self, mix: torch.Tensor, rows: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """KL(p⁰ ‖ p) per background row [m] for the step (f64): lse − lse⁰ − μ⁰·(mix − mix⁰) (`kl_from`, the
        judge's `kl_against` on the same KlReference). Its gradient −μ⁰ + μ is exact; its value carries the two
        f32 lse's rounding (~ε₃₂·|z|, on the demo model 1.5e-6 nats mean, 1.0e-5 max per row), as the judge's does
        (the former Σp⁰log p⁰ − μ⁰·mix + lse carried the entropy accumulator's f32 row-dot error instead: +9e-5 nats
        mean, 6.6e-4 max per row on the demo's background at its bundle, against the f64 KL 4.4e-4)."""
        r = self.ref_bg
        return kl_from(lse, mix, r.lse0[rows], r.mix0[rows], r.mu0[rows])

    # the terms' orders as the landed code has them: the forward builds them in EVAL_ORDER (the shared rows first),
    # the loss adds them in SUM_ORDER, the step's parts list PARTS; float sums and autograd's accumulation follow
    # these orders, and the record's bytes follow them (tests/test_ftpo_terms.py re-derives each term alone)
    EVAL_ORDER = ("pref", "kl_step", "special", "cond_kl", "coll", "flip")
    SUM_ORDER = ("pref", "kl_step", "cond_kl", "flip", "coll", "special", "ridge")
    PARTS = ("pref", "kl_step", "cond_kl", "coll", "special", "flip")

    def _terms(self) -> dict[str, Term]:
        """name -> Term: the loss is Σ weighted(cost) over them (module docstring of l47.solvers.ftpo)."""
        cfg, budget = self.cfg, self.pb.kl_budget
        return {
            "pref": Term("pref", None, None, self._pref_cost),  # the target hinge (or the margin term)
            "kl_step": Term("kl_step", cfg.lambda_kl, budget, self._kl_cost),  # λ doubled by the trainer
            "special": Term("special", cfg.lambda_special, None, self._special_cost),
            "cond_kl": Term("cond_kl", None, budget, self._cond_cost),  # λ_shape, λ_cond inside
            "coll": Term("coll", cfg.lambda_coll, None, self._coll_cost),
            "flip": Term("flip", cfg.lambda_flip, None, self._flip_cost),  # doubled by the trainer on a flip
            "ridge": Term("ridge", cfg.lambda_ridge, self.W_sq, self._ridge_cost),
        }

    @property
    def lam_flip(self) -> float:
        return self.terms["flip"].weight

    @lam_flip.setter
    def lam_flip(self, v: float) -> None:
        self.terms["flip"].weight = v

    def __call__(self, dW: torch.Tensor, rows: torch.Tensor, lam: float) -> tuple[torch.Tensor, dict]:
        """(loss, its parts as floats) at ΔW [n, f] with the background rows `rows` [m]; λ = `lam`."""
        self.terms["kl_step"].weight = lam
        return self.loss(Step(self, dW, rows))

    def loss(self, st: Step) -> tuple[torch.Tensor, dict]:
        """(loss, its parts as floats) of a step's forward: the terms' costs (EVAL_ORDER first), weighted and summed
        in SUM_ORDER."""
        cost = {k: self.terms[k].cost(st) for k in self.EVAL_ORDER}
        loss = None
        for k in self.SUM_ORDER:
            c = cost[k] if k in cost else self.terms[k].cost(st)
            x = self.terms[k].weighted(c)
            loss = x if loss is None else loss + x
        parts = {"loss": loss, **{k: cost[k] for k in self.PARTS}}
        return loss, {k: float(v.detach()) for k, v in parts.items()}

    # ---- each term's cost at a step (unweighted)

    def odds(self, mix: torch.Tensor, z_s: torch.Tensor) -> torch.Tensor:
        """The events' log-odds o [E] (f64) the target hinge moves: against every ordinary token
        (`vocab_log_odds`, odds = "vocabulary") or against the base top-K only (`log_odds`, "top_k"). mix [E, n],
        z_s [E, K] the logits of the tether's ids."""
        r = self.pb.terms.rejected
        if self.cfg.odds == "vocabulary":
            return vocab_log_odds(mix, self.w, r, self.special)
        return log_odds(logits_at(mix, self.w, r[:, None])[:, 0], z_s, self.teth_ev.keep)

    def _pref_cost(self, st: Step) -> torch.Tensor:
        """Target: mean over phrases of the mean over their pulling events of target_hinge (nats); margin: the
        seed's preference term τ·softplus((Δ(ℓ_r − ℓ_c) + margin·scale)/τ), mean over events and chosen."""
        cfg, terms, w = self.cfg, self.pb.terms, self.w
        if cfg.objective == "target":
            o = self.odds(st.mix, st.z_s)  # [E]
            return per_group_mean(target_hinge(o - self.o0, self.need, cfg.taper) * self.event_on,
                                  self.ev_group).float()
        lp = st.lp
        gap = (lp["rejected"] - self.base["rejected"])[:, None] - (lp["chosen"] - self.base["chosen"])  # [E, kc]
        return (cfg.taper * F.softplus((gap + cfg.margin * terms.scale[:, None]) / cfg.taper)).mean()

    def _kl_cost(self, st: Step) -> torch.Tensor:
        """Mean KL(p⁰ ‖ p) over the step's background rows (step_kl; nats)."""
        return self.step_kl(st.mix_bg, st.rows, st.lse_bg).mean().float()

    def _special_cost(self, st: Step) -> torch.Tensor:
        """No rise of log Σ p(special) at the events, nor in the step's background (nats, means). In nats like the
        hinge: lowering a near-certain token r multiplies every other token's p, the special tokens' included
        (×(1 − p′_r)/(1 − p_r), ~450 for p_r 0.998 → 0.1), so the guard asks their logits down about as far as r's.
        On the mass itself (ΔΣ p_s / special_rise_tol, 1e-6) its gradient was ~10⁶ the hinge's wherever one event
        rose, Adam's normalised step followed the guard alone and near-certain phrases stalled (zoo 65167 on an
        H100: two at 0.98–1.00 after 1000 steps, the guard cancelling 52–66 % of their pull). Bar (f)'s own figure,
        the mean mass's rise at the train and dev events (and at the slop events the background documents hold:
        one more term here), is the judge's (BIND_SPECIAL): λ_special doubles while
        a candidate breaks it and comes back down when they hold (the trainer's `control`)."""
        if not self.special.numel():
            return st.mix.new_zeros(())
        rise = F.relu(torch.logsumexp(st.lp["special"], 1) - self.lm0_special_ev)  # [E] nats
        cost = (rise.mean()
                + F.relu(self._log_special_mass(st.mix_bg, st.lse_bg) - self.lm0_special[st.rows]).mean().float())
        if self.guards:  # the background documents' own slop events: bar (f) reads them as a split of their own
            cost = cost + F.relu(self.log_special_at(self.pb.guard, dW=st.dW) - self.lm0_special_guard).mean().float()
        return cost

    def _cond_cost(self, st: Step) -> torch.Tensor:
        """λ_shape × the conditional tether KL at events (the freed mass's shape) + λ_cond × it at near misses (the
        natural continuation keeps its share)."""
        cfg, pb, w = self.cfg, self.pb, self.w
        cond = (cfg.lambda_shape * self.teth_ev.kl(st.mix, w, st.z_s).mean().float() if cfg.lambda_shape
                else st.mix.new_zeros(()))
        if self.teth_near is not None:
            cond = cond + cfg.lambda_cond * self.teth_near.kl(batch_mix(pb.near, w, dW=st.dW), w).mean().float()
        return cond

    def _coll_cost(self, st: Step) -> torch.Tensor:
        """The soft anchors: mean over groups (the collateral words, the turn ends, the plausible turn ends, the
        runner-ups' leads) of the mean cost within each."""
        pb, cfg, w, dW = self.pb, self.cfg, self.w, st.dW
        coll, ng = st.mix.new_zeros(()), 0  # mean over anchor groups; ng groups so far
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
        return coll

    def _flip_cost(self, st: Step) -> torch.Tensor:
        """The near-tie guard (_NearTies): Σ (shrink of the gap / its base size)²."""
        return self.ties.cost(self.w, st.dW) if self.ties is not None and self.ties.n else st.mix.new_zeros(())

    def _ridge_cost(self, st: Step) -> torch.Tensor:
        """‖ΔW‖² (its norm: ‖W‖²)."""
        return st.dW.pow(2).sum()


# what each term of the loss is, in words (the record's pull balance names the terms so)
TERM_MEANING = {"kl_step": "the background KL penalty", "special": "the special-mass guard",
                "cond_kl": "the near-miss tether", "coll": "the soft anchors", "flip": "the near-tie guard",
                "ridge": "the ridge"}


def pull_balance(obj: _Objective, dW_of, param: torch.Tensor, rows: torch.Tensor,
                 mask: torch.Tensor) -> dict[str, float]:
    """term -> the share of one phrase's pull that the term's gradient cancels at `param`: −⟨∇ term, ∇ pull⟩ /
    ‖∇ pull‖², where the pull is the phrase's part of the target hinge (the `pref` term with only its events on:
    `mask` [E] 0/1; every event of a phrase short of its target pulls) and each term enters weighted as in the loss (λ as the trainer left it), at the background rows
    `rows`. A share > 0 opposes the pull; where the phrase stands still with no constraint binding the shares
    sum to about 1 (plain gradients, not Adam's scaled step: a diagnosis, not the step). {} when the phrase
    pulls no more (its pull's gradient is 0)."""
    p = param.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        st = Step(obj, dW_of(p), rows)
        on = obj.event_on
        obj.event_on = mask
        try:
            pull = obj.terms["pref"].weighted(obj.terms["pref"].cost(st))
        finally:
            obj.event_on = on
        g = torch.autograd.grad(pull, p, retain_graph=True)[0].double()
        gg = float((g * g).sum())
        if gg <= 0:
            return {}
        out = {}
        for k in obj.SUM_ORDER:
            if k == "pref":
                continue
            c = obj.terms[k].weighted(obj.terms[k].cost(st))
            if not c.requires_grad:
                continue
            gk = torch.autograd.grad(c, p, retain_graph=True, allow_unused=True)[0]
            if gk is not None:
                out[k] = -float((gk.double() * g).sum()) / gg
    return out


@dataclass
class Term:
    """One term of FTPO's loss: its name (the step's parts), weight λ (None: enters as it is; the trainer raises
    the KL's and the flip guard's), norm (a divisor: the KL budget, ‖W‖²; None: none) and cost (unweighted, at a
    Step). Its share of the loss is weight · cost / norm."""

    name: str
    weight: float | None
    norm: float | None
    cost: Callable[[Step], torch.Tensor]

    def weighted(self, c: torch.Tensor) -> torch.Tensor:
        x = c if self.weight is None else self.weight * c
        return x if self.norm is None else x / self.norm


class Step:
    """What one step's terms share: ΔW, the background rows, the events' forward (built first) and the background
    rows' forward with its one vocabulary pass (built when a term first needs it)."""

    def __init__(self, obj: _Objective, dW: torch.Tensor, rows: torch.Tensor):
        self.obj, self.dW, self.rows = obj, dW, rows
        self.mix = batch_mix(obj.pb.events, obj.w, dW=dW)  # [E, n]
        self.lp = event_logps(self.mix, obj.w, obj.pb.terms)
        self.z_s = logits_at(self.mix, obj.w, obj.teth_ev.ids)  # [E, K]

    @cached_property
    def mix_bg(self) -> torch.Tensor:
        return batch_mix(batch_rows(self.obj.pb.background, self.rows), self.obj.w, dW=self.dW)  # [m, n]

    @cached_property
    def lse_bg(self) -> torch.Tensor:
        return streamed_lse(self.mix_bg, self.obj.w)  # [m] the one vocabulary pass of the background rows


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
