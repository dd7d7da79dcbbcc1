"""LoopProfile: the timing hooks the engine loop calls when profile=True.

The loop is the same with and without them (each hook is behind one `if`), so the profiled
host split describes the path that serves. An iteration is split into: plan (the scheduler),
the runner's acquire / refresh / launch / drain (timed inside the runner), collect (the
tokens, their bookkeeping, the progress callback) and the rest ("other" in vt bench). Device
time comes from the runner's sampled timing events (device_ms over device_steps).
"""
from __future__ import annotations

import time

# The runner's own timed parts (vt/runner/plan.py RunnerStats) that a phase accumulates.
RUNNER_SPLIT = ("acquire_s", "refresh_s", "launch_s", "drain_s")


class LoopProfile:
    __slots__ = ("_rs", "_t0", "_t1", "_t2", "_before")

    def __init__(self, runner_stats):
        self._rs = runner_stats
        self._t0 = self._t1 = self._t2 = 0.0
        self._before = (0.0,) * 6

    def begin(self) -> None:
        rs = self._rs
        self._before = (rs.acquire_s, rs.refresh_s, rs.launch_s, rs.drain_s, rs.device_ms,
                        rs.device_steps)
        self._t0 = time.perf_counter()

    def planned(self) -> None:
        self._t1 = time.perf_counter()

    def launched(self) -> None:
        self._t2 = time.perf_counter()

    def end(self, phase) -> None:
        """Add this iteration's split to `phase` (a vt.engine.progress.Phase)."""
        t3 = time.perf_counter()
        rs, (acquire, refresh, launch, drain, device_ms, device_steps) = self._rs, self._before
        phase.plan_s += self._t1 - self._t0
        phase.collect_s += t3 - self._t2
        phase.acquire_s += rs.acquire_s - acquire
        phase.refresh_s += rs.refresh_s - refresh
        phase.launch_s += rs.launch_s - launch
        phase.drain_s += rs.drain_s - drain
        phase.device_ms += rs.device_ms - device_ms
        phase.device_steps += rs.device_steps - device_steps
