"""How the host waits for an event: a short query-poll, then a blocking-sync wait.

The events are created with cudaEventBlockingSync, so a blocked host sleeps in the driver
instead of spinning a core (a 200 ms wait costs ~0.5 ms of CPU, spinning ~202 ms). Waking up
from that sleep adds latency on the critical path when the awaited step ends within tens
of microseconds; polling with cudaEventQuery for at most `poll_s` first removes that wake-up
for short waits and caps the CPU a long wait burns. docs/design.md has the measurement
the default is taken from.
"""
from __future__ import annotations

import time

DEFAULT_POLL_US = 50.0


def wait_event(event, poll_s: float) -> float:
    """Block until `event` completed; seconds spent (0.0 when it already had)."""
    if event.query():
        return 0.0
    clock = time.perf_counter
    t0 = clock()
    if poll_s > 0:
        deadline = t0 + poll_s
        while clock() < deadline:
            if event.query():
                return clock() - t0
    event.synchronize()
    return clock() - t0
