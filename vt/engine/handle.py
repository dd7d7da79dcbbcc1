"""RequestHandle: one submitted request, seen from the caller's threads; StepNotifier: how
the serving loop wakes the readers of streams.

The loop does no work per request per step for readers: it publishes one counter (the
token buffer's stored_t) and, only when some stream waits, wakes every waiter once per step
(one notify_all, and one call_soon_threadsafe per asyncio waiter). A reader then copies its
new tokens out of the shared buffer by cursor. result() waits on the request's own event,
set once when it finishes.
"""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np

from vt.engine.requests import Request, RequestResult

_EMPTY = np.zeros(0, np.int32)


class StepNotifier:
    def __init__(self):
        self.cv = threading.Condition(threading.Lock())
        self.waiting = 0          # threads in wait_for (read by the loop without the lock)
        self._futures = []        # (event loop, future) of asyncio waiters

    def notify(self) -> None:
        """Called by the loop after it published a step. Waiters register, then check their
        condition, under the lock; the loop publishes, then reads `waiting`: a waiter it does
        not see has checked after the publication (so it does not sleep on it)."""
        if self.waiting or self._futures:
            with self.cv:
                self.cv.notify_all()
                futures, self._futures = self._futures, []
            for loop, fut in futures:
                try:
                    loop.call_soon_threadsafe(_wake, fut)
                except RuntimeError:   # that event loop is closed: nobody awaits it any more
                    pass

    def wait_for(self, ready, timeout: float | None) -> bool:
        """Block until ready() (checked after each step); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cv:
            self.waiting += 1
            try:
                while not ready():
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self.cv.wait(left)
                return True
            finally:
                self.waiting -= 1

    def future(self, ready) -> asyncio.Future | None:
        """A future set after the next step, or None when ready() already holds."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self.cv:
            self._futures.append((loop, fut))
            if ready():
                self._futures.remove((loop, fut))
                return None
        return fut


def _wake(fut) -> None:
    if not fut.done():
        fut.set_result(None)


class RequestHandle:
    """What Engine.submit returns. Thread-safe; every method may be called from any thread.

    stream(): the tokens as their steps reach the host (an iterator; it raises the step's
    error if the request failed). result(timeout=None): the RequestResult, blocking until the
    request finishes (TimeoutError after `timeout` seconds; the step's error if it failed).
    cancel(): the request stops at the next step boundary, its row and KV blocks freed, with
    finish_reason "cancelled" and the tokens collected until then. done(): finished (any
    reason) or failed.
    """

    def __init__(self, engine, req: Request):
        self._engine, self._req = engine, req
        self._buffer, self._notifier = engine._buffer, engine._notifier

    @property
    def request_id(self) -> int:
        return self._req.index

    @property
    def submitted_at(self) -> float:
        """When submit() queued the request (time.perf_counter, the clock of token_times)."""
        return self._req.submitted_at

    def done(self) -> bool:
        return self._req.final is not None

    def cancel(self) -> None:
        """Idempotent; no effect on a finished request."""
        req = self._req
        if req.final is None and not req.cancel_requested:
            req.cancel_requested = True
            self._engine._request_cancel(req)

    def add_done_callback(self, fn) -> None:
        """fn(handle) once the request has finished (any reason) or failed: on the serving
        thread, or at once in this thread if it has finished already. It runs exactly once
        however the two race; it must be quick and must not call Engine.close()."""
        once = _Once(fn, self)
        self._req.on_done.append(lambda req: once())
        # The loop sets `final` before it runs on_done: if it is still unset here, the loop
        # will see the callback appended above; if it is set, the loop may have run on_done
        # already, so call it here too (_Once keeps the second call out).
        if self.done():
            once()

    def result(self, timeout: float | None = None) -> RequestResult:
        req = self._req
        if not req.done_event.wait(timeout):
            raise TimeoutError(f"request {req.index} not finished after {timeout} s")
        if req.error is not None:
            raise req.error
        return _result(req)

    def snapshot(self) -> tuple[np.ndarray, bool]:
        """(the tokens so far, finished?) without blocking."""
        req = self._req
        final = req.final
        if final is not None:
            return final, True
        n = self._buffer.available(req)
        got = self._buffer.tokens[req.base:req.base + n].copy() if n else _EMPTY
        final = req.final      # finished meanwhile: its span may be reused, take the copy
        return (final, True) if final is not None else (got, False)

    def _take(self, sent: int) -> tuple[list, int, bool]:
        """The tokens after the first `sent`, how many there are now, and whether it ended."""
        got, finished = self.snapshot()
        return got[sent:].tolist(), len(got), finished

    def _raise_failure(self) -> None:
        """A finished request whose step failed: its error (after the tokens before it)."""
        if self._req.error is not None:
            raise self._req.error

    def stream(self, timeout: float | None = None):
        """Iterate the tokens as they arrive. timeout: the longest wait for the next one."""
        sent = 0
        while True:
            new, sent, finished = self._take(sent)
            yield from new
            if finished:
                self._raise_failure()
                return
            if not self._notifier.wait_for(lambda: self._more(sent), timeout):
                raise TimeoutError(f"request {self._req.index}: no token in {timeout} s")

    async def stream_async(self):
        """stream() for asyncio: the event loop is never blocked."""
        sent = 0
        while True:
            new, sent, finished = self._take(sent)
            for tok in new:
                yield tok
            if finished:
                self._raise_failure()
                return
            fut = self._notifier.future(lambda: self._more(sent))
            if fut is not None:
                await fut

    def _more(self, sent: int) -> bool:
        req = self._req
        return req.final is not None or self._buffer.available(req) > sent


class _Once:
    def __init__(self, fn, handle):
        self._fn, self._handle, self._lock, self._called = fn, handle, threading.Lock(), False

    def __call__(self) -> None:
        with self._lock:
            if self._called:
                return
            self._called = True
        self._fn(self._handle)


def _result(req: Request) -> RequestResult:
    return RequestResult(req.index, req.prompt_len, req.final.tolist(), req.finish_reason,
                         req.final_logits, req.token_times, req.error_message)
