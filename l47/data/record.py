"""The solve record: what `l47 solve` used and claims, written as JSON beside the bundle.

The audit checks bar (a) (every slop position is prefix-exact and an event), the non-event rule and
train/eval disjointness against THIS record — what the solver actually touched — never against its own
re-mining (seed §5.3: the failure was positions the solver added).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from l47.errors import L47Error

RECORD_SCHEMA = 1
# kinds of objective terms a touched position can carry
TERM_SLOP = "slop"  # FTPO margin / preference at a training event (must be prefix-exact, base p >= 1e-2)
TERM_ANCHOR = "anchor"  # protected collateral context (zero change)
TERM_BACKGROUND = "background"  # background KL / Fisher preservation
TERM_SPECIAL = "special"  # no rise of special tokens at an event
TERM_TETHER = "tether"  # non-target tether at an event position
TERM_KINDS = (TERM_SLOP, TERM_ANCHOR, TERM_BACKGROUND, TERM_SPECIAL, TERM_TETHER)


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
    claims: dict  # figures the solver claims, after re-quantisation (e.g. train/dev p(rejected) before/after,
    # background KL, ||dW||/||W||, feasibility)
    schema: int = RECORD_SCHEMA
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)


def record_path_for(bundle: Path) -> Path:
    bundle = Path(bundle)
    return bundle.with_name(bundle.name + ".solve.json")


def read_record(path: Path) -> SolveRecord:
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise L47Error(path, "solve record", "an existing JSON file", "nothing") from None
    except ValueError as e:
        raise L47Error(path, "solve record", "valid JSON", f"{type(e).__name__}: {e}") from None
    if d.get("schema") != RECORD_SCHEMA:
        raise L47Error(path, "schema", str(RECORD_SCHEMA), repr(d.get("schema")))
    try:
        return SolveRecord(
            method=d["method"], toolkit_version=d["toolkit_version"], seed=int(d["seed"]),
            base_sha256=d["base_sha256"], bundle_sha256=d["bundle_sha256"], target=d["target"], config=d["config"],
            inputs=[InputFile(**x) for x in d["inputs"]], touched=[Touched(**x) for x in d["touched"]],
            claims=d["claims"], schema=d["schema"], notes=list(d.get("notes", [])),
        )
    except (KeyError, TypeError) as e:
        raise L47Error(path, "solve record", "every field of SolveRecord", f"{type(e).__name__}: {e}") from None
