"""How long a solve will take on the machine it runs on, before it starts: measured unit costs × a count of the
solver's work (FTPO: per step × the step cap; WFLD: its closed form's passes).

Nearly all of a solve's time is vocabulary passes — [rows, n] × [n, V] GEMMs with the streaming reductions of
l47.tail.stream — and the tail forward of the rows. `measure_units` times each kind of pass ONCE, on this
machine and device, with the functions the solvers call, on `probe_rows` random mixer rows against the first
`probe_vocab` rows of the run's own head (in the run's head precision), and divides by rows × vocabulary entries:

    lse     streamed_lse forward (log-sum-exp: a step's background rows, events, soft anchors)
    mu      its backward: stream_head with μ = E_p[W_out] (one more pass)
    kl      streamed_kl without gradient, per (base, edited) pair (WFLD's exact KL check)
    stats   head_stats (lse, top-k, entropy: the judge's events, the objective's base quantities)
    tail    batch_mix forward + backward through ΔW, per row (no vocabulary)

The costs are linear in V at a fixed row count (the head is streamed in fixed chunks): a pass over V entries
costs unit × rows × V. The count (`SolveShape`, from the posed problem) is the solver's own:

FTPO, per step (E train events, m = min(background_batch, B) background rows, a = min(anchor_batch, A) soft
anchors, p = plausible turn ends (at most anchor_batch; counted in full, an upper bound), N near misses):
    forward   tail·(E + a + p + N) + lse·V·(E + a + p)        the events' and anchors' log p
    kl        tail·m + lse·V·m                                the background rows' one pass
    backward  mu·V·(E + m + a + p)                            ∂lse/∂mix of every row that had a pass
    judge     [lse·V·(B + R) + stats·V·(E + D + T)] / eval_every  every eval_every steps, exact, amortised
  (B background rows, R dev rows, D dev events, T turn ends; the KLs by `kl_against`: one lse pass over the
  candidate's rows); once: (mu + lse)·V·(B + R) (the KlReferences) + stats·V·(B + E + N + D + R + A).
  Steps: the configured cap (`steps`) — an UPPER bound (a solve that converges stops earlier).
WFLD: once the Fisher (its μ and top-K pass and the tail samples' μ pass, 2·mu·V·B, their two sampling passes,
  2·lse·V·B, and K + S backward passes of the tail, tail·(K + S)·B); its eigenbases ([n, n] and [f', f'] eigh) are
  left out (seconds; timed on this shared CPU they swung 10× between calls); per Gauss–Newton step the exact
  constraints (stats·V·E) and the exact KL of the trial, float and as shipped (2·kl·V·B); steps: the
  configured cap gn_iters. Not counted: the dual QP, and the rejected trials a trust-region step may re-solve
  (each one more exact KL) — so no bound either way: on the TINY bench world (n 128, V 4,096) the solve took
  83 s against 19 s estimated, all of it QP and re-solves; at the real size the passes are the cost.

Pure: no printing (the app renders `Estimate`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from l47.errors import L47Error
from l47.model.weights import Numerics, TailWeights
from l47.solvers.batch import Batch, batch_mix
from l47.tail.forward import head_stats, streamed_kl, streamed_lse

PROBE_ROWS = 256  # mixer rows of each timed pass (the step's background batch is 512)
PROBE_VOCAB = 16384  # head rows of each timed pass (two default chunks)


@dataclass(frozen=True)
class UnitCosts:
    """Seconds per row per vocabulary entry of each pass (tail: per row)."""

    lse: float
    mu: float
    kl: float
    stats: float
    tail: float
    device: str
    threads: int
    precision: str  # the head precision the passes ran in
    probe_rows: int
    probe_vocab: int


@dataclass(frozen=True)
class SolveShape:
    """What a solve's cost depends on: V and the rows of each set the solver passes over the vocabulary."""

    V: int
    events: int  # E train events
    background: int  # B background rows (FTPO: every row up to kl_rows; WFLD: max_background)
    anchors: int = 0  # A soft anchors (collateral + turn ends)
    turn_ends: int = 0  # T
    near: int = 0  # N near misses
    dev_events: int = 0  # D
    dev_rows: int = 0  # R
    plausible_ends: int = 0  # p: rows per step of the plausible turn ends' group (an upper bound)


@dataclass(frozen=True)
class Estimate:
    """The estimated solve time: `per_step` seconds by part, `steps` of them, `setup_s` once."""

    method: str
    per_step: dict[str, float]
    steps: int
    setup_s: float
    units: UnitCosts
    upper_bound: bool = True  # `steps` is a cap the solve may stop short of (the per-step figure is an estimate)
    note: str = ""

    @property
    def step_s(self) -> float:
        return float(sum(self.per_step.values()))

    @property
    def total_s(self) -> float:
        return self.setup_s + self.steps * self.step_s


def _best(fn, device, reps: int) -> float:
    """The best wall time of `reps` calls (device synchronised), after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        if str(device).startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if str(device).startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def probe_weights(w: TailWeights, vocab: int) -> TailWeights:
    """w with its head cut to its first `vocab` rows and a fresh Numerics of the run's precision (resolved again on
    the probe's first pass, so a split precision is checked on the probe's head)."""
    num = w.numerics
    head = w.head[: min(vocab, w.V)]
    return replace(w, head=head, V=int(head.shape[0]),
                   numerics=Numerics(precision=num.used or num.precision, no_f64=num.no_f64))


def _random_batch(w: TailWeights, P: int, seed: int) -> Batch:
    """P rows of random layer-L states at w's dims (the tail's cost does not depend on the values)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=g).to(w.device)

    return Batch(R=rnd(P, w.hc, w.n), inj=rnd(P, w.hc), hh=rnd(P, w.f), sgv=rnd(P), yr=rnd(P, w.n),
                 target=torch.randint(0, w.V, (P,), generator=g).to(w.device), doc=("probe",) * P,
                 pos=tuple(range(P)))


def measure_units(w: TailWeights, rows: int = PROBE_ROWS, vocab: int = PROBE_VOCAB, reps: int = 2) -> UnitCosts:
    """Time each pass once on this machine (module docstring): `rows` random mixer rows against the first `vocab`
    rows of w's head, best of `reps` after a warm-up."""
    pw, dev = probe_weights(w, vocab), w.device
    b = _random_batch(pw, rows, 0)
    with torch.no_grad():
        mix0 = batch_mix(b, pw)  # [rows, n]
    mix1 = mix0 + 0.01 * torch.randn(mix0.shape, generator=torch.Generator().manual_seed(1)).to(dev)
    tg = b.target.cpu().numpy()
    Vp, per = pw.V, float(rows * pw.V)

    def lse_fwd():
        with torch.no_grad():
            streamed_lse(mix1, pw)

    def lse_fwd_bwd():
        x = mix1.clone().requires_grad_(True)
        streamed_lse(x, pw).sum().backward()

    dW = torch.zeros(w.n, w.f, device=dev, requires_grad=True)

    def tail():
        batch_mix(b, pw, dW=dW).sum().backward()

    t_lse = _best(lse_fwd, dev, reps)
    t_mu = max(_best(lse_fwd_bwd, dev, reps) - t_lse, 0.0)
    with torch.no_grad():
        t_kl = _best(lambda: streamed_kl(mix1, mix0, pw), dev, reps)
        t_stats = _best(lambda: head_stats(mix0, pw, tg, topk=5), dev, reps)
    return UnitCosts(lse=t_lse / per, mu=t_mu / per, kl=t_kl / per, stats=t_stats / per,
                     tail=_best(tail, dev, reps) / rows,
                     device=str(dev) if not str(dev).startswith("cuda") else torch.cuda.get_device_name(dev),
                     threads=torch.get_num_threads(), precision=pw.numerics.used or pw.numerics.precision,
                     probe_rows=rows, probe_vocab=Vp)


def ftpo_step(s: SolveShape, cfg, u: UnitCosts) -> dict[str, float]:
    """Seconds of one FTPO step by part (forward, kl, backward, judge amortised over eval_every); cfg: FtpoConfig."""
    V = s.V
    m = min(cfg.background_batch, s.background) if cfg.background_batch > 0 else s.background
    a = min(cfg.anchor_batch, s.anchors) if cfg.anchor_batch > 0 else s.anchors
    p = min(cfg.anchor_batch, s.plausible_ends) if cfg.anchor_batch > 0 else s.plausible_ends
    # the judge's KLs: one lse pass over the candidate's background and dev rows (`kl_against`, not the pair pass)
    judge = u.lse * V * (s.background + s.dev_rows) + u.stats * V * (s.events + s.dev_events + s.turn_ends)
    return {"forward": u.tail * (s.events + a + p + s.near) + u.lse * V * (s.events + a + p),
            "kl": u.tail * m + u.lse * V * m,
            "backward": u.mu * V * (s.events + m + a + p),
            "judge": judge / max(cfg.eval_every, 1)}


def estimate_ftpo(s: SolveShape, cfg, u: UnitCosts) -> Estimate:
    """FTPO: setup + steps × per step, steps = the configured cap (an upper bound; module docstring)."""
    V = s.V
    setup = (u.mu * V * (s.background + s.dev_rows) + u.lse * V * (s.background + s.dev_rows)  # the KlReferences
             + u.stats * V * (s.background + s.events + s.near + s.dev_events + s.dev_rows + s.anchors))
    return Estimate("ftpo", ftpo_step(s, cfg, u), int(cfg.steps), setup, u, True,
                    f"steps = the step cap {cfg.steps} (an upper bound: a solve that reaches its target stops "
                    f"earlier); an exact judgement every {cfg.eval_every} steps over {s.background:,} background "
                    f"and {s.dev_rows:,} dev rows")


def estimate_wfld(s: SolveShape, cfg, u: UnitCosts) -> Estimate:
    """WFLD: the Fisher and its eigenbases once, then per Gauss–Newton step the exact constraints and the exact KL
    (float and shipped) of one trial; steps = gn_iters (module docstring). cfg: WfldConfig."""
    V = s.V
    per = {"constraints": u.tail * s.events + u.stats * V * s.events, "kl": 2 * (u.tail * s.background
                                                                              + u.kl * V * s.background)}
    K = cfg.fisher_topk + (cfg.fisher_tail_samples if cfg.fisher_topk < V else 0)  # backward passes of the tail
    setup = u.tail * (1 + K) * s.background + 2 * u.mu * V * s.background + 2 * u.lse * V * s.background
    return Estimate("wfld", per, int(cfg.gn_iters), setup, u, False,
                    f"closed form: the Fisher over {s.background:,} background rows once, then at most "
                    f"{cfg.gn_iters} Gauss–Newton steps; vocabulary passes and tail rows only (its dual QP, "
                    f"eigendecompositions and rejected trials are not counted: they dominate at small dims)")


ESTIMATORS = {"ftpo": (estimate_ftpo, "ftpo"), "wfld": (estimate_wfld, "wfld")}  # solver name -> (its count,
# the config table it reads)


def shape_of(problem) -> SolveShape:
    """The solve's row counts from a posed problem (solvers/problem.py `Problem`)."""
    P = lambda b: 0 if b is None else b.P  # noqa: E731
    cfg = problem.plan.cfg.ftpo
    n_te = P(problem.turn_ends)
    plaus = min(cfg.plausible_end_rows, P(problem.background)) if cfg.plausible_end_p > 0 and n_te else 0
    return SolveShape(V=problem.plan.w.V, events=P(problem.events), background=P(problem.background),
                      anchors=P(problem.protected), turn_ends=n_te, near=P(problem.near),
                      dev_events=P(problem.dev), dev_rows=P(problem.dev_rows), plausible_ends=plaus)


def estimate_solve(problem, units: UnitCosts | None = None) -> Estimate:
    """The estimated time of solving `problem` (its solver and config) on this machine; units measured here when
    not given."""
    name = problem.solver.name
    if name not in ESTIMATORS:
        raise L47Error("solve time estimate", "method", f"one of {tuple(ESTIMATORS)}", repr(name))
    fn, table = ESTIMATORS[name]
    u = units or measure_units(problem.plan.w)
    return fn(shape_of(problem), getattr(problem.plan.cfg, table), u)

