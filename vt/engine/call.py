"""GenerateCall: generate() as submit() for every prompt and a wait, in the caller's thread.

The progress callback runs here too, once per step of the engine while the call runs: the
serving loop only appends a small record per step to the call's sink (when a sink exists), so
a slow or raising callback never stalls or breaks the loop.
"""
from __future__ import annotations

import time
from collections import deque

from vt.backend.errors import ClosedError
from vt.engine.progress import Progress


class ProgressSink:
    """The per-step records of one generate() call (filled by the loop, read by the caller)."""

    def __init__(self, total: int):
        self.total, self.finished, self.t0 = total, 0, time.perf_counter()
        self.records: deque = deque()

    def count_finished(self, req) -> None:
        self.finished += 1

    def push(self, step: int, tokens: int, now: float) -> None:
        self.records.append(Progress(step, self.finished, self.total, tokens, now - self.t0))


class GenerateCall:
    """One generate() call over `loop` (a ServingLoop): its requests, queued together, and
    the caller's progress callback."""

    def __init__(self, loop, reqs, progress):
        self.loop, self.reqs, self.progress = loop, reqs, progress

    def run(self) -> list:
        loop, reqs = self.loop, self.reqs
        if not reqs:
            return []
        sink = None
        if self.progress is not None:
            sink = ProgressSink(len(reqs))
            for req in reqs:
                req.on_done.append(sink.count_finished)
            loop.add_progress_sink(sink)
        try:
            handles = loop.enqueue(reqs, number=False)
            try:
                if sink is None:
                    for req in reqs:
                        req.done_event.wait()
                else:
                    self._report(sink)
            except BaseException as exc:
                for h in handles:
                    h.cancel()
                for req in reqs:
                    req.done_event.wait()   # the loop finishes each at a step boundary
                errors = [r.error for r in reqs if r.error is not None and r.error is not exc]
                if errors:
                    exc.add_note(f"vt: the device also reported: {errors[0]}")
                raise
        finally:
            if sink is not None:
                loop.remove_progress_sink(sink)
        failed = next((r for r in reqs if r.error is not None), None)
        if failed is not None:
            for h in handles:
                h.cancel()
            for req in reqs:
                req.done_event.wait()
            raise failed.error
        if any(r.finish_reason == "cancelled" for r in reqs):
            raise ClosedError("Engine closed while generate() ran: its requests were cancelled")
        return [r.result() for r in reqs]

    def _report(self, sink: ProgressSink) -> None:
        """Call progress for every step record until the record of the step that finished the
        call's last request (or a request failed: no such record comes)."""
        loop, reqs, records = self.loop, self.reqs, sink.records

        def cut_short():
            return all(r.finished for r in reqs) and any(
                r.error is not None or r.finish_reason == "cancelled" for r in reqs)

        while True:
            loop.wait_for_step(lambda: records or cut_short(), None)
            while records:
                rec = records.popleft()
                self.progress(rec)
                if rec.finished == sink.total:
                    return
            if cut_short():
                return
