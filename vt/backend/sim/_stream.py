"""Sim streams: a worker thread per stream executes queued ops in order, like a CUDA stream."""
from __future__ import annotations

import itertools
import math
import numbers
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from .._handle import HandleOwner
from ..errors import CudaError

_handles = itertools.count(0x5000)

# The longest sleep one sim op may take: time.sleep refuses NaN and overflows past ~1e9 s, and
# a delay beyond a minute per op is a typo, not a simulation.
MAX_DELAY_S = 60.0


def check_delay(seconds, name: str = "device_delay_s") -> None:
    """Refuse a delay the stream worker could not sleep (ValueError/TypeError naming it)."""
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, got {seconds!r}")
    if not (math.isfinite(seconds) and 0 <= seconds <= MAX_DELAY_S):
        raise ValueError(f"{name} must be a finite number of seconds in [0, {MAX_DELAY_S:g}], "
                         f"got {seconds!r}")


@dataclass(frozen=True)
class Op:
    """One queued device operation. `work` ops pay the device delay; markers (events) do not."""
    label: str
    fn: Callable[[], None]
    work: bool = True

    def replay(self, stream: "Stream") -> None:
        stream.submit(self)


class Stream(HandleOwner):
    """A non-blocking sim stream. Ops run on its worker thread; the host only enqueues.

    close() is idempotent; ops already queued still run (as cudaStreamDestroy lets them finish).
    """

    def __init__(self, name: str = "stream", *, device_delay_s: float = 0.0, legacy: bool = False):
        check_delay(device_delay_s)
        self.name = name
        self.legacy = legacy
        self.handle = 0 if legacy else next(_handles)   # cudaStreamLegacy is handle 0 too
        self.capture = None      # the Capture recording this stream's ops, if any
        self._worker = _Worker(name, device_delay_s)
        self._own(self._worker.stop)

    def submit(self, op: Op) -> None:
        """Enqueue `op`, or record it when the stream captures."""
        self._require_open()
        if self.capture is not None:
            self.capture.record(op)
        else:
            self._worker.submit(op)

    def wait_event(self, event) -> None:
        """Later ops on this stream wait for the event's latest record issued before this call."""
        self._require_open()
        target = event.issued
        self.submit(Op(f"wait_event({event.name})", lambda: event.wait_for(target), work=False))

    def synchronize(self) -> None:
        """Block until every op issued so far ran; raise an op's failure if one was recorded."""
        self._require_open()
        self._refuse_in_capture("cudaStreamSynchronize")
        self._worker.wait(self._worker.submitted)
        self.raise_pending_error()

    def query(self) -> bool:
        """Whether every op issued so far ran; raises an op's failure as synchronize() does
        (cudaStreamQuery returns the error of an earlier launch too)."""
        self._require_open()
        self._refuse_in_capture("cudaStreamQuery")
        done = self._worker.done >= self._worker.submitted
        self.raise_pending_error()
        return done

    def raise_pending_error(self) -> None:
        failure = self._worker.take_error()
        if failure is not None:
            label, exc = failure
            raise RuntimeError(f"sim op {label!r} on stream {self.name!r} failed: "
                               f"{type(exc).__name__}: {exc}") from exc

    def __repr__(self):
        return f"SimStream({self.name!r}{', legacy' if self.legacy else ''})"

    def _closed_message(self) -> str:
        return f"stream {self.name!r} is closed"

    def _refuse_in_capture(self, call: str) -> None:
        if self.capture is not None:
            self.capture.fail(CudaError("cudaErrorStreamCaptureUnsupported", call,
                                        f"stream {self.name!r} is capturing {self.capture.name!r}"))


class _Worker:
    """The thread behind a stream (no reference back to the Stream, so the stream can be GC'd)."""

    def __init__(self, name: str, device_delay_s: float):
        self.delay = device_delay_s
        self.submitted = 0
        self.done = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._error: tuple[str, BaseException] | None = None
        self._thread = threading.Thread(target=self._run, name=f"vt-sim-{name}", daemon=True)
        self._thread.start()

    def submit(self, op: Op) -> None:
        with self._cv:
            self.submitted += 1
            self._queue.put(op)

    def wait(self, target: int) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self.done >= target)

    def take_error(self):
        with self._cv:
            failure, self._error = self._error, None
            return failure

    def stop(self) -> None:
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        while (op := self._queue.get()) is not None:
            try:   # the delay inside: nothing an op brings may end this thread (waits would hang)
                if op.work and self.delay:
                    time.sleep(self.delay)
                op.fn()
            except BaseException as exc:  # kept for the next synchronize: never lost
                with self._cv:
                    self._error = self._error or (op.label, exc)
            del op  # drop the op's arrays now: a finished op must not keep pool buffers alive
            with self._cv:
                self.done += 1
                self._cv.notify_all()
