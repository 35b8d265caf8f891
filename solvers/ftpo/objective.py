"""FTPO's objective L(ΔW) (the package docstring): its terms as pure functions of logits / log-probs, the
base-model row sets they act on, and `_Objective`, their weighted sum at chosen background rows."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from l47.model import names
from l47.model.weights import TailWeights
from l47.solvers.batch import Batch, batch_cat, batch_mix, batch_rows, event_logps
from l47.solvers.ftpo.config import FtpoConfig, FtpoProblem
from l47.tail.forward import head_stats, logits_at, logp_at, streamed_lse
from l47.tail.stream import stream_head


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
