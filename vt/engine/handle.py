"""RequestHandle: one submitted request, seen from the caller's threads; StepNotifier: how
the serving loop wakes the readers of streams.

The loop does no work per request per step for readers: it publishes one counter (the
token buffer's stored_t) and, only when some stream waits, wakes every waiter once per step
(one notify_all, and one call_soon_threadsafe per asyncio waiter). A reader then copies its
new tokens out of the shared buffer by cursor. result() waits on the request's own event,
set once when it finishes. AsyncTokens is the asyncio reader; TokenStream, what
Engine.stream_async returns, is one whose early exit cancels the request.
"""
from __future__ import annotations

import asyncio
import math
import numbers
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
    A timeout of None or inf waits forever; NaN is refused (wait_timeout).
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
        timeout = wait_timeout(timeout, "result")
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
        return self._stream(wait_timeout(timeout, "stream"))

    def _stream(self, timeout: float | None):
        sent = 0
        while True:
            new, sent, finished = self._take(sent)
            yield from new
            if finished:
                self._raise_failure()
                return
            if not self._notifier.wait_for(lambda: self._more(sent), timeout):
                raise TimeoutError(f"request {self._req.index}: no token in {timeout} s")

    def stream_async(self):
        """stream() for asyncio: the event loop is never blocked. Leaving the loop early does
        not cancel the request (Engine.stream_async's stream does)."""
        return AsyncTokens(self, cancel_on_exit=False)

    def _more(self, sent: int) -> bool:
        req = self._req
        return req.final is not None or self._buffer.available(req) > sent


class AsyncTokens:
    """An async iterator over a handle's tokens as they arrive. cancel_on_exit: the request
    is cancelled when the iteration ends before the request did: an exception or task
    cancellation inside, aclose(), or the iterator dropped (a `break` drops the one an
    `async for` made). cancel() does nothing to a finished request, so a stream read to its
    end cancels nothing."""

    def __init__(self, handle: RequestHandle, *, cancel_on_exit: bool):
        self._handle, self._cancel_on_exit = handle, cancel_on_exit
        self._new: list = []        # taken from the buffer, not handed out yet
        self._sent = 0              # tokens taken so far
        self._finished = False      # the request finished: nothing more to take
        self._closed = False        # everything handed out (or aclose): the iteration is over

    def __aiter__(self):
        return self

    async def __anext__(self) -> int:
        if self._closed:
            raise StopAsyncIteration
        try:
            return await self._next()
        except StopAsyncIteration:
            raise
        except BaseException:   # the request's own error, or the task cancelled
            self._closed = True
            self._exit()
            raise

    async def _next(self) -> int:
        handle = self._handle
        while not self._new:
            if self._finished:
                self._closed = True
                handle._raise_failure()
                raise StopAsyncIteration
            self._new, self._sent, self._finished = handle._take(self._sent)
            if not self._new and not self._finished:
                sent = self._sent
                fut = handle._notifier.future(lambda: handle._more(sent))
                if fut is not None:
                    await fut
        return self._new.pop(0)

    async def aclose(self) -> None:
        """Stop reading (the request is cancelled when cancel_on_exit)."""
        self._closed, self._new = True, []
        self._exit()

    def _exit(self) -> None:
        if self._cancel_on_exit:
            self._handle.cancel()

    def __del__(self):
        self._exit()


class TokenStream:
    """What Engine.stream_async returns: `async for tok in stream` iterates the request's
    tokens, and leaving that loop early (break, an exception, the task cancelled) cancels the
    request, whether the stream is written inline or held in a variable: each `async for`
    reads through an iterator of its own, which cancels when the loop drops it unfinished.
    aclose() cancels too; so does dropping a stream never iterated (nobody can read it).
    One `async for` per stream."""

    def __init__(self, handle: RequestHandle):
        self._handle = handle
        self._iterated = False

    @property
    def request_id(self) -> int:
        return self._handle.request_id

    def __aiter__(self) -> AsyncTokens:
        if self._iterated:
            raise RuntimeError(f"request {self.request_id}: its stream_async() stream is read "
                               f"by one `async for` only")
        self._iterated = True
        return AsyncTokens(self._handle, cancel_on_exit=True)

    async def aclose(self) -> None:
        """Cancel the request (no effect once it finished)."""
        self._iterated = True
        self._handle.cancel()

    def __del__(self):
        if not self._iterated:
            self._handle.cancel()


def wait_timeout(timeout, call: str) -> float | None:
    """A wait's timeout as threading takes it: None or inf wait forever; NaN, a non-number
    or a bool is refused (a NaN deadline never passes and never blocks: a busy spin)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"{call}: timeout must be a number of seconds or None, got {timeout!r}")
    if math.isnan(timeout):
        raise ValueError(f"{call}: timeout must be a number of seconds or None, got nan")
    return None if math.isinf(timeout) and timeout > 0 else float(timeout)


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
