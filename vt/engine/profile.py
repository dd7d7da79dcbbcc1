"""LoopProfile: the timing hooks the engine loop calls when profile=True.

The loop is the same with and without them (each hook is behind one `if`), so the profiled
host split describes the path that serves. The first FIRST iterations of a call and then
one in EVERY are timed (every one with a trace): a timed iteration is split into plan (the
scheduler), the runner's acquire / refresh / launch / drain (timed inside the runner while `runner.timed` is set), collect (the tokens,
their bookkeeping, the progress callback) and the rest ("other" in vt bench), and its step
gets device timing events (every step that prefills gets them too, timed or not: the runner's
_launch_eager says why). Timing every step would cost the host several µs per step (clock
reads, two event records and a query), making the profiled loop slower than the one it
describes; a phase's split per step is its sums over `timed_steps`. One in 16 still cost the
H200 loop about 12 % of its host time per step at 20 µs steps, one in 64 about 6 %
(docs/benchmarks.md, section 2).
"""
from __future__ import annotations

import time

# The runner's own timed parts (vt/runner/plan.py RunnerStats) that a phase accumulates.
RUNNER_SPLIT = ("acquire_s", "refresh_s", "launch_s", "drain_s")
FIRST = 16   # a call's first iterations, all timed: a short call still gets a split
EVERY = 64   # then one iteration in EVERY


class LoopProfile:
    __slots__ = ("_runner", "_rs", "_every", "_n", "_t0", "_t1", "_t2", "_before")

    def __init__(self, runner):
        self._runner, self._rs = runner, runner.stats
        self._every = 1 if runner.tracer.enabled else EVERY
        self._n = 0
        self._t0 = self._t1 = self._t2 = 0.0
        self._before = (0.0,) * 4
        runner.timed = False

    def start_call(self) -> None:
        """A generate() call's loop starts: its first FIRST iterations are timed."""
        self._n = 0

    def begin(self) -> bool:
        """An iteration starts; returns whether it is timed (the loop then calls planned,
        launched and end): the call's first FIRST iterations, so that a short call still
        gets a split, then one in EVERY."""
        self._n += 1
        if self._n > FIRST and self._n % self._every:
            return False
        rs = self._rs
        self._before = (rs.acquire_s, rs.refresh_s, rs.launch_s, rs.drain_s)
        self._runner.timed = True
        self._t0 = time.perf_counter()
        return True

    def planned(self) -> None:
        self._t1 = time.perf_counter()

    def launched(self) -> None:
        self._t2 = time.perf_counter()
        self._runner.timed = False   # the collect's waits count; nothing else launches

    def end(self, phase) -> None:
        """Add a timed iteration's split to `phase` (a vt.engine.progress.Phase). Device time
        is the runner's, per phase (RunnerStats.device_by_phase)."""
        t3 = time.perf_counter()
        rs, (acquire, refresh, launch, drain) = self._rs, self._before
        phase.timed_steps += 1
        phase.plan_s += self._t1 - self._t0
        phase.collect_s += t3 - self._t2
        phase.acquire_s += rs.acquire_s - acquire
        phase.refresh_s += rs.refresh_s - refresh
        phase.launch_s += rs.launch_s - launch
        phase.drain_s += rs.drain_s - drain
