"""What the serving loop does at a step boundary when a request arrived or was cancelled
(Engine._loop checks two deques' lengths per step and calls these only when one moved)."""
from __future__ import annotations

from collections import deque


class SchedulerStalledError(RuntimeError):
    """Requests wait and nothing can run or is in flight (a request the refusal checks let
    through that can never be admitted): they fail instead of waiting forever."""


def take_arrivals(arrivals: deque, pending: deque, buffer) -> None:
    """Move the arrivals into the queue the scheduler admits from (a request cancelled
    before it got there finishes at once)."""
    while arrivals:
        req = arrivals.popleft()
        if req.cancel_requested:
            buffer.finish(req, "cancelled")
        else:
            pending.append(req)


def cancel_everything(cancels: deque, pending: deque, sched) -> None:
    """close() without finish: every queued and running request is cancelled."""
    cancels.extend(pending)
    cancels.extend(sched.prefilling)
    cancels.extend(sched.batch.reqs[:sched.batch.n])


def apply_cancels(cancels: deque, pending: deque, sched, buffer, in_flight: bool) -> list:
    """A queued request finishes at once; a running one leaves the batch now (its row and KV
    blocks free for this step's plan) with the tokens of the steps launched so far, and
    finishes once the step in flight, which still holds it, has been collected (before the
    row's next request writes its span). Returns those still to finish."""
    later = []
    while cancels:
        req = cancels.popleft()
        if req.final is not None:
            continue
        if req.t0 < 0:
            if req in pending:
                pending.remove(req)
                buffer.finish(req, "cancelled")
            elif req.row >= 0:            # prefilling in chunks: no token yet
                sched.leave(req)
                buffer.finish(req, "cancelled")
            # else: still in the arrivals; take_arrivals finishes it
            continue
        sched.leave(req)
        req.end = min(req.end, req.base + sched.batch.t - req.t0)
        if in_flight:
            later.append(req)
        else:
            buffer.finish(req, "cancelled")
    return later
