"""FTPO's settings (`FtpoConfig`, the [solver.ftpo] table) and the problem it acts on (`FtpoProblem`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from l47.model import names
from l47.solvers.batch import Batch, EventTerms
from l47.solvers.knobs import knob

OBJECTIVES = ("target", "margin")
ODDS = ("top_k", "vocabulary")


@dataclass(frozen=True)
class FtpoConfig:
    """The [solver.ftpo] table: each field's meaning, default and range in its metadata (solvers/knobs.py). Why
    each default is what it is, as measured on the demo and model2: docs/SOLVERS.md and docs/BENCHMARKS.md."""

    objective: str = knob(
        "target", "target (log-odds hinge to aim·target_residual·p0 per event) | margin (the seed's preference term)")
    odds: str = knob(
        "top_k", "the log-odds the target hinge lowers: top_k (of the banned token against the rest of its base "
        "top-K) | vocabulary (against every ordinary token: what the residual measures)")
    aim: float = knob(
        0.5, 'train events aim at aim × target_residual × their base p (held-out follows train only in part)')
    margin: float = knob(2.0, 'nats of the preference margin (margin objective)')
    taper: float = knob(0.25, "τ (nats) of the hinge's softplus taper")
    lr: float = knob(0.2, "Adam step, relative to the RMS of W's entries")
    warmup: int = knob(20, 'steps of linear step-size warm-up')
    floor: float = knob(0.0, "Adam's ε as this × the matrix RMS of √v (0: plain Adam)")
    key_ridge: float = knob(
        1e-3, 'ridge of the key basis relative to the background energy per direction (larger: fewer directions the'
        ' background never shows)')
    key_rank: int = knob(
        8, 'per phrase, key directions ΔW may act on (generalized eigenvectors vs the background); 0: all of f')
    metric_cap: float = knob(
        0.0, "> 0: ΔW's output directions scaled by the background KL's Gauss–Newton factor (K-FAC G), each gain "
        'within [1/metric_cap, metric_cap] (0: off; docs/SOLVERS.md "The output metric")', 0.0)
    steps: int = knob(
        1000, 'step cap (the candidate within the KL budget with the most removal, each phrase judged by the larger'
        ' of its dev and train residuals, is kept)')
    lambda_kl: float = knob(
        1.0, 'initial weight of background KL / kl_budget (doubled while the exact KL is over the budget)')
    lambda_floor: float = knob(
        1.0, 'λ comes down (relax) to lambda_kl × this at the lowest while the KLs stand with slack (1: never below '
        'its initial value)', 0.0, 1.0)
    lambda_cond: float = knob(
        1.0, 'weight of the conditional tether KL / kl_budget at near misses (the natural continuation keeps its '
        'share)')
    lambda_shape: float = knob(
        0.0, 'weight of the conditional tether KL / kl_budget at events (the freed mass spreads as the base '
        'spreads it; 0: off, see docs/SOLVERS.md)')
    lambda_coll: float = knob(
        4.0, 'weight of the soft anchors ((Δlog p / bar tolerance)², linear past anchor_knee for the words; mean per '
        "word and turn ends; doubled while a judged word's or the turn ends' mean Δlog p over the solver's anchors, "
        "or the words' share below bar (d)'s threshold, is past its bar)")
    anchor_knee: float = knob(
        2.0, "soft anchors of the collateral words: the square of Δlog p / tolerance turns linear past this many "
        "tolerances (Huber; inf: the square throughout). Bar (d) asks a word's MEAN and the share of occurrences "
        "below its per-occurrence threshold, not every anchor at the tolerance", lo=0.5)
    own_anchors: bool = knob(
        False, "the collateral words' ordinary uses in the solver's own train and background documents are soft "
        "anchors too (beside collateral_anchor's)")
    lambda_special: float = knob(
        1.0, "weight of the special-token guard (nats of log Σ p(special) risen, mean over the events; doubled while "
        "the judged mean Σ p(special) at the train, dev or background events rises past bar (f)'s special_rise_tol)")
    lambda_flip: float = knob(
        1.0, "weight of the near-tie guard: (shrink of the special-vs-argmax gap / its base size)², summed (bar "
        "(f)'s flips)")
    flip_margin: float = knob(
        1.0, 'nats: background rows and turn ends whose top two (one special, one not) are this close are guarded')
    gap_margin: float = knob(
        4.0, 'nats: rows whose top two (one special, one word) are this close define the gap directions ΔW is kept'
        ' off (0: off)')
    gap_rows: int = knob(2048, 'at most this many of those rows (the smallest gaps first)')
    turn_end_energy: float = knob(
        0.0, "> 0: share of the solver's turn ends' ∂ log p(<|im_end|>)/∂ys energy whose directions ΔW's output is"
        " kept off (at most n // 8 directions; 0: off, the default)")
    lambda_ridge: float = knob(0.0, 'ridge on ‖ΔW‖² / ‖W‖²')
    tether_topk: int = knob(32, 'top-K base tokens of the conditional tether and the log-odds')
    background_batch: int = knob(512, 'background positions per step (rotating; the exact KL uses all)')
    kl_rows: int = knob(
        65536, 'background and dev positions at most: every row of their documents up to this cap (a strided sample '
        'is what the edit fits)', 1)
    anchor_batch: int = knob(256, 'soft anchors per step (rotating; 0: all of them)')
    plausible_end_p: float = knob(
        0.05, 'background rows whose base p(<|im_end|>) is at least this (the turn may end there; target another '
        'token) hold log p(<|im_end|>) as one more soft-anchor group, tol = bar (f)\'s 0.005 nats (0: off; '
        'docs/SOLVERS.md "Plausible turn ends")', 0.0, 1.0)
    plausible_end_rows: int = knob(4096, '... at most this many, the most likely first')
    end_odds_tol: float = knob(
        0.0, 'nats of Δ log-odds of <|im_end|> against its base top-K rivals that cost λ_coll at the real and '
        'plausible turn ends, beside their Δlog p (holds its lead where p ≈ 1; 0: off, the default; '
        'docs/SOLVERS.md)')
    end_lead_tol: float = knob(
        0.0, 'nats by which a runner-up word may gain on <|im_end|> on average over the turn ends (real and '
        'plausible) where it is the base runner-up, at a cost of λ_coll (0: off, the default; '
        'docs/SOLVERS.md)')
    eval_every: int = knob(10, 'steps between exact evaluations (re-quantised: KL, train and dev residual per phrase)')
    recover_after: int = knob(
        3, 'after this many exact evaluations in a row over the KL budget, restart from the kept candidate with '
        'fresh Adam moments and half the step (0: off, λ alone; docs/BENCHMARKS.md)')
    relax: float = knob(
        0.5, 'the multipliers come back down (next_multiplier): λ halves (never below lambda_kl) after an evaluation '
        'whose KLs all stand below this share of their limits, λ_flip after relax_after clean evaluations (0: they '
        'only rise; docs/SOLVERS.md "Multipliers that come back down")', 0.0, 1.0)
    relax_after: int = knob(3, 'clean evaluations in a row (no flip, no lost turn end) before λ_flip halves', 1)
    time_budget_s: float = knob(0.0, '> 0: stop after this many seconds, keeping the best candidate so far')
    seed: int = knob(0, 'training seed')


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
    turn_ends: int = 0  # the last `turn_ends` anchors are real turn ends (target <|im_end|>): their own group
    near: Batch | None = None  # prefix rows whose target is not the banned final (near misses)
    near_banned: torch.Tensor | None = None  # [N] the banned final token at each near miss
    dev: Batch | None = None  # dev events
    dev_final: torch.Tensor | None = None  # [D]
    dev_phrase: list[str] = field(default_factory=list)
    dev_rows: Batch | None = None  # dev documents' rows but the phrases' prefix rows (bar (g)'s rows): exact KL, flips
    # and turn ends per candidate
    dev_kl_limit: float | None = None  # bar (g)'s limit: admissible while the dev rows' mean KL is within it at 95 %
    # confidence (its upper bound over documents); None: the dev mean within kl_budget
    word_below: float = -0.1  # bar (d)'s per-occurrence threshold, nats (collateral_below) ...
    word_frac_below: float = 0.10  # ... and the share of the words' anchors the judge lets fall below it
    guard: Batch | None = None  # slop events of the background documents: Σ p(special) guarded and judged there
    special_tol: float = 1e-6  # bar (f)'s allowed rise of the mean Σ p(special) at the events (the judge's)
    im_end: int | None = None  # the turn-end token: the judge counts turn ends (dev rows, anchors) that lose its argmax
    im_end_tol: float = 0.005  # nats of Δlog p(<|im_end|>) that cost λ_coll at a plausible turn end (bar (f)'s)
    shipped: object = None  # callable ΔW -> runtime W_sd as shipped (re-quantised); None: W_sd + ΔW

    def word_anchors(self) -> list[bool]:
        """Per anchor: a collateral word's (bar (d)), not the turn ends' group (bar (f))."""
        return [g != names.IM_END for g in self.anchor_group]

    def turn_end_rows(self) -> list[int]:
        """The anchors' rows that are real turn ends (the last `turn_ends` of them)."""
        n = 0 if self.anchors is None else self.anchors.P
        return list(range(n - self.turn_ends, n))
