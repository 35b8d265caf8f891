"""The scoring ledger: one per base model, recording every document (by content: the sha256 of its token ids)
that any command scored, before it scored it (DESIGN §4, §6; seed §6.2–6.3: a blind document is scored once).

Where: `$L47_HOME/ledgers/<base sha256>.jsonl` (L47_HOME defaults to `~/.l47`): one file per base model,
shared by every experiment, output folder and command on this machine; `--ledger PATH` names another. Never per
`--out` folder: a blind document scored once is refused from any folder after.

Format: JSON lines. Line 1 is the header `{"schema": "l47.ledger/1", "base_sha256": <base model's sha256>}`;
every other line is an entry `{"doc_sha256", "bundle_sha256", "command", "time", "event"[, "note"]}`:
    doc_sha256     the document's content hash (l47.dumps.content_hash of its tokens)
    bundle_sha256  the model it was scored against (the base, or an edited bundle of it)
    command        score | sets | solve | audit | penalty | demo
    event          "scored" (appended BEFORE the scoring starts), "blind-started" (the blind sign-off is about to
                   score it: the document is burned from here on, even if the run is killed) or "blind-verdict"
                   (the sign-off finished: note = "PASS" / "FAIL" and the report path)
A line that is not such JSON is an error naming the line (never skipped); a ledger whose header names another
base model is refused. Nothing is appended when a check fails. Appends are single `O_APPEND` writes of whole
lines, fsynced; a new ledger is created through a temp file + rename with its header.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from l47.dumps import read_dump
from l47.errors import L47Error
from l47.fileio import write_text_atomic

LEDGER_SCHEMA = "l47.ledger/1"
HOME_ENV = "L47_HOME"
LEDGER_DIR = "ledgers"
EV_SCORED = "scored"
EV_BLIND_STARTED = "blind-started"
EV_BLIND_VERDICT = "blind-verdict"
EVENTS = (EV_SCORED, EV_BLIND_STARTED, EV_BLIND_VERDICT)
_ENTRY_FIELDS = ("doc_sha256", "bundle_sha256", "command", "time", "event")


@dataclass(frozen=True)
class LedgerEntry:
    doc_sha256: str  # content hash of the document (its token ids)
    bundle_sha256: str  # the model/bundle the document was scored against
    command: str
    time: float
    event: str = EV_SCORED
    note: str = ""


def l47_home() -> Path:
    """$L47_HOME, else ~/.l47."""
    v = os.environ.get(HOME_ENV)
    return Path(v).expanduser() if v else Path.home() / ".l47"


def default_ledger_path(base_sha256: str) -> Path:
    """The one ledger of a base model: $L47_HOME/ledgers/<base sha256>.jsonl."""
    _check_sha(base_sha256, "base_sha256", "ledger")
    return l47_home() / LEDGER_DIR / f"{base_sha256}.jsonl"


def _check_sha(v, field: str, where) -> str:
    if not (isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)):
        raise L47Error(where, field, "a sha256 (64 lowercase hex digits)", f"{str(v)[:70]!r}")
    return v


def _parse(path: Path, base_sha256: str | None) -> list[LedgerEntry]:
    """Every entry of an existing ledger; L47Error naming the line for anything else (base_sha256 None: a
    ledger of any base model)."""
    if not path.is_file():
        raise L47Error(path, "ledger", "a JSON-lines ledger file", "a directory" if path.is_dir() else "not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise L47Error(path, "ledger", "UTF-8 JSON lines", f"undecodable bytes ({e.reason})") from None
    lines = text.splitlines()
    if not lines:
        return []
    try:
        head = json.loads(lines[0])
    except ValueError:
        head = None
    if not isinstance(head, dict) or head.get("schema") != LEDGER_SCHEMA:
        raise L47Error(path, "line 1 (header)", f'{{"schema": "{LEDGER_SCHEMA}", "base_sha256": …}} (an l47 '
                       "ledger)", f"{lines[0][:80]!r}")
    if base_sha256 is not None and head.get("base_sha256") != base_sha256:
        raise L47Error(path, "line 1 base_sha256", f"{base_sha256[:16]}… (the base model being scored)",
                       f"{str(head.get('base_sha256'))[:16]}… (a ledger for another base model)")
    out = []
    for i, line in enumerate(lines[1:], 2):
        if not line.strip():
            raise L47Error(path, f"line {i}", "a JSON ledger entry", "an empty line")
        try:
            d = json.loads(line)
            if not isinstance(d, dict):
                raise TypeError("not an object")
            missing = [k for k in _ENTRY_FIELDS if k not in d]
            if missing:
                raise KeyError(missing[0])
            if d["event"] not in EVENTS:
                raise ValueError(f"event {d['event']!r}")
            out.append(LedgerEntry(str(d["doc_sha256"]), str(d["bundle_sha256"]), str(d["command"]),
                                   float(d["time"]), str(d["event"]), str(d.get("note", ""))))
        except (ValueError, KeyError, TypeError) as e:
            raise L47Error(path, f"line {i}", f"a JSON object with {', '.join(_ENTRY_FIELDS)}",
                           f"{line[:80]!r} ({type(e).__name__}: {e})") from None
    return out


def check_ledger_file(path: Path | str) -> None:
    """A named ledger, before any work: an existing file must be an l47 ledger (header and every entry valid);
    which base model it belongs to is checked when the command opens it (`Ledger.open`)."""
    path = Path(path)
    if path.exists():
        _parse(path, None)


class Ledger:
    """One base model's ledger file, validated when opened (corrupt line, other base model: L47Error, nothing
    appended). Use `Ledger.open(path or None, base_sha256)`."""

    def __init__(self, path: Path, base_sha256: str):
        self.path = Path(path)
        self.base_sha256 = _check_sha(base_sha256, "base_sha256", self.path)

    @classmethod
    def open(cls, path: Path | str | None, base_sha256: str) -> "Ledger":
        """The named ledger, or the base model's default one; validated now (before anything is scored)."""
        led = cls(Path(path) if path is not None else default_ledger_path(base_sha256), base_sha256)
        if led.path.is_dir():
            raise L47Error(led.path, "ledger", "a JSON-lines file", "a directory")
        led.entries()
        return led

    def entries(self) -> list[LedgerEntry]:
        return _parse(self.path, self.base_sha256) if self.path.exists() else []

    def scored(self, doc_sha256: str) -> list[LedgerEntry]:
        """Every entry of this document (any event: a blind-started document counts as scored)."""
        return [e for e in self.entries() if e.doc_sha256 == doc_sha256]

    def count(self, event: str) -> int:
        return sum(1 for e in self.entries() if e.event == event)

    def append(self, doc_shas, bundle_sha256: str, command: str, event: str = EV_SCORED, note: str = "") -> None:
        """Append one entry per document hash (call it BEFORE scoring them). Validates the file first."""
        if event not in EVENTS:
            raise ValueError(f"ledger event {event!r}")
        docs = list(dict.fromkeys(doc_shas))
        for d in docs:
            _check_sha(d, "doc_sha256", self.path)
        self.entries()  # refuses a ledger that was corrupted or replaced since it was opened
        now = time.time()
        text = "".join(json.dumps(asdict(LedgerEntry(d, bundle_sha256, command, now, event, note))) + "\n"
                       for d in docs)
        if not docs:
            return
        if not self.path.exists():
            head = json.dumps({"schema": LEDGER_SCHEMA, "base_sha256": self.base_sha256}) + "\n"
            write_text_atomic(self.path, head + text)
            return
        data = text.encode("utf-8")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            with open(self.path, "rb") as fh:  # a file not ending in a newline: start a fresh line
                fh.seek(0, os.SEEK_END)
                if fh.tell():
                    fh.seek(-1, os.SEEK_END)
                    if fh.read(1) != b"\n":
                        data = b"\n" + data
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)


def dump_content_hashes(paths) -> dict[str, str]:
    """path -> content hash of each dump (tokens only: mapped, not validated or scored), for the ledger
    appends that precede scoring. Unreadable files are left out (the scoring step reports them)."""
    out = {}
    for p in paths:
        try:
            out[str(p)] = read_dump(p, validate=False).sha256
        except (L47Error, OSError, ValueError, KeyError, TypeError):
            continue
    return out
