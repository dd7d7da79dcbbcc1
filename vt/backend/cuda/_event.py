"""Events, with options named after the CUDA flags they set."""
from __future__ import annotations

from dataclasses import dataclass

from cuda.bindings import runtime as cudart

from ._check import SUCCESS, check, cuda_error
from .._handle import HandleOwner

_NOT_READY = cudart.cudaError_t.cudaErrorNotReady


@dataclass(frozen=True)
class EventOptions:
    """blocking_sync -> cudaEventBlockingSync: synchronize() sleeps on the driver instead of
    spinning a host core (docs/design.md: 0.5 ms of CPU for a 200 ms wait, vs 202 ms spinning).
    timing_enabled=False -> cudaEventDisableTiming: cheaper record, no elapsed_ms."""

    blocking_sync: bool = True
    timing_enabled: bool = False

    @property
    def flags(self) -> int:
        flags = cudart.cudaEventDefault
        if self.blocking_sync:
            flags |= cudart.cudaEventBlockingSync
        if not self.timing_enabled:
            flags |= cudart.cudaEventDisableTiming
        return int(flags)


class Event(HandleOwner):
    _kind = "event"

    def __init__(self, options: EventOptions = EventOptions(), name: str = ""):
        self.options = options
        self.name = name
        self._event = check(cudart.cudaEventCreateWithFlags(options.flags), "cudaEventCreateWithFlags")
        self.handle = int(self._event)
        self._own(_destroy_event, self._event)

    def record(self, stream, external: bool = False) -> None:
        """Record on `stream`. Inside a capture this becomes a graph node; `external=True`
        (cudaEventRecordExternal) makes it an event-record node that re-records this event on
        every replay, so the host can wait on a point inside the graph (inputs-read event)."""
        self._require_open()
        if external:
            check(cudart.cudaEventRecordWithFlags(self._event, stream.handle,
                                                  cudart.cudaEventRecordExternal),
                  "cudaEventRecordWithFlags(cudaEventRecordExternal)")
        else:   # on every step's path: one error compare
            err = cudart.cudaEventRecord(self._event, stream.handle)[0]
            if err != SUCCESS:
                stream._require_open()
                raise cuda_error(err, "cudaEventRecord")

    def synchronize(self) -> None:
        """Block the host until the event completes (sleeping if blocking_sync)."""
        self._require_open()
        check(cudart.cudaEventSynchronize(self._event), "cudaEventSynchronize")

    def query(self) -> bool:
        """True when the work before the last record has completed (or it was never recorded)."""
        self._require_open()
        err = cudart.cudaEventQuery(self._event)[0]
        if err == SUCCESS:
            return True
        if err == _NOT_READY:
            return False
        raise cuda_error(err, "cudaEventQuery")

    def elapsed_ms(self, start: "Event") -> float:
        """Milliseconds from `start` to this event; both must be timing-enabled and complete."""
        self._require_open()
        start._require_open()
        for ev, role in ((start, "start"), (self, "end")):
            if not ev.options.timing_enabled:
                raise ValueError(f"elapsed_ms: the {role} event {ev._label()} was created with "
                                 f"timing_enabled=False")
        return float(check(cudart.cudaEventElapsedTime(start._event, self._event), "cudaEventElapsedTime"))

    def __repr__(self) -> str:
        return f"<Event {self.name!r} {self.options} {'closed' if self.closed else 'open'}>"


def _destroy_event(event) -> None:
    check(cudart.cudaEventDestroy(event), "cudaEventDestroy")
