"""LoopProfile: the timing hooks the engine loop calls when profile=True.

The loop is the same with and without them (each hook is behind one `if`), so the profiled
host split describes the path that serves. An iteration is split into: plan (the scheduler),
the runner's acquire / refresh / launch / drain (timed inside the runner), collect (the
tokens, their bookkeeping, the progress callback) and the rest ("other" in vt bench).
"""
from __future__ import annotations

import time

# The runner's own timed parts (vt/runner/plan.py RunnerStats) that a phase accumulates.
RUNNER_SPLIT = ("acquire_s", "refresh_s", "launch_s", "drain_s")


class LoopProfile:
    def __init__(self, runner_stats):
        self._rs = runner_stats
        self._t0 = self._t1 = self._t2 = 0.0
        self._before: list[float] = []
        self._device_ms = 0.0

    def begin(self, t0: float) -> None:
        """An iteration starts at t0 (the loop's own clock: the end of the previous one)."""
        rs = self._rs
        self._t0 = t0
        self._before = [getattr(rs, k) for k in RUNNER_SPLIT]
        self._device_ms = rs.device_ms

    def planned(self) -> None:
        self._t1 = time.perf_counter()

    def launched(self) -> None:
        self._t2 = time.perf_counter()

    def end(self, phase, t3: float) -> None:
        """The iteration ended at t3: add its split to `phase` (a vt.engine.progress.Phase)."""
        rs = self._rs
        phase.plan_s += self._t1 - self._t0
        phase.collect_s += t3 - self._t2
        phase.device_ms += rs.device_ms - self._device_ms
        for k, b in zip(RUNNER_SPLIT, self._before):
            setattr(phase, k, getattr(phase, k) + getattr(rs, k) - b)
