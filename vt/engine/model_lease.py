"""One driver at a time per model: the lease an Engine holds on its model while it drives it.

Engines over one model share the model's device state: its KV cache, token table, recurrent
state (and for a user forward its prefill staging). Two engines driving that state at once,
one per thread, silently sample wrong tokens. So an engine takes the model's lease for all
it does with the device state (capture and warm-up at construction, generate(),
device_ceiling_us()), and a second engine is refused while the first holds it. Engines over
one model used one after the other (the bench's modes over one model) stay allowed: each
call runs its requests to completion and frees every row and block before it returns.

A model is known by the device address of its token table, the one buffer every step model
has: two adapters over one user forward (two ForwardModel objects over the same arrays) are
one model, as they must be.
"""
from __future__ import annotations

import contextlib
import threading

from vt.engine.requests import EngineBusyError

_guard = threading.Lock()
_driven: set[int] = set()   # addresses of the token tables being driven now


def model_key(step_model) -> int:
    """The identity of the device state a step model drives: its token table's address."""
    table = step_model.token_table
    data = getattr(table, "data", None)
    ptr = getattr(data, "ptr", None)                       # cupy
    if ptr is None and hasattr(table, "__array_interface__"):
        ptr = table.__array_interface__["data"][0]         # numpy (the sim's device arrays)
    return int(ptr) if ptr is not None else id(table)


def acquire(key: int, what: str) -> None:
    """Take the lease of the model `key` (model_key); EngineBusyError at once if another
    engine holds it. Not reentrant on purpose: an engine's progress callback that drives a
    second engine over the same model would interleave their steps on the shared state just
    as two threads do."""
    with _guard:
        if key in _driven:
            raise EngineBusyError(
                f"{what}: another Engine over the same model is driving it right now (in another "
                f"thread, or this call comes from its progress callback). Engines over one "
                f"model share its KV cache and state, so they take turns: wait for that call to "
                f"return, or build one model per thread and an Engine over each")
        _driven.add(key)


def release(key: int) -> None:
    with _guard:
        _driven.discard(key)


@contextlib.contextmanager
def driving(key: int, what: str):
    """Hold the lease of the model `key` for the block (acquire, then release)."""
    acquire(key, what)
    try:
        yield
    finally:
        release(key)
