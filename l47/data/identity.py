"""Model identity of dumps (issue 14 item 6): every dump records the model that made it (`meta.model`: the
sha256 of the GGUF file — which covers every tensor, the tokenizer and the dims — or "hf:<hash>" of a
transformers checkpoint). `sets`, `solve`, `audit`, `score` and `penalty` refuse dumps of another model before any
work, naming both identities, unless --allow-other-model; then the run's report records which dumps were
allowed (`other_model_notes`)."""

from __future__ import annotations

from pathlib import Path

from l47.dumps import read_dump
from l47.errors import L47Error

_HEX = frozenset("0123456789abcdef")


def is_gguf_identity(m: str) -> bool:
    return len(m) == 64 and set(m) <= _HEX


def dump_models(paths) -> list[tuple[Path, str]]:
    """(path, meta.model) of every readable dump (metadata only; unreadable dumps are reported elsewhere)."""
    out = []
    for p in paths:
        try:
            out.append((Path(p), str(read_dump(p, validate=False).meta.model)))
        except (L47Error, OSError):
            continue
    return out


OTHER_MODEL_STAMP = "other model"  # the stamp's first words (reports, records, summary lines)


def other_model_stamp(n: int) -> str:
    """The stamp a report carries when --allow-other-model let `n` dumps of another model in."""
    return f"{OTHER_MODEL_STAMP}: {n} dump(s) made by another model, used with --allow-other-model"


def other_model_notes(paths, model_sha256: str, model_path, allow: bool) -> list[str]:
    """Refuse (L47Error naming both identities) dumps whose meta.model is another GGUF's sha256; with `allow`,
    return one note per such dump for the report instead. Checkpoint ids ("hf:…") are compared by the zero-proxy
    check instead (a GGUF exported from the checkpoint has another file hash but the same numbers)."""
    other = [(p, m) for p, m in dump_models(paths) if is_gguf_identity(m) and m != model_sha256]
    if not other:
        return []
    if not allow:
        p, m = other[0]
        more = f" ({len(other)} such dumps)" if len(other) > 1 else ""
        raise L47Error(p, "meta.model", f"a dump of the model {model_path} (sha256 {model_sha256[:16]}…), or "
                       "--allow-other-model", f"a dump of model sha256 {m[:16]}…{more}")
    return [f"{p}: dumped from model {m[:16]}…, used under {model_sha256[:16]}… (--allow-other-model)"
            for p, m in other]
