"""RequestHandle: one submitted request, seen from the caller's threads; StepNotifier: how
the serving loop wakes the readers of streams.

The loop does no work per request per step for readers: it publishes one counter (the
token buffer's stored_t) and, only when some stream waits, wakes every waiter once per step
(one notify_all, and one call_soon_threadsafe per asyncio waiter). A reader then copies its
new tokens out of the shared buffer by cursor. result() waits on the request's own event,
set once when it finishes. A handle reads through its TokenReader (the request, the buffer
and the notifier), and holds nothing of the engine but the serving loop's cancel callable.
AsyncTokens is the asyncio reader; TokenStream, what Engine.stream_async returns, is one
whose early exit cancels the request.
"""
from __future__ import annotations

import asyncio
import math
import numbers
import threading
import time
from typing import Callable

import numpy as np

from vt.engine.token_buffer import TokenBuffer
from vt.sampling.logprobs import read_record
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


class TokenReader:
    """One request's tokens, read from the shared token buffer by cursor in any thread: what
    a RequestHandle and its async iterators read through."""

    def __init__(self, req: Request, buffer: TokenBuffer, notifier: StepNotifier):
        self._req, self._buffer, self._notifier = req, buffer, notifier

    def snapshot(self) -> tuple[np.ndarray, bool]:
        """(the tokens so far, finished?) without blocking."""
        req = self._req
        final = req.final
        if final is not None:
            return final, True
        n = self._buffer.available(req)
        got = self._buffer.tokens[req.span_start:req.span_start + n].copy() if n else _EMPTY
        final = req.final      # finished meanwhile: its span may be reused, take the copy
        return (final, True) if final is not None else (got, False)

    def record(self, i: int) -> np.ndarray | None:
        """The record [RECORD_WORDS] of its token i (stored: i < the tokens taken), or None
        when its sampling asks for no logprobs."""
        req = self._req
        if req.sampling.logprobs is None:
            return None
        final = req.final_records
        if final is None:
            got = self._buffer.records.get(req.span_start + i)
            final = req.final_records     # finished meanwhile: the entry may be gone, take the copy
            if final is None:
                return got
        return final[i]

    def take(self, sent: int) -> tuple[list, int, bool]:
        """The tokens after the first `sent`, how many there are now, and whether it ended."""
        got, finished = self.snapshot()
        return got[sent:].tolist(), len(got), finished

    def more(self, sent: int) -> bool:
        """More than `sent` tokens are stored, or the request finished."""
        req = self._req
        return req.finished or self._buffer.available(req) > sent

    def wait(self, sent: int, timeout: float | None) -> bool:
        """Block until more(sent); False on timeout."""
        return self._notifier.wait_for(lambda: self.more(sent), timeout)

    def future(self, sent: int) -> asyncio.Future | None:
        """A future set after the next step, or None when more(sent) already holds."""
        return self._notifier.future(lambda: self.more(sent))

    def raise_failure(self) -> None:
        """A finished request whose step failed: its error (after the tokens before it)."""
        if self._req.error is not None:
            raise self._req.error


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

    def __init__(self, req: Request, buffer: TokenBuffer, notifier: StepNotifier,
                 request_cancel: Callable[[Request], None]):
        """request_cancel(req): the serving loop's, called once by cancel()."""
        self._req, self._request_cancel = req, request_cancel
        self._reader = TokenReader(req, buffer, notifier)

    @property
    def submitted_at(self) -> float:
        """When submit() queued the request (time.perf_counter, the clock of token_times)."""
        return self._req.submitted_at

    def done(self) -> bool:
        return self._req.finished

    def cancel(self) -> None:
        """Idempotent; no effect on a finished request."""
        req = self._req
        if not req.finished and not req.cancel_requested:
            req.cancel_requested = True
            self._request_cancel(req)

    def add_done_callback(self, fn) -> None:
        """fn(handle) once the request has finished (any reason) or failed: on the serving
        thread, or at once in this thread if it has finished already. It runs exactly once
        however the two race; it must be quick and must not call Engine.close()."""
        once = _Once(fn, self)
        self._req.on_done.append(lambda req: once())
        # The loop finishes the request before it runs on_done: if it has not here, the loop
        # will see the callback appended above; if it has, the loop may have run on_done
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
        return req.result()

    def snapshot(self) -> tuple[np.ndarray, bool]:
        """(the tokens so far, finished?) without blocking."""
        return self._reader.snapshot()

    def logprobs(self, i: int) -> tuple[float, list[tuple[int, float]]] | None:
        """Of its token i (one the handle has handed out): (its logprob, [(token, logprob)] of
        the sampling.logprobs most likely tokens), or None when its sampling asks for none
        (vt.SamplingParams.logprobs says which distribution)."""
        rec = self._reader.record(i)
        return None if rec is None else read_record(rec, self._req.sampling.logprobs)

    def stream(self, timeout: float | None = None):
        """Iterate the tokens as they arrive. timeout: the longest wait for the next one."""
        return self._stream(wait_timeout(timeout, "stream"))

    def _stream(self, timeout: float | None):
        reader, sent = self._reader, 0
        while True:
            new, sent, finished = reader.take(sent)
            yield from new
            if finished:
                reader.raise_failure()
                return
            if not reader.wait(sent, timeout):
                raise TimeoutError(f"request {self._req.index}: no token in {timeout} s")

    def stream_async(self) -> AsyncTokens:
        """stream() for asyncio: the event loop is never blocked. Leaving the loop early does
        not cancel the request (Engine.stream_async's stream does)."""
        return AsyncTokens(self._reader, self.cancel, cancel_on_exit=False)


class AsyncTokens:
    """An async iterator over a request's tokens as they arrive. cancel_on_exit: `cancel()`
    is called when the iteration ends before the request did: an exception or task
    cancellation inside, aclose(), or the iterator dropped (a `break` drops the one an
    `async for` made). cancel() does nothing to a finished request, so a stream read to its
    end cancels nothing."""

    def __init__(self, reader: TokenReader, cancel: Callable[[], None], *,
                 cancel_on_exit: bool):
        self._reader, self._cancel = reader, cancel
        self.cancel_on_exit = cancel_on_exit
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
        reader = self._reader
        while not self._new:
            if self._finished:
                self._closed = True
                reader.raise_failure()
                raise StopAsyncIteration
            self._new, self._sent, self._finished = reader.take(self._sent)
            if not self._new and not self._finished:
                fut = reader.future(self._sent)
                if fut is not None:
                    await fut
        return self._new.pop(0)

    async def aclose(self) -> None:
        """Stop reading (the request is cancelled when cancel_on_exit)."""
        self._closed, self._new = True, []
        self._exit()

    def _exit(self) -> None:
        if self.cancel_on_exit:
            self._cancel()

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

    def __aiter__(self) -> AsyncTokens:
        if self._iterated:
            raise RuntimeError("this stream_async() stream is read by one `async for` only")
        self._iterated = True
        tokens = self._handle.stream_async()
        tokens.cancel_on_exit = True
        return tokens

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
