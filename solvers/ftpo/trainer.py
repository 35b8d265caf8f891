"""FTPO's loop: parameterise ΔW, then (judge exactly, stop?, λ, restart?, optimise) every `eval_every` steps;
the kept candidate is the result."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from l47.data import record as rec
from l47.errors import L47Error
from l47.model.weights import TailWeights
from l47.solvers.ftpo.basis import _parameterise
from l47.solvers.ftpo.config import ODDS, OBJECTIVES, FtpoConfig, FtpoProblem
from l47.solvers.ftpo.judge import (BIND_DEV_KL, BIND_END_DLOGP, BIND_ENDS, BIND_FLIPS, BIND_KL, BIND_SPECIAL,
                                    BIND_WORDS, BIND_WORDS_BELOW, _Judge, at_target_residuals, next_multiplier,
                                    pulling)
from l47.solvers.ftpo.objective import TERM_MEANING, Step, _Objective, _Rotation, pull_balance


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
    pull_balance: dict = field(default_factory=dict)  # short phrase -> term -> share of its pull cancelled

    def summary(self) -> dict:
        return {"best_step": self.best_step, "stopped": self.stopped, "kl_exact": self.kl_exact,
                "dev_residual": self.dev_residual, "train_residual": self.train_residual, "history": self.history,
                "notes": self.notes, "info": self.info, "phrase_stops": self.phrase_stops,
                **({"pull_balance": self.pull_balance} if self.pull_balance else {})}

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


def phrase_groups(pb: FtpoProblem, device) -> torch.Tensor:
    """[E] each event's phrase as an index into the sorted phrases."""
    ids = {p: i for i, p in enumerate(sorted(set(pb.phrase)))}
    return torch.as_tensor([ids[p] for p in pb.phrase], device=device)


def step_parts(w: TailWeights, pb: FtpoProblem, cfg: FtpoConfig, steps: int = 3, clock=time.perf_counter) -> dict:
    """Seconds of each part of `steps` steps of the trainer's own objective (λ = lambda_kl) and of one exact
    evaluation, for `l47 bench --what ftpo`: forward (the events' forward and every term but the background rows'
    pass), kl (the step's background rows: tail and one vocabulary pass), backward, judge (one evaluation; per step:
    ÷ eval_every); each part the best of the steps (another process's load only adds; the first step also warms
    up), and the setup (parameterisation, base quantities). `clock`: seconds, synchronising the device."""
    t0 = clock()
    group = phrase_groups(pb, w.device)
    param, dW_of, _ = _parameterise(w, pb, cfg, group)
    obj = _Objective(w, pb, cfg, group)
    judge = _Judge(w, pb, obj)
    setup = clock() - t0
    rot, runs = _Rotation(pb.background.P, cfg.background_batch, cfg.seed, w.device), []
    obj.terms["kl_step"].weight = cfg.lambda_kl
    for _ in range(steps):
        param.grad = None
        t = [clock()]
        st = Step(obj, dW_of(param), rot())
        t.append(clock())
        st.lse_bg  # noqa: B018 - the background rows' tail and vocabulary pass (cached for the terms)
        t.append(clock())
        loss, _ = obj.loss(st)
        t.append(clock())
        loss.backward()
        t.append(clock())
        runs.append({"forward": t[1] - t[0] + t[3] - t[2], "kl": t[2] - t[1], "backward": t[4] - t[3]})
    t0 = clock()
    judge(steps, dW_of(param.detach()), cfg.lambda_kl)
    judge_s = clock() - t0
    per = {k: min(r[k] for r in runs) for k in ("forward", "kl", "backward")}
    return {"per_step": per | {"judge": judge_s / max(cfg.eval_every, 1)}, "judge_eval_s": judge_s,
            "setup_s": setup, "steps": steps, "first_step": runs[0]}


def train_ftpo(w: TailWeights, pb: FtpoProblem, cfg: FtpoConfig = FtpoConfig(), progress=None) -> FtpoResult:
    """Minimise L(ΔW) (the package docstring) by Adam with a floor; keep the best dev candidate within the
    KL budget. Steps: parameterise ΔW -> base quantities -> the loop (`_Trainer.run`) -> the kept candidate."""
    for name, allowed in (("objective", OBJECTIVES), ("odds", ODDS)):
        if getattr(cfg, name) not in allowed:
            raise L47Error("solver.ftpo", name, f"one of {allowed}", repr(getattr(cfg, name)))
    return _Trainer(w, pb, cfg, progress).run()


class _Trainer:
    """The loop as a small state machine, one turn every `eval_every` steps:

        judge     the candidate re-quantised as shipped, measured exactly (_Judge); recorded
        stop?     converged (every phrase at its target, within the budget) | the step cap | the time budget
        control   λ and the near-tie guard follow their constraints both ways (next_multiplier); the kept
                  candidate's parameter is saved; after `recover_after` evaluations in a row over the budget,
                  restart from the kept candidate with fresh moments and half the step; which events still pull
        step      `eval_every` optimiser steps on L(ΔW)

    State: the step, λ, the evaluations in a row over the budget, the kept parameter, the history (no wall time:
    the same inputs write the same bytes) and the restarts' notes."""

    def __init__(self, w: TailWeights, pb: FtpoProblem, cfg: FtpoConfig, progress):
        self.w, self.pb, self.cfg, self.progress = w, pb, cfg, progress
        self.t_start = time.monotonic()
        torch.manual_seed(cfg.seed)
        ev_group = phrase_groups(pb, w.device)
        self.param, self.dW_of, self.pnotes = _parameterise(w, pb, cfg, ev_group)
        self.obj = _Objective(w, pb, cfg, ev_group)
        self.judge = _Judge(w, pb, self.obj)
        self.opt = _Adam(self.param, cfg, float(w.W_sd.pow(2).mean().sqrt()), pb.background.P)
        self.lam, self.history, self.stopped, self.step = cfg.lambda_kl, [], rec.STOP_ITERATION_CAP, 0
        self.over, self.kept, self.restarts = 0, None, []  # evaluations in a row over the budget; kept parameter
        self.clean = 0  # evaluations in a row with no flip and no lost turn end

    def run(self) -> FtpoResult:
        while True:
            info, reached = self.evaluate()
            if self.stop(reached):
                break
            self.control(info)
            self.optimise()
        res = _result(self.judge, self.history, self.stopped, self.step, self.pb, self.w, self.balance())
        return dataclasses.replace(res, info=self.pnotes + self.obj.notes + self.restarts)

    def balance(self) -> dict[str, dict[str, float]]:
        """phrase -> pull_balance at the kept candidate, for every phrase short of its target there ({} when the
        solve converged or kept nothing): what stands against each short phrase when no constraint binds."""
        best = self.judge.best
        kept = self.param.detach() if best is not None and best[1] == self.step else self.kept  # judged last
        if best is None or self.stopped == rec.STOP_CONVERGED or kept is None or self.cfg.objective != "target":
            return {}
        at = at_target_residuals(best[5], best[4])
        rows = _Rotation(self.pb.background.P, self.cfg.background_batch, self.cfg.seed + 3, self.w.device)()
        out = {}
        for ph in sorted(p for p, v in at.items() if v > self.pb.target_residual):
            mask = torch.as_tensor([float(x == ph) for x in self.pb.phrase], device=self.w.device)
            out[ph] = pull_balance(self.obj, self.dW_of, kept, rows, mask)
        return out

    def evaluate(self) -> tuple[dict, bool]:
        """The candidate judged exactly and recorded: (its figures, whether every phrase is at its target)."""
        info = self.judge(self.step, self.dW_of(self.param.detach()), self.lam)
        reached = info.pop("reached")
        self.history.append(info)
        if self.progress is not None:
            self.progress({**info, "elapsed_s": round(time.monotonic() - self.t_start, 2)})
        return info, reached

    def stop(self, reached: bool) -> bool:
        """Whether the loop ends here (the reason in `stopped`)."""
        if reached and self.step > 0:
            self.stopped = rec.STOP_CONVERGED
            return True
        if self.step >= self.cfg.steps:
            return True
        if self.cfg.time_budget_s > 0 and time.monotonic() - self.t_start > self.cfg.time_budget_s:
            self.stopped = rec.STOP_TIME
            return True
        return False

    def control(self, info: dict) -> None:
        """λ, the kept parameter, a restart, the near-tie guard and the pulling events, from the judged figures."""
        cfg, pb, judge, obj = self.cfg, self.pb, self.judge, self.obj
        bad = info["inadmissible"]
        kl_bad = BIND_KL in bad or BIND_DEV_KL in bad  # the background KL is the trainer's handle on both KLs
        kl_slack = info["kl_used"] < cfg.relax and (info["kl_dev_used"] is None or info["kl_dev_used"] < cfg.relax)
        self.lam = next_multiplier(self.lam, cfg.lambda_kl * cfg.lambda_floor, kl_bad, kl_slack, cfg.relax)
        self.over = self.over + 1 if info["kl_exact"] > pb.kl_budget else 0
        if judge.best is not None and judge.best[1] == self.step:
            self.kept = self.param.detach().clone()
        if cfg.recover_after > 0 and self.over >= cfg.recover_after and self.kept is not None:
            self.restart()
        tie_bad = BIND_FLIPS in bad or BIND_ENDS in bad  # the near-tie guard follows flips and lost turn ends
        self.clean = 0 if tie_bad else self.clean + 1
        obj.lam_flip = next_multiplier(obj.lam_flip, cfg.lambda_flip, tie_bad, self.clean >= cfg.relax_after,
                                       cfg.relax)
        for term, floor, binds in (("coll", cfg.lambda_coll, (BIND_WORDS, BIND_WORDS_BELOW, BIND_END_DLOGP)),
                                   ("special", cfg.lambda_special, (BIND_SPECIAL,))):  # the held anchors' and the
            t = obj.terms[term]  # special mass's weights follow their bars as the judge reads them, both ways
            t.weight = next_multiplier(t.weight, floor, any(b in bad for b in binds), not bad, cfg.relax)
        judged = at_target_residuals(info["train_residual"], info["dev_residual"])
        obj.event_on = torch.as_tensor(pulling(judge.ratio_ev, pb.phrase, judged, pb.target_residual),
                                       dtype=torch.float32, device=self.w.device)  # the budget goes to what is short

    def restart(self) -> None:
        """λ alone did not bring the KL back: the step is too long for the valley; back to the kept candidate with
        fresh moments and half the step (λ as it stands)."""
        self.opt.restart(self.kept)
        self.over, best = 0, self.judge.best[1]
        self.history.append({"step": self.step, "restart_from": best, "lr_scale": self.opt.scale})
        self.restarts.append(f"FTPO: exact KL over the budget {self.cfg.recover_after} evaluations in a row at step "
                             f"{self.step}: restarted from the kept candidate (step {best}), step × {self.opt.scale:g}")

    def optimise(self) -> None:
        """`eval_every` optimiser steps (fewer at the cap) at the current λ; the last step's parts recorded."""
        n = min(self.cfg.eval_every, self.cfg.steps - self.step)
        obj, param, dW_of, lam = self.obj, self.param, self.dW_of, self.lam
        parts = self.opt.run(n, lambda rows: obj(dW_of(param), rows, lam))
        self.step += n
        self.history.append({"step": self.step, **parts[-1]})


STOP_TARGET = "target met"
TREND_EVALS = 30  # evaluations the trend at a step cap is fitted on (the last 300 steps at eval_every 10)
TREND_Z = 1.645  # one-sided 95 %: a phrase "still falls" when the slope's upper bound is below zero


def residual_trend(steps: list[int], res: list[float]) -> tuple[float, float]:
    """(slope, its standard error) of log(residual) against the step over the last TREND_EVALS evaluations
    (ordinary least squares, f64; (0, 0) with fewer than 3). The judge's residuals wander by a few % between
    evaluations (Adam's steps, the rotating rows): measured on a zoo model (seed 61347), a phrase flat at 0.56–0.64
    for 800 steps fitted −2.5 % per 100 steps over its last 10 evaluations."""
    x, y = np.asarray(steps[-TREND_EVALS:], float), np.log(np.maximum(np.asarray(res[-TREND_EVALS:], float), 1e-300))
    if len(x) < 3 or np.ptp(x) == 0:
        return 0.0, 0.0
    xc = x - x.mean()
    slope = float((xc * (y - y.mean())).sum() / (xc * xc).sum())
    resid = y - y.mean() - slope * xc
    se = math.sqrt(float((resid * resid).sum()) / (len(x) - 2) / float((xc * xc).sum()))
    return slope, se


def phrase_stops(history: list[dict], best_step: int, best_res: dict[str, float], target: float, stopped: str,
                 kl_used: float, near: float = 0.8, balance: dict[str, dict[str, float]] | None = None) -> dict[str, str]:
    """phrase -> why it stands where the kept candidate left it: `target met`; else the judge's condition that
    rejected the later candidates which had removed more of it (the most frequent; BIND_*), else the KL budget when
    the kept candidate used ≥ `near` of it, else the stop (step cap / time budget) with the residual's trend over
    the last evaluations and, when it still falls, the steps it would take at that rate. history: the judge's
    evaluations (with train/dev residuals and `inadmissible`), in order. `balance` (pull_balance per phrase):
    where no constraint binds, the soft terms that stand against the phrase, named with their shares."""
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
        slope, se = residual_trend(xs, ys)
        if math.expm1(100 * (slope + TREND_Z * se)) < -1e-3:  # falling by more than 0.1 % per 100 steps, surely
            more = math.log(target / r_best) / slope
            out[ph] = (f"{stopped}: still falling ({math.expm1(100 * slope):+.1%} per 100 steps; about "
                       f"{more:.0f} more steps to the target at that rate); no constraint binds")
        elif se > 0:
            out[ph] = (f"{stopped}: no longer falling ({math.expm1(100 * slope):+.1%} ± "
                       f"{math.expm1(100 * TREND_Z * se):.1%} per 100 steps over the last {min(len(xs), TREND_EVALS)} "
                       "evaluations); no constraint binds")
        else:
            out[ph] = f"{stopped}: no longer falling; no constraint binds"
        out[ph] += held_by((balance or {}).get(ph, {}))
    return out


def held_by(shares: dict[str, float], least: float = 0.1) -> str:
    """'; held by X (cancels a% of its pull), Y (b%)' over the terms whose share is ≥ `least`, largest first; ''
    when none."""
    top = sorted(((v, k) for k, v in shares.items() if v >= least), reverse=True)
    if not top:
        return ""
    return "; held by " + ", ".join(f"{TERM_MEANING.get(k, k)} ({v:.0%})" if i else
                                    f"{TERM_MEANING.get(k, k)} (cancels {v:.0%} of its pull)"
                                    for i, (v, k) in enumerate(top))


def _result(judge: _Judge, history: list[dict], stopped: str, step: int, pb: FtpoProblem, w: TailWeights,
            balance: dict[str, dict[str, float]] | None = None):
    t = pb.target_residual
    if judge.best is None:
        return FtpoResult(torch.zeros(w.n, w.f, device=w.device), 0, history, rec.STOP_BUDGET, 0.0, {}, {},
                          ["convergence: no candidate within the KL budget; ΔW = 0"])
    _, bstep, bdW, bkl, bdv, btr = judge.best
    at = at_target_residuals(btr, bdv)
    stops = phrase_stops(history, bstep, at, t, stopped, bkl / pb.kl_budget, balance=balance)
    notes = []
    if stopped != rec.STOP_CONVERGED:
        short = {p: round(v, 4) for p, v in at.items() if v > t}
        notes.append(f"convergence: stopped by {stopped} at step {step}; kept the candidate of step {bstep} "
                     f"(exact KL {bkl:.3g} ≤ budget {pb.kl_budget:.3g}); phrases short of the target residual {t:g} "
                     f"(residual at the stop): {short or 'none'}")
        notes += [f"convergence: {p!r} at {at[p]:.3g}: {stops[p]}" for p in short]
    return FtpoResult(bdW, bstep, history, stopped, bkl, bdv, btr, notes, phrase_stops=stops,
                      pull_balance=balance or {})
