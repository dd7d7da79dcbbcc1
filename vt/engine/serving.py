"""ServingLoop: the serving thread and everything it runs on.

The loop owns the queues requests reach it by (arrivals, cancellations), the scheduler, the
token buffer, the notifier that wakes readers, the progress sinks and the serving thread.
Only the serving thread changes the scheduler and the buffer: it plans, launches, collects
and finishes requests. Other threads go through the loop's methods (enqueue, request_cancel,
add/remove_progress_sink, wait_for_step) and read the buffer only through the handles
enqueue returns. The hand-off is two deques whose lengths the loop reads once per step;
the lock beside them is taken by the callers' side (enqueue, start, set_profile, close),
never per step.

The serving thread holds the loop only while it serves (a busy period, `_serve`): a loop
nobody else holds (its Engine dropped, no handle left) is collected, and its finalizer wakes
the thread, which finds it gone and ends, and closes the runner.
"""
from __future__ import annotations

import threading
import time
import traceback
import weakref
from collections import deque
from typing import Callable

from vt.backend.errors import ClosedError
from vt.engine.errors import EngineBusyError, SchedulerStalledError
from vt.engine.handle import RequestHandle, StepNotifier
from vt.engine.model_lease import acquire as acquire_model, driving, release as release_model
from vt.engine.token_buffer import TokenBuffer
from vt.engine.pipeline import step_pipeline
from vt.engine.profile import LoopProfile
from vt.engine.progress import Phase
from vt.engine.grammars import GrammarRows
from vt.engine.requests import RequestPhase
from vt.engine.scheduler import Scheduler


class ServingLoop:
    """The loop that serves one Engine's requests over `runner` (captured and warmed up
    already), holding the lease of the model `model_key` while it serves. It closes the
    runner when closed, or when collected without close()."""

    def __init__(self, backend, runner, step_model, *, serving_conc: int, depth: int,
                 max_prefill_tokens: int, record_logits: bool, model_key: int,
                 prefix_caching: bool = False, speculative: int = 0):
        geo = step_model.geometry
        self.be, self.runner = backend, runner
        self._model_key = model_key
        self._state_lock = threading.Lock()   # enqueue/start/set_profile vs close; never per step
        self._arrivals, self._cancels = deque(), deque()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = self._finish_on_close = False
        self._closed = False
        self._next_id = 0
        self._progress_sinks: list = []       # generate() calls with a progress callback
        self._buffer = TokenBuffer(geo.max_seqs, geo.max_context, step_model.vocab, record_logits,
                                   speculative=speculative, records_read=runner.set_copy_records)
        self._notifier = StepNotifier()
        hooks = runner.hooks
        self._sched = Scheduler(geo, serving_conc, max_prefill_tokens,
                                bool(step_model.chunked_prefill), prefix_caching=prefix_caching,
                                identity=model_key, kv_fenced=hooks.kv_fence,
                                on_kv_reuse=hooks.kv_blocks_reused, speculative=speculative)
        self._pipeline = step_pipeline(depth, self._sched.leave)
        self._masks = step_model.token_masks   # the sampler's grammar masks (None: refused)
        self._grammars = GrammarRows(self._masks, runner.stream, hooks.after_mask_write)
        self._wall_s = 0.0
        self._failed_steps = 0
        self._decode_phase, self._prefill_phase = Phase(), Phase()
        self._phases = {"decode": self._decode_phase, "prefill": self._prefill_phase}
        # The serving thread's own, per busy period: the cancelled requests that finish once
        # the step in flight is collected, and the clocks of the per-phase times.
        self._cancelled: list = []
        self._busy_since = self._step_start = self._waited = 0.0
        self._loop_profile = LoopProfile(runner) if runner.profile else None
        self._finalizer = weakref.finalize(self, close_dropped, runner, self._wake)

    # -- the callers' side: any thread ---------------------------------------------------
    def enqueue(self, reqs, *, number: bool) -> list[RequestHandle]:
        """Queue requests for the next step boundary and start the serving thread if needed.
        number: give each the loop's next request number (submit(); generate() keeps the
        prompt's index). ClosedError once close() has started."""
        now = time.perf_counter()
        if self._masks is None and any(r.sampling.grammar is not None for r in reqs):
            raise ValueError("SamplingParams.grammar: this engine's step model has no grammar "
                             "masks (tensor parallel, speculative, or a StepModel without "
                             "token_masks)")
        with self._state_lock:
            self.check_open()
            for req in reqs:
                if number:
                    req.index, self._next_id = self._next_id, self._next_id + 1
                req.submitted_at = now
            self._arrivals.extend(reqs)
            self._start_locked()
        self._wake.set()
        return [RequestHandle(req, self._buffer, self._notifier, self.request_cancel)
                for req in reqs]

    def request_cancel(self, req) -> None:
        """The request stops at the next step boundary (idempotence is the handle's)."""
        self._cancels.append(req)
        self._wake.set()

    def add_progress_sink(self, sink) -> None:
        """sink.push(step, tokens, now) after every step from now on, on the serving thread."""
        self._progress_sinks.append(sink)

    def remove_progress_sink(self, sink) -> None:
        self._progress_sinks.remove(sink)

    def wait_for_step(self, ready: Callable[[], bool], timeout: float | None = None) -> bool:
        """Block until ready() holds, checked after each step; False on timeout."""
        return self._notifier.wait_for(ready, timeout)

    def start(self) -> None:
        """Start the serving thread (enqueue does it when needed)."""
        with self._state_lock:
            self.check_open()
            self._start_locked()

    def check_open(self) -> None:
        if self._closed or self._stopping:
            raise ClosedError("Engine is closed")

    def idle(self) -> bool:
        """Nothing queued or running, every row and KV block free."""
        return not self._arrivals and not self._buffer.live and self._sched.idle()

    @property
    def kv_capacity(self) -> int:
        """The KV blocks a request may hold at most: every block of the cache."""
        return self._sched.blocks.capacity

    def set_profile(self, on: bool) -> None:
        """Time the loop and the runner (LoopProfile) or not, while idle (RuntimeError
        otherwise): Engine.set_profile."""
        with self._state_lock:
            self.check_open()
            if not self.idle():
                raise RuntimeError("Engine.set_profile: the engine is serving; call it while "
                                   "it is idle (nothing queued or running)")
            with driving(self._model_key, "Engine.set_profile()"):   # the loop has let go
                self.runner.set_profile(on)
                self._loop_profile = LoopProfile(self.runner) if self.runner.profile else None

    def stats(self) -> dict:
        """The loop's counts: tokens, wall time, failed steps, requests, rows and KV blocks
        free, prefix caching's counts, and per phase (decode, prefill) its Phase's fields."""
        buf, sched = self._buffer, self._sched
        pool, cache = sched.blocks, sched.cache_stats
        return dict(tokens=buf.tokens_out, wall_s=self._wall_s, failed_steps=self._failed_steps,
                    requests_finished=buf.finished, requests_running=len(buf.live),
                    rows_free=sched.rows.free_count, kv_blocks_free=pool.free_count,
                    kv_blocks_total=pool.capacity,
                    prefix_cache=dict(enabled=sched.caching, hit_rate=cache.hit_rate,
                                      prompt_tokens=cache.prompt_tokens,
                                      cached_tokens=cache.cached_tokens,
                                      cached_blocks=pool.cached_count,
                                      evictable_blocks=pool.evictable_count,
                                      evictions=cache.evictions),
                    speculative=buf.spec.as_dict() if buf.k else None,
                    phases={k: dict(vars(p)) for k, p in self._phases.items()})

    def close(self, *, finish: bool = False) -> str | None:
        """Engine.close: stop serving (cancel or, with finish, serve to the end what is
        queued or running), join the serving thread, close the runner; returns what
        runner.close() returns. Idempotent: None after the first."""
        with self._state_lock:
            if self._closed or self._stopping:
                return None
            self._stopping, self._finish_on_close = True, finish
            thread = self._thread
        if thread is not None:
            if thread is threading.current_thread():
                raise RuntimeError("Engine.close() from a done callback of its own serving thread")
            self._wake.set()
            thread.join()
        for req in self._arrivals:        # queued after the loop's last look: none ever ran
            self._buffer.finish(req, "cancelled")
        self._arrivals.clear()
        self._closed = True
        return self._finalizer()

    def _start_locked(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=serving_thread,
                                            args=(weakref.WeakMethod(self._serve), self._wake),
                                            name="vt-engine", daemon=True)
            self._thread.start()

    # -- the serving thread --------------------------------------------------------------
    def _serve(self) -> bool:
        """One busy period of the serving thread, holding the model's lease (another Engine
        over the same model serving now: this one's arrivals fail with EngineBusyError).
        Returns True when the loop stops. Should the loop itself break (a bug: step
        failures are handled inside it), every request it holds or that arrives later fails
        with that error instead of waiting forever, and enqueue() refuses from then on."""
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
                if not req.finished:
                    self._buffer.finish(req, "error", exc)
            self._arrivals.clear()
            self._notifier.notify()
            traceback.print_exc()   # a bug: say so, the requests carry the error
            return True
        finally:
            release_model(self._model_key)

    def _loop(self, pending: deque) -> bool:
        """The one serving loop, one step per turn: at the step boundary take arrivals and
        cancellations (a length check each), then plan, launch, collect and update; return
        when there is nothing to do (True: the loop stops; the serving thread sleeps
        otherwise). The depth is the pipeline's (vt/engine/pipeline.py), the profiling
        hooks are the profiled turn's (`_profiled_step`): the body is the same either way.
        A failed step fails its requests (`_fail`) and the loop serves the rest."""
        self.be.bind_thread()
        self._pipeline.drop()
        self._cancelled = []
        self._busy_since = self._step_start = time.perf_counter()
        self._waited = self.runner.stats.wait_s
        prof = self._loop_profile
        if prof is not None:
            prof.start_call((self._decode_phase, self._prefill_phase))
        step = self._step if prof is None else self._profiled_step
        while True:
            if self._arrivals:
                self._take_arrivals(pending)
            if self._cancels or (self._stopping and not self._finish_on_close):
                self._take_cancels(pending)
            sched = self._sched
            if not (pending or sched.batch.n or sched.prefilling) and self._pipeline.empty():
                return self._end_busy_period()
            try:
                step(pending)
            except BaseException as exc:   # noqa: BLE001 (the step's requests get it)
                self._fail(exc, pending if isinstance(exc, SchedulerStalledError) else ())

    def _step(self, pending: deque) -> None:
        """One step: plan step N+1, launch it, collect what the pipeline's depth says, update.
        While a constrained request is live, a step that can be split launches its forward,
        then collects step N (which queues the masks), then its sampler; any other is
        planned once step N is collected (`_split_next`)."""
        split = self._split_next(pending)
        plan = self._sched.plan(pending)
        handle = self._launch(plan, pending, sample=not split)
        ready = self._pipeline.launched(handle)
        if ready is not None:
            self._collect(ready)
        if split:
            self.runner.launch_sampler(handle)
        self._update(plan)

    def _profiled_step(self, pending: deque) -> None:
        """_step with LoopProfile's hooks between its parts (profile=True)."""
        prof = self._loop_profile
        timed = prof.begin()
        split = self._split_next(pending)
        plan = self._sched.plan(pending)
        if timed:
            prof.planned()
        handle = self._launch(plan, pending, sample=not split)
        ready = self._pipeline.launched(handle)
        if timed:
            prof.launched()
        if ready is not None:
            self._collect(ready)
        if split:
            self.runner.launch_sampler(handle)
        phase = self._update(plan)
        if timed:
            prof.end(phase)

    # -- the parts of a step, in order --------------------------------------------------
    def _launch(self, plan, pending: deque, *, sample: bool = True):
        """Launch the plan (Scheduler.plan's: the requests it admits are live from now) and
        move the batch past it; returns its handle (None: an empty plan, which only a step
        in flight or stops still to apply may explain). sample=False: its forward alone
        (Runner.launch)."""
        if plan.admitted:
            self._buffer.admit(plan.admitted)
            self._grammars.admit(plan.admitted)
        if plan.n:
            # a tensor-parallel group's runner launches whole steps only (its model has no
            # grammar masks, so nothing splits there)
            handle = (self.runner.launch(plan) if sample
                      else self.runner.launch(plan, sample=False))
            self._sched.after_launch(plan)
            return handle
        if self._pipeline.empty():
            raise SchedulerStalledError(f"scheduler stalled: {len(pending)} pending, "
                                        f"{self._sched.batch.n} running, nothing launched or "
                                        f"in flight")
        return None

    def _collect(self, ready) -> None:
        """A step's tokens into the buffer (finishing the requests they complete); its
        stops go to the pipeline, which applies them."""
        tokens = self.runner.collect(ready)
        if self._buffer.k:   # a number of tokens per row: the stopped include those at length
            stopped = self._buffer.store_verified(ready.tag, ready.records, time.perf_counter())
        else:
            stopped = self._buffer.store(ready.tag, tokens, ready.host_logits,
                                         time.perf_counter(), ready.records)
        sched = self._sched
        if sched.caching and (stopped or ready.tag.leaving):
            # before the fence below lifts: the finished requests' blocks are still theirs
            sched.cache_generated([*stopped, *ready.tag.leaving])
        sched.completed(ready.tag.t)   # its done event seen: its released blocks reusable
        if stopped:
            self._pipeline.collected(stopped)
        if self._grammars:
            self._grammars.advance(ready.tag.t, self._buffer.tokens)
        if self._progress_sinks:
            self._report(ready.index)

    # -- grammars (vt/engine/grammars.py) ------------------------------------------------
    # A constrained request's mask for step N+1 is built from its token of step N, so that
    # token must be on the host before step N+1's sampler runs. At depth 2, when the next
    # step is a graph step (decode rows only, a captured size), its forward is launched
    # first and reads token N on the device; step N is then collected, the grammars take
    # their tokens and the masks are copied in the stream, and the step's sampler follows:
    # the device runs the forward while the host builds the masks, for every row. Any other
    # step (prefill, mixed, eager; depth 1) is planned once the step in flight is collected.
    def _split_next(self, pending: deque) -> bool:
        """Whether the next step launches its forward before step N is collected (a
        constrained request live and the step a graph step at depth 2); when a constrained
        request is live and it does not, step N is collected now."""
        if not self._grammars:
            return False
        sched = self._sched
        if (self._pipeline.depth == 2 and sched.decode_only_next(pending)
                and self.runner.splits(sched.batch.n)):
            return True
        ready = self._pipeline.take_in_flight()
        if ready is not None:
            self._collect(ready)
        return False

    def _update(self, plan):
        """After the collect: the cancelled requests finish (the step that held them is
        collected), the readers are woken, and the step's wall and wait time go to its phase
        (decode or prefill), which is returned."""
        if self._cancelled:
            self._finish_cancelled()
        self._notifier.notify()
        stats = self.runner.stats
        now, waited = time.perf_counter(), stats.drain_s + stats.token_wait_s
        phase = self._prefill_phase if plan.prefill else self._decode_phase
        phase.steps += plan.n > 0
        phase.wall_s += now - self._step_start
        phase.wait_s += waited - self._waited
        self._waited, self._step_start = waited, now
        return phase

    def _finish_cancelled(self) -> None:
        for req in self._cancelled:
            if not req.finished:
                self._buffer.finish(req, "cancelled")
        self._cancelled = []

    def _end_busy_period(self) -> bool:
        """Nothing left to serve: finish the cancelled (nothing in flight holds them), count
        the busy time; True when the loop stops."""
        self._finish_cancelled()
        self._notifier.notify()
        self._wall_s += time.perf_counter() - self._busy_since
        return self._stopping and not self._arrivals

    # What the loop does at a step boundary when a request arrived or was cancelled (it
    # checks the two deques' lengths per step and calls these only when one moved).
    def _take_arrivals(self, pending: deque) -> None:
        """Move the arrivals into the queue the scheduler admits from (a request cancelled
        before it got there finishes at once)."""
        arrivals = self._arrivals
        while arrivals:
            req = arrivals.popleft()
            if req.cancel_requested:
                self._buffer.finish(req, "cancelled")
            else:
                pending.append(req)

    def _take_cancels(self, pending: deque) -> None:
        """Apply the cancellations (close() without finish: of every queued and running
        request). A WAITING or PREFILLING request finishes at once (no token yet); a
        DECODING one leaves the batch now (its row and KV blocks free for this step's plan)
        with the tokens of the steps launched so far, and finishes once the step in flight,
        which still holds it, has been collected (before the row's next request writes its
        span): `_update` finishes it."""
        cancels, sched, buffer = self._cancels, self._sched, self._buffer
        if self._stopping and not self._finish_on_close:
            cancels.extend(pending)
            cancels.extend(sched.running())
        in_flight = self._pipeline.in_flight is not None
        while cancels:
            req = cancels.popleft()
            phase = req.phase
            if phase is RequestPhase.FINISHED:
                continue
            if phase is RequestPhase.WAITING:
                if req in pending:
                    pending.remove(req)
                    buffer.finish(req, "cancelled")
                # else: still in the arrivals; _take_arrivals finishes it
                continue
            sched.leave(req)
            if phase is RequestPhase.PREFILLING:
                buffer.finish(req, "cancelled")
                continue
            if req.emitted is None:   # speculative: the step in flight's count is its end
                req.span_end = min(req.span_end, req.entry(sched.batch.t))
            if in_flight:
                self._cancelled.append(req)
            else:
                buffer.finish(req, "cancelled")

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
        device_error = self.runner.abort(exc)
        if device_error is not None and device_error is not exc:
            exc.add_note(f"vt: the device also reported: {device_error}")
        buf = self._buffer
        for req in list(buf.live) + list(pending):
            if not req.finished:
                buf.finish(req, "error", exc)
        if pending:
            pending.clear()
        self._sched.reset()
        self._pipeline.drop()
        self._cancelled = []
        self._step_start = time.perf_counter()
        self._notifier.notify()


def serving_thread(serve_ref: weakref.WeakMethod, wake: threading.Event) -> None:
    """The serving thread: a busy period (the loop's `_serve`) whenever woken, holding the
    loop only while it serves, so that a loop nobody holds is collected (its finalizer
    wakes this thread, which then finds it gone and ends)."""
    while True:
        serve = serve_ref()
        if serve is None or serve():
            return
        del serve
        wake.wait()
        wake.clear()


def close_dropped(runner, wake: threading.Event) -> str | None:
    """weakref.finalize of a ServingLoop (close() calls it too): wake the serving thread (it
    finds the loop gone, or stopping, and ends) and close the runner."""
    wake.set()
    return runner.close()
