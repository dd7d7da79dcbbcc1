"""Ctrl-C for a command's whole run, start-up included: SIGINT raises KeyboardInterrupt at
once, as Python's default handler does, and is also remembered.

With Python's default handler, `vt serve` interrupted while it captured its graphs was seen
to finish its start-up and serve on, the Ctrl-C lost (three of three tries at one timing on
the sim); with a handler of vt's own it never was. What depends on the default handler being
installed is asyncio's: `asyncio.run` (uvicorn's) replaces exactly that handler with one that
only cancels its main task, and restores it afterwards. Remembering the signal is the second
guard: `raise_if_interrupted()`, called at each start-up line and before serving, raises a
KeyboardInterrupt that something caught and dropped (a bare `except:` in a library imported
lazily during start-up would).

CPython also marks a KeyboardInterrupt raised inside code compiled from a string (the
`exec` by which `dataclasses` builds methods, inside those lazy imports) as unhandled even
when it is caught, and then ends the process by SIGINT instead of with its exit code;
`forget_unhandled_mark()` clears that mark (any string code run clears it) so that the
command exits 130 as documented.
"""
from __future__ import annotations

import contextlib
import signal
import threading

_interrupted = False


def _on_sigint(signum, frame) -> None:
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


@contextlib.contextmanager
def remembered_sigint():
    """SIGINT raises KeyboardInterrupt and is remembered while the block runs (main thread
    only: elsewhere signals cannot be set, and nothing is changed)."""
    global _interrupted
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _interrupted = False
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _interrupted = False


def raise_if_interrupted() -> None:
    """KeyboardInterrupt if SIGINT came while remembered_sigint() was on, whoever caught it."""
    if _interrupted:
        raise KeyboardInterrupt


def forget_unhandled_mark() -> None:
    """Clear CPython's "unhandled KeyboardInterrupt" mark after the interrupt was handled
    (module docstring): running any code compiled from a string resets it."""
    exec("")   # noqa: S102 (the reset is a side effect of running string code)
