"""One home per solver setting: its meaning, default and range live in the config dataclass field's metadata
(`knob`). `l47 init`'s schema (l47/app/init.py), docs/EXPERIMENT.md's generated tables and the range validation of
`l47 solve` (solvers/solve.py `resolve_config`) read them from there."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

KNOB = "l47.knob"  # the metadata key


@dataclass(frozen=True)
class Knob:
    meaning: str  # one line: what the setting does (the schema's and the docs' text)
    lo: float | None = 0.0  # inclusive bounds of a number (None: unbounded); every element of a list of numbers
    hi: float | None = None
    open_lo: bool = False  # the bound itself is refused
    open_hi: bool = False
    expected: str | None = None  # the error's "expected" text where a plain "in [lo, hi]" says too little

    def ok(self, x: float) -> bool:
        """Whether the number x is finite and within the bounds."""
        if not math.isfinite(x):
            return False
        if self.lo is not None and (x <= self.lo if self.open_lo else x < self.lo):
            return False
        return self.hi is None or (x < self.hi if self.open_hi else x <= self.hi)


def knob(default, meaning: str, lo: float | None = 0.0, hi: float | None = None, **kw):
    """A config field with its default and its Knob (meaning, range) in the metadata."""
    return field(default=default, metadata={KNOB: Knob(meaning, lo, hi, **kw)})


def knob_of(cls, name: str) -> Knob | None:
    """The Knob of field `name` of dataclass `cls` (None: the field has none)."""
    return next((f.metadata.get(KNOB) for f in dataclasses.fields(cls) if f.name == name), None)


def meanings(cls) -> dict[str, str]:
    """Field name -> its meaning ('' where the field has no Knob)."""
    return {f.name: (f.metadata[KNOB].meaning if KNOB in f.metadata else "") for f in dataclasses.fields(cls)}


def ranges(cls) -> dict[str, tuple[float | None, float | None]]:
    """Field name -> its inclusive (lo, hi), what l47.data.experiment.config_from_table checks (fields without a
    Knob: its default, >= 0)."""
    return {f.name: (f.metadata[KNOB].lo, f.metadata[KNOB].hi) for f in dataclasses.fields(cls) if KNOB in f.metadata}
