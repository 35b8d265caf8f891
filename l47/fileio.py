"""File helpers shared by every stage: one atomic writer for text, JSON and binary outputs, staging folders,
interrupt-safe cleanup, and streaming sha256.

Every output goes through `atomic_path` (or a helper built on it): the bytes go to a temp file in the target's
own folder (so the rename is atomic), the file is fsynced, then `os.replace`d over the target and the folder
fsynced. Until the rename a reader sees the old file (or none); on any exception the temp file is removed.
Temp files and staging folders in flight are registered: `install_signal_cleanup()` (called by the CLI) turns
SIGTERM / SIGHUP into an ordinary exception (SIGINT already is one), so the same cleanup runs, and removes whatever is
still registered at exit. An interrupted run leaves the old file or the new one, nothing else.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import secrets
import signal
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

_CHUNK = 8 << 20
TEMP_SUFFIX = ".tmp"  # temp files are ".<name>.<random>.tmp" beside their target
STAGE_SUFFIX = ".staging"  # staging folders are ".<name>.<random>.staging" beside their target

_live: set[Path] = set()  # temp files and staging folders in flight (removed on interrupt / exit)
_lock = threading.RLock()  # re-entrant: the signal handler runs cleanup_live() in the main thread, which may hold it


def _register(p: Path) -> None:
    with _lock:
        _live.add(p)


def _forget(p: Path) -> None:
    with _lock:
        _live.discard(p)


def _remove(p: Path) -> None:
    """Remove a temp file or staging folder (whatever is there); never raises."""
    try:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    except OSError:
        pass
    _forget(p)


def cleanup_live() -> list[Path]:
    """Remove every registered temp file / staging folder still in flight; returns what was removed."""
    with _lock:
        todo = sorted(_live)
    for p in todo:
        _remove(p)
    return todo


def live_temps() -> list[Path]:
    """The temp files / staging folders in flight (for tests)."""
    with _lock:
        return sorted(_live)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _new_registered(parent: Path, prefix: str, suffix: str, folder: bool) -> Path:
    """Create a new temp file (mode 0666 & ~umask) or folder (0700) named parent/prefix<random>suffix, registered
    BEFORE it exists: an interrupt that lands during the create still finds and removes it."""
    while True:
        p = parent / f"{prefix}{secrets.token_hex(6)}{suffix}"
        _register(p)
        try:
            if folder:
                p.mkdir(mode=0o700)
            else:
                os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # the umask applies
            return p
        except FileExistsError:
            _forget(p)  # someone else's: never ours to remove


def temp_beside(path, suffix: str = TEMP_SUFFIX) -> Path:
    """Create (empty, mode 0666 & ~umask) and register a temp file in `path`'s folder; the caller writes it and
    then `commit`s or `discard`s it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return _new_registered(path.parent, f".{path.name}.", suffix, folder=False)


def commit(tmp, path) -> Path:
    """fsync the finished temp file, rename it over `path`, fsync the folder."""
    tmp, path = Path(tmp), Path(path)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _forget(tmp)
    _fsync_dir(path.parent)
    return path


def discard(tmp) -> None:
    """Remove a temp file or staging folder and forget it."""
    _remove(Path(tmp))


@contextmanager
def atomic_path(path) -> Iterator[Path]:
    """Yield a registered temp path beside `path`; write it inside the block. On a clean exit it replaces
    `path` (fsync + rename); on any exception (KeyboardInterrupt and SystemExit included) it is removed."""
    path = Path(path)
    tmp = temp_beside(path)
    try:
        yield tmp
        commit(tmp, path)
    except BaseException:
        discard(tmp)
        raise


@contextmanager
def atomic_open(path, mode: str = "w", *, fsync: bool = True):
    """`with atomic_open(path, "wb") as f: ...` — `open` for writing through `atomic_path` ("w"/"wb"; text is
    UTF-8). The file is always fsynced before the rename (`fsync` is accepted for callers that name it)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open: mode {mode!r} (only 'w' or 'wb')")
    with atomic_path(path) as tmp:
        with open(tmp, mode, encoding="utf-8" if mode == "w" else None) as fh:
            yield fh
            fh.flush()


def write_bytes_atomic(path, data: bytes | bytearray | memoryview, *, fsync: bool = True) -> Path:
    """Write bytes atomically (temp in the same folder + fsync + rename)."""
    with atomic_open(path, "wb") as fh:
        fh.write(data)
    return Path(path)


def write_text_atomic(path, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically: a reader never sees half a file, and a failure leaves the old
    file (or none) in place."""
    with atomic_open(path, "w") as fh:
        fh.write(text)
    return Path(path)


def write_json_atomic(path, obj: Any, *, indent: int | None = 1, sort_keys: bool = False) -> Path:
    """Write `obj` as JSON atomically. NaN / Inf are refused (allow_nan=False): a NaN is never written as a
    result."""
    return write_text_atomic(path, json.dumps(obj, indent=indent, sort_keys=sort_keys, ensure_ascii=False,
                                              allow_nan=False) + "\n")


@contextmanager
def temp_dir(prefix: str = "l47-") -> Iterator[Path]:
    """A registered scratch folder under the system temp folder ($TMPDIR); removed when the block ends, however it
    ends (an interrupt's handler removes it too, even before the block is entered)."""
    tmp = _new_registered(Path(tempfile.gettempdir()), prefix, "", folder=True)
    try:
        yield tmp
    finally:
        discard(tmp)


@contextmanager
def staging_dir(path) -> Iterator[Path]:
    """A registered, empty folder beside `path` (".<name>.<random>.staging"); removed when the block ends,
    however it ends. The caller moves finished files out of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    stage = _new_registered(path.parent, f".{path.name}.", STAGE_SUFFIX, folder=True)
    try:
        yield stage
    finally:
        discard(stage)


# --- interrupts -------------------------------------------------------------------------------------------


class Interrupted(SystemExit):
    """Raised in the main thread by the SIGTERM / SIGHUP handler, so every `finally` / `except BaseException`
    cleanup runs as for Ctrl-C. Its code is 128 + the signal number (the shell's convention)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(128 + signum)


def _on_signal(signum, frame):  # noqa: ARG001 - signal handler signature
    cleanup_live()
    raise Interrupted(signum)


_installed = False


def install_signal_cleanup() -> None:
    """Make SIGTERM / SIGHUP raise `Interrupted` (SIGINT raises KeyboardInterrupt by default) and remove the
    registered temp files at exit. Idempotent; only from the main thread."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if s is not None:
            signal.signal(s, _on_signal)
    atexit.register(cleanup_live)
    _installed = True


def read_json(path, what: str, expected: str = "an existing JSON file") -> Any:
    """Parsed JSON of `path`; L47Error naming the file and `what` it should be when missing or not JSON."""
    from l47.errors import L47Error

    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise L47Error(path, what, expected, "nothing") from None
    except IsADirectoryError:
        raise L47Error(path, what, expected, "a directory") from None
    except ValueError as e:
        raise L47Error(path, what, "valid JSON", f"{type(e).__name__}: {e}") from None


# --- hashing ----------------------------------------------------------------------------------------------


def sha256_file(path) -> str:
    """sha256 of a file's bytes, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
