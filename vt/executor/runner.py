"""Runner: one step at a time, depth-2 async, with the drain and its skip.

A graph step is one launch of the slot's step graph (vt/graphs/capture.py): the input
block's H2D and the forward, then the sampler (which writes the next step's input token into
the device token table), the tokens' D2H into the slot's pinned output and one event record.
Step N+1 is launched before the host reads step N's tokens. launch(plan, sample=False)
launches a graph step's forward graph alone, and launch_sampler(handle) its sampler graph
later: the host queues work between the two in the stream (a grammar's masks, built from
step N's tokens while the forward of step N+1 runs: vt/engine/serving.py).

Before Refresh(N+1) the host drains (waits for step N) unless the skip applies: the
previous step's logits are a non-owning graph view AND the mode skips the drain
(ExecutorConfig.skips_graph_drain: the ring modes, safe because the slot's event guards its
block, or the unguarded test arm, unsafe because nothing does). Eager, mixed and prefill
steps own their logits and always drain.

Every step goes through launch() and collect(). Profiling is the timer's
(vt/executor/timers.py): the runner calls its hooks at fixed points of every step, and with
profile off they do nothing, so a profiled run times the path that serves.
"""
from __future__ import annotations

import numpy as np

from vt.backend.errors import ClosedError
from vt.executor.eager import EagerPath
from vt.graphs import DecodeGraphDriver, GraphSettings, StepHalves
from vt.executor.logits_record import LogitsRecord
from vt.executor.plan import RunnerStats, StepHandle, StepPlan  # noqa: F401  (StepPlan: re-exported)
from vt.executor.timers import NULL_TIMER, SampledTimer, TracingTimer
from vt.backend.waits import DEFAULT_POLL_US, wait_event
from vt.hooks import NULL_HOOKS, ExecutorHooks


def _step_halves(model) -> StepHalves:
    """The captured step's two halves. Bound methods of the model only: a bound method of
    the runner would make runner -> driver -> runner a cycle, freed only by the cyclic GC at
    any later moment (its pinned buffers with it)."""
    return StepHalves(forward=model.decode, sample=model.sample)


class Runner:
    """Launches steps of a step model (vt.step.contract.StepModel): graphs through the driver,
    the rest through the eager path. With profile=True (or a trace) `timer` is a sampled
    timer (vt/executor/timers.py), else the null one. `hooks`: the test arms (vt/hooks.py),
    called at fixed points; the default does nothing there."""

    def __init__(self, be, model, config, *, hooks: ExecutorHooks = NULL_HOOKS,
                 record_logits: bool = False, profile: bool = False):
        if not isinstance(hooks, ExecutorHooks):
            raise TypeError(f"Runner: hooks must be a vt.hooks.ExecutorHooks, got "
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
        self.driver = DecodeGraphDriver(be, self.stream, _step_halves(model), vocab=model.vocab,
                                        max_blocks=geo.max_blocks, pad=model.pad, settings=settings,
                                        hooks=hooks)
        self.eager = EagerPath(be, self.stream, model, capacity=self.capacity,
                               graph_size=self.driver.padded_size)
        self.stats = RunnerStats()
        self._tracing = (TracingTimer(be, self.stream, self.stats, self._poll_s, config.trace)
                         if config.trace is not None else None)
        self._sampled = self._tracing
        self._record = (LogitsRecord(be, self.stream, self.capacity, model.vocab)
                        if record_logits else None)
        self._skip_graph_drain = config.skips_graph_drain
        self._after_graph_launch = hooks.after_graph_launch
        self._ring_for = self.driver.ring_for
        self.set_profile(profile)
        self._last: StepHandle | None = None
        self._unsampled: StepHandle | None = None   # launched with sample=False, sampler not yet
        self._inflight: list[StepHandle] = []
        self._steps = 0
        self._copy_records = True   # set_copy_records
        self._closed = False

    def set_copy_records(self, on: bool) -> None:
        """Whether collect copies each step's token records out of the pinned buffer into
        handle.records from now on (on at first). Off, handle.records stays None: a caller
        turns it off while it reads no records (the engine: no running request asks for
        logprobs and no speculation): they are [n, RECORD_WORDS], the tokens [n]."""
        self._copy_records = bool(on)

    def set_profile(self, on: bool) -> None:
        """Profile from the next launch on (always with a trace): the sampled timer, made
        the first time (its timing events), armed; or the null timer. Call it between steps
        only (Engine.set_profile: while idle)."""
        self.profile = bool(on) or self._tracing is not None
        if self.profile and self._sampled is None:
            self._sampled = SampledTimer(self.be, self.stream, self.stats, self._poll_s)
        self.timer = self._sampled if self.profile else NULL_TIMER
        if self.profile:
            self.timer.armed = True   # a standalone runner times every step

    def capture(self, progress=None) -> None:
        """Capture every graph (warm-up, pre-grow and capture per size: vt/graphs/capture.py).
        progress(done, total, detail): before the first graph and after each, or None."""
        self._check_open()
        self.driver.capture(progress)

    def warm_up(self, max_prefill_tokens: int, progress=None) -> None:
        """Run every eager shape once, so that serving never calls the driver afterwards.
        progress: as capture's, over the eager shapes."""
        self._check_open()
        self.eager.warm_up(self.driver.rings, max_prefill_tokens, progress)

    # -- launch -------------------------------------------------------------------------
    def launch(self, plan: StepPlan, *, sample: bool = True) -> StepHandle:
        """Launch one step: a graph replay when its rows are decode-only and a captured size
        fits, else the eager path. Drains first unless the skip applies (its logits are a
        graph's view and the mode skips the drain: module docstring). sample=False: a graph
        step's forward alone (splits(plan.n) must hold); launch_sampler(handle) launches the
        rest before the next launch or its collect."""
        self.check_launch(plan)
        n = plan.n
        ring = None if plan.prefill else self._ring_for(n)
        if not sample and ring is None:
            raise ValueError(f"a step of {n} rows{' with prompts' if plan.prefill else ''} runs "
                             f"eagerly: only a graph step launches its forward alone "
                             f"(Runner.splits)")
        prev = self._last
        if prev is not None and prev.tokens is None and not (
                prev.logits.non_owning_view and self._skip_graph_drain):
            self._drain(prev)
        handle = (self._launch_graph(ring, plan, sample) if ring is not None
                  else self._launch_eager(plan))
        self._last = handle
        self._inflight.append(handle)
        self._steps += 1
        return handle

    def splits(self, n: int) -> bool:
        """Whether a decode-only step of n rows is a graph step, whose forward launch(plan,
        sample=False) may launch alone."""
        return 0 < n <= self.capacity and self._ring_for(n) is not None

    def launch_sampler(self, handle: StepHandle) -> None:
        """The sampler of the step launched with sample=False (after what the host queued on
        the stream since its forward)."""
        if handle is not self._unsampled:
            raise ValueError(f"step {handle.index} has no forward awaiting its sampler "
                             f"(awaiting: {None if self._unsampled is None else self._unsampled.index})")
        self._unsampled = None
        handle.slot.launch_sampler(self.stream)
        self._graph_launched(self._ring_for(handle.n), handle)

    def check_usable(self) -> None:
        """Raise what makes this runner unable to take steps (a stopped tensor-parallel group:
        vt/parallel/rank.py); a Runner has no such state."""

    def check_launch(self, plan: StepPlan) -> None:
        """What launch() refuses before it does anything: a closed runner, an empty or
        oversize step, a third step in flight."""
        if self._closed:
            raise ClosedError("Runner is closed")
        n = plan.n
        if n == 0:
            raise ValueError("an empty step: nothing to decode or prefill")
        if n > self.capacity:
            raise ValueError(f"a step of {n} rows exceeds max_seqs={self.capacity}")
        if self._unsampled is not None:
            raise RuntimeError(f"step {self._unsampled.index} was launched without its sampler; "
                               f"launch_sampler() it before the next launch")
        if len(self._inflight) >= 2:
            raise RuntimeError(f"two steps ({[h.index for h in self._inflight]}) are launched and "
                               f"not collected; collect the oldest before launching (depth 2)")

    def _launch_graph(self, ring, plan: StepPlan, sample: bool) -> StepHandle:
        """Acquire the ring's next slot (its guard), write the rows into it, replay it: the
        whole step in one graph launch, or without `sample` its forward graph alone."""
        timer, index, n, st = self.timer, self._steps, plan.n, self.stats
        timer.acquiring()
        slot, waited = ring.acquire(self._poll_s)
        st.ring_waits += waited > 0
        timer.acquired(slot, waited)
        slot.write(plan.decode)
        timer.refreshed()
        logits = (slot.launch if sample else slot.launch_forward)(self.stream, n, index)
        handle = StepHandle(index, "graph", n, slot.size, logits, plan.tag, slot.out_host, slot.done, slot)
        st.steps += 1
        st.graph_steps += 1
        st.steps_by_size[slot.size] = st.steps_by_size.get(slot.size, 0) + 1
        if sample:
            self._graph_launched(ring, handle)
        else:
            st.split_steps += 1
            self._unsampled = handle
        return handle

    def _graph_launched(self, ring, handle: StepHandle) -> None:
        """After a graph step's sampler launch: what reads its logits (the record of them
        follows the sampler, which changes a constrained or penalized row's), its timing,
        the hook."""
        if self._record is not None:
            self._record.record(handle)
        self.timer.launched(handle)
        self._after_graph_launch(ring, handle, self._skip_graph_drain, self.stats)

    def _launch_eager(self, plan: StepPlan) -> StepHandle:
        """Prefill, mixed and oversize steps (vt/executor/eager.py), with their own logits."""
        timer, index, n, parity = self.timer, self._steps, plan.n, self._steps % 2
        timer.eager_begin()
        slot = self._mixed_decode_slot(plan)
        timer.eager_launching()
        logits, kind = self.eager.launch(plan.decode, plan.prefill, parity, slot=slot, index=index,
                                         keep_logits=self._record is not None)
        done = self.eager.done[parity]
        done.record(self.stream)
        handle = StepHandle(index, kind, n, n, logits, plan.tag, self.eager.out_host[parity], done)
        if self._record is not None:
            self._record.record(handle)
        st = self.stats
        st.steps += 1
        setattr(st, f"{kind}_steps", getattr(st, f"{kind}_steps") + 1)
        timer.eager_launched(handle)
        return handle

    def _mixed_decode_slot(self, plan: StepPlan):
        """The graph slot for a mixed step's decode rows, through its ring's guard (None: none,
        no size fits, or one call runs the whole step): its graph replaces the eager decode's
        launches (one per kernel per layer), which made a mixed step launch-bound."""
        n_dec = len(plan.decode) if plan.decode is not None and plan.prefill else 0
        ring = self._ring_for(n_dec) if n_dec and not self.model.mixed_in_one_call else None
        if ring is None:
            return None
        slot, waited = ring.acquire(self._poll_s)
        self.stats.ring_waits += waited > 0
        return slot

    # -- collect ------------------------------------------------------------------------
    def collect(self, handle: StepHandle) -> np.ndarray:
        """Wait for the oldest step in flight and return its sampled tokens [n] (a host copy;
        handle.records [n, RECORD_WORDS] holds them with the logprobs rows asked for, unless
        set_copy_records(False))."""
        if self._closed:
            raise ClosedError("Runner is closed")
        inflight = self._inflight
        if not inflight or handle is not inflight[0]:
            raise ValueError(f"step {handle.index} is not the oldest step in flight "
                             f"(in flight: {[h.index for h in inflight]})")
        if handle is self._unsampled:
            raise RuntimeError(f"step {handle.index} was launched without its sampler; "
                               f"launch_sampler() it before collecting it")
        inflight.pop(0)
        if handle.tokens is None:
            self._wait(handle, drain=False)
        return handle.tokens

    def _drain(self, prev: StepHandle) -> None:
        """Wait for the step in flight before a launch, counted by the kind of that step (a
        graph step: the mode does not skip the drain; the others own their logits)."""
        self._wait(prev, drain=True)
        by_kind = self.stats.drains_after
        by_kind[prev.kind] = by_kind.get(prev.kind, 0) + 1

    def _wait(self, handle: StepHandle, *, drain: bool) -> None:
        """Block on the step's done event, then copy its tokens out of the pinned buffer (the
        next launch of its slot may overwrite that buffer before the host collects). The
        time counted is the time blocked (wait_event's own measure: no clock when the step
        was already done)."""
        waited = wait_event(handle.done, self._poll_s)
        self.timer.waited(handle, drain, waited)
        out = handle.out_host[:handle.n]   # [n, RECORD_WORDS]: the tokens and their logprobs
        handle.tokens = out[:, 0].copy()
        if self._copy_records:
            handle.records = out.copy()
        if handle.slot is not None:
            handle.slot.collected(handle.index)
        st = self.stats
        if drain:
            st.drains += 1
            st.drain_s += waited
        else:
            st.token_waits += 1
            st.token_wait_s += waited

    # -- recovery, measurement, teardown ------------------------------------------------
    def ceiling_us(self, n: int, replays: int) -> float:
        """µs per replay of the captured graph for n rows, back to back (Engine.device_ceiling_us)."""
        self._check_open()
        return self.driver.ceiling_us(n, replays)

    def abort(self, cause: BaseException | None = None) -> BaseException | None:
        """After a failure mid-run (`cause`, the step's error): wait for the stream, drop the
        steps in flight. Returns the device-side error the wait raised, if any (the sim
        reports a failed op this way)."""
        error = None
        try:
            if self._unsampled is not None:
                # the step's sampler too (its tokens are dropped): the slot's graphs and its
                # done event stay paired for the slot's next step
                self._unsampled.slot.launch_sampler(self.stream)
            self.stream.synchronize()
        except Exception as exc:  # noqa: BLE001 (reported to the caller, who re-raises its own)
            error = exc
        self._inflight.clear()
        self._last = self._unsampled = None
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
                if self._tracing is not None:
                    path = self._tracing.write_trace()
        finally:
            self.driver.close()
            self.eager.close()
            for owner in (self._sampled, self._record):
                if owner is not None:
                    owner.close()
            self.model.release_stream(self.stream)   # after the graphs that used it are gone
            self.stream.close()
        return path

    def _check_open(self):
        if self._closed:
            raise ClosedError("Runner is closed")
