"""Output files that are either whole or absent: every writer of a user-named path (the trace,
`vt bench --json`, `--png`) goes through here.

A write goes to a temporary file in the target's own directory (so the rename stays on one
file system) and is renamed over the target with os.replace, which is atomic on POSIX and
Windows: a reader, or a run stopped at any moment (a second Ctrl-C included), sees the old
file, the new one, or none, never a truncated one. `output_path_problem` is the check the
front ends make before any work, so that a bad path fails in a second, not after the run.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import tempfile


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w"):
    """`with atomic_open(path) as f: ...` writes `path` whole on a clean exit, and leaves it
    untouched (and no temporary file behind) when the block raises, KeyboardInterrupt included."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open: mode must be 'w' or 'wb', got {mode!r}")
    directory, name = os.path.split(os.path.abspath(path))
    tmp = None
    try:
        # The name is known before the file exists (mkstemp returns it only after it made
        # the file), so an exception at any point below, SIGTERM turned into one included,
        # removes what was made.
        for _ in range(100):
            tmp = os.path.join(directory, f".{name}.{secrets.token_hex(8)}.tmp")
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                break
            except FileExistsError:   # another writer's: not ours to remove
                tmp = None
        else:
            raise FileExistsError(f"atomic_open: no free temporary name beside {path!r}")
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        # Made 0600 (as mkstemp does); give it the mode a plain open() would have.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise


def write_text_atomic(path: str, text: str) -> None:
    with atomic_open(path) as f:
        f.write(text)


def output_path_problem(path: str) -> str | None:
    """Why `path` cannot be written as an output file (atomically), or None when it can.

    It can when it is not a directory, its directory exists and is writable (the temporary
    file and the rename need that), and an existing file there may be replaced."""
    if path == "":
        return "is empty; give a file path"
    if os.path.isdir(path):
        return "is a directory; give a file path inside it"
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.exists(parent) and not os.path.isdir(parent):
        return f"is under {parent!r}, which is not a directory; write elsewhere"
    if not os.path.isdir(parent):
        return f"is in directory {parent!r}, which does not exist; create it or write elsewhere"
    if os.path.exists(path) and not os.path.isfile(path):
        return "exists and is not a regular file; write elsewhere"
    # Make the temporary file the real write will make: os.access says yes to root on a
    # read-only or pseudo file system (/proc), where only trying tells.
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=parent)
    except OSError as e:
        return f"cannot be written in directory {parent!r} ({e.strerror}); write elsewhere"
    os.close(fd)
    os.unlink(tmp)
    return None
