"""LoopProfile: the timing hooks the engine loop calls when profile=True.

The loop is the same with and without them (each hook is behind one `if`), so the profiled
host split describes the path that serves. The first SAMPLE iterations of an engine and then
one in SAMPLE are timed (every one with a trace): a timed iteration is split into plan (the scheduler), the runner's acquire / refresh
/ launch / drain (timed inside the runner while `runner.timed` is set), collect (the tokens,
their bookkeeping, the progress callback) and the rest ("other" in vt bench), and its step
gets device timing events. Timing every step would cost the host several µs per step (clock
reads, two event records and a query), making the profiled loop slower than the one it
describes; a phase's split per step is its sums over `timed_steps`.
"""
from __future__ import annotations

import time

# The runner's own timed parts (vt/runner/plan.py RunnerStats) that a phase accumulates.
RUNNER_SPLIT = ("acquire_s", "refresh_s", "launch_s", "drain_s")
SAMPLE = 8


class LoopProfile:
    __slots__ = ("_runner", "_rs", "_every", "_n", "_on", "_t0", "_t1", "_t2", "_before",
                 "_dev_steps", "_dev_ms_at")

    def __init__(self, runner):
        self._runner, self._rs = runner, runner.stats
        self._every = 1 if runner.tracer.enabled else SAMPLE
        self._n, self._on = 0, False
        self._t0 = self._t1 = self._t2 = 0.0
        self._before = (0.0,) * 4
        self._dev_steps, self._dev_ms_at = self._rs.device_steps, self._rs.device_ms
        runner.timed = False

    def begin(self) -> None:
        """An iteration starts: time it if it is the sample's turn."""
        self._n += 1
        # the first SAMPLE iterations, then one in SAMPLE: a short call still gets a split
        self._on = self._n <= SAMPLE or self._n % self._every == 0
        if not self._on:
            return
        rs = self._rs
        self._before = (rs.acquire_s, rs.refresh_s, rs.launch_s, rs.drain_s)
        self._runner.timed = True
        self._t0 = time.perf_counter()

    def planned(self) -> None:
        if self._on:
            self._t1 = time.perf_counter()

    def launched(self) -> None:
        if self._on:
            self._t2 = time.perf_counter()
            self._runner.timed = False   # the collect's waits count; nothing else launches

    def end(self, phase) -> None:
        """Add a timed iteration's split to `phase` (a vt.engine.progress.Phase), and the
        device time of a timed step collected in this iteration (depth 2: the one after its
        launch) to this iteration's phase."""
        rs = self._rs
        if rs.device_steps != self._dev_steps:
            phase.device_ms += rs.device_ms - self._dev_ms_at
            phase.device_steps += rs.device_steps - self._dev_steps
            self._dev_steps, self._dev_ms_at = rs.device_steps, rs.device_ms
        if not self._on:
            return
        t3 = time.perf_counter()
        acquire, refresh, launch, drain = self._before
        phase.timed_steps += 1
        phase.plan_s += self._t1 - self._t0
        phase.collect_s += t3 - self._t2
        phase.acquire_s += rs.acquire_s - acquire
        phase.refresh_s += rs.refresh_s - refresh
        phase.launch_s += rs.launch_s - launch
        phase.drain_s += rs.drain_s - drain
