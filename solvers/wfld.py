"""WFLD: weighted least squares with linear constraints over ΔW, closed form through its dual.

Objective minimised (ΔW has the shape of W_sd, [n, f]):

    ½ ρ ‖ΔW‖²_F  +  β KL_bg(ΔW)                   (ridge + the mean background KL(base ‖ edited), modelled)

KL_bg is modelled by the K-FAC quadratic ½ c·tr(ΔWᵀ G ΔW A) (G with its sampled tail, solvers/fisher.py) whose
scale c is fitted to the EXACT streamed KL (`background_kl`, full vocabulary) at the last accepted ΔW:
c = KL_exact(ΔW_k) / ½ tr(ΔW_kᵀ G ΔW_k A). After each step the exact KL is measured; if it is outside [½, 2] ×
the model's prediction (made before the exact forward), c is re-fitted to the new point and the step re-solved
(at most `kl_retries` times). Every step's prediction and exact value are kept side by side (`iterations`).
Why (measured, docs/SOLVERS.md): the uncalibrated metric dropped the Fisher outside the top-K (×1.3 on the demo,
×3.4 on a flat synthetic head), factorised E[J F J ⊗ hh hhᵀ] as a product (×1.4 / ×2), and is a quadratic at
the base used far from it (‖ΔW‖/‖W‖ = 1.6 on the demo, 19.5 on the second model), where the KL is not its base
quadratic. A model with the exact gradient at ΔW_k was tried and rejected: with the factorised curvature its
minimum falls below zero (predictions of 0 against an exact rise), the base-anchored scale does not.

subject to, linearised at the current ΔW (Gauss–Newton: re-linearise until the exact forward agrees with the
linear prediction), at every training event e (rejected token r, chosen natural alternatives c, specials s):

    Δ(ℓ_r − ℓ_c) ≤ −margin · scale_phrase      (FTPO margin; ℓ = log p)
    Δℓ_c        ≥ δ_cho                         (freed mass goes to natural alternatives, seed §6.1)
    Δℓ_s        ≤ 0                             (no rise of any special token)
    ℓ_r − ℓ_c   ≤ log(p_cap / (1 − p_cap))      (optional absolute margin: for near-certain slop a change-based
                                                 margin alone leaves p(rejected) ≈ 1; a logit difference, so it
                                                 does not saturate the way log p_r does)
Far targets are approached by continuation: each Gauss–Newton step moves a row's target by at most
min(max_step, ½ r), r the trust radius below.
and exactly ΔW·hh_a = 0 at every protected anchor a (ΔW = Y Bᵀ with B an orthonormal basis of the anchors'
null space; no approximation).

Notation used for tensor shapes:
    E events   m constraint rows   n hidden   f shared-expert width   f' = dim of the anchors' null space

Solution (per step): with M = ρ I + β c A'⊗G (A' = Bᵀ A B), eigen-bases G = U_G diag(γ) U_Gᵀ, A' = U_A diag(α) U_Aᵀ,
D[a, b] = 1 / (ρ + β γ_a α_b), every constraint is rank one (g_i h_iᵀ) so the dual Gram K = C M⁻¹ Cᵀ [m, m]
is assembled from per-event-pair kernels without forming M. The dual  min_{μ ≥ 0} ½ μᵀ K μ + μᵀ b'  is solved
exactly by NNLS on its Cholesky factor; the primal is ΔW = −U_G (D ⊙ Ĝᵀ diag(μ) Ĥ) U_Aᵀ Bᵀ.
Trust region (on the linearised rows, in nats; model-agnostic): every step's QP also bounds EVERY linearised row
i (margin, chosen, special-mass rows alike) in both directions, |⟨∇c_i, ΔW − ΔW_k⟩| ≤ r, as two more rows of the
dual ([C; −C], bounds [b; r − ⟨∇c, ΔW_k⟩]). Why (measured, docs/BENCHMARKS.md "Issue 16, fourth perf pass"):
on the bench world the unbounded step moved the δ_cho rows (Δ log p of a chosen token, which cannot exceed
−log p_c) by ~140 nats while the exact changes are linear only up to a few nats, so every line-search fraction
was worse than not moving and WFLD shipped ΔW = 0. The targets move by at most ½ r so the two bounds of one row
are never both active (the passive sets of the dual stay positive definite). Bounding the rows alone was not
enough there: the QP also resets the iterate's component in the rows' null space to the objective's minimum, a
large ΔW move no row sees, and the exact rows still left the prediction by 0.8 nats at r = 0.002 nats. So the
step pulls towards that minimum only a fraction θ = min(1, r / TR_RADIUS0) of the way: the step's objective is
½ ‖Ŷ − (1 − θ) Ŷ_k‖²_M (at Ŷ_k = 0, and whenever r ≥ TR_RADIUS0, the undamped one; `tr_qp_step`). The trial
is judged by the exact forward with the merit φ = max_i (c_i − bound_i)₊ (the real bounds, not the step's),
the standard rule (Nocedal & Wright, Numerical Optimization, Alg. 4.1) on ϱ = (φ_k − φ_trial) / (φ_k − φ_linear)
(at a feasible iterate, φ_k ≤ gn_tol, where the step lowers the objective: ϱ = 1 − max_i |c_i − linear_i| / r):
    ϱ ≤ TR_ACCEPT (0)    rejected: r ← TR_SHRINK·r (¼), re-solved from the same iterate;
    ϱ < TR_BAD (¼)       accepted, r ← TR_SHRINK·r;
    ϱ > TR_GOOD (¾)      accepted, r ← min(TR_GROW·r, TR_MAX) (2×, 8 nats) when the radius limited the step;
starting at TR_RADIUS0 = 1 nat. When r falls below TR_MIN (1e-3 nats) no step lowers φ: line_search_failed.
A damped step (θ < 1) counts as limited by the radius, and `converged` needs an undamped last step (θ = 1: the
iterate is its linearisation's optimum, not a point on the way to it).
KL budget (`KlBudget`: nats of mean background KL; `l47 solve` passes solvers/solve.py `kl_budget(plan)` and its
re-quantisation, None = no budget): a trial that passes the ratio rule but whose EXACT background KL (the streamed
forward above, of the float ΔW and then of the weights as shipped, re-quantised) exceeds the budget is rejected
like a step that raised the merit (r ← TR_SHRINK·r, re-solved from the same iterate; its float KL still re-fits
c). So every accepted iterate, and the one returned, is within the budget as shipped. When the radius falls
below TR_MIN and a trial of that step was over the budget, the solve stops `budget` (the record's
STOP_BUDGET) with a note starting "convergence:" (the audit's explanation of a stop short of the constraints),
else `line_search_failed`. Why (measured, docs/SOLVERS.md): on the pipeline bench world WFLD went on to an exact
KL of 0.217 nats, 87× the 0.0025 budget, and shipped it; judged on the float ΔW alone, the budgeted solve shipped
0.00251 > 0.0025 (re-quantisation added 1.6 %).

Precision: forward and gradients in f32; every solve step in f64.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import numpy as np
import scipy.optimize
import torch

from l47.data import record as rec
from l47.errors import L47Error
from l47.model.weights import TailWeights
from l47.solvers.knobs import knob
from l47.solvers.problem import KlBudget
from l47.tail.forward import logits_at, streamed_kl
from l47.solvers.batch import Batch, EventTerms, batch_mix, ys_grad_mix
from l47.solvers.fisher import fisher_factors, mu_lse
from l47.solvers.qp import nnls_gram

# trust region on the linearised rows (nats; module docstring): the standard ratio rule's constants
TR_RADIUS0 = 1.0  # initial radius
TR_MIN = 1e-3  # below it no step lowers the merit: line_search_failed
TR_MAX = 8.0
TR_ACCEPT, TR_BAD, TR_GOOD = 0.0, 0.25, 0.75  # ratio thresholds: reject / shrink / grow
TR_SHRINK, TR_GROW = 0.25, 2.0


@dataclass(frozen=True)
class WfldConfig:
    margin: float = knob(2.0, "nats, times the phrase's margin_scale: ℓ_rejected − ℓ_chosen drops by this")
    p_cap: float = knob(0.0, '> 0: also an absolute margin, p(rejected) ≤ p_cap after the edit', 0.0, 0.999)
    max_step: float = knob(1.5, "nats a constraint's target moves per Gauss–Newton step at most")
    delta_cho: float = knob(0.05, 'nats; > 0 so freed mass goes to natural alternatives')
    n_chosen: int = knob(1, 'alternatives per event', 1)
    ridge: float = knob(1e-2, 'ρ, relative to mean(γ)·mean(α)')
    bg_weight: float = knob(1.0, 'β, weight of the background KL')
    fisher_topk: int = knob(32, 'top-K Fisher factors of the head')
    fisher_tail_samples: int = knob(32, 'sampled tokens per position for the Fisher outside the top-K')
    refresh_fisher: bool = knob(False, 're-measure the Fisher at every Gauss–Newton point (slower)')
    kl_retries: int = knob(3, 're-solves of a step whose exact KL is outside ½–2× the prediction')
    kl_floor: float = knob(1e-6, 'nats: below this predicted and exact KL are not compared')
    gn_iters: int = knob(20, 'Gauss–Newton steps at most')
    gn_tol: float = knob(1e-3, 'nats: |exact − linear prediction| of every constraint')
    anchor_tol: float = knob(1e-6, "relative singular-value cut of the anchors' span")
    max_removed: float = knob(
        0.95, 'an event whose key loses more than this to the protected span is infeasible', 0.0, 1.0)
    special_constraints: bool = knob(True, 'keep Σ p(special) from rising at slop positions')
    special_margin: float = knob(0.1, 'nats: Δℓ_special ≤ −special_margin')


def within_budget(kl: float, kl_shipped: float | None, budget: KlBudget | None) -> bool:
    """Whether exact KLs (nats; float ΔW, shipped weights or None where not measured) are within the budget."""
    return budget is None or (kl <= budget.nats and (kl_shipped is None or kl_shipped <= budget.nats))


@dataclass(frozen=True)
class WfldResult:
    dW: torch.Tensor  # [n, f] f32
    iterations: list[dict]
    residual: float  # max |exact − linear prediction| at the last step (nats)
    violation: float  # max constraint violation of the exact forward (nats; 0 = all met)
    removed: list[float]  # per event: fraction of ‖hh‖² in the protected span
    infeasible_events: list[int]
    worst_rows: list[dict]  # the most violated constraints at the end (event index, kind, value, bound)
    anchor_rank: int
    null_dim: int
    predicted_bg_kl: float  # the KL model's prediction at the returned step (made before the exact forward)
    exact_bg_kl: float  # the exact streamed mean background KL at the returned ΔW (float, before re-quantisation)
    fisher_tail_mass: float
    stop_reason: str = ""  # l47.data.record.STOP_REASONS: converged | iteration_cap | line_search_failed | budget
    tolerance: float = 0.0  # nats: what `violation` is judged against
    kl_budget: float | None = None  # nats: the exact background KL every accepted iterate stayed within (None: none)
    shipped_bg_kl: float | None = None  # the exact KL of the returned ΔW as shipped (re-quantised), where measured
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("dW")
        return d


def anchor_basis(anchors: Batch | None, f: int, tol: float, device) -> tuple[torch.Tensor, int]:
    """Orthonormal basis B [f, f'] of the null space of the anchors' hh (f' = f − rank)."""
    if anchors is None or anchors.P == 0:
        return torch.eye(f, dtype=torch.float64, device=device), 0
    H = anchors.hh.double()  # [Pa, f]
    _, S, Vh = torch.linalg.svd(H, full_matrices=True)
    rank = int((S > tol * S[0]).sum()) if S.numel() else 0
    return Vh[rank:].T.contiguous(), rank  # [f, f − rank]


def _constraints(ev: Batch, terms: EventTerms, w: TailWeights, W: torch.Tensor, base: dict, cfg: WfldConfig,
                 active: list[int]):
    """Exact constraint values c (change vs base), bounds b and ys-gradients g at W, for the active events.

    One streamed head pass gives lse and μ = E_p[W_out]; ∂ℓ_v/∂mix = W_out[v] − μ exactly, so each constraint
    family needs only a vector-Jacobian product through the output mixer (no further head passes)."""
    ys, mix = ys_grad_mix(ev, w, W)
    with torch.no_grad():
        mu, lse = mu_lse(mix.detach(), w)  # [E, n], [E] f64
        lp = {k: (logits_at(mix, w, ids).double() - lse[:, None]) for k, ids in
              (("rejected", terms.rejected[:, None]), ("chosen", terms.chosen), ("special", _per_event(terms)))}
    lp["rejected"] = lp["rejected"][:, 0]
    rows_val, rows_grad, rows_b, rows_ev, rows_kind = [], [], [], [], []

    def add(value: torch.Tensor, bound, u_mix: torch.Tensor, kind: str):
        (g,) = torch.autograd.grad(mix, ys, grad_outputs=u_mix.to(mix.dtype), retain_graph=True)  # [E, n]
        for e in active:
            rows_val.append(float(value[e]))
            rows_grad.append(g[e].double())
            rows_b.append(float(bound[e]) if torch.is_tensor(bound) else float(bound))
            rows_ev.append(e)
            rows_kind.append(kind)

    head = w.head.double()
    d_rej = lp["rejected"] - base["rejected"]
    d_cho = lp["chosen"] - base["chosen"]
    for j in range(terms.chosen.shape[1]):
        c = terms.chosen[:, j]
        bound = -cfg.margin * terms.scale.double()
        if cfg.p_cap > 0:  # absolute margin: final gap ≤ log(p_cap/(1−p_cap)), scaled per phrase
            gap0 = base["rejected"] - base["chosen"][:, j]
            bound = torch.minimum(bound, float(np.log(cfg.p_cap / (1 - cfg.p_cap))) * terms.scale.double() - gap0)
        add(d_rej - d_cho[:, j], bound, head[terms.rejected] - head[c], f"margin{j}")
        add(-d_cho[:, j], -cfg.delta_cho, -(head[c] - mu), f"chosen{j}")
    if cfg.special_constraints and terms.special.numel():
        # the special tokens' total mass: Δ log Σ_s p_s ≤ −special_margin (what bar (f) measures; one smooth row
        # per event instead of one per token, whose tiny probabilities make the linearisation poor)
        lse_sp = torch.logsumexp(lp["special"], 1)  # [E] log Σ p_s (f64)
        lse_sp0 = torch.logsumexp(base["special"], 1)
        w_sp = torch.softmax(lp["special"], 1)  # [E, ks] share of each special in the mass
        u = w_sp @ head[terms.special] - mu  # [E, n] ∂ log Σ p_s / ∂mix
        add(lse_sp - lse_sp0, -cfg.special_margin, u, "special_mass")
    return (np.array(rows_val), torch.stack(rows_grad), np.array(rows_b), np.array(rows_ev), rows_kind, lp)


def _per_event(terms: EventTerms) -> torch.Tensor:
    return terms.special[None, :].expand(terms.rejected.shape[0], -1)


def _base_logps(ev: Batch, terms: EventTerms, w: TailWeights) -> dict:
    with torch.no_grad():
        mix = batch_mix(ev, w)
        _, lse = mu_lse(mix, w)
        return {"rejected": logits_at(mix, w, terms.rejected[:, None])[:, 0].double() - lse,
                "chosen": logits_at(mix, w, terms.chosen).double() - lse[:, None],
                "special": logits_at(mix, w, _per_event(terms)).double() - lse[:, None]}


def _dual_gram(Gh: torch.Tensor, Hh: torch.Tensor, D: torch.Tensor, ev_of_row: np.ndarray) -> torch.Tensor:
    """K_ij = Σ_ab Ĝ_i[a] Ĝ_j[a] D[a,b] Ĥ_e(i)[b] Ĥ_e(j)[b], assembled per event (never forms M)."""
    m = Gh.shape[0]
    evs = np.unique(ev_of_row)
    pos = {e: i for i, e in enumerate(evs)}
    col = torch.as_tensor([pos[e] for e in ev_of_row], device=Gh.device)
    He = Hh[torch.as_tensor(evs, device=Gh.device)]  # [E', f']
    K = torch.zeros(m, m, dtype=torch.float64, device=Gh.device)
    for e in evs:
        Te = D @ (He[pos[e]][:, None] * He.T)  # [n, E']: Σ_b D[a,b] ĥ_e[b] ĥ_e'[b]
        rows = torch.as_tensor(np.nonzero(ev_of_row == e)[0], device=Gh.device)
        K[rows] = Gh[rows] @ (Gh * Te[:, col].T).T  # [k_e, m]
    return 0.5 * (K + K.T)


def _nnls_dual(K: torch.Tensor, b: np.ndarray) -> np.ndarray:
    """argmin_{μ ≥ 0} ½ μᵀKμ + μᵀb: Lawson–Hanson in the Gram form (solvers/qp.py, on CUDA when K is there),
    else (the active set did not settle) scipy's NNLS on K = L Lᵀ: ‖Lᵀμ + L⁻¹b‖² — the same minimiser."""
    Kt = K.to("cuda" if K.is_cuda else "cpu", torch.float64)
    bt = torch.as_tensor(np.asarray(b, dtype=np.float64), device=Kt.device)
    if not bool(torch.isfinite(Kt).all()) or not bool(torch.isfinite(bt).all()):
        raise L47Error("solve", "WFLD dual", "finite constraint gradients and bounds", "NaN or Inf")
    jitter = 1e-12 * max(1.0, float(torch.trace(Kt)) / len(Kt))
    Kt = Kt + jitter * torch.eye(len(Kt), dtype=torch.float64, device=Kt.device)
    mu = nnls_gram(Kt, bt)
    if mu is not None:
        return mu.cpu().numpy()
    Kn = Kt.cpu().numpy()
    try:
        L = np.linalg.cholesky(Kn)
        rhs = -np.linalg.solve(L, b)
        mu, _ = scipy.optimize.nnls(L.T, rhs, maxiter=50 * len(Kn))
    except (np.linalg.LinAlgError, RuntimeError) as e:
        raise L47Error("solve", "WFLD dual", "a positive semi-definite dual Gram and a converging NNLS",
                       f"{type(e).__name__}: {e}") from None
    return mu


def background_kl(bg: Batch, w: TailWeights, dW: torch.Tensor, mix0: torch.Tensor) -> float:
    """Exact mean background KL(base ‖ edited) over the batch (streamed, full vocabulary). Precision: f32
    forward, f64 vocabulary sums; mean in f64."""
    with torch.no_grad():
        return float(streamed_kl(batch_mix(bg, w, dW=dW), mix0, w).double().mean())


@dataclass(frozen=True)
class Metric:
    """The K-FAC metric (solvers/fisher.py) at one point, in its eigenbases: G = U_G diag(γ) U_Gᵀ [n, n] and
    A' = Bᵀ A B = U_A diag(α) U_Aᵀ [f', f'] (eigenvalues clamped ≥ 0), ρ the ridge that keeps M = ρI + A'⊗G
    invertible, the events' keys in the A-eigenbasis, and the Fisher's sampled tail mass. f64."""
    gam: torch.Tensor  # [n]
    UG: torch.Tensor  # [n, n]
    alp: torch.Tensor  # [f']
    UA: torch.Tensor  # [f', f']
    rho: float
    Hh: torch.Tensor  # [E, f'] event keys: (hh B) U_A
    tail_mass: float

    def inverse_diag(self, scale: float = 1.0) -> torch.Tensor:
        """D[a, b] = 1 / (ρ + scale·γ_a α_b) [n, f']: M⁻¹ in the eigenbases (scale = β c in WFLD)."""
        return 1.0 / (self.rho + scale * self.gam[:, None] * self.alp[None, :])


def eigen_metric(background: Batch, w: TailWeights, W: torch.Tensor, B: torch.Tensor, keys: torch.Tensor,
                 cfg: WfldConfig, ridge: float, seed: int = 0) -> Metric:
    """K-FAC factors over the background at weights W (top-K cfg.fisher_topk, cfg.fisher_tail_samples tail
    samples) in the anchors' null space B [f, f'], their eigenbases, ρ = ridge·mean(γ)·mean(α) (ridge when that
    is 0) and the event keys [E, f] in the A-eigenbasis. f64."""
    ff = fisher_factors(background, w, W, K=cfg.fisher_topk, row_basis=B, tail_samples_n=cfg.fisher_tail_samples,
                        seed=seed)
    gam, UG = torch.linalg.eigh(ff.G)
    alp, UA = torch.linalg.eigh(ff.A)
    gam, alp = gam.clamp_min(0), alp.clamp_min(0)
    rho = ridge * float(gam.mean() * alp.mean()) or ridge
    return Metric(gam, UG, alp, UA, rho, (keys.double() @ B) @ UA, ff.tail_mass)


def span_share(keys: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Per key [E, f]: the share of ‖hh‖² inside the protected anchors' span (outside the null space B). f64."""
    he = keys.double()
    return 1.0 - (he @ B).pow(2).sum(1) / he.pow(2).sum(1).clamp_min(1e-300)  # [E]


@dataclass(frozen=True)
class _Problem:
    """What every Gauss–Newton step reads: the inputs, the anchors' null space B [f, f'] and rank, the events
    that can move (`active`), the base log-probs of the events and the base mixer output of the background."""
    w: TailWeights
    events: Batch
    terms: EventTerms
    background: Batch
    cfg: WfldConfig
    B: torch.Tensor
    rank: int
    removed: list[float]
    infeasible: list[int]
    active: list[int]
    warnings: list[str]
    base: dict
    mix0_bg: torch.Tensor  # [P, n] (the KL reference)
    budget: KlBudget | None = None  # the background KL no accepted iterate may exceed (None: no budget)

    def shipped_kl(self, dW: torch.Tensor, kl: float) -> float | None:
        """The exact mean background KL of ΔW [n, f] as shipped, when the budget judges it there and the float
        KL `kl` is within it (else None: not measured)."""
        if self.budget is None or self.budget.shipped is None or kl > self.budget.nats:
            return None
        with torch.no_grad():
            mix = batch_mix(self.background, self.w, W_sd=self.budget.shipped(dW))
            return float(streamed_kl(mix, self.mix0_bg, self.w).double().mean())

    def constraints(self, dW: torch.Tensor):
        return _constraints(self.events, self.terms, self.w, self.w.W_sd + dW, self.base, self.cfg, self.active)


@dataclass
class _State:
    """The Gauss–Newton iterate ΔW = Y Bᵀ and what the next step reads of the last one."""
    Y: torch.Tensor  # [n, f'] f64
    dW: torch.Tensor  # [n, f] f32
    kl: float = 0.0  # exact background KL at ΔW
    kl_pred: float = float("nan")  # the KL model's prediction of it (made before the exact forward)
    kl_shipped: float | None = None  # exact background KL of ΔW as shipped (re-quantised); None: not measured
    curv: float = 1.0  # c: the K-FAC quadratic's scale, fitted to the exact KL at the last accepted ΔW
    pred: np.ndarray | None = None  # [m] the linear prediction of the constraint values at ΔW
    cached: tuple | None = None  # the accepted trial's constraints: the next linearisation point, not redone
    radius: float = TR_RADIUS0  # nats: the trust region on every linearised row's change per step
    undamped: bool = True  # the last step went the whole way to its QP's optimum (θ = 1): converged may be said


def solve_wfld(w: TailWeights, events: Batch, terms: EventTerms, background: Batch, anchors: Batch | None,
               cfg: WfldConfig = WfldConfig(), log=None, budget: KlBudget | None = None) -> WfldResult:
    """Minimise ½ρ‖ΔW‖² + β KL_bg(ΔW) s.t. the FTPO margin, δ_cho and special-token constraints at the events
    and ΔW·hh = 0 at the anchors (see the module docstring): Gauss–Newton steps until the exact forward agrees
    with the linear prediction and every constraint holds, every accepted iterate's exact background KL within
    `budget` (None: no budget); the best exact iterate is returned."""
    pb = replace(_problem(w, events, terms, background, anchors, cfg), budget=budget)
    st = _State(Y=torch.zeros(w.n, pb.B.shape[1], dtype=torch.float64, device=w.device),
                dW=torch.zeros(w.n, w.f, dtype=torch.float32, device=w.device))
    iters: list[dict] = []
    keep, metric, stop = None, None, rec.STOP_ITERATION_CAP
    for it in range(cfg.gn_iters + 1):
        c = st.cached if st.cached is not None else pb.constraints(st.dW)
        row, kept = _measure(c, st, cfg, it)
        iters.append(row)
        best = keep is None or row["violation"] < keep[0] - 1e-12  # the best exact iterate is the one returned
        if best and within_budget(st.kl, st.kl_shipped, budget):  # (always: an over-budget trial is never accepted)
            keep = kept
        if log:
            log(f"WFLD GN step {it}: {row['rows']} constraints, max violation {row['violation']:.4g} nats, "
                f"linear-prediction residual {row['residual']:.3g}, background KL exact {st.kl:.3g} "
                f"(predicted {st.kl_pred:.3g})")
        if st.pred is not None and row["residual"] < cfg.gn_tol and row["violation"] < cfg.gn_tol and st.undamped:
            stop = rec.STOP_CONVERGED
            break
        if it == cfg.gn_iters:
            break
        if metric is None or cfg.refresh_fisher:
            m = eigen_metric(background, w, w.W_sd + st.dW if cfg.refresh_fisher else w.W_sd, pb.B, events.hh, cfg,
                             cfg.ridge, seed=it)
            metric = m if metric is None else replace(m, rho=metric.rho)  # ρ stays the one set at the base
        failed = _gn_step(pb, metric, st, c, row, log)
        if failed:  # no radius improved on the iterate (within the budget): another step from it is the same
            stop = failed
            break
    return _result(pb, metric, keep, iters, stop)


def _problem(w: TailWeights, events: Batch, terms: EventTerms, background: Batch, anchors: Batch | None,
             cfg: WfldConfig) -> _Problem:
    """The anchors' null space, which events it leaves movable (refused when none), the base log-probs."""
    warnings: list[str] = []
    B, rank = anchor_basis(anchors, w.f, cfg.anchor_tol, w.device)  # [f, f']
    removed = span_share(events.hh, B).tolist()
    infeasible = [i for i, r in enumerate(removed) if r > cfg.max_removed]
    active = [i for i in range(events.P) if i not in infeasible]
    if infeasible:
        warnings.append(f"{len(infeasible)} event(s) have their key ≥ {cfg.max_removed:.0%} inside the protected "
                        f"anchors' span and cannot be moved without moving the anchors: {infeasible[:10]}")
    if rank + events.P > 0.8 * w.f:
        warnings.append(f"anchors (rank {rank}) + events ({events.P}) approach the shared-expert width f = {w.f}: "
                        "the null space is nearly exhausted")
    if not active:
        raise L47Error("solve", "events", "at least one event whose key is not inside the protected anchors' span",
                       f"all {events.P} events ≥ {cfg.max_removed:.0%} inside it (infeasible)")
    with torch.no_grad():
        mix0_bg = batch_mix(background, w)  # [P, n] base mixer output of the background (KL reference)
    return _Problem(w, events, terms, background, cfg, B, rank, removed, infeasible, active, warnings,
                    _base_logps(events, terms, w), mix0_bg)


def _measure(c: tuple, st: _State, cfg: WfldConfig, it: int) -> tuple[dict, tuple]:
    """The iteration record of the exact constraints `c` at the iterate, and the tuple kept if it is the best
    (violation, residual, ΔW, worst rows, exact KL, predicted KL, iteration, exact KL as shipped)."""
    vals, _, bounds, evr, kinds, _ = c
    residual = float(np.abs(vals - st.pred).max()) if st.pred is not None else float("nan")
    excess = vals - bounds  # [m] > 0: violated
    violation = float(np.clip(excess, 0, None).max())
    worst = [dict(event=int(evr[i]), kind=kinds[i], value=float(vals[i]), bound=float(bounds[i]))
             for i in np.argsort(-excess)[:5] if excess[i] > cfg.gn_tol]
    row = dict(iter=it, residual=residual, violation=violation, rows=len(vals), kl_exact=st.kl,
               kl_predicted=st.kl_pred, kl_shipped=st.kl_shipped, curvature_scale=st.curv)
    return row, (violation, residual, st.dW, worst, st.kl, st.kl_pred, it, st.kl_shipped)


def _gn_step(pb: _Problem, m: Metric, st: _State, c: tuple, row: dict, log) -> str | None:
    """One trust-region Gauss–Newton step from the linearisation `c` at the iterate (module docstring): the QP
    with every linearised row's change bounded by the radius, its trial judged on the exact forward (rejected:
    the radius shrunk, re-solved from the same iterate) and then on its exact background KL (over the budget:
    rejected the same way), then re-solved while the KL model and the exact KL disagree (at most kl_retries
    times). Updates `st` (iterate, radius); every trial's radius, merits, ratio, exact KL against the budget and
    the linear model's worst error per row kind go into row["trust_region"]. Returns None when a trial was
    accepted; else, leaving the iterate as it was once the radius fell below TR_MIN, the stop reason: `budget`
    when a trial of this step lowered the merit but went over the KL budget, `line_search_failed` otherwise."""
    vals, grads, bounds, evr, kinds, _ = c
    Gh = grads @ m.UG  # [m, n] constraint gradients in the G-eigenbasis
    Hrow = m.Hh[torch.as_tensor(evr, device=pb.w.device)]  # [m, f']
    cur = (Gh * ((m.UG.T @ st.Y @ m.UA) @ Hrow.T).T).sum(1).cpu().numpy()  # ⟨A_i, ΔW_k⟩
    phi0 = _merit(vals, bounds)
    lin = Linearised(Gh, Hrow, evr, vals, bounds, cur, m.UG.T @ st.Y @ m.UA)
    trials = row.setdefault("trust_region", [])
    over_budget = False  # a trial of this step lowered the merit but not within the KL budget
    for attempt in range(pb.cfg.kl_retries + 1):
        while True:
            D = m.inverse_diag(pb.cfg.bg_weight * st.curv)  # [n, f']
            Yhat, new_lin, limited = tr_qp_step(lin, m.Hh, D, st.radius, pb.cfg.max_step)
            pred = vals + (new_lin - cur)  # [m] the linear model's values at the trial
            Y_try = m.UG @ Yhat @ m.UA.T  # [n, f']
            dW_try = (Y_try @ pb.B.T).to(torch.float32)  # [n, f]
            c_try = pb.constraints(dW_try)
            phi, phi_lin = _merit(c_try[0], bounds), _merit(pred, bounds)
            ratio = tr_ratio(phi0, phi_lin, phi, pb.cfg.gn_tol, float(np.abs(c_try[0] - pred).max()), st.radius)
            r_old, st.radius = st.radius, tr_update(st.radius, ratio, limited)
            trial = dict(radius=r_old, merit_before=phi0, merit_predicted=phi_lin, merit_after=phi, ratio=ratio,
                         accepted=ratio > TR_ACCEPT, max_linear_change=float(np.abs(new_lin - cur).max()),
                         worst_error=_worst_error(c_try[0], pred, kinds))
            trials.append(trial)
            if ratio > TR_ACCEPT:
                kl_try, kl_pred, honest = _kl_check(pb, m, st, (r_old, Y_try, dW_try), row, log)
                kl_ship = pb.shipped_kl(dW_try, kl_try)
                trial.update(kl_exact=kl_try, kl_predicted=kl_pred, kl_shipped=kl_ship,
                             within_budget=within_budget(kl_try, kl_ship, pb.budget))
                if trial["within_budget"]:
                    break
                over_budget, trial["accepted"], st.radius = True, False, TR_SHRINK * r_old  # as if rejected
                if log:
                    log(f"WFLD GN step {row['iter']}: trust region {r_old:.3g} nats over the KL budget (exact "
                        f"background KL {kl_try:.3g}, as shipped {kl_ship if kl_ship is not None else kl_try:.3g} "
                        f"> {pb.budget.nats:.3g}): radius {st.radius:.3g}")
            elif log:
                log(f"WFLD GN step {row['iter']}: trust region {r_old:.3g} nats rejected (merit {phi0:.4g} -> "
                    f"{phi:.4g}, linear model {phi_lin:.4g}): radius {st.radius:.3g}")
            if st.radius < TR_MIN:
                row["line_search"] = dict(merit_before=phi0, merit_after=phi, radius=r_old)
                if over_budget:  # what meeting every row from here would cost, in the same linear and KL models
                    row["linear_least_kl"] = linear_least_kl(lin, m.Hh, m.inverse_diag(pb.cfg.bg_weight * st.curv),
                                                             m.gam, m.alp, st.curv)
                return rec.STOP_BUDGET if over_budget else rec.STOP_LINE_SEARCH
        row["line_search"] = dict(merit_before=phi0, merit_after=phi, radius=r_old)
        if honest:
            break
    st.Y, st.dW, st.cached = Y_try, dW_try, c_try
    st.kl, st.kl_pred, st.kl_shipped = kl_try, kl_pred, kl_ship
    st.pred = pred
    st.undamped = r_old >= TR_RADIUS0 or not bool(lin.Yk.abs().max() > 0)
    return None


@dataclass(frozen=True)
class Linearised:
    """One step's linear model in the metric's eigenbases: rows' gradients Ĝ [m, n] and keys Ĥ [m, f'] (row i's
    gradient is Ĝ_i ⊗ Ĥ_i), each row's event `evr` [m], exact values and bounds [m] at the iterate, the iterate's
    linear term cur_i = ⟨A_i, Ŷ_k⟩ [m] and the iterate Ŷ_k [n, f'] (None = 0). f64."""
    Gh: torch.Tensor
    Hrow: torch.Tensor
    evr: np.ndarray
    vals: np.ndarray
    bounds: np.ndarray
    cur: np.ndarray
    Yk: torch.Tensor | None = None


def tr_qp_step(lin: Linearised, Hh: torch.Tensor, D: torch.Tensor, radius: float, max_step: float):
    """The step's QP in the metric's eigenbases, from the iterate Ŷ_k:
        min ½ ‖Ŷ − (1 − θ) Ŷ_k‖²_M   (θ = min(1, r / TR_RADIUS0): a damped pull towards the objective's minimum)
    s.t. for every row i (linearised value vals_i + ⟨A_i, Ŷ⟩ − cur_i):
        ⟨A_i, Ŷ⟩ − cur_i ≤ min(t_i − vals_i, r),  t_i = max(bound_i, vals_i − min(max_step, ½ r))
        ⟨A_i, Ŷ⟩ − cur_i ≥ −r
    solved as Ŷ = (1 − θ) Ŷ_k + θ Z, Z the M-least-norm point of the same rows with bounds shifted and divided by
    θ, through its dual on [C; −C] (K → [[K, −K], [−K, K]]). Hh [E, f'] the events' keys, D [n, f'] = M⁻¹.
    Returns Ŷ [n, f'], the new linearised values ⟨A_i, Ŷ⟩ [m] and whether the radius limited the step (a target
    clipped by it, the pull damped, or a row's change at the radius)."""
    vals, bounds, cur, m = lin.vals, lin.bounds, lin.cur, len(lin.vals)
    move = min(max_step, 0.5 * radius)
    theta = 1.0 if lin.Yk is None else min(1.0, radius / TR_RADIUS0)
    up = np.minimum(np.maximum(bounds, vals - move) - vals, radius) + cur  # [m] ⟨A_i, Ŷ⟩ ≤ up (the targets)
    lo = cur - radius  # [m] ⟨A_i, Ŷ⟩ ≥ lo
    keep = (1.0 - theta) * cur  # [m] what the damped iterate keeps of the rows
    K = _dual_gram(lin.Gh, Hh, D, lin.evr)  # [m, m]
    K2 = torch.cat([torch.cat([K, -K], 1), torch.cat([-K, K], 1)], 0)  # [2m, 2m]
    mu2 = _nnls_dual(K2, np.concatenate([(up - keep) / theta, -(lo - keep) / theta]))
    mu = torch.as_tensor(mu2[:m] - mu2[m:], dtype=torch.float64, device=lin.Gh.device)  # [m] net multiplier
    Z = -D * (lin.Gh.T @ (mu[:, None] * lin.Hrow))  # [n, f']
    Yhat = theta * Z if lin.Yk is None or theta == 1.0 else (1.0 - theta) * lin.Yk + theta * Z
    new_lin = (lin.Gh * (Yhat @ lin.Hrow.T).T).sum(1).cpu().numpy()  # [m]
    clipped = theta < 1.0 or (bool(((vals - bounds) > move + 1e-12).any()) and 0.5 * radius < max_step)
    return Yhat, new_lin, clipped or bool((np.abs(new_lin - cur) >= (1 - 1e-6) * radius).any())


def linear_least_kl(lin: Linearised, Hh: torch.Tensor, D: torch.Tensor, gam: torch.Tensor, alp: torch.Tensor,
                    curv: float) -> float:
    """The modelled background KL (nats) of the point that meets EVERY linearised row at its real bound with the
    least objective (no trust region, no continuation): the budget's lower bound in the step's own models.
        Ŷ* = argmin ½ ‖Ŷ‖²_M  s.t.  ⟨A_i, Ŷ⟩ ≤ bound_i − vals_i + cur_i  (M = diag(1/D), D [n, f'] = M⁻¹)
           = −D ⊙ (Ĝᵀ diag(μ) Ĥ),  μ = argmin_{μ ≥ 0} ½ μᵀ K μ + μᵀ (bound − vals + cur)   [n, f'], [m]
        KL* = c · ½ Σ_ab γ_a α_b Ŷ*_ab²   (the KL model: K-FAC quadratic × its fitted scale c = curv)
    Precision: f64 (the dual by solvers/qp.py). Shapes as in `Linearised`; gam [n], alp [f']."""
    K = _dual_gram(lin.Gh, Hh, D, lin.evr)  # [m, m]
    mu = torch.as_tensor(_nnls_dual(K, lin.bounds - lin.vals + lin.cur), dtype=torch.float64,
                         device=lin.Gh.device)  # [m]
    Y = -D * (lin.Gh.T @ (mu[:, None] * lin.Hrow))  # [n, f']
    return curv * 0.5 * float((gam[:, None] * alp[None, :] * Y.pow(2)).sum())


def _worst_error(exact: np.ndarray, pred: np.ndarray, kinds: list[str]) -> dict:
    """Per constraint kind: the max |exact − linear prediction| of a trial (nats), where the linear model fails."""
    err = np.abs(exact - pred)
    return {k: float(err[[i for i, x in enumerate(kinds) if x == k]].max()) for k in sorted(set(kinds))}


def tr_ratio(phi0: float, phi_lin: float, phi: float, tol: float, err: float, radius: float) -> float:
    """The trust-region ratio ϱ of actual to predicted merit decrease (merits in nats, ≥ 0). At a feasible
    iterate (φ_k ≤ tol) there is no violation to decrease (the step lowers the objective): ϱ = 1 − err / r, the
    linear model's agreement (err = max |exact − linear prediction| of the trial's rows, nats)."""
    if phi0 <= tol:
        return 1.0 - err / radius
    return (phi0 - phi) / max(phi0 - phi_lin, 1e-12)


def tr_update(radius: float, ratio: float, limited: bool) -> float:
    """The standard radius rule (Nocedal & Wright Alg. 4.1) with the module's constants: shrink on a poor ratio,
    grow (to at most TR_MAX) on a good one when the radius limited the step."""
    if ratio < TR_BAD:
        return TR_SHRINK * radius
    if ratio > TR_GOOD and limited:
        return min(TR_GROW * radius, TR_MAX)
    return radius


def _merit(vals: np.ndarray, bounds: np.ndarray) -> float:
    """The trust region's merit: the max violation (nats, ≥ 0) of the bounds [m] by values [m]."""
    return float(np.clip(vals - bounds, 0, None).max())


def _kl_check(pb: _Problem, m: Metric, st: _State, trial: tuple, row: dict, log) -> tuple[float, float, bool]:
    """The KL model's prediction for the trial step (radius, Y, ΔW) made before the exact forward, then the exact KL;
    the curvature scale c (st.curv) is re-fitted to the value the exact KL implies along this ΔW (what the
    top-K / factorised / base-point metric misses along the direction the solver takes). Returns (exact,
    predicted, honest: within [½, 2] of each other or both below the noise floor)."""
    radius, Y_try, dW_try = trial
    Yt_hat = m.UG.T @ Y_try @ m.UA
    quad = 0.5 * float((m.gam[:, None] * m.alp[None, :] * Yt_hat.pow(2)).sum())  # ½ tr(ΔWᵀ G ΔW A)
    kl_pred = st.curv * quad
    kl_try = background_kl(pb.background, pb.w, dW_try, pb.mix0_bg)
    ratio = kl_try / kl_pred if kl_pred > 0 else float("inf")
    honest = 0.5 <= ratio <= 2.0 or max(kl_try, kl_pred) < pb.cfg.kl_floor
    row.setdefault("kl_attempts", []).append(dict(kl_exact=kl_try, kl_predicted=kl_pred, curvature_scale=st.curv,
                                                  radius=radius))
    new_curv = kl_try / quad if quad > 0 and kl_try > 0 else st.curv
    if log and not honest:
        log(f"WFLD GN step {row['iter']}: background KL exact {kl_try:.3g} vs predicted {kl_pred:.3g} "
            f"(×{ratio:.2g}): curvature scale {st.curv:.3g} -> {new_curv:.3g}, step re-solved")
    st.curv = new_curv if max(kl_try, kl_pred) >= pb.cfg.kl_floor else st.curv
    return kl_try, kl_pred, honest


def _result(pb: _Problem, metric: Metric | None, keep: tuple, iters: list[dict], stop: str) -> WfldResult:
    """The best exact iterate as a WfldResult, with its stop reason (a budget stop short of the constraints
    explained by a note starting "convergence:", which the audit's claims bar reads)."""
    violation, residual, dW, worst, kl_exact, kl_pred, it, kl_shipped = keep
    notes = list(pb.warnings)
    if stop == rec.STOP_BUDGET and violation > pb.cfg.gn_tol:
        notes.append(budget_note(pb.budget.nats, it, (kl_exact, kl_shipped), violation, pb.cfg.gn_tol,
                                 iters[-1].get("linear_least_kl")))
    if violation > pb.cfg.gn_tol and stop == rec.STOP_CONVERGED:
        stop = rec.STOP_ITERATION_CAP
    if stop == rec.STOP_ITERATION_CAP and len(iters) > 1 and iters[-1]["violation"] > violation:
        stop = rec.STOP_LINE_SEARCH  # later steps did not improve on the returned iterate
    return WfldResult(dW=dW, iterations=iters, residual=residual, violation=violation, removed=pb.removed,
                      infeasible_events=pb.infeasible, worst_rows=worst, anchor_rank=pb.rank, null_dim=pb.B.shape[1],
                      predicted_bg_kl=kl_pred, exact_bg_kl=kl_exact,
                      fisher_tail_mass=metric.tail_mass if metric is not None else 0.0, stop_reason=stop,
                      tolerance=pb.cfg.gn_tol, kl_budget=None if pb.budget is None else pb.budget.nats,
                      shipped_bg_kl=kl_shipped, warnings=notes)


def budget_note(budget: float, it: int, kls: tuple[float, float | None], violation: float, tol: float,
                needed: float | None = None) -> str:
    """The record note of a solve stopped by the KL budget (the "convergence:" prefix: evals/audit.py); `kls` the
    returned iterate's exact background KL of the float ΔW and as shipped (None: not measured); `needed` the
    modelled KL of meeting every linearised row from the last iterate (`linear_least_kl`; None: not measured)."""
    kl, ks = kls
    shipped = "" if ks is None else f", as shipped {ks:.3g}"
    need = "" if needed is None else (
        f"; meeting every constraint from the last iterate needs a background KL of {needed:.3g} nats in WFLD's "
        f"linear and KL models ({needed / budget:.3g}× the budget; an estimate from the linearisation at that iterate)")
    return (f"convergence: WFLD stopped at the background KL budget {budget:.3g} nats: no trust-region step from "
            f"Gauss–Newton iterate {it} (exact background KL {kl:.3g} nats{shipped}; returned) lowered the max "
            f"violation ({violation:.3g} nats > tolerance {tol:g}) within it; the constraints are not met within the "
            f"budget{need}")
