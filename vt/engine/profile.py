"""LoopProfile: the timing hooks the engine loop calls when profile=True.

The loop is the same with and without them (each hook is behind one `if`), so the profiled
host split describes the path that serves. A busy period's first FIRST iterations and then
one in EVERY (61) are timed (every one with a trace): a timed iteration is split into plan (the
scheduler), the runner's acquire / refresh / launch / drain (timed inside the runner while
its timer is armed: vt/executor/timers.py), collect (the tokens, their bookkeeping, the
progress callback) and the rest ("other" in vt bench), and its step gets device timing events
(every step that prefills gets them too, timed or not: vt/executor/timers.py says why).

The split is a stratified sample: a timed iteration stands for the iterations of its phase
since that phase's previous timed one, and its times are weighted by their count, which
`timed_steps` sums (`sampled_steps` counts the timed iterations). So a phase's split per step
is its sums over `timed_steps`, whatever the iterations cost: the first iterations of a busy
period, timed one by one so that a short call still gets a split, run slower than the rest
(a batch that forms, caches that warm) and, counted once each like the later samples, had
the split of a 3000-step run reading about twice its host time. Timing every step would cost
the host several µs per step (clock reads, two event records and a query), making the
profiled loop slower than the one it describes.
"""
from __future__ import annotations

import time

FIRST = 16   # a busy period's first iterations, all timed: a short call still gets a split
# Then one iteration in EVERY: a prime, not a power of two. A batch whose rows advance in
# lockstep crosses a KV block (new blocks for every row: a slower plan) every block_size
# steps, a power of two; a stride of 64 timed only those iterations, and the split's plan read
# three times its mean (on the sim at 32 rows; vt bench's "other" column went negative).
EVERY = 61


class LoopProfile:
    __slots__ = ("_timer", "_rs", "_every", "_n", "_t0", "_t1", "_t2", "_before", "_last")

    def __init__(self, runner):
        self._timer, self._rs = runner.timer, runner.stats
        self._every = 1 if self._timer.every_step else EVERY
        self._n = 0
        self._t0 = self._t1 = self._t2 = 0.0
        self._before = (0.0,) * 4
        self._last: dict[int, int] = {}   # id(phase) -> its steps when it was last timed
        self._timer.armed = False

    def start_call(self, phases) -> None:
        """A busy period starts: its first FIRST iterations are timed, and the iterations of
        the one before that no sample stands for are left out."""
        self._n = 0
        self._last = {id(ph): ph.steps for ph in phases}

    def begin(self) -> bool:
        """An iteration starts; returns whether it is timed (the loop then calls planned,
        launched and end)."""
        self._n += 1
        if self._n > FIRST and self._n % self._every:
            return False
        rs = self._rs
        self._before = (rs.acquire_s, rs.refresh_s, rs.launch_s, rs.drain_s)
        self._timer.armed = True
        self._t0 = time.perf_counter()
        return True

    def planned(self) -> None:
        self._t1 = time.perf_counter()

    def launched(self) -> None:
        self._t2 = time.perf_counter()
        self._timer.armed = False   # the collect's waits count; nothing else launches

    def end(self, phase) -> None:
        """Add a timed iteration's split to `phase` (a vt.engine.progress.Phase), weighted by
        the phase's iterations it stands for. Device time is the runner's, per phase
        (RunnerStats.device_by_phase)."""
        t3 = time.perf_counter()
        w = phase.steps - self._last.get(id(phase), 0)
        if w <= 0:   # launched nothing
            return
        self._last[id(phase)] = phase.steps
        rs, (acquire, refresh, launch, drain) = self._rs, self._before
        phase.timed_steps += w
        phase.sampled_steps += 1
        phase.plan_s += w * (self._t1 - self._t0)
        phase.collect_s += w * (t3 - self._t2)
        phase.acquire_s += w * (rs.acquire_s - acquire)
        phase.refresh_s += w * (rs.refresh_s - refresh)
        phase.launch_s += w * (rs.launch_s - launch)
        phase.drain_s += w * (rs.drain_s - drain)
