"""FTPO trainer on the exact tail forward (torch; CPU / CUDA / MPS).

Objective minimised over ΔW [n, f] with AdamW:

    L(ΔW) =  mean_e mean_c τ·softplus((Δ(ℓ_r − ℓ_c) + margin·scale_e) / τ)      preference, tapered at the margin
           + λ_tether · mean_e Σ_{v ∈ top-K(p⁰_e) \\ r} p⁰_v (Δz_v − Δz̄_e)²        non-target tether at events
           + λ_kl · mean_t KL(p⁰_t ‖ p_t)                                         background (plain + chat)
           + λ_coll · mean_word mean_{a ∈ word} (Δℓ_a)²                            per-word collateral tether
           + λ_special · mean_e Σ_s relu(Δℓ_s)                                     special-token hinge
           + λ_ridge · ‖ΔW‖²_F
(ℓ = log p, z = logits, Δ = edited − base, r the rejected final token, c the chosen natural alternatives.)
Early stopping: the step with the best dev reduction of mean p(rejected) whose background KL is within the
budget is kept. Precision: f32 forward/backward, f64 reductions over the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from l47.tail.forward import logits_at, streamed_kl
from l47.model.weights import TailWeights
from l47.solvers.batch import Batch, EventTerms, batch_mix, event_logps


@dataclass(frozen=True)
class FtpoConfig:
    margin: float = 2.0
    taper: float = 0.25  # τ
    lr: float = 2e-3
    steps: int = 300
    weight_decay: float = 0.0
    lambda_tether: float = 0.5
    lambda_kl: float = 20.0
    lambda_coll: float = 20.0
    lambda_special: float = 5.0
    lambda_ridge: float = 1e-4
    tether_topk: int = 16
    kl_budget: float = 0.01
    eval_every: int = 10
    seed: int = 0


@dataclass(frozen=True)
class FtpoResult:
    dW: torch.Tensor
    best_step: int
    history: list[dict] = field(default_factory=list)
    stopped: str = ""

    def summary(self) -> dict:
        return {"best_step": self.best_step, "stopped": self.stopped, "history": self.history}


def train_ftpo(w: TailWeights, events: EventTerms, ev: Batch, background: Batch, anchors: Batch | None,
               anchor_word: list[int] | None, dev: tuple[Batch, torch.Tensor] | None, cfg: FtpoConfig = FtpoConfig(),
               progress=None) -> FtpoResult:
    """Minimise L(ΔW) (module docstring) with AdamW; keep the best dev step within the KL budget."""
    from l47.tail.forward import head_stats

    torch.manual_seed(cfg.seed)
    dev_ = w.device
    dW = torch.zeros(w.n, w.f, device=dev_, requires_grad=True)
    opt = torch.optim.AdamW([dW], lr=cfg.lr, weight_decay=cfg.weight_decay)
    with torch.no_grad():
        mix0_ev = batch_mix(ev, w)
        base = event_logps(mix0_ev, w, events)
        st0 = head_stats(mix0_ev, w, ev.target.cpu().numpy(), topk=cfg.tether_topk + 1)
        top = torch.as_tensor(st0.top_ids, device=dev_)  # [E, K+1]
        keep = top != events.rejected[:, None]
        p0 = torch.exp(torch.as_tensor(st0.top_logp)).float().to(dev_) * keep  # f64 exp on the CPU (MPS)
        z0_top = logits_at(mix0_ev, w, top)
        mix0_bg = batch_mix(background, w)
        mix0_an = batch_mix(anchors, w) if anchors is not None and anchors.P else None
        lp0_an = None
        if mix0_an is not None:
            from l47.tail.forward import logp_at
            lp0_an = logp_at(mix0_an, w, anchors.target)
        dev_base = None
        if dev is not None:
            dmix = batch_mix(dev[0], w)
            dev_base = float(np.exp(head_stats(dmix, w, dev[1].cpu().numpy()).logp_target).mean())
    words = torch.as_tensor(anchor_word or [], device=dev_)
    best = (float("inf"), 0, dW.detach().clone())
    history: list[dict] = []
    stopped = "steps"
    for step in range(1, cfg.steps + 1):
        opt.zero_grad()
        mix = batch_mix(ev, w, dW=dW)
        lp = event_logps(mix, w, events)
        gap = (lp["rejected"] - base["rejected"])[:, None] - (lp["chosen"] - base["chosen"])  # [E, kc]
        pref = (cfg.taper * F.softplus((gap + cfg.margin * events.scale[:, None]) / cfg.taper)).mean()
        dz = logits_at(mix, w, top) - z0_top  # [E, K+1]
        dzbar = (dz * p0).sum(1, keepdim=True) / p0.sum(1, keepdim=True).clamp_min(1e-12)
        tether = (p0 * (dz - dzbar) ** 2).sum(1).mean()
        kl = streamed_kl(batch_mix(background, w, dW=dW), mix0_bg, w).mean()
        coll = mix.new_zeros(())
        if mix0_an is not None:
            from l47.tail.forward import logp_at
            d = (logp_at(batch_mix(anchors, w, dW=dW), w, anchors.target) - lp0_an) ** 2
            per_word = [d[words == u].mean() for u in torch.unique(words)]
            coll = torch.stack(per_word).mean()
        special = F.relu(lp["special"] - base["special"]).sum(1).mean() if lp["special"].numel() else coll * 0
        loss = (pref + cfg.lambda_tether * tether + cfg.lambda_kl * kl + cfg.lambda_coll * coll
                + cfg.lambda_special * special + cfg.lambda_ridge * dW.pow(2).sum())
        loss.backward()
        rec = {k: float(v.detach()) for k, v in
               dict(loss=loss, pref=pref, kl=kl, coll=coll, special=special).items()}
        rec["step"] = step
        if step % cfg.eval_every == 0 or step == cfg.steps:
            with torch.no_grad():
                p_rej = float(torch.exp(lp["rejected"]).mean())
                rec["train_p_rej"] = p_rej
                score = p_rej
                if dev is not None:
                    dmix = batch_mix(dev[0], w, dW=dW)
                    dp = float(np.exp(head_stats(dmix, w, dev[1].cpu().numpy()).logp_target).mean())
                    rec["dev_p_rej"], rec["dev_reduction"] = dp, 1 - dp / max(dev_base, 1e-12)
                    score = dp
                if rec["kl"] <= cfg.kl_budget and score < best[0]:
                    best = (score, step, dW.detach().clone())  # the ΔW this step's loss, KL and dev were taken at
            history.append(rec)
        opt.step()  # after the evaluation: the kept ΔW is the one whose KL and dev figures were measured
        if progress is not None:
            progress(rec)
        if rec["kl"] > 3 * cfg.kl_budget and step > 3 * cfg.eval_every:
            stopped = f"background KL {rec['kl']:.4g} > 3x budget"
            break
    if best[1] == 0:
        best = (float("nan"), 0, torch.zeros_like(dW.detach()))
        stopped += "; no step within the KL budget: ΔW = 0"
    return FtpoResult(dW=best[2], best_step=best[1], history=history, stopped=stopped)
