"""File helpers shared by every stage: one atomic writer for text, JSON and binary outputs, staging folders,
interrupt-safe cleanup, and streaming sha256.

Every output goes through `atomic_path` (or a helper built on it): the bytes go to a temp file in the target's
own folder (so the rename is atomic), the file is fsynced, then `os.replace`d over the target and the folder
fsynced. Until the rename a reader sees the old file (or none); on any exception the temp file is removed.
Temp files and staging folders in flight are registered: `install_signal_cleanup()` (called by the CLI) turns
SIGTERM / SIGHUP into an ordinary exception (SIGINT already is one), so the same cleanup runs, and removes whatever is
still registered at exit. An interrupted run leaves the old file or the new one, nothing else.

Outputs that only make sense together (a bundle and its solve record) are written as one `AtomicGroup`: every file
to its own temp name, then renamed in order with interrupts deferred (`deferred_interrupts`), so a signal leaves
all of them or none. Folders created for an output (`make_dirs`) are removed again at exit or on an interrupt when
they are left empty. Once a run is interrupted, further signals are noted and ignored: the cleanup of the first one
always runs to its end (SIGKILL still stops the process).
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

from l47.errors import L47Error

_CHUNK = 8 << 20
TEMP_SUFFIX = ".tmp"  # temp files are ".<name>.<random>.tmp" beside their target
STAGE_SUFFIX = ".staging"  # staging folders are ".<name>.<random>.staging" beside their target

_live: set[Path] = set()  # temp files and staging folders in flight (removed on interrupt / exit)
_made: list[Path] = []  # folders created for outputs (removed on interrupt / exit when left empty), in creation order
_committed: list = [0, []]  # outputs renamed into place by the current command: [count, the first few]
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
    """Remove every registered temp file / staging folder still in flight, then every folder created for an
    output that is now empty (deepest first); returns what was removed."""
    with _lock:
        todo = sorted(_live)
    for p in todo:
        _remove(p)
    with _lock:
        made = list(reversed(_made))
    for d in made:
        try:
            d.rmdir()  # only when empty: never a file of anyone's
            todo.append(d)
        except OSError:
            pass
        with _lock:
            if not d.exists() and d in _made:
                _made.remove(d)
    return todo


def make_dirs(folder) -> list[Path]:
    """`folder.mkdir(parents=True, exist_ok=True)`, remembering the folders it created (outermost first): they are
    removed again at exit or on an interrupt if they are left empty. Returns the created folders."""
    folder = Path(folder)
    missing = []
    f = folder
    while not f.exists() and f != f.parent:
        missing.append(f)
        f = f.parent
    missing.reverse()
    with _lock:
        _made.extend(m for m in missing if m not in _made)
    folder.mkdir(parents=True, exist_ok=True)
    return missing


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
    make_dirs(path.parent)
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
    with _lock:
        _committed[0] += 1
        if len(_committed[1]) < 3:
            _committed[1].append(path)
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
    make_dirs(path.parent)
    stage = _new_registered(path.parent, f".{path.name}.", STAGE_SUFFIX, folder=True)
    try:
        yield stage
    finally:
        discard(stage)


# --- outputs that belong together -------------------------------------------------------------------------


class AtomicGroup:
    """Files that are complete only together (a bundle and its solve record): `temp(path)` gives each its
    registered temp name beside it; on a clean exit of the `with` block they are renamed into place in the order
    the paths were given, then the `on_commit` actions run — all with interrupts deferred, so a signal leaves every
    file of the group or none; on any exception every temp is removed and no target is touched."""

    def __init__(self, *paths):
        self.paths = [Path(p) for p in paths]
        self._tmp: dict[Path, Path] = {}
        self._after: list = []

    def temp(self, path) -> Path:
        return self._tmp[Path(path)]

    def on_commit(self, fn) -> None:
        self._after.append(fn)

    def __enter__(self) -> "AtomicGroup":
        try:
            for p in self.paths:
                self._tmp[p] = temp_beside(p)
        except BaseException:
            self._discard()
            raise
        return self

    def _discard(self) -> None:
        for t in self._tmp.values():
            discard(t)

    def __exit__(self, et, ev, tb) -> None:
        if et is not None:
            self._discard()
            return
        done: list[Path] = []
        with deferred_interrupts():  # a signal meanwhile acts when the block ends, on the complete group
            try:
                for p in self.paths:
                    commit(self._tmp[p], p)
                    done.append(p)
                for fn in self._after:
                    fn()
            except BaseException:  # a rename or an on_commit action failed: none of the group is left
                self._discard()
                for p in done:
                    p.unlink(missing_ok=True)
                raise


# --- interrupts -------------------------------------------------------------------------------------------


_defer = 0  # depth of deferred_interrupts blocks
_pending: int | None = None  # a signal that arrived while deferred
_stopping: int | None = None  # the signal this run is stopping for (later ones are ignored)


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold SIGINT / SIGTERM / SIGHUP (once `install_signal_cleanup` ran) until the block ends, then act on the
    first that arrived. For short steps that must happen together (renames of a group of outputs)."""
    global _defer, _pending
    _defer += 1
    try:
        yield
    finally:
        _defer -= 1
        if _defer == 0 and _pending is not None:
            sig, _pending = _pending, None
            _stop(sig)


def begin_command() -> None:
    """A command starts (the CLI calls it): no output committed yet, no interrupt pending."""
    global _stopping, _pending
    with _lock:
        _committed[0], _committed[1] = 0, []
    _stopping, _pending = None, None


def _stop(signum: int) -> None:
    global _stopping
    _stopping = signum
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    cleanup_live()
    raise Interrupted(signum)


def interrupt_cleanup() -> str:
    """The cleanup after an interrupt reached the command's top (later signals stay ignored while it runs):
    temp files and staging folders removed, empty folders created for outputs removed. Returns what the user
    should know: what was kept complete, and anything that could not be removed."""
    global _stopping, _pending
    _stopping = _stopping or signal.SIGINT
    try:
        cleanup_live()
        left = live_temps()
        with _lock:
            n, first = _committed[0], list(_committed[1])
    finally:
        begin_command()
    parts = [f"kept {n} complete output file(s) written before the signal ({', '.join(map(str, first))}"
             f"{', ...' if n > len(first) else ''})"] if n else []
    parts.append(f"partial output NOT removed: {', '.join(map(str, left))}" if left else "no partial output left")
    return "; ".join(parts)


class Interrupted(SystemExit):
    """Raised in the main thread by the SIGTERM / SIGHUP handler, so every `finally` / `except BaseException`
    cleanup runs as for Ctrl-C. Its code is 128 + the signal number (the shell's convention)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(128 + signum)


def _on_signal(signum, frame):  # noqa: ARG001 - signal handler signature
    global _pending
    if _stopping is not None:  # already stopping: let the first signal's cleanup finish
        return
    if _defer:
        _pending = _pending or signum
        return
    _stop(signum)


_installed = False


def install_signal_cleanup() -> None:
    """Make SIGTERM / SIGHUP raise `Interrupted` and SIGINT KeyboardInterrupt (unless the process ignores SIGINT),
    each held while `deferred_interrupts` runs and ignored once the run is stopping; remove the registered temp
    files at exit. Idempotent; only from the main thread."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if s is not None:
            signal.signal(s, _on_signal)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_signal)
    atexit.register(cleanup_live)
    _installed = True


def read_json(path, what: str, expected: str = "an existing JSON file") -> Any:
    """Parsed JSON of `path`; L47Error naming the file and `what` it should be when missing or not JSON."""
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
