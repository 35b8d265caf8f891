"""The scoring ledger: every command that scores documents appends (document hash, bundle hash, command).

A JSON-lines file. The blind sign-off refuses a document whose hash is already in it (seed §6.2–6.3: a blind
document is scored once). Appends are atomic: the whole new file is written to a temp file and renamed.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from l47.errors import L47Error
from l47.fileio import write_text_atomic

LEDGER_NAME = "ledger.jsonl"


@dataclass(frozen=True)
class LedgerEntry:
    doc_sha256: str
    bundle_sha256: str  # the model/bundle the document was scored against
    command: str
    time: float


LEDGER_ENV = "L47_LEDGER"


def default_ledger() -> Path | None:
    """The ledger `score` and `sets` append to when none is named: $L47_LEDGER, else none. (`solve` defaults to
    the bundle's folder, `audit` to its output folder.)"""
    v = os.environ.get(LEDGER_ENV)
    return Path(v) if v else None


def read_ledger(path: Path) -> list[LedgerEntry]:
    path = Path(path)
    if not path.exists():
        return []
    if not path.is_file():
        raise L47Error(path, "ledger", "a JSON-lines ledger file", "a directory" if path.is_dir() else "not a file")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise L47Error(path, "ledger", "a JSON-lines ledger (UTF-8 text)", f"binary bytes at offset {e.start}") from None
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            out.append(LedgerEntry(str(d["doc_sha256"]), str(d["bundle_sha256"]), str(d["command"]),
                                   float(d["time"])))
        except (ValueError, KeyError, TypeError) as e:
            raise L47Error(path, f"line {i}", "a JSON object with doc_sha256, bundle_sha256, command, time",
                           f"{line[:80]!r} ({type(e).__name__})") from None
    return out


def append_ledger(path: Path, entries: list[tuple[str, str]], command: str) -> None:
    """Append (doc hash, bundle hash) pairs scored by `command`, atomically."""
    path = Path(path)
    existing = read_ledger(path)  # refuses a corrupt ledger before touching it
    now = time.time()
    lines = [json.dumps(asdict(e)) for e in existing]
    lines += [json.dumps(asdict(LedgerEntry(d, b, command, now))) for d, b in entries]
    write_text_atomic(path, "\n".join(lines) + "\n")


def scored_before(path: Path, doc_sha256: str) -> list[LedgerEntry]:
    return [e for e in read_ledger(path) if e.doc_sha256 == doc_sha256]
