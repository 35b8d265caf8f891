"""Small file helpers shared by every stage: atomic text writes and streaming sha256."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

_CHUNK = 8 << 20


def write_text_atomic(path, text: str) -> Path:
    """Write `text` to `path` via a temp file in the same folder and a rename: a reader never sees half a file,
    and a failure leaves the old file (or none) in place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def sha256_file(path) -> str:
    """sha256 of a file's bytes, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
