"""Per-step trace written as Chrome trace JSON (chrome://tracing and ui.perfetto.dev open it).

Host spans (refresh, waits, launches) are timed with perf_counter on the host thread. Device
spans come from timing events recorded around each step on the stream, placed on the host's
clock through one anchor event whose completion the host observed at a known time.
"""
from __future__ import annotations

import json
import time

from vt.atomic_file import atomic_open

HOST_TID, DEVICE_TID = 1, 2


class Tracer:
    """Collects spans; `write()` saves them. A disabled tracer (path None) records nothing."""

    def __init__(self, be, stream, path: str | None):
        self.path = path
        self.enabled = path is not None
        self.events: list[dict] = []
        self._t0 = time.perf_counter()
        self._anchor = None
        self._anchor_host = 0.0
        if self.enabled:
            self._anchor = be.event(blocking_sync=True, timing_enabled=True)
            self._anchor.record(stream)
            self._anchor.synchronize()
            # The anchor completed no later than now and no earlier than the record: its device
            # time maps to this host time within one round trip (tens of µs).
            self._anchor_host = time.perf_counter()

    def host_span(self, name: str, start: float, end: float, **args) -> None:
        if self.enabled:
            self.events.append(_span(name, "host", HOST_TID, self._us(start), (end - start) * 1e6, args))

    def device_span(self, name: str, pair, **args) -> float:
        """Add the span between a completed pair's records; returns its device ms."""
        start, end = pair
        ms = end.elapsed_ms(start)
        if self.enabled:
            t = self._anchor_host + start.elapsed_ms(self._anchor) / 1e3
            self.events.append(_span(name, "device", DEVICE_TID, self._us(t), ms * 1e3, args))
        return ms

    def write(self) -> str | None:
        if not self.enabled:
            return None
        meta = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": n}}
                for tid, n in ((HOST_TID, "host"), (DEVICE_TID, "device (stream)"))]
        with atomic_open(self.path) as f:   # whole or absent, even after a second Ctrl-C
            json.dump({"traceEvents": meta + self.events, "displayTimeUnit": "ms"}, f)
        return self.path

    def close(self) -> None:
        if self._anchor is not None:
            self._anchor.close()

    def _us(self, t: float) -> float:
        return (t - self._t0) * 1e6


def _span(name, cat, tid, ts, dur, args):
    return {"name": name, "cat": cat, "ph": "X", "pid": 0, "tid": tid, "ts": ts, "dur": dur,
            "args": args}
