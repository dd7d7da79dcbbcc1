"""Engine: continuous batching of requests over the runner, served by ONE loop in a thread
the engine owns.

Requests arrive from any thread (submit(); generate() is submit() for a list and a wait) and
are picked up between steps: the loop checks two deques' lengths per step (arrivals,
cancellations) and takes no lock unless one moved. Each step decodes every running request
one token and prefills the newly admitted ones (admitted while fewer than `serving_conc` run,
their KV blocks are free and the step's prompt tokens stay within `max_prefill_tokens`, which
bounds the prefill shapes warmed at construction: after it, serving makes no driver malloc;
a step model with `chunked_prefill` gets longer prompts in chunks over several steps).
The running requests' per-step state is a persistent DecodeBatch (vt/engine/batch.py): a row's
position is an offset plus the batch's step counter, so a step moves nothing per row. The
host knows each sequence's length without its tokens, so it plans step N+1 before step N's
tokens arrive. Tokens go to one shared buffer (vt/engine/outputs.py) that handles read by
cursor (vt/engine/handle.py): nothing is done per request per step to deliver them.

Schedule = f(requests) at every depth: a stop token takes effect on the schedule two steps
after the step that sampled it (the earliest the async pipeline can know it), also at depth 1,
so the synchronous run and the async modes see the same batches. A request's tokens depend
only on its prompt, its sampling and the model (the sampler keys on seed and position), not
on what else runs or when it arrived.

A failure inside a step (a kernel, the forward's host code, the device) fails the requests
that hold a row at that moment (those of the failed step and of the one in flight) with the
error; the stream is synchronized, every row and KV block is freed, and the loop goes on with
the requests not yet admitted and with new ones.
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
from vt.testing import NULL_HOOKS, ExecutorHooks, hooks_from_env
from vt.engine.call import GenerateCall
from vt.engine.handle import RequestHandle, StepNotifier, TokenStream
from vt.engine.outputs import TokenBuffer
from vt.engine.requests import RequestResult
from vt.runner.runner import Runner
from vt.engine.scheduler import Scheduler
from vt.engine.serving import ServingLoop, close_dropped, serving_thread
from vt.engine.profile import LoopProfile
from vt.engine.progress import Phase, Progress
from vt.engine.submit import check_one_request, make_requests
from vt.engine.model_lease import driving, model_key
from vt.engine.args import check_engine_args, check_generate_args

__all__ = ["Engine", "Progress", "RequestHandle"]


class Engine(ServingLoop):
    """Engine(backend, model_or_forward, config): captures at construction; close() when done.

    model_or_forward: a vt.model.HybridModel, or a vt.ForwardModel wrapping a user forward.
    profile=True: device timing events around each step and the per-phase host split.
    hooks: the test arms (vt.testing, e.g. Poison()); with config=None they come from the
    environment too (VT_ASYNC_EXECUTOR_POISON).
    submit() and generate() may be called from any number of threads at once; the serving
    thread starts with start() or the first of them.
    """

    def __init__(self, backend, model_or_forward, config: ExecutorConfig | None = None, *,
                 record_logits: bool = False, max_prefill_tokens: int | None = None,
                 profile: bool = False, hooks: ExecutorHooks | None = None):
        check_engine_args(backend, config, record_logits, max_prefill_tokens, profile)
        self.be = backend
        if hooks is None:
            hooks = hooks_from_env() if config is None else NULL_HOOKS
        self.config = config if config is not None else ExecutorConfig.from_env()
        self.model = as_step_model(backend, model_or_forward)
        geo = self.model.geometry
        if self.config.serving_conc > geo.max_seqs:
            raise ValueError(f"serving_conc={self.config.serving_conc} exceeds the model's "
                             f"max_seqs={geo.max_seqs}")
        # A step prefills at most this many prompt tokens. A step model that prefills from a
        # position (chunked_prefill) gets longer prompts in chunks; for any other, one prompt
        # always fits (a prompt of up to max_context tokens is admitted alone). No step can
        # hold more than every row's full context: a larger budget means that one (and the
        # prefill shapes warmed stay within what the step model allocated for).
        self._chunked = bool(self.model.chunked_prefill)
        self.max_prefill_tokens = min(geo.max_seqs * geo.max_context,
                                      max_prefill_tokens or geo.max_context if self._chunked else
                                      max(geo.max_context, max_prefill_tokens or 0))
        self.record_logits = record_logits
        self.runner = Runner(backend, self.model, self.config, hooks=hooks,
                             record_logits=record_logits, profile=profile)
        self._state_lock = threading.Lock()   # submit/start vs close; never taken per step
        self._arrivals, self._cancels = deque(), deque()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = self._finish_on_close = False
        self._next_id = 0
        self._progress_sinks: list = []       # generate() calls with a progress callback
        self._buffer = TokenBuffer(geo.max_seqs, geo.max_context, self.model.vocab, record_logits)
        self._notifier = StepNotifier()
        self._wall_s = 0.0
        self._failed_steps = 0
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
        # An Engine dropped without close(): its serving thread holds it only weakly while
        # idle (_serving_thread), so it is collected; then this stops the thread and frees
        # the graphs, events and stream.
        self._finalizer = weakref.finalize(self, close_dropped, self.runner, self._wake)
        self._pool_after_warm_up = backend.pool.stats()

    # -- public -------------------------------------------------------------------------
    def submit(self, prompt, *, max_new_tokens: int = 16, stop_token=None,
               sampling=None) -> RequestHandle:
        """Queue one request; it joins the batch at the next step boundary. Validates as
        generate() does and raises here, in the caller's thread. stop_token: None, a token id
        or a collection of ids (any of them ends the request). sampling: None (greedy) or a
        vt.SamplingParams. Thread-safe."""
        self._check_open()
        check_one_request(max_new_tokens, sampling)
        (req,) = make_requests([prompt], max_new_tokens, stop_token, sampling,
                               self.model.geometry, self.model.vocab, self._sched.blocks.capacity)
        return self._enqueue([req], number=True)[0]

    def set_profile(self, on: bool) -> None:
        """Switch profile=True's timing (Engine's docstring) on or off for the calls that
        follow, on this engine and its captured graphs: the same loop timed and untimed,
        without a second engine. Only while the engine is idle (RuntimeError otherwise);
        with a trace it stays on."""
        with self._state_lock:
            self._check_open()
            if not self.idle():
                raise RuntimeError("Engine.set_profile: the engine is serving; call it while "
                                   "it is idle (nothing queued or running)")
            with driving(self._model_key, "Engine.set_profile()"):   # the loop has let go
                self.runner.set_profile(on)
                self._loop_profile = LoopProfile(self.runner) if self.profile else None

    @property
    def profile(self) -> bool:
        """Whether the engine times its loop now (profile=True, set_profile, or a trace)."""
        return self.runner.profile

    def stream_async(self, prompt, **kwargs) -> TokenStream:
        """`async for tok in engine.stream_async(prompt, max_new_tokens=...)`: submit() now
        (its errors raise here) and the tokens as they arrive, without blocking the event
        loop. Leaving the loop early (break, the task cancelled) cancels the request, also
        when the stream is held in a variable; `await stream.aclose()` cancels it outright
        (vt/engine/handle.py: TokenStream)."""
        return TokenStream(self.submit(prompt, **kwargs))

    def generate(self, prompts, *, max_new_tokens=16, stop_token=None,
                 sampling=None, progress: Callable[[Progress], None] | None = None
                 ) -> list[RequestResult]:
        """Run every prompt to completion; results in prompt order (submit() for each, then
        wait for all).

        max_new_tokens: one int for all prompts, or one per prompt. sampling: None (greedy),
        one vt.SamplingParams for all, or one per prompt. stop_token: as in submit(). A
        request that cannot be served whole raises RequestTooLargeError before any step runs.
        progress: called in this thread once per step of the engine while the call runs.
        If a step of its requests fails, the others are cancelled and the step's error is
        raised; on any exception here (the progress callback, KeyboardInterrupt) its requests
        are cancelled (rows and KV blocks freed) before it propagates. ClosedError if the
        engine is closed meanwhile.
        """
        self._check_open()
        check_generate_args(prompts, progress)
        reqs = make_requests(prompts, max_new_tokens, stop_token, sampling, self.model.geometry,
                             self.model.vocab, self._sched.blocks.capacity)
        return GenerateCall(self, reqs, progress).run()

    def start(self) -> None:
        """Start the serving thread (submit() and generate() do it when needed)."""
        with self._state_lock:
            self._check_open()
            self._start_locked()

    def stats(self) -> dict:
        """Steps, graph vs eager steps, drains and why, waits and their time, per-phase time,
        pool state, rows and KV blocks in use."""
        self._check_open()
        st = self.runner.stats.as_dict()
        pool = self.be.pool.stats()
        buf, sched = self._buffer, self._sched
        st.update(tokens=buf.tokens_out, wall_s=self._wall_s,
                  tokens_per_s=buf.tokens_out / self._wall_s if self._wall_s else 0.0,
                  mode=self.mode, pool=pool.__dict__, failed_steps=self._failed_steps,
                  drained_fraction=st["drains"] / st["steps"] if st["steps"] else 0.0,
                  requests_finished=buf.finished, requests_running=len(buf.live),
                  rows_free=sched.rows.free_count, kv_blocks_free=sched.blocks.free_count,
                  kv_blocks_total=sched.blocks.capacity,
                  phases={k: dict(vars(p), device_ms=st["device_by_phase"][k][0],
                                  device_steps=st["device_by_phase"][k][1])
                          for k, p in self._phases.items()},
                  driver_mallocs_since_warm_up=pool.driver_mallocs - self._pool_after_warm_up.driver_mallocs)
        return st

    def idle(self) -> bool:
        """Nothing queued or running, every row and KV block free."""
        return not self._arrivals and not self._buffer.live and self._sched.idle()

    @property
    def mode(self) -> str:
        """The executor mode's name (vt.knobs.MODES), then the test hooks' ("+poison")."""
        return self.config.mode + self.runner.hooks.label

    def device_ceiling_us(self, n: int, replays: int = 200) -> float:
        """µs per replay of the captured decode graph for n rows, back to back with no host
        work: the device-bound ceiling of a decode step. It replays the last real step of
        that size (all padding if none ran yet). Call it while the engine is idle."""
        self._check_open()
        with driving(self._model_key, "Engine.device_ceiling_us()"):
            return self.runner.driver.ceiling_us(n, replays)

    def close(self, *, finish: bool = False) -> str | None:
        """Stop serving and free the engine (idempotent). finish=False: requests queued or
        running are cancelled at the next step boundary (finish_reason "cancelled"; a
        generate() waiting on them raises ClosedError); finish=True: they are served to the
        end first. Either way the steps in flight are collected, the serving thread exits
        and is joined, then graphs and buffers are freed. submit() raises ClosedError from
        the moment close() starts. Returns the trace path when a trace was written."""
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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- requests in and out ------------------------------------------------------------
    def _enqueue(self, reqs, *, number: bool) -> list[RequestHandle]:
        now = time.perf_counter()
        with self._state_lock:
            self._check_open()
            for req in reqs:
                if number:
                    req.index, self._next_id = self._next_id, self._next_id + 1
                req.submitted_at = now
            self._arrivals.extend(reqs)
            self._start_locked()
        self._wake.set()
        return [RequestHandle(self, r) for r in reqs]

    def _request_cancel(self, req) -> None:
        self._cancels.append(req)
        self._wake.set()

    def _start_locked(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=serving_thread, args=(weakref.ref(self), self._wake),
                                            name="vt-engine", daemon=True)
            self._thread.start()

    def _reset_schedule(self) -> None:
        self._sched = Scheduler(self.model.geometry, self.config.serving_conc,
                                self.max_prefill_tokens, self._chunked)

    def _check_open(self):
        if self._closed or self._stopping:
            raise ClosedError("Engine is closed")
