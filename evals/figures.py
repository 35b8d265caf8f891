"""The audit's evidence: one frozen dataclass per bar family, with the fields the bars read typed.

Each is made in one place — the evidence functions of `l47.evals.metrics` (proxy, slop, collateral, flips, turn
ends, ordinary tokens, special mass) and `l47.evals.audit` (bundle, record, split, claims, KLD per set, engine,
counts, blind, the sampler penalty) — read by the bars (`l47.evals.bars`) by attribute, and turned into dicts
only at the JSON boundary: `figures_dict` (field order = the report's key order; a field marked `OMIT` is left
out while None, so the report keeps the shape it had as a dict), called by `l47.evals.audit.clean` when
report.json is built; report.md is rendered from that JSON. Values below a family's top level (per phrase, per
word, per document, rows) stay JSON-able dicts and lists."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass

from l47.evals.kld_stats import KldStats

OMIT = {"omit_none": True}  # field metadata: the key is absent from the JSON while the value is None


def _opt(default=None):
    """A field that is absent from the JSON while None (a figure only one shape of the family has)."""
    return field(default=default, metadata=OMIT)


def figures_dict(obj) -> dict:
    """A figures dataclass -> its JSON dict, one level (nested figures are converted by the caller's walk):
    fields in declaration order, `OMIT` fields left out while None."""
    if hasattr(obj, "to_dict"):  # a figure with its own JSON shape (SetKld, KldStats)
        return obj.to_dict()
    return {f.name: getattr(obj, f.name) for f in fields(obj)
            if not (f.metadata.get("omit_none") and getattr(obj, f.name) is None)}


def is_figures(obj) -> bool:
    """A dataclass instance (a family of figures, or a KldStats) the JSON boundary turns into a dict."""
    return is_dataclass(obj) and not isinstance(obj, type)


@dataclass(frozen=True)
class BundleFigures:
    """Bars bundle.*: the bundle compared with the base tensor by tensor and key by key (audit.bundle_figures)."""

    form: str  # "full" | "overlay"
    target: str
    compared: int  # tensors compared with the base
    others_changed: list[str]
    target_type_shape: list[str]
    target_changed: bool
    dw_rel: float  # ‖ΔW‖/‖W‖ of the runtime weights (0 when the target is unchanged)
    dw_fro: float
    blocks_changed: int | None  # Q8_0 blocks of the target that differ (None: types differ / not blockwise)
    metadata_changed: list[str]
    metadata_omitted: list[str]
    scope_claims: dict[str, list[str]]
    scope_mismatches: list[str]
    sha256: str
    base_sha256: str


@dataclass(frozen=True)
class ProxyFigures:
    """Bars proxy.*: base CE per document, the zero-proxy agreement, the own-generation check
    (metrics.proxy_figures)."""

    ln_V: float
    limit: float  # ce_proxy_frac · ln V
    ce_max: float | None
    ce_pooled: float | None
    tokens: int
    docs: dict[str, dict]  # path -> {set, ce, top1, T}
    zero_proxy: dict[str, dict]  # path -> {max_rel, mean_abs}
    zero_proxy_max: float | None
    unverified: list[str]  # paths of scored dumps without the engine's log p
    tol: float
    own_generation: dict[str, dict]  # path -> {set, checked, undecided, outside, first_rows[, wider]}
    allow_unverified: bool


@dataclass(frozen=True)
class RecordFigures:
    """Bars (a), (b) and c.disjoint against the solve record (audit.record_figures). Without a record only
    `present`, `why` and `overlap` (the experiment's own copies) are set."""

    present: bool
    why: str | None = _opt()
    path: str | None = _opt()
    method: str | None = _opt()
    n_slop: int | None = _opt()
    n_terms: dict[str, int] | None = _opt()
    not_prefix_exact: list[dict] | None = _opt()
    non_events: list[dict] | None = _opt()
    unnatural_docs: list[dict] | None = _opt()
    training_docs: list[dict] | None = _opt()
    overlap: list[dict] | None = None  # in the JSON even when None
    slop_positions: list[tuple[str, int]] | None = _opt()
    background_positions: list[tuple[str, int]] | None = _opt()


@dataclass(frozen=True)
class SplitFigures:
    """Bar c.heldout_fraction: events per split (audit.dev_evidence)."""

    events: dict[str, int]  # train / dev / heldout
    heldout_frac: float | None
    split: dict | None  # the sets report's split (seed, fractions, assignment)


@dataclass(frozen=True)
class SlopFigures:
    """Bars c.slop and blind.slop_residual*: p(rejected) before / after at the given events, pooled, fresh,
    copies and per phrase (metrics.slop_figures). With no event only n, p_before, p_after, reduction,
    residual_ratio (None) and the bootstrap keys; the per-set table leaves `events` out."""

    n: int
    p_before: float | None
    p_after: float | None
    reduction: float | None
    residual_ratio: float | None
    argmax_rejected_before: int | None = _opt()
    argmax_rejected_after: int | None = _opt()
    argmax_special_after: int | None = _opt()
    special_p_before: float | None = _opt()
    special_p_after: float | None = _opt()
    p_penalty: float | None = _opt()
    p_stacked: float | None = _opt()
    residual_interval: list[float] | None = None
    n_docs: int = 0
    fresh: dict = field(default_factory=dict)  # the same figures over events that are not in-context copies
    copies: dict = field(default_factory=dict)
    per_phrase: dict[str, dict] = field(default_factory=dict)  # phrase -> figures + interval + copies
    bootstrap: dict = field(default_factory=dict)  # l47.data.uncertainty.settings
    events: list[dict] | None = _opt()


@dataclass(frozen=True)
class ClaimsFigures:
    """Bar claims: the record's claims re-derived and compared (audit.claims_figures). Without a record only
    `present` and `why`."""

    present: bool
    why: str | None = _opt()
    compared: dict[str, dict] | None = _opt()
    mismatched: list[str] | None = _opt()
    not_rederived: list[str] | None = _opt()
    rederived: dict | None = _opt()
    convergence: dict | None = _opt()


@dataclass(frozen=True)
class CollateralFigures:
    """Bars d.word_mean and d.frac_below (metrics.collateral_figures)."""

    n: int
    mean_dlogp: float | None
    n_below: int
    frac_below: float | None
    min_word_mean: float | None
    per_word: dict[str, dict]  # word -> {n, mean_dlogp, n_below, frac_below, worst, worst_context, worst_p}
    rows: list[dict]


@dataclass(frozen=True)
class SetKld:
    """Bar e.kld, one set: KL(base ‖ bundle) statistics away from the prefix rows (judged), at them, over all
    rows (audit.kld_figures). JSON: the judged statistics' keys with `prefix_rows` and `all_rows` beside them."""

    stats: KldStats
    prefix_rows: KldStats | None
    all_rows: KldStats | None

    def to_dict(self) -> dict:
        return {**self.stats.to_dict(),
                "prefix_rows": self.prefix_rows.to_dict() if self.prefix_rows else {"n": 0},
                "all_rows": self.all_rows.to_dict() if self.all_rows else None}


@dataclass(frozen=True)
class EngineFigures:
    """Bars e.engine_kld and engine.zero_proxy (audit._engine_figures); both None (JSON {}) without engine
    dumps of the bundle."""

    zero_proxy_edited: dict[str, dict] | None = _opt()  # edited-engine dump -> {doc, max_rel, mean_abs}
    kld: dict[str, dict] | None = _opt()  # set -> {kld, floor, tail_kld}


@dataclass(frozen=True)
class FlipFigures:
    """Bars f.flips / blind.f.flips (metrics.flip_figures)."""

    docs: int  # chat-formatted documents
    positions: int
    damage: int  # flips of the failing kind
    by_kind: dict[str, int]
    flips: list[dict]


@dataclass(frozen=True)
class TurnEndFigures:
    """Bars f.turn_end_* / blind.f.turn_end_* (metrics.turn_end_figures)."""

    n: int
    was_argmax: int
    kept: int
    lost: int
    lost_rows: list[dict]
    mean_dlogp: float | None
    min_dlogp: float | None
    protected: dict  # {n, lost, mean_dlogp} of the turn ends the solver held fixed


@dataclass(frozen=True)
class OrdinaryFigures:
    """Bars (g) / blind.g.* (metrics.ordinary_figures)."""

    docs: int
    n_ordinary: int
    mean_dlogp: float | None
    median_dlogp: float | None
    frac_below: float | None
    n_non_slop: int
    kld: float | None
    prefix_rows: dict  # {n, kld_mean, target_dlogp_mean}: reported apart, not judged


@dataclass(frozen=True)
class SpecialMassFigures:
    """Bars f.special_mass / blind.f.special_mass (metrics.special_mass_figures)."""

    per_split: dict[str, dict]  # split -> {n, before, after, rise}
    max_rise: float | None


@dataclass(frozen=True)
class CountFigures:
    """Bars c.min_heldout_per_phrase, d.min_per_word, d.min_total (audit.count_figures)."""

    heldout_per_phrase: dict[str, int]
    collateral_per_word: dict[str, int]
    collateral_total: int


@dataclass(frozen=True)
class BlindFigures:
    """Bars blind.*: the blind set's figures beside the dev report's (audit.blind_evidence)."""

    bundle_sha256: str
    dev_bundle_sha256: str
    doc_sha256: list[str]
    n_docs: int
    never_scored: bool
    ledgers: list[str]
    slop: SlopFigures
    flips: FlipFigures
    turn_ends: TurnEndFigures
    special_mass: SpecialMassFigures
    ordinary: OrdinaryFigures
    dev_residual_ratio: float | None
    events_before_scoring: dict
    own_generation_replay: str
    absolute_residual_vs_dev: float | None
    comparisons: list[dict]


@dataclass(frozen=True)
class CheapFormFigures:
    """One cheaper form of the sampler penalty (l47.evals.penalty: not exported) against the exact one, over the
    scored documents: its extra hits and what they cost (audit._penalty_figures)."""

    positions: int  # rows with at least one extra penalised token
    pairs: int  # (row, token) pairs penalised by the cheap form only
    target_hit: int  # rows where an extra-penalised token is the actual target (a legitimate use suppressed)
    examples: list[dict]  # the first extra rows: {doc, pos, context, target, dlogp_target}
    mean_dlogp_target: float | None  # Δ log p(target) of base + cheap penalty at the extra rows (None: no row)
    min_dlogp_target: float | None
    mean_kld: float | None  # KL(base ‖ base + cheap penalty) at the extra rows


@dataclass(frozen=True)
class PenaltyFigures:
    """The sampler penalty of seed §6.3 simulated exactly on the scored documents, alone on the base and stacked
    on the bundle (audit._penalty_figures). Reported, no bar."""

    bias: float  # logits
    form: str  # the exported form (l47.evals.penalty.FORMS)
    rules: list[dict]  # {phrase, prefix, token, text}: one per banned tuple
    penalised_rows: int  # rows where the exact form lowers at least one token
    unchanged_rows: int
    unchanged_max_abs_dlogp_alone: float  # max |Δ log p(target)| at the unchanged rows: 0 by construction, measured
    unchanged_max_abs_dlogp_stacked: float  # the same for bundle + penalty against the bundle
    kld_alone_per_set: dict[str, dict]  # set -> {mean: KL(base ‖ base + penalty) over its rows, penalised_rows}
    cheap_forms: dict[str, CheapFormFigures]  # cheap form -> its extra hits
