"""FTPO's loop: parameterise ΔW, then (judge exactly, stop?, λ, restart?, optimise) every `eval_every` steps;
the kept candidate is the result."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import torch

from l47.data import record as rec
from l47.model.weights import TailWeights
from l47.solvers.ftpo.basis import _parameterise
from l47.solvers.ftpo.config import OBJECTIVES, FtpoConfig, FtpoProblem
from l47.solvers.ftpo.judge import _Judge, at_target_residuals, pulling
from l47.solvers.ftpo.objective import _Objective, _Rotation


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

    def summary(self) -> dict:
        return {"best_step": self.best_step, "stopped": self.stopped, "kl_exact": self.kl_exact,
                "dev_residual": self.dev_residual, "train_residual": self.train_residual, "history": self.history,
                "notes": self.notes, "info": self.info}

    def convergence(self, target: float) -> rec.Convergence:
        """Max violation: nats by which the worst phrase's at-target residual (at_target_residuals: the larger of
        dev and train) exceeds the target."""
        res = at_target_residuals(self.train_residual, self.dev_residual)
        worst = max((math.log(max(v, 1e-300) / target) for v in res.values()), default=0.0)
        return rec.Convergence(stop_reason=self.stopped, max_violation=max(0.0, worst), violation_tol=0.0,
                               iterations=len(self.history) and self.history[-1]["step"])


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
        if info["kl_exact"] > pb.kl_budget:  # the dev rows' KL and flips only judge candidates (never trained on)
            lam, over = min(lam * 2.0, 1e6), over + 1
        else:
            over = 0
        if judge.best is not None and judge.best[1] == step:
            kept = param.detach().clone()
        if cfg.recover_after > 0 and over >= cfg.recover_after and kept is not None:
            opt.restart(kept)  # λ alone did not bring the KL back: the step is too long for the valley
            over = 0
            history.append({"step": step, "restart_from": judge.best[1], "lr_scale": opt.scale})
            restarts.append(f"FTPO: exact KL over the budget {cfg.recover_after} evaluations in a row at step "
                             f"{step}: restarted from the kept candidate (step {judge.best[1]}), step × {opt.scale:g}")
        if info["dev_flips"] or sum(info["turn_ends_lost"].values()):  # the near-tie guard stiffens
            obj.lam_flip = min(obj.lam_flip * 2.0, 1e6)
        judged = at_target_residuals(info["train_residual"], info["dev_residual"])
        obj.event_on = torch.as_tensor(pulling(judge.ratio_ev, pb.phrase, judged, pb.target_residual),
                                       dtype=torch.float32, device=w.device)  # the budget goes to what is short
        n = min(cfg.eval_every, cfg.steps - step)
        loss_of = lambda rows, lam=lam: obj(dW_of(param), rows, lam)  # noqa: E731
        parts = opt.run(n, loss_of)
        step += n
        history.append({"step": step, **parts[-1]})
    return dataclasses.replace(_result(judge, history, stopped, step, pb, w), info=pnotes + obj.notes + restarts)


def _result(judge: _Judge, history: list[dict], stopped: str, step: int, pb: FtpoProblem, w: TailWeights):
    t = pb.target_residual
    if judge.best is None:
        return FtpoResult(torch.zeros(w.n, w.f, device=w.device), 0, history, rec.STOP_BUDGET, 0.0, {}, {},
                          ["convergence: no candidate within the KL budget; ΔW = 0"])
    _, bstep, bdW, bkl, bdv, btr = judge.best
    notes = []
    if stopped != rec.STOP_CONVERGED:
        short = [p for p, v in at_target_residuals(btr, bdv).items() if v > t]
        notes.append(f"convergence: stopped by {stopped} at step {step}; kept the candidate of step {bstep} "
                     f"(exact KL {bkl:.3g} ≤ budget {pb.kl_budget:.3g}); phrases short of the target residual {t:g}: "
                     f"{short or 'none'}")
    return FtpoResult(bdW, bstep, history, stopped, bkl, bdv, btr, notes)
