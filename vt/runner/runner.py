"""Runner: one step at a time, depth-2 async, with the drain and its skip.

A graph step is one graph launch: the slot's input block H2D, the forward, the sampler (which
writes the next step's input token into the device token table) and the tokens' D2H into the
slot's pinned output, then one event record. Step N+1 is launched before the host reads step
N's tokens.

Before Refresh(N+1) the host drains (waits for step N) unless the skip applies: the
previous step's logits are a non-owning graph view AND the mode skips the drain
(ExecutorConfig.skips_graph_drain: the ring modes, safe because the slot's event guards its
block, or the unguarded test arm, unsafe because nothing does). Eager, mixed and prefill
steps own their logits and always drain.

Every step goes through launch() and collect(): profiling (timing events, the host split,
the trace) is a cheap check inside that one path, so a profiled run times the path that
serves.
"""
from __future__ import annotations

import time
import numpy as np

from vt.backend.errors import ClosedError
from vt.runner.eager import EagerPath
from vt.graphs import DecodeGraphDriver, GraphSettings
from vt.step.contract import LOGITS_DTYPE
from vt.runner.plan import RunnerStats, StepHandle, StepPlan  # noqa: F401  (StepPlan: re-exported)
from vt.runner.trace import Tracer
from vt.backend.waits import DEFAULT_POLL_US, wait_event
from vt.testing import NULL_HOOKS, ExecutorHooks


def _decode_and_sample(model):
    """The captured step. A closure over the model only: a bound method of the runner would
    make runner -> driver -> runner a cycle, freed only by the cyclic GC at any later moment
    (its pinned buffers with it)."""
    def step(stream, inputs, logits, out_tokens) -> None:
        model.decode(stream, inputs, logits)
        model.sample(stream, logits, inputs, out_tokens)
    return step


class Runner:
    """Launches steps of a step model (vt.step.contract.StepModel): graphs through the driver, the rest
    through the eager path. With profile=True, a launch while `timed` is set has its host
    split timed and device timing events recorded around it (the engine's LoopProfile sets
    `timed` on the iterations it samples; a standalone runner times every step); an eager
    step gets device timing events whenever profile is on. `hooks`: the test arms
    (vt/testing.py), called at fixed points; the default does nothing there."""

    def __init__(self, be, model, config, *, hooks: ExecutorHooks = NULL_HOOKS,
                 record_logits: bool = False, profile: bool = False):
        if not isinstance(hooks, ExecutorHooks):
            raise TypeError(f"Runner: hooks must be a vt.testing.ExecutorHooks, got "
                            f"{type(hooks).__name__}")
        self.be, self.model, self.config, self.hooks = be, model, config, hooks
        self.stream = be.stream(name="vt-decode")
        geo = model.geometry
        self.capacity = max(geo.max_seqs, max(config.capture_sizes, default=0))
        # Poll before blocking on the GPU (vt/backend/waits.py); on the sim a poll would take the GIL
        # from the worker thread that completes the event, so it blocks at once.
        poll_us = config.wait_poll_us
        if poll_us is None:
            poll_us = DEFAULT_POLL_US if be.name == "cuda" else 0.0
        self._poll_s = poll_us * 1e-6
        settings = GraphSettings(sizes=config.capture_sizes, slots_per_size=config.slots_per_size,
                                 guarded=config.guarded, staged=config.staged_h2d)
        self.driver = DecodeGraphDriver(be, self.stream, _decode_and_sample(model), vocab=model.vocab,
                                        max_blocks=geo.max_blocks, pad=model.pad, settings=settings,
                                        hooks=hooks)
        self.eager = EagerPath(be, self.stream, model, capacity=self.capacity,
                               graph_size=self.driver.padded_size)
        self.tracer = Tracer(be, self.stream, config.trace)
        self.profile = profile or self.tracer.enabled
        self.stats = RunnerStats()
        self._skip_graph_drain = config.skips_graph_drain
        self._after_graph_launch = hooks.after_graph_launch
        self._ring_for = self.driver.ring_for
        self._record = ([be.pinned_empty((self.capacity, model.vocab), LOGITS_DTYPE) for _ in range(2)],
                        [be.event(blocking_sync=True) for _ in range(2)]) if record_logits else None
        self._n_timed = 0
        self._timing = None
        self.set_profile(self.profile)
        self._last: StepHandle | None = None
        self._inflight: list[StepHandle] = []
        self._steps = 0
        self._closed = False

    def set_profile(self, on: bool) -> None:
        """Profile from the next launch on (always with a trace). The timing events are made
        the first time; call it between steps only (Engine.set_profile: while idle)."""
        self.profile = bool(on) or self.tracer.enabled
        if self.profile and self._timing is None:
            self._timing = [tuple(self.be.event(blocking_sync=True, timing_enabled=True)
                                  for _ in range(2)) for _ in range(2)]
        self.timed = self.profile   # time the next launch (host split + device events)

    def capture(self) -> None:
        """Capture every graph (warm-up, pre-grow and capture per size: vt/graphs/capture.py)."""
        self._check_open()
        self.driver.capture()

    def warm_up(self, max_prefill_tokens: int) -> None:
        """Run every eager shape once, so that serving never calls the driver afterwards."""
        self._check_open()
        self.eager.warm_up(self.driver.rings, max_prefill_tokens)

    # -- launch -------------------------------------------------------------------------
    def launch(self, plan: StepPlan) -> StepHandle:
        """Launch one step: a graph replay when its rows are decode-only and a captured size
        fits, else the eager path. Drains first unless the skip applies."""
        self._check_open()
        n = plan.n
        if n == 0:
            raise ValueError("an empty step: nothing to decode or prefill")
        if n > self.capacity:
            raise ValueError(f"a step of {n} rows exceeds max_seqs={self.capacity}")
        if len(self._inflight) >= 2:
            raise RuntimeError(f"two steps ({[h.index for h in self._inflight]}) are launched and "
                               f"not collected; collect the oldest before launching (depth 2)")
        self._drain_if_needed()
        ring = None if plan.prefill else self._ring_for(n)
        handle = self._launch_graph(ring, plan) if ring is not None else self._launch_eager(plan)
        self._last = handle
        self._inflight.append(handle)
        self._steps += 1
        return handle

    def _drain_if_needed(self) -> None:
        """Wait for the step in flight before this launch unless the drain skip applies (its
        logits are a graph's view and the mode skips the drain: module docstring)."""
        prev = self._last
        if prev is not None and prev.tokens is None and not (
                prev.logits.non_owning_view and self._skip_graph_drain):
            self._wait(prev, drain=True)
            by_kind = self.stats.drains_after
            by_kind[prev.kind] = by_kind.get(prev.kind, 0) + 1

    def _launch_graph(self, ring, plan: StepPlan) -> StepHandle:
        """Acquire the ring's next slot (its guard), refresh its block, replay it. With
        profile, the host split is timed and the device timing events recorded around the
        step; without it, no clock is read."""
        prof, st = self.timed, self.stats
        t0 = time.perf_counter() if prof else 0.0
        slot, waited = self._acquire(ring)
        t1 = time.perf_counter() if prof else 0.0
        plan.decode.write_into(slot.host, self.model.pad)
        timing = None
        if prof:
            t2 = time.perf_counter()
            timing = self._start_timing()
            t2_launch = time.perf_counter()   # the profile's own event stays out of the launch span
        index, n = self._steps, plan.n
        logits = slot.launch(self.stream, n, index)
        st.steps += 1
        st.graph_steps += 1
        st.steps_by_size[slot.size] = st.steps_by_size.get(slot.size, 0) + 1
        handle = StepHandle(index, "graph", n, slot.size, logits, plan.tag, slot.out_host, slot.done, slot)
        if self._record is not None:
            self._record_logits(handle)
        if prof:
            t3 = time.perf_counter()
            self._end_timing(handle, timing)   # the profile's own event: out of the span too
            st.acquire_s += t1 - t0
            st.refresh_s += t2 - t1
            st.launch_s += t3 - t2_launch
            if self.tracer.enabled:
                if waited:
                    self.tracer.host_span("ring wait", t0, t0 + waited, slot=slot.name)
                self.tracer.host_span("refresh", t1, t2, step=index, slot=slot.name)
                self.tracer.host_span(f"launch graph S={slot.size}", t2_launch, t3, step=index, n=n)
        self._after_graph_launch(ring, handle, self._skip_graph_drain, st)
        return handle

    def _launch_eager(self, plan: StepPlan) -> StepHandle:
        """With profile, every eager step gets device timing events and its host launch time
        summed (eager_launch_s), sampled or not: they are few, long and unlike each other (the
        first wave's prefill is many times a refill's), so a sample would misstate them all."""
        index, n, parity, t2 = self._steps, plan.n, self._steps % 2, time.perf_counter()
        slot = self._mixed_decode_slot(plan)
        timing = self._start_timing() if self.profile else None
        logits, kind = self.eager.launch(plan.decode, plan.prefill, parity, slot=slot, index=index,
                                         keep_logits=self._record is not None)
        done = self.eager.done[parity]
        done.record(self.stream)
        handle = StepHandle(index, kind, n, n, logits, plan.tag, self.eager.out_host[parity], done)
        if self._record is not None:
            self._record_logits(handle)
        self._end_timing(handle, timing)
        self.stats.steps += 1
        setattr(self.stats, f"{kind}_steps", getattr(self.stats, f"{kind}_steps") + 1)
        if self.profile:
            t3 = time.perf_counter()
            self.stats.eager_launch_s += t3 - t2
            if self.timed:
                self.stats.launch_s += t3 - t2
                self.tracer.host_span(f"launch {kind} n={n}", t2, t3, step=index, n=n)
        return handle

    def _mixed_decode_slot(self, plan: StepPlan):
        """The graph slot for a mixed step's decode rows, through its ring's guard (None: none,
        no size fits, or one call runs the whole step): its graph replaces the eager decode's
        launches (one per kernel per layer), which made a mixed step launch-bound."""
        n_dec = len(plan.decode) if plan.decode is not None and plan.prefill else 0
        ring = self._ring_for(n_dec) if n_dec and not self.model.mixed_in_one_call else None
        return None if ring is None else self._acquire(ring)[0]

    def _acquire(self, ring):
        """The ring's next slot through its guard, and the seconds the guard blocked (counted)."""
        slot, waited = ring.acquire(self._poll_s)
        self.stats.ring_waits += waited > 0
        return slot, waited

    def _start_timing(self):
        """A pair of timing events (two pairs in turn: two steps may be in flight), the start
        recorded now."""
        if self._timing is None:
            return None
        timing = self._timing[self._n_timed % 2]
        self._n_timed += 1
        timing[0].record(self.stream)
        return timing

    def _record_logits(self, handle: StepHandle) -> None:   # a test/debug option
        parity = handle.index % 2
        handle.host_logits = self._record[0][parity][:handle.n]
        self.be.copy_d2h(handle.host_logits, handle.logits.rows, self.stream)
        handle.done = self._record[1][parity]
        handle.done.record(self.stream)

    def _end_timing(self, handle: StepHandle, timing) -> None:   # after all the step does
        if timing is not None:
            timing[1].record(self.stream)
            handle.timing = timing

    # -- collect ------------------------------------------------------------------------
    def collect(self, handle: StepHandle) -> np.ndarray:
        """Wait for the oldest step in flight and return its sampled tokens [n] (a host copy)."""
        self._check_open()
        inflight = self._inflight
        if not inflight or handle is not inflight[0]:
            raise ValueError(f"step {handle.index} is not the oldest step in flight "
                             f"(in flight: {[h.index for h in inflight]})")
        inflight.pop(0)
        if handle.tokens is None:
            self._wait(handle, drain=False)
        if handle.timing is not None:
            start, end = handle.timing
            wait_event(end, self._poll_s)   # recorded after `done`, which is all a drain waited for
            ms = (self.tracer.device_span(f"{handle.kind} S={handle.size}", handle.timing,
                                          step=handle.index)
                  if self.tracer.enabled else end.elapsed_ms(start))
            st = self.stats
            st.device_ms += ms
            st.device_steps += 1
            phase = st.device_by_phase["prefill" if handle.kind in ("mixed", "prefill") else "decode"]
            phase[0] += ms
            phase[1] += 1
            handle.timing = None
        return handle.tokens

    def _wait(self, handle: StepHandle, *, drain: bool) -> None:
        """Block on the step's done event, then copy its tokens out of the pinned buffer (the
        next launch of its slot may overwrite that buffer before the host collects). The
        time counted is the time blocked (wait_event's own measure: no clock when the step
        was already done)."""
        t0 = time.perf_counter() if self.tracer.enabled else 0.0
        waited = wait_event(handle.done, self._poll_s)
        handle.tokens = handle.out_host[:handle.n].copy()
        if handle.slot is not None:
            handle.slot.collected(handle.index)
        st = self.stats
        if drain:
            st.drains += 1
            st.drain_s += waited
        else:
            st.token_waits += 1
            st.token_wait_s += waited
        if self.tracer.enabled:
            self.tracer.host_span("wait drain" if drain else "wait tokens", t0, t0 + waited,
                                  step=handle.index)

    # -- recovery, measurement, teardown ------------------------------------------------
    def abort(self) -> BaseException | None:
        """After a failure mid-run: wait for the stream, drop the steps in flight. Returns the
        device-side error the wait raised, if any (the sim reports a failed op this way)."""
        error = None
        try:
            self.stream.synchronize()
        except Exception as exc:  # noqa: BLE001 (reported to the caller, who re-raises its own)
            error = exc
        self._inflight.clear()
        self._last = None
        return error

    def close(self) -> str | None:
        """Wait for the device, write the trace, then free graphs, events, stream (idempotent)."""
        if self._closed:
            return None
        self._closed = True
        path = None
        try:
            # The backend may be closed already (an Engine dropped after it, closed by its
            # finalizer): its streams and graphs are gone with it, nothing is left to wait for.
            if not self.stream.closed:
                self.stream.synchronize()
                path = self.tracer.write()
        finally:
            self.driver.close()
            self.eager.close()
            events = [e for pair in (self._timing or []) for e in pair]
            events += self._record[1] if self._record is not None else []
            for ev in events:
                ev.close()
            self.model.release_stream(self.stream)   # after the graphs that used it are gone
            self.stream.close()
        return path

    def _check_open(self):
        if self._closed:
            raise ClosedError("Runner is closed")
