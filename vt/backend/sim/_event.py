"""Sim events: complete when the stream's worker reaches their record op."""
from __future__ import annotations

import threading
import time
import weakref

from .._handle import HandleOwner
from ..errors import CudaError
from ._stream import Op


class Event(HandleOwner):
    """A sim event. `blocking_sync` picks how the host waits: a threading wait, or a spin.

    Holds no OS resource, so unlike streams it has nothing to release: close() only marks it
    closed.
    """

    def __init__(self, *, blocking_sync: bool = True, timing_enabled: bool = False,
                 name: str = "event"):
        self.blocking_sync = blocking_sync
        self.timing_enabled = timing_enabled
        self.name = name
        self.issued = 0            # records issued by the host (outside capture or by replays)
        self._completed = 0        # highest record generation the device has reached
        self._time: float | None = None
        self._cv = threading.Condition()
        self._stream = None        # stream of the latest record, whose op failures sync reports
        # The capture that holds the latest record, if recorded in one. Weak: a graph's node
        # holds this event, and a strong link back to the capture (which holds its graph)
        # would keep the graph, its stream and the stream's worker thread alive forever.
        self._capture = None
        self._own()

    def record(self, stream, *, external: bool = False) -> None:
        """Record on `stream`; inside a capture a node (external=True: re-recorded per replay)."""
        self._require_open()
        stream._require_open()
        if stream.capture is not None:
            self._capture = weakref.ref(stream.capture)
            node = _ExternalRecord(self) if external else Op(f"record({self.name})",
                                                             lambda: None, work=False)
            stream.submit(node)
            return
        with self._cv:
            self.issued += 1
            generation = self.issued
            self._stream, self._capture = stream, None
        stream.submit(Op(f"record({self.name})", lambda: self._complete(generation), work=False))

    def synchronize(self) -> None:
        """Wait for the latest record issued before this call."""
        self._require_open()
        self._refuse_in_capture("cudaEventSynchronize")
        self.wait_for(self.issued, spin=not self.blocking_sync)
        if self._stream is not None:
            self._stream.raise_pending_error()

    def query(self) -> bool:
        """Whether the latest record completed. Like cudaEventQuery, it also reports the
        failure of an earlier op on the record's stream (a kernel that raised), so a host
        that polls instead of synchronizing learns of it at the same call as on CUDA."""
        self._require_open()
        self._refuse_in_capture("cudaEventQuery")
        done = self._completed >= self.issued
        if self._stream is not None:
            self._stream.raise_pending_error()
        return done

    def elapsed_ms(self, start: "Event") -> float:
        """Milliseconds from `start`'s latest record to this event's, timed when they ran."""
        self._require_open()
        start._require_open()
        for ev, role in ((start, "start"), (self, "end")):
            if not ev.timing_enabled:
                raise ValueError(f"elapsed_ms: the {role} event {ev.name!r} was created with "
                                 f"timing_enabled=False")
        for ev in (start, self):
            if ev._time is None or ev._completed < ev.issued:
                raise CudaError("cudaErrorNotReady", "cudaEventElapsedTime",
                                f"event {ev.name!r} has not completed its latest record")
        return (self._time - start._time) * 1e3

    def wait_for(self, generation: int, *, spin: bool = False) -> None:
        """Block until record `generation` completed (a spin polls, like a default CUDA event)."""
        if spin:
            while self._completed < generation:
                time.sleep(0)
            return
        with self._cv:
            self._cv.wait_for(lambda: self._completed >= generation)

    def _complete(self, generation: int) -> None:
        with self._cv:
            if generation > self._completed:   # records on two streams may complete out of order
                self._completed = generation
                self._time = time.perf_counter()
            self._cv.notify_all()

    def _closed_message(self) -> str:
        return f"event {self.name!r} is closed"

    def _refuse_in_capture(self, call: str) -> None:
        # CUDA refuses the call with cudaErrorCapturedEvent; it does not invalidate the capture.
        capture = self._capture() if self._capture is not None else None
        if capture is not None and capture.active:
            raise CudaError("cudaErrorCapturedEvent", call,
                            f"event {self.name!r} was last recorded in capture "
                            f"{capture.name!r}, which is still open")


class _ExternalRecord:
    """Graph node of ev.record(s, external=True): each replay issues a new record of the event."""

    def __init__(self, event: Event):
        self.event = event
        self.label = f"record_external({event.name})"

    def replay(self, stream) -> None:
        self.event.record(stream, external=True)
