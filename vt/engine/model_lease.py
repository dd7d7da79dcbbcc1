"""One driver at a time per model: the lease an Engine holds on its model while it drives it.

Engines over one model share the model's device state: its KV cache, token table, recurrent
state (and for a user forward its prefill staging). Two engines driving that state at once,
one per thread, silently sample wrong tokens. So an engine takes the model's lease for all
it does with the device state (capture and warm-up at construction, generate(),
device_ceiling_us()), and a second engine is refused while the first holds it. Engines over
one model used one after the other (the bench's modes over one model) stay allowed: each
call runs its requests to completion and frees every row and block before it returns.

generate() returns when its last request is finished, a moment before the serving thread
finds nothing left to do and lets the lease go. So a holder whose work is all finished is
waited for (it releases within one loop iteration; HANDOVER_S bounds the wait), and only a
holder with work is refused at once: the next engine's call right after generate() returned
must not fail by a race it cannot see.

A model is known by the device address of its token table, the one buffer every step model
has: two adapters over one user forward (two ForwardModel objects over the same arrays) are
one model, as they must be.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable

from vt.engine.errors import EngineBusyError

HANDOVER_S = 5.0   # the longest wait for a holder with no work left to let the lease go

_lease = threading.Condition()
_driven: dict[int, Callable[[], bool]] = {}   # token table address -> its holder's "all done?"


def model_key(step_model) -> int:
    """The identity of the device state a step model drives: its token table's address."""
    table = step_model.token_table
    data = getattr(table, "data", None)
    ptr = getattr(data, "ptr", None)                       # cupy
    if ptr is None and hasattr(table, "__array_interface__"):
        ptr = table.__array_interface__["data"][0]         # numpy (the sim's device arrays)
    return int(ptr) if ptr is not None else id(table)


def _never_done() -> bool:
    return False


def acquire(key: int, what: str, all_done: Callable[[], bool] = _never_done) -> None:
    """Take the lease of the model `key` (model_key). While another engine holds it:
    EngineBusyError at once if that holder has work, else wait for its release (module
    docstring). `all_done` is this holder's own check, for whoever asks next (read without
    a lock: a stale answer only makes the asker wait or be refused). Not reentrant on
    purpose: an engine's progress callback that drives a second engine over the same model
    would interleave their steps on the shared state just as two threads do."""
    with _lease:
        deadline = None
        while key in _driven:
            if not _driven[key]():
                raise EngineBusyError(_busy(what))
            deadline = deadline or time.monotonic() + HANDOVER_S
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineBusyError(_busy(what) + f" (it had no work left but kept the model "
                                                    f"for {HANDOVER_S:g} s)")
            _lease.wait(left)
        _driven[key] = all_done


def _busy(what: str) -> str:
    return (f"{what}: another Engine over the same model is driving it right now (in another "
            f"thread, or this call comes from its progress callback). Engines over one "
            f"model share its KV cache and state, so they take turns: wait for that call to "
            f"return, or build one model per thread and an Engine over each")


def release(key: int) -> None:
    with _lease:
        _driven.pop(key, None)
        _lease.notify_all()


@contextlib.contextmanager
def driving(key: int, what: str):
    """Hold the lease of the model `key` for the block (acquire, then release)."""
    acquire(key, what)
    try:
        yield
    finally:
        release(key)
