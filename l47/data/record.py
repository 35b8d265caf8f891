"""The solve record: what `l47 solve` used and claims, written as JSON beside the bundle (`<bundle>.solve.json`).

One set of types for both sides: the solver fills a `SolveRecord` (its `claims` a `SolveClaims`), the audit reads
the same types back with `read_record` and re-derives the same `SolveClaims` with its own forward
(l47.evals.audit.claims_figures). No string keys are shared between them: a claim is a dataclass field.

The audit checks bar (a) (every slop position is prefix-exact and an event), the non-event rule and
train/eval disjointness against THIS record — what the solver actually touched — never against its own
re-mining (seed §5.3: the failure was positions the solver added).

JSON form (`schema` = RECORD_SCHEMA = 3; documented in docs/ARCHITECTURE.md "The solve record"): the dataclasses
below as nested objects (`dataclasses.asdict`), keys sorted; an absent optional claim is `null`. Schemas 1 (the
same layout without `claims.convergence`) and 2 (without `sweep`, the candidates of `l47 solve --sweep`) are read
as well: every field added since is optional (`experiment_content` / `experiment_content_sha256`, what the solve
was made from, included: the audit refuses a record without them).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from l47.errors import L47Error
from l47.fileio import read_json

RECORD_SCHEMA = 3
READABLE_SCHEMAS = (1, 2, 3)
# kinds of objective terms a touched position can carry
TERM_SLOP = "slop"  # FTPO margin / preference at a training event (must be prefix-exact, base p >= 1e-2)
TERM_ANCHOR = "anchor"  # protected collateral context (zero change)
TERM_BACKGROUND = "background"  # background KL / Fisher preservation
TERM_SPECIAL = "special"  # no rise of special tokens at an event
TERM_TETHER = "tether"  # non-target tether at an event position
TERM_KINDS = (TERM_SLOP, TERM_ANCHOR, TERM_BACKGROUND, TERM_SPECIAL, TERM_TETHER)
# why a solver stopped (SolveClaims.convergence.stop_reason)
STOP_CONVERGED = "converged"  # every constraint within its tolerance
STOP_ITERATION_CAP = "iteration_cap"  # the iteration / step budget ran out first
STOP_LINE_SEARCH = "line_search_failed"  # no backtracking step improved the merit function
STOP_BUDGET = "budget"  # the ‖ΔW‖ / background-KL budget was reached
STOP_TIME = "time_budget"  # the solver's time budget ran out first (the best candidate so far is kept)
STOP_REASONS = (STOP_CONVERGED, STOP_ITERATION_CAP, STOP_LINE_SEARCH, STOP_BUDGET, STOP_TIME)


@dataclass(frozen=True)
class Touched:
    doc_sha256: str
    pos: int  # row t (predicts tokens[t+1])
    token: int  # the token whose logit the term acts on (for slop: the rejected final token)
    term: str  # one of TERM_KINDS
    phrase: str = ""  # for slop terms: the banned phrase
    base_p: float | None = None  # base p(token) at that position when the term was built


@dataclass(frozen=True)
class InputFile:
    path: str
    sha256: str
    set: str  # experiment set name (train, dev, background, collateral_anchor, ...) or "model"/"experiment"


# ----------------------------------------------------------------------------------------------------------
# the claims


@dataclass(frozen=True)
class PRejected:
    """Mean p(rejected final token) over a set's events, base vs the re-quantised bundle."""

    before: float
    after: float
    n: int  # events
    per_phrase_before: dict[str, float] = field(default_factory=dict)  # phrase -> mean over its events
    per_phrase_after: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class AnchorClaims:
    """|Δ log p(target)| at the protected anchor positions (collateral contexts and turn ends)."""

    n: int
    max_abs_dlogp_float: float | None = None  # float ΔW, before re-quantisation
    max_abs_dlogp_shipped: float | None = None  # the re-quantised bundle
    requant_floor: float | None = None  # float ΔW vs shipped: what re-quantisation alone moves


@dataclass(frozen=True)
class Convergence:
    """How the solver ended (filled by the solvers; None where a solver does not report it)."""

    stop_reason: str | None = None  # one of STOP_REASONS
    max_violation: float | None = None  # max constraint violation at the returned iterate (nats)
    violation_tol: float | None = None  # the tolerance it was held to (nats)
    iterations: int | None = None


@dataclass(frozen=True)
class SolveClaims:
    """Figures the solver claims, measured on the re-quantised weights unless the field says otherwise. Every
    field is optional: a record claims only what it fills (a hand-made control bundle may claim nothing)."""

    dW_rel_norm: float | None = None  # ‖ΔW‖/‖W‖ of the runtime weights after re-quantisation
    dW_rel_norm_float: float | None = None  # the same of the float ΔW
    blocks_changed: int | None = None  # Q8_0 blocks of the target whose bytes differ from the base
    train_p_rejected: PRejected | None = None  # at the record's slop positions
    dev_p_rejected: PRejected | None = None  # at the dev events
    background_kl_exact: float | None = None  # mean KL(base ‖ bundle) at the record's background positions
    background_kl_predicted: float | None = None  # the solver's own prediction of the same (WFLD: its KL model)
    anchors: AnchorClaims | None = None
    convergence: Convergence | None = None
    feasibility: dict | None = None  # the plan made before solving (solvers/plan.py FeasibilityPlan, as JSON)
    anchor_choice: dict | None = None  # anchors thinned to the budget: kept, rank, budget (solvers/anchors.py)
    method: dict = field(default_factory=dict)  # the solver's own diagnostics (free form, never re-derived)

    def flat(self) -> Iterator[tuple[tuple[str, ...], object]]:
        """(path, value) of every filled leaf, e.g. (("train_p_rejected", "per_phrase_after", "short version"),
        0.8): the path is field names (and phrase / method keys), in field order; None fields are skipped."""
        yield from flat_items(self)

    @staticmethod
    def from_dict(d: dict | None) -> "SolveClaims":
        d = dict(d or {})
        sub = {"train_p_rejected": PRejected, "dev_p_rejected": PRejected, "anchors": AnchorClaims,
               "convergence": Convergence}
        for k, cls in sub.items():
            if d.get(k) is not None:
                d[k] = cls(**d[k])
        return SolveClaims(**d)


def flat_items(o, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], object]]:
    """(path, value) of every leaf of nested dicts and dataclasses (None skipped)."""
    if o is None:
        return
    if isinstance(o, dict):
        for k, v in o.items():
            yield from flat_items(v, path + (str(k),))
    elif hasattr(o, "__dataclass_fields__"):
        for f in fields(o):
            yield from flat_items(getattr(o, f.name), path + (f.name,))
    else:
        yield path, o


def claim_name(path: tuple[str, ...]) -> str:
    """The dotted display name of a claim path (report.json's `claims.compared` keys)."""
    return ".".join(path)


# ----------------------------------------------------------------------------------------------------------
# the sweep (`l47 solve --sweep`, solvers/sweep.py)


@dataclass(frozen=True)
class SweepCandidate:
    """One candidate of the grid, solved, re-quantised as shipped and judged on dev only (exact forward)."""

    name: str  # "c1", "c2", ... in grid order
    overrides: dict  # the solver keys it sets over the resolved config (e.g. {"kl_budget": 0.0025, ...})
    background_kl_exact: float  # mean KL(base ‖ shipped) at the solve's background positions
    dev_removal: float  # mean over phrases of log max(dev residual, configured target): lower = more removal
    dev_residual: float  # pooled dev p(rejected) after / before
    dev_residual_worst: float  # the largest per-phrase dev residual (phrases with dev events)
    dev_residual_per_phrase: dict[str, float]  # phrase -> mean after / mean before on its dev events
    within_budget: bool  # background_kl_exact ≤ the sweep's KL budget
    on_frontier: bool  # no other candidate has ≤ removal score, ≤ worst residual and ≤ KL, one strictly
    chosen: bool
    stop_reason: str | None = None  # the solver's (SolveClaims.convergence)
    # the residuals' 90 % intervals, bootstrapped over dev DOCUMENTS (l47.data.uncertainty.residual_intervals):
    # [lo, hi], None with fewer than 2 documents; absent (None / {}) in records written before they existed
    dev_residual_interval: list[float] | None = None  # of the pooled dev_residual
    dev_residual_interval_per_phrase: dict[str, list[float] | None] = field(default_factory=dict)


@dataclass(frozen=True)
class SweepRecord:
    budget: float  # nats of mean background KL the choice is held to (the solve's KL budget)
    rule: str  # how the chosen candidate is picked
    chosen: str  # its name
    reason: str  # why, with its figures
    candidates: list[SweepCandidate] = field(default_factory=list)

    @staticmethod
    def from_dict(d: dict | None) -> "SweepRecord | None":
        if d is None:
            return None
        d = dict(d)
        return SweepRecord(**{**d, "candidates": [SweepCandidate(**c) for c in d.get("candidates", [])]})


# ----------------------------------------------------------------------------------------------------------
# the record


@dataclass(frozen=True)
class SolveRecord:
    method: str  # "wfld" | "ftpo"
    toolkit_version: str
    seed: int
    base_sha256: str
    bundle_sha256: str
    target: str
    config: dict  # the resolved solver config (every knob)
    inputs: list[InputFile]
    touched: list[Touched]
    claims: SolveClaims
    schema: int = RECORD_SCHEMA
    notes: list[str] = field(default_factory=list)
    numerics: dict = field(default_factory=dict)  # head precision used and its measured error (Numerics.record)
    stamps: list[str] = field(default_factory=list)  # facts the reader must see first (other_model_stamp)
    sweep: SweepRecord | None = None  # `l47 solve --sweep`: every candidate and the choice (schema ≥ 3)
    # what the solve was made from (l47.data.sets.experiment_content of its sets report, and its hash): the audit
    # refuses a record whose solve view of it is not the experiment at hand's (l47.data.sets.check_handoff)
    experiment_content: dict | None = None
    experiment_content_sha256: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)


def record_path_for(bundle: Path) -> Path:
    bundle = Path(bundle)
    return bundle.with_name(bundle.name + ".solve.json")


def read_record(path: Path) -> SolveRecord:
    path = Path(path)
    d = read_json(path, "solve record")
    if d.get("schema") not in READABLE_SCHEMAS:
        raise L47Error(path, "schema", f"one of {READABLE_SCHEMAS}", repr(d.get("schema")))
    try:
        return SolveRecord(
            method=d["method"], toolkit_version=d["toolkit_version"], seed=int(d["seed"]),
            base_sha256=d["base_sha256"], bundle_sha256=d["bundle_sha256"], target=d["target"], config=d["config"],
            inputs=[InputFile(**x) for x in d["inputs"]], touched=[Touched(**x) for x in d["touched"]],
            claims=SolveClaims.from_dict(d["claims"]), schema=RECORD_SCHEMA, notes=list(d.get("notes", [])),
            numerics=dict(d.get("numerics", {})), stamps=list(d.get("stamps", [])),
            sweep=SweepRecord.from_dict(d.get("sweep")), experiment_content=d.get("experiment_content"),
            experiment_content_sha256=str(d.get("experiment_content_sha256") or ""),
        )
    except (KeyError, TypeError) as e:
        raise L47Error(path, "solve record", "every field of SolveRecord", f"{type(e).__name__}: {e}") from None
