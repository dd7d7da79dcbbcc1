"""Engine: continuous batching of requests over the runner.

Each step decodes every running request one token and prefills the newly admitted ones
(admitted while fewer than `serving_conc` run, their KV blocks are free and the step's prompt
tokens stay within `max_prefill_tokens`, which bounds the prefill shapes warmed at
construction: after it, serving makes no driver malloc). The running requests' per-step state
is a persistent DecodeBatch (vt/batch.py), advanced in place. The host knows each sequence's
length without its tokens, so it plans step N+1 before step N's tokens arrive.

Schedule = f(requests) at every depth: a stop token takes effect on the schedule two steps
after the step that sampled it (the earliest the async pipeline can know it), also at depth 1,
so the synchronous run and the async modes see the same batches. A request's tokens depend
only on its prompt, its sampling and the model (the sampler keys on seed and position).
"""
from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from typing import Callable

from vt.backend.errors import ClosedError
from vt.adapt import as_step_model
from vt.batch import BatchStep
from vt.engine_args import check_engine_args, check_generate_args
from vt.knobs import ExecutorConfig
from vt.model_lease import driving, model_key
from vt.outputs import CallOutputs
from vt.requests import EngineBusyError, Request, RequestResult
from vt.runner import Runner
from vt.schedule import Scheduler
from vt.steps import Phase, Progress, StepHandle  # noqa: F401  (Progress: public, documented here)
from vt.submit import make_requests


_RUNNER_SPLIT = ("acquire_s", "refresh_s", "launch_s", "drain_s")


class Engine:
    """Engine(backend, model_or_forward, config): captures at construction; close() when done.

    model_or_forward: a vt.model.HybridModel, or a vt.ForwardModel wrapping a user forward.
    profile=True: device timing events around each step and the per-phase host split.
    One generate() at a time: a second thread's call raises EngineBusyError, and so does a
    second Engine over the same model while this one drives it (vt/model_lease.py).
    An Engine dropped without close() is closed when collected (weakref.finalize).
    """

    def __init__(self, backend, model_or_forward, config: ExecutorConfig | None = None, *,
                 record_logits: bool = False, max_prefill_tokens: int | None = None,
                 profile: bool = False):
        check_engine_args(backend, config, record_logits, max_prefill_tokens, profile)
        self.be = backend
        self.config = config if config is not None else ExecutorConfig.from_env()
        self.model = as_step_model(backend, model_or_forward)
        geo = self.model.geometry
        if self.config.serving_conc > geo.max_seqs:
            raise ValueError(f"serving_conc={self.config.serving_conc} exceeds the model's "
                             f"max_seqs={geo.max_seqs}")
        # A step prefills at most this many prompt tokens (one prompt always fits: a prompt of
        # up to max_context tokens is admitted alone).
        self.max_prefill_tokens = max(geo.max_context, max_prefill_tokens or 0)
        self.record_logits, self.profile = record_logits, profile
        self.runner = Runner(backend, self.model, self.config, record_logits=record_logits,
                             profile=profile)
        self._lock = threading.Lock()
        self._tokens_out = 0
        self._wall_s = 0.0
        self._phases = {"decode": Phase(), "prefill": Phase()}
        self._closed = False
        self._reset_schedule()
        self._model_key = model_key(self.model)
        try:
            with driving(self._model_key, "Engine(...)"):
                self.runner.capture()
                self.runner.warm_up(self.max_prefill_tokens)
        except BaseException:
            self.runner.close()
            raise
        # The runner (not self) is the finalizer's argument: a dropped Engine frees its
        # graphs, events and stream thread when collected.
        self._finalizer = weakref.finalize(self, Runner.close, self.runner)
        self._pool_after_warm_up = backend.pool.stats()

    # -- public -------------------------------------------------------------------------
    def generate(self, prompts, *, max_new_tokens=16, stop_token: int | None = None,
                 sampling=None, progress: Callable[[Progress], None] | None = None
                 ) -> list[RequestResult]:
        """Run every prompt to completion; results in prompt order.

        max_new_tokens: one int for all prompts, or one per prompt. sampling: None (greedy),
        one vt.SamplingParams for all, or one per prompt. A request that cannot be served
        whole raises RequestTooLargeError before any step runs. On any exception (a kernel,
        the progress callback, KeyboardInterrupt) the engine waits for its stream, drops the
        steps in flight, frees every row and KV block and re-raises: the next generate()
        serves as a fresh engine would.
        """
        self._check_open()
        check_generate_args(prompts, progress)
        reqs = make_requests(prompts, max_new_tokens, stop_token, sampling, self.model.geometry,
                             self.model.vocab, self._sched.blocks.capacity)
        if not self._lock.acquire(blocking=False):
            raise EngineBusyError("Engine.generate() is already running (in another thread, or "
                                  "this call comes from inside it, e.g. its progress callback); "
                                  "an Engine serves one generate() at a time: wait for it to "
                                  "return, or give each thread its own model and Engine")
        try:
            with driving(self._model_key, "Engine.generate()"):
                try:
                    return self._serve(reqs, progress)
                except BaseException as exc:
                    device_error = self.runner.abort()
                    self._reset_schedule()
                    if device_error is not None and device_error is not exc:
                        exc.add_note(f"vt: the device also reported: {device_error}")
                    raise
        finally:
            self._lock.release()

    def stats(self) -> dict:
        """Steps, graph vs eager steps, waits and their time, per-phase time, pool state."""
        self._check_open()
        st = self.runner.stats.as_dict()
        pool = self.be.pool.stats()
        st.update(tokens=self._tokens_out, wall_s=self._wall_s,
                  tokens_per_s=self._tokens_out / self._wall_s if self._wall_s else 0.0,
                  mode=self.mode, pool=pool.__dict__,
                  phases={k: dict(vars(p)) for k, p in self._phases.items()},
                  driver_mallocs_since_warm_up=pool.driver_mallocs - self._pool_after_warm_up.driver_mallocs)
        return st

    @property
    def mode(self) -> str:
        """The executor mode's name (vt.knobs.MODES), "+poison" when poisoning."""
        return self.config.mode + ("+poison" if self.config.poison else "")

    def device_ceiling_us(self, n: int, replays: int = 200) -> float:
        """µs per replay of the captured decode graph for n rows, back to back with no host
        work: the device-bound ceiling of a decode step. It replays the last real step of
        that size (all padding if none ran yet). Call it between generate() calls."""
        self._check_open()
        with driving(self._model_key, "Engine.device_ceiling_us()"):
            return self.runner.driver.ceiling_us(n, replays)

    def close(self) -> str | None:
        """Idempotent. Returns the trace path when a trace was written. Refused with
        EngineBusyError while a generate() runs: closing would destroy the graphs it launches."""
        if self._closed:
            return None
        if not self._lock.acquire(blocking=False):
            raise EngineBusyError("Engine.close() while generate() runs (in another thread, or "
                                  "from its progress callback): let generate() return first")
        try:
            self._closed = True
            return self._finalizer()
        finally:
            self._lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the loop -----------------------------------------------------------------------
    def _serve(self, reqs: list[Request], progress) -> list[RequestResult]:
        out = CallOutputs(reqs, self.model.vocab, self.record_logits)
        try:
            self._loop(reqs, out, progress)
        finally:
            self._tokens_out += out.count
        return [out.result(r) for r in reqs]

    def _loop(self, reqs: list[Request], out: CallOutputs, progress) -> None:
        sched, runner = self._sched, self.runner
        stops = any(r.stop_token is not None for r in reqs)
        pending, inflight, deferred = deque(reqs), None, []
        depth, clock, t_start = self.config.depth, time.perf_counter, time.perf_counter()
        runner_st = self.runner.stats
        # Plan (and prepare) step N+1 before collecting step N-1 when nothing in step N-1's
        # tokens can change that plan: no stop tokens in this call (requests that end by
        # length leave at launch time). The runner then has only the launch left after its
        # wait (Runner.prepare).
        ahead = runner.prepares_ahead and depth == 2 and not stops
        # The steady loop (_steady) takes every decode-only step it can, unless this call
        # needs what only this loop does: profiling, depth 1, prepare-ahead.
        steady = depth == 2 and not ahead and not self.profile and not runner.profile
        planned = None                        # (plan, admitted) of the next step, if made early
        profile, ahead_s = self.profile, 0.0
        waited = runner_st.wait_s
        t0 = t_start
        while pending or sched.batch.n or inflight is not None or deferred or planned:
            if steady and inflight is not None:
                inflight = self._steady(pending, inflight, out, stops, progress, t_start)
                waited = runner_st.wait_s
                t0 = clock()
            # Without profile an iteration reads one clock (its end); the split costs four more
            before = [getattr(runner_st, k) for k in _RUNNER_SPLIT] if profile else None
            plan, admitted = planned or sched.plan(pending, stops)
            planned = None
            t1 = clock() if profile else 0.0
            handle = None
            if plan.n:
                handle = runner.launch(plan)
                sched.after_launch(plan, admitted)
            elif inflight is None and not deferred:
                raise RuntimeError(f"scheduler stalled: {len(pending)} pending, "
                                   f"{sched.batch.n} running, nothing launched or in flight")
            if ahead and handle is not None:
                t_ahead = clock() if profile else 0.0
                planned = sched.plan(pending, stops)
                if profile:
                    ahead_s = clock() - t_ahead
                if planned[0].n:
                    runner.prepare(planned[0])
                else:
                    planned = None            # nothing to run next: plan again next time
            t2 = clock() if profile else 0.0
            if depth == 1:
                for req in deferred:          # a stop sampled two steps ago (module docstring)
                    sched.leave(req)
                ready, handle, deferred = handle, None, []
            else:
                ready = inflight
            device_ms = runner_st.device_ms
            if ready is not None:
                stopped = out.store(ready.tag, runner.collect(ready), ready.host_logits)
                if depth == 1:
                    deferred = stopped
                else:
                    for req in stopped:
                        sched.leave(req)
                if progress is not None:
                    progress(Progress(ready.index, out.finished, len(reqs),
                                      self._tokens_out + out.count, clock() - t_start))
            t3 = clock()
            ph = self._phases["prefill" if plan.prefill else "decode"]
            ph.steps += bool(plan.n)
            ph.wall_s += t3 - t0
            now_waited = runner_st.wait_s
            ph.wait_s += now_waited - waited
            waited = now_waited
            if before is not None:
                ph.plan_s += (t1 - t0) + ahead_s
                ph.collect_s += t3 - t2
                ph.device_ms += runner_st.device_ms - device_ms
                for k, b in zip(_RUNNER_SPLIT, before):
                    setattr(ph, k, getattr(ph, k) + getattr(runner_st, k) - b)
                ahead_s = 0.0
            inflight, t0 = handle, t3
        self._wall_s += clock() - t_start

    def _steady(self, pending: deque, inflight: StepHandle, out: CallOutputs, stops: bool,
                progress, t_start: float) -> StepHandle | None:
        """Decode steps while nothing but decoding can happen: no request can be admitted and
        the batch's size has a graph. It is the loop above with everything such a step cannot
        need taken out (admission, prefill, the profile's clocks), so that the
        host's share of a step is a few µs: the batch's per-step writes, the ring's guard,
        one replay, the previous step's tokens. Requests still leave (at the launch of their
        last token) and cross KV blocks inside it. Returns the step in flight when it hands
        back (the loop above plans the next step: an admission, an eager size, or the end)."""
        runner, sched, b = self.runner, self._sched, self._sched.batch
        ring_for, launch, collect = runner.driver.ring_for, runner.launch_steady, runner.collect_steady
        st, ph, clock = runner.stats, self._phases["decode"], time.perf_counter
        waited = st.wait_s
        t0, steps = clock(), 0
        while not sched.can_admit(pending):
            b.begin_step()
            ring = ring_for(b.n) if b.n else None
            if ring is None:
                break
            handle = launch(ring, BatchStep(b), sched.decode_tag(stops))
            sched.end_step()
            for req in out.store(inflight.tag, collect(inflight), inflight.host_logits):
                sched.leave(req)   # a stop token: the same step as the loop above leaves it
            if progress is not None:
                progress(Progress(inflight.index, out.finished, len(out.reqs),
                                  self._tokens_out + out.count, clock() - t_start))
            inflight = handle
            steps += 1
        ph.steps += steps
        ph.steady_steps += steps
        ph.wall_s += clock() - t0
        ph.wait_s += st.wait_s - waited
        return inflight

    def _reset_schedule(self) -> None:
        self._sched = Scheduler(self.model.geometry, self.config.serving_conc, self.max_prefill_tokens)

    def _check_open(self):
        if self._closed:
            raise ClosedError("Engine is closed")


