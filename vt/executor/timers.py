"""The runner's profiling, beside its hot path: a timer the runner calls at fixed points of
every step, whatever the timer does there.

The hooks, in the order a step calls them: a graph step `acquiring`, `acquired` (the slot's
guard passed), `refreshed` (its rows written), `launched` (its handle made); an eager step
`eager_begin`, `eager_launching` (its host preparation done), `eager_launched`; then, once,
`waited` when the host has waited for the step (a drain, or for its tokens at collect). The
timer the runner holds decides what they cost:

- NullTimer (profile off): every hook does nothing; no clock is read, no event recorded.
- SampledTimer (Engine(profile=True), `vt bench --profile both`): a graph step launched
  while `armed` has its host split timed (acquire, refresh, launch: RunnerStats) and a pair
  of device timing events recorded around it. The engine's LoopProfile arms the iterations
  it samples (vt/engine/profile.py); a standalone runner stays armed, timing every step.
  Every eager step gets the events and its host launch time summed (eager_launch_s), armed
  or not: eager steps are few, long and unlike each other (the first wave's prefill is many
  times a refill's), so a sample would misstate them all. Once the host waited for a step
  with events, their device time is read (device_ms, and per engine phase).
- TracingTimer (VT_ASYNC_EXECUTOR_TRACE): the sampled timer that also writes every span into
  the Chrome trace (vt/executor/trace.py), the waits' included; LoopProfile arms every
  iteration (`every_step`).

The profile's own work stays out of what it measures: the start event is recorded between
the refresh's clock read and the launch's, the end event after the launch's.
"""
from __future__ import annotations

import time

from vt.backend.waits import wait_event
from vt.executor.trace import Tracer

_clock = time.perf_counter


class NullTimer:
    """Profile off: every hook does nothing."""

    every_step = False   # whether the engine's LoopProfile times every iteration
    armed = False        # whether the next graph step is timed (SampledTimer)

    def acquiring(self) -> None:
        """A graph step is about to acquire its slot (through the slot's guard)."""

    def acquired(self, slot, waited: float) -> None:
        """The slot passed its guard after `waited` seconds blocked."""

    def refreshed(self) -> None:
        """The step's rows are in the slot's input block; the launch is next."""

    def launched(self, handle) -> None:
        """The graph step was launched; `handle` is its StepHandle."""

    def eager_begin(self) -> None:
        """An eager, mixed or prefill step starts (before a mixed step's slot guard)."""

    def eager_launching(self) -> None:
        """The eager step's device work is about to be launched."""

    def eager_launched(self, handle) -> None:
        """The eager step was launched; `handle` is its StepHandle."""

    def waited(self, handle, drain: bool, seconds: float) -> None:
        """The host waited `seconds` (0: it was done) for `handle`'s step: a drain, or for its
        tokens at collect. Called once per step."""

    def write_trace(self) -> str | None:
        """Write the trace, if any (after the stream is done); its path or None."""
        return None

    def close(self) -> None:
        """Free the timer's events."""


NULL_TIMER = NullTimer()


class SampledTimer(NullTimer):
    """Profile on (the module docstring). `stats` is the runner's RunnerStats, which the
    timer adds to; `poll_s` how long a wait for an end event polls before it blocks."""

    def __init__(self, be, stream, stats, poll_s: float):
        self.stream, self.stats, self._poll_s = stream, stats, poll_s
        # Two pairs used in turn: two steps may be in flight.
        self._pairs = [tuple(be.event(blocking_sync=True, timing_enabled=True) for _ in range(2))
                       for _ in range(2)]
        self._turn = 0
        self.armed = True
        self._t0 = self._t1 = self._t2 = self._t2_launch = 0.0
        self._slot, self._waited, self._pair = None, 0.0, None
        self._e0, self._eager_pair = 0.0, None

    # -- graph steps, while armed --------------------------------------------------------
    def acquiring(self) -> None:
        if self.armed:
            self._t0 = _clock()

    def acquired(self, slot, waited: float) -> None:
        if self.armed:
            self._t1 = _clock()
            self._slot, self._waited = slot, waited

    def refreshed(self) -> None:
        if self.armed:
            self._t2 = _clock()
            self._pair = self._start()
            self._t2_launch = _clock()   # the start event's record stays out of the launch span

    def launched(self, handle) -> None:
        if self.armed:
            t3 = _clock()
            self._end(handle, self._pair)   # after t3: out of the launch span too
            st = self.stats
            st.acquire_s += self._t1 - self._t0
            st.refresh_s += self._t2 - self._t1
            st.launch_s += t3 - self._t2_launch
            self._graph_spans(handle, t3)

    # -- eager steps, always -------------------------------------------------------------
    def eager_begin(self) -> None:
        self._e0 = _clock()

    def eager_launching(self) -> None:
        self._eager_pair = self._start()

    def eager_launched(self, handle) -> None:
        self._end(handle, self._eager_pair)
        t3 = _clock()
        st = self.stats
        st.eager_launch_s += t3 - self._e0
        if self.armed:
            st.launch_s += t3 - self._e0
            self._eager_span(handle, self._e0, t3)

    # -- after the wait ------------------------------------------------------------------
    def waited(self, handle, drain: bool, seconds: float) -> None:
        """Read the step's device time, if it has events."""
        pair = handle.timing
        if pair is None:
            return
        handle.timing = None
        wait_event(pair[1], self._poll_s)   # recorded after `done`, which is all a wait saw
        ms = self._device_ms(handle, pair)
        st = self.stats
        st.device_ms += ms
        st.device_steps += 1
        phase = st.device_by_phase["prefill" if handle.kind in ("mixed", "prefill") else "decode"]
        phase[0] += ms
        phase[1] += 1

    def close(self) -> None:
        for pair in self._pairs:
            for ev in pair:
                ev.close()

    # -- the events, and what the tracing timer adds -------------------------------------
    def _start(self):
        """The next pair of timing events, its start recorded now."""
        pair = self._pairs[self._turn]
        self._turn ^= 1
        pair[0].record(self.stream)
        return pair

    def _end(self, handle, pair) -> None:
        pair[1].record(self.stream)
        handle.timing = pair

    def _device_ms(self, handle, pair) -> float:
        return pair[1].elapsed_ms(pair[0])

    def _graph_spans(self, handle, t3: float) -> None:
        pass

    def _eager_span(self, handle, t2: float, t3: float) -> None:
        pass


class TracingTimer(SampledTimer):
    """The sampled timer writing every span into a Chrome trace at `path` (vt/executor/trace.py)."""

    every_step = True

    def __init__(self, be, stream, stats, poll_s: float, path: str):
        super().__init__(be, stream, stats, poll_s)
        self.tracer = Tracer(be, stream, path)

    def waited(self, handle, drain: bool, seconds: float) -> None:
        t = _clock()
        self.tracer.host_span("wait drain" if drain else "wait tokens", t - seconds, t,
                              step=handle.index)
        super().waited(handle, drain, seconds)

    def write_trace(self) -> str | None:
        return self.tracer.write()

    def close(self) -> None:
        super().close()
        self.tracer.close()

    def _device_ms(self, handle, pair) -> float:
        return self.tracer.device_span(f"{handle.kind} S={handle.size}", pair, step=handle.index)

    def _graph_spans(self, handle, t3: float) -> None:
        tr, slot, index = self.tracer, self._slot, handle.index
        if self._waited:
            tr.host_span("ring wait", self._t0, self._t0 + self._waited, slot=slot.name)
        tr.host_span("refresh", self._t1, self._t2, step=index, slot=slot.name)
        tr.host_span(f"launch graph S={slot.size}", self._t2_launch, t3, step=index, n=handle.n)

    def _eager_span(self, handle, t2: float, t3: float) -> None:
        self.tracer.host_span(f"launch {handle.kind} n={handle.n}", t2, t3, step=handle.index,
                              n=handle.n)
