"""The engine's serving loop (a base class of Engine, which owns the state it runs on): one
busy period of the serving thread (_serve), the one loop over every step (_loop), what a step
failure does (_fail), and the thread itself (serving_thread), which holds the engine only
while it serves."""
from __future__ import annotations

import threading
import time
import traceback
from collections import deque

from vt.engine.model_lease import acquire as acquire_model, release as release_model
from vt.engine.boundary import (SchedulerStalledError, apply_cancels, cancel_everything,
                                take_arrivals)
from vt.engine.errors import EngineBusyError


class ServingLoop:
    def _serve(self) -> bool:
        """One busy period of the serving thread, holding the model's lease (another Engine
        over the same model serving now: this one's arrivals fail with EngineBusyError).
        Returns True when the engine stops. Should the loop itself break (a bug: step
        failures are handled inside it), every request it holds or that arrives later fails
        with that error instead of waiting forever, and submit() refuses from then on."""
        pending: deque = deque()
        try:
            acquire_model(self._model_key, "Engine.submit()", lambda: not (
                self._arrivals or pending or self._buffer.live))
        except EngineBusyError as exc:
            while self._arrivals:
                self._buffer.finish(self._arrivals.popleft(), "error", exc)
            self._notifier.notify()
            return self._stopping
        try:
            return self._loop(pending)
        except BaseException as exc:   # noqa: BLE001 (handed to every waiting request)
            with self._state_lock:
                self._stopping = True
            for req in [*self._buffer.live, *pending, *self._arrivals]:
                if req.final is None:
                    self._buffer.finish(req, "error", exc)
            self._arrivals.clear()
            self._notifier.notify()
            traceback.print_exc()   # a bug: say so, the requests carry the error
            return True
        finally:
            release_model(self._model_key)

    def _loop(self, pending: deque) -> bool:
        """The one serving loop: take arrivals and cancellations (a length check each), plan
        step N+1, launch it, collect step N (depth 2); return when there is nothing to do
        (True: the engine stops; the serving thread sleeps otherwise).
        Everything a step may need (admission, prefill, stops, progress, profiling) is a
        cheap check inside it; a decode step with nobody to admit costs the plan's fast path,
        one launch and one collect."""
        self.be.bind_thread()
        runner, buf, notifier = self.runner, self._buffer, self._notifier
        launch, collect, store, notify = runner.launch, runner.collect, buf.store, notifier.notify
        arrivals, cancels, sinks = self._arrivals, self._cancels, self._progress_sinks
        clock, rs, prof = time.perf_counter, runner.stats, self._loop_profile
        decode_ph, prefill_ph = self._phases["decode"], self._phases["prefill"]
        sync = self.config.depth == 1
        inflight, deferred, cancelled = None, [], []
        t_busy = t0 = clock()
        waited = rs.drain_s + rs.token_wait_s
        if prof is not None:
            prof.start_call((decode_ph, prefill_ph))
        while True:
            if arrivals:
                take_arrivals(arrivals, pending, buf)
            if cancels or (self._stopping and not self._finish_on_close):
                if self._stopping and not self._finish_on_close:
                    cancel_everything(cancels, pending, self._sched)
                cancelled = apply_cancels(cancels, pending, self._sched, buf, inflight is not None)
            sched = self._sched
            if not (pending or sched.batch.n or sched.prefilling or inflight is not None or
                    deferred):
                for req in cancelled:    # nothing in flight holds them
                    buf.finish(req, "cancelled")
                cancelled = []
                self._wall_s += clock() - t_busy
                notify()
                return self._stopping and not arrivals
            try:
                timed = prof is not None and prof.begin()
                plan = sched.plan(pending)
                if plan.admitted:
                    buf.live.update(plan.admitted)
                if timed:
                    prof.planned()
                handle = None
                if plan.n:
                    handle = launch(plan)
                    sched.after_launch(plan)
                elif inflight is None and not deferred:
                    raise SchedulerStalledError(f"scheduler stalled: {len(pending)} pending, "
                                                f"{sched.batch.n} running, nothing launched or "
                                                f"in flight")
                if timed:
                    prof.launched()
                if sync:
                    # Depth 1 reads each step's tokens at once, but applies a stop token on the
                    # same step the async pipeline can (module docstring): two steps later.
                    for req in deferred:
                        sched.leave(req)
                    ready, handle, deferred = handle, None, []
                else:
                    ready = inflight
                if ready is not None:
                    tokens = collect(ready)
                    stopped = store(ready.tag, tokens, ready.host_logits, clock())
                    if sync:
                        deferred = stopped
                    else:
                        for req in stopped:
                            sched.leave(req)
                    if sinks:
                        self._report(ready.index)
                if cancelled:
                    for req in cancelled:
                        if req.final is None:
                            buf.finish(req, "cancelled")
                    cancelled = []
                notify()
                t3 = clock()
            except BaseException as exc:   # noqa: BLE001 (the step's requests get it)
                self._fail(exc, pending if isinstance(exc, SchedulerStalledError) else ())
                inflight, deferred, cancelled, t0 = None, [], [], clock()
                continue
            ph = prefill_ph if plan.prefill else decode_ph
            ph.steps += plan.n > 0
            ph.wall_s += t3 - t0
            now_waited = rs.drain_s + rs.token_wait_s
            ph.wait_s += now_waited - waited
            if timed:
                prof.end(ph)
            waited, inflight, t0 = now_waited, handle, t3

    def _report(self, step: int) -> None:
        now = time.perf_counter()
        for sink in list(self._progress_sinks):
            sink.push(step, self._buffer.tokens_out, now)

    def _fail(self, exc: BaseException, pending) -> None:
        """A step failed: wait for the stream, drop what is in flight, fail every request that
        holds a row (and, when nothing could be scheduled at all, the queued ones), free
        every row and block (the batch step counter goes on: Scheduler.reset). The loop then
        serves the rest."""
        self._failed_steps += 1
        device_error = self.runner.abort()
        if device_error is not None and device_error is not exc:
            exc.add_note(f"vt: the device also reported: {device_error}")
        buf = self._buffer
        for req in list(buf.live) + list(pending):
            if req.final is None:
                buf.finish(req, "error", exc)
        if pending:
            pending.clear()
        self._sched.reset()
        self._notifier.notify()


def serving_thread(engine_ref, wake: threading.Event) -> None:
    """The engine's serving thread: a busy period (ServingLoop._serve) whenever woken, holding the
    engine only while it serves, so that a dropped engine is collected (its finalizer wakes
    this thread, which then finds it gone and ends)."""
    while True:
        engine = engine_ref()
        if engine is None or engine._serve():
            return
        del engine
        wake.wait()
        wake.clear()


def close_dropped(runner, wake: threading.Event) -> str | None:
    """weakref.finalize of an Engine (close() calls it too): wake the serving thread (it
    finds the engine gone, or stopping, and ends) and close the runner."""
    wake.set()
    return runner.close()
