"""Engine: continuous batching of requests over the runner.

Each step decodes every running request one token and prefills the newly admitted ones
(admitted while fewer than `serving_conc` run, their KV blocks are free and the step's prompt
tokens stay within `max_prefill_tokens`, which bounds the prefill shapes warmed at
construction: after it, serving makes no driver malloc). The running requests' per-step state
is a persistent DecodeBatch (vt/engine/batch.py): a row's position is an offset plus the batch's
step counter, so a step moves nothing per row. The host knows each sequence's length without
its tokens, so it plans step N+1 before step N's tokens arrive.

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
from vt.forward.adapt import as_step_model
from vt.knobs import ExecutorConfig
from vt.engine.outputs import CallOutputs
from vt.engine.requests import EngineBusyError, Request, RequestResult
from vt.runner.runner import Runner
from vt.engine.scheduler import Scheduler
from vt.engine.profile import LoopProfile
from vt.engine.progress import Phase, Progress
from vt.engine.submit import make_requests
from vt.engine.args import check_engine_args, check_generate_args
from vt.engine.model_lease import driving, model_key


class Engine:
    """Engine(backend, model_or_forward, config): captures at construction; close() when done.

    model_or_forward: a vt.model.HybridModel, or a vt.ForwardModel wrapping a user forward.
    profile=True: device timing events around each step and the per-phase host split.
    One generate() at a time: a second thread's call raises EngineBusyError, and so does a
    second Engine over the same model while this one drives it (vt/engine/model_lease.py).
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
        self._loop_profile = LoopProfile(self.runner) if self.runner.profile else None
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
                  phases={k: dict(vars(p), device_ms=st["device_by_phase"][k][0],
                                  device_steps=st["device_by_phase"][k][1])
                          for k, p in self._phases.items()},
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
        """The one decode loop: plan step N+1, launch it, collect step N (depth 2), until
        every request is done. Everything a step may need (admission, prefill, stops, a
        progress callback, profiling) is a cheap check inside it; a decode step with nobody
        to admit costs the plan's fast path, one launch and one collect. Per-phase wall and
        wait time are taken when the kind of step changes, not per step."""
        sched, runner = self._sched, self.runner
        plan_step, launch, collect, after_launch = (sched.plan, runner.launch, runner.collect,
                                                    sched.after_launch)
        store, leave, clock = out.store, sched.leave, time.perf_counter
        prof = self._loop_profile
        decode_ph, prefill_ph = self._phases["decode"], self._phases["prefill"]
        stops = any(r.stop_token is not None for r in reqs)
        sync = self.config.depth == 1
        pending, inflight, deferred = deque(reqs), None, []
        if prof is not None:
            prof.start_call()
        t_start = clock()
        span = _PhaseSpan(decode_ph, t_start, runner.stats)
        try:
            while pending or sched.batch.n or inflight is not None or deferred:
                timed = prof is not None and prof.begin()
                plan = plan_step(pending, stops)
                ph = prefill_ph if plan.prefill else decode_ph
                if ph is not span.phase:
                    span.switch(ph)
                if timed:
                    prof.planned()
                handle = None
                if plan.n:
                    handle = launch(plan)
                    after_launch(plan)
                    span.steps += 1
                elif inflight is None and not deferred:
                    raise RuntimeError(f"scheduler stalled: {len(pending)} pending, "
                                       f"{sched.batch.n} running, nothing launched or in flight")
                if timed:
                    prof.launched()
                if sync:
                    # Depth 1 reads each step's tokens at once, but applies a stop token on the
                    # same step the async pipeline can (module docstring): two steps later.
                    for req in deferred:
                        leave(req)
                    ready, handle, deferred = handle, None, []
                else:
                    ready = inflight
                if ready is not None:
                    stopped = store(ready.tag, collect(ready), ready.host_logits)
                    if sync:
                        deferred = stopped
                    else:
                        for req in stopped:
                            leave(req)
                    if progress is not None:
                        progress(Progress(ready.index, out.finished, len(reqs),
                                          self._tokens_out + out.count, clock() - t_start))
                if timed:
                    prof.end(ph)
                inflight = handle
        finally:
            span.close()
            self._wall_s += clock() - t_start

    def _reset_schedule(self) -> None:
        self._sched = Scheduler(self.model.geometry, self.config.serving_conc, self.max_prefill_tokens)

    def _check_open(self):
        if self._closed:
            raise ClosedError("Engine is closed")


class _PhaseSpan:
    """Consecutive loop iterations that launched one kind of step: their count, wall time and
    time blocked on the device go to that kind's Phase when the kind changes (two clock reads
    per change instead of one per step)."""

    __slots__ = ("phase", "steps", "_t0", "_wait0", "_rs")

    def __init__(self, phase, t0: float, runner_stats):
        self.phase, self.steps, self._t0, self._rs = phase, 0, t0, runner_stats
        self._wait0 = runner_stats.drain_s + runner_stats.token_wait_s

    def switch(self, phase) -> None:
        self.close()
        self.phase, self.steps = phase, 0

    def close(self) -> None:
        t, wait = time.perf_counter(), self._rs.drain_s + self._rs.token_wait_s
        ph = self.phase
        ph.steps += self.steps
        ph.wall_s += t - self._t0
        ph.wait_s += wait - self._wait0
        self._t0, self._wait0, self.steps = t, wait, 0


