"""Ctrl-C for a command's whole run, start-up included.

A process started in the background by a non-interactive shell (`vt serve ... &` in a
script, a job runner) inherits SIGINT ignored, and Python leaves an ignored SIGINT ignored:
`vt serve` started that way let Ctrl-C or `kill -INT` pass through its whole start-up and then
served on, although its server, once up, stops on SIGINT whatever was inherited (uvicorn
installs its own handler). Every `vt` command therefore runs with SIGINT raising
KeyboardInterrupt, as in a process started in the foreground.

CPython also marks a KeyboardInterrupt raised inside code compiled from a string (the `exec`
by which `dataclasses` builds methods, in modules imported lazily during start-up) as
unhandled even when it is caught, and then ends the process by SIGINT instead of with its exit
code; `forget_unhandled_mark()` clears that mark (running any string code clears it), so the
command exits 130 as documented.
"""
from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def sigint_raises():
    """SIGINT raises KeyboardInterrupt while the block runs, whatever the process inherited
    (main thread only: elsewhere signals cannot be set, and nothing is changed)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def forget_unhandled_mark() -> None:
    """Clear CPython's "unhandled KeyboardInterrupt" mark once the interrupt was handled
    (module docstring)."""
    exec("")   # noqa: S102 (the reset is a side effect of running string code)
