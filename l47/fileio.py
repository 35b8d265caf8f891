"""Small file helpers shared by every stage: atomic writes (text and binary) and streaming sha256.

Every file the toolkit writes goes through `atomic_open`: a temp file in the target's folder, renamed onto the
target only when the writer finished without an exception — a reader never sees half a file, and a failure
leaves the old file (or none) and no temp file behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from l47.errors import L47Error

_CHUNK = 8 << 20


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_open(path, mode: str = "w", *, fsync: bool = False) -> Iterator:
    """`with atomic_open(path, "wb", fsync=True) as f: ...` — write to a temp file in path's folder (created if
    missing), then flush (and fsync), and rename it onto `path`. The file gets the usual permissions (0666 less
    the umask), not mkstemp's 0600. Text modes are UTF-8."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as fh:
            yield fh
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically."""
    with atomic_open(path, "w") as fh:
        fh.write(text)
    return Path(path)


def write_bytes_atomic(path, data: bytes, *, fsync: bool = False) -> Path:
    """Write `data` to `path` atomically."""
    with atomic_open(path, "wb", fsync=fsync) as fh:
        fh.write(data)
    return Path(path)


def read_json(path, what: str, expected: str = "an existing JSON file") -> Any:
    """Parsed JSON of `path`; L47Error naming the file and `what` it should be when missing or not JSON."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise L47Error(path, what, expected, "nothing") from None
    except ValueError as e:
        raise L47Error(path, what, "valid JSON", f"{type(e).__name__}: {e}") from None


def sha256_file(path) -> str:
    """sha256 of a file's bytes, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
