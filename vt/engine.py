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
from collections import deque
from typing import Callable

import numpy as np

from vt.backend.errors import ClosedError
from vt.batch import BatchStep, DecodeBatch
from vt.knobs import ExecutorConfig
from vt.requests import (BlockAllocator, EngineBusyError, Request, RequestResult, RowAllocator)
from vt.adapt import as_step_model
from vt.runner import Runner, StepPlan
from vt.steps import Phase, Progress  # noqa: F401  (Progress: public, documented here)
from vt.step import PrefillSeq
from vt.submit import make_requests


_RUNNER_SPLIT = ("acquire_s", "refresh_s", "launch_s", "drain_s")


class Engine:
    """Engine(backend, model_or_forward, config): captures at construction; close() when done.

    model_or_forward: a vt.model.HybridModel, or a vt.ForwardModel wrapping a user forward.
    profile=True: device timing events around each step and the per-phase host split.
    One generate() at a time: a second thread's call raises EngineBusyError.
    """

    def __init__(self, backend, model_or_forward, config: ExecutorConfig | None = None, *,
                 record_logits: bool = False, max_prefill_tokens: int | None = None,
                 profile: bool = False):
        self.be = backend
        self.config = config if config is not None else ExecutorConfig.from_env()
        self.model = as_step_model(backend, model_or_forward)
        geo = self.model.geometry
        if self.config.serving_conc > geo.max_seqs:
            raise ValueError(f"serving_conc={self.config.serving_conc} exceeds the model's "
                             f"max_seqs={geo.max_seqs}")
        if max_prefill_tokens is not None and (isinstance(max_prefill_tokens, bool) or
                                               not isinstance(max_prefill_tokens, int) or
                                               max_prefill_tokens < 1):
            raise ValueError(f"max_prefill_tokens must be a positive int, got {max_prefill_tokens!r}")
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
        try:
            self.runner.capture()
            self.runner.warm_up(self.max_prefill_tokens)
        except BaseException:
            self.runner.close()
            raise
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
        reqs = make_requests(prompts, max_new_tokens, stop_token, sampling, self.model.geometry,
                             self.model.vocab, self._blocks.capacity)
        if not self._lock.acquire(blocking=False):
            raise EngineBusyError("Engine.generate() is already running (in another thread, or "
                                  "this call comes from inside it, e.g. its progress callback); "
                                  "an Engine serves one generate() at a time: wait for it to "
                                  "return or give each thread its own Engine")
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
        return self.runner.ceiling_us(n, replays)

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
            return self.runner.close()
        finally:
            self._lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the loop -----------------------------------------------------------------------
    def _serve(self, reqs: list[Request], progress) -> list[RequestResult]:
        total = reqs[-1].end if reqs else 0
        self._out = np.zeros(total, np.int32)                  # every request's tokens
        self._limit = np.array([r.end for r in reqs], np.int64)  # per request: where they stop
        self._out_logits = (np.zeros((total, self.model.vocab), np.float32)
                            if self.record_logits else None)
        self._reqs, self._finished = reqs, 0
        self._stops = any(r.stop_token is not None for r in reqs)
        pending, inflight, deferred = deque(reqs), None, []
        depth, clock, t_start = self.config.depth, time.perf_counter, time.perf_counter()
        runner_st = self.runner.stats
        # Plan (and prepare) step N+1 before collecting step N-1 when nothing in step N-1's
        # tokens can change that plan: no stop tokens in this call (requests that end by
        # length leave at launch time). The runner then has only the launch left after its
        # wait (Runner.prepare).
        ahead = self.runner.prepares_ahead and depth == 2 and not self._stops
        planned = None                        # (plan, admitted) of the next step, if made early
        while pending or self._batch.n or inflight is not None or deferred or planned:
            t0 = clock()
            waited = runner_st.drain_s + runner_st.token_wait_s
            before = [getattr(runner_st, k) for k in _RUNNER_SPLIT] if self.profile else None
            plan, admitted = planned or self._plan(pending)
            planned = None
            t1 = clock()
            handle = None
            if plan.n:
                handle = self.runner.launch(plan)
                self._after_launch(plan, admitted)
            elif inflight is None and not deferred:
                raise RuntimeError(f"scheduler stalled: {len(pending)} pending, "
                                   f"{self._batch.n} running, nothing launched or in flight")
            plan_ahead_s = 0.0
            if ahead and handle is not None:
                t_ahead = clock()
                planned = self._plan(pending)
                plan_ahead_s = clock() - t_ahead
                if planned[0].n:
                    self.runner.prepare(planned[0])
                else:
                    planned = None            # nothing to run next: plan again next time
            t2 = clock()
            if depth == 1:
                for req in deferred:          # a stop sampled two steps ago (module docstring)
                    self._leave(req)
                ready, handle, deferred = handle, None, []
            else:
                ready = inflight
            device_ms = runner_st.device_ms
            if ready is not None:
                stopped = self._store(ready, self.runner.collect(ready))
                if depth == 1:
                    deferred = stopped
                else:
                    for req in stopped:
                        self._leave(req)
                if progress is not None:
                    progress(Progress(ready.index, self._finished, len(reqs), self._tokens_out,
                                      clock() - t_start))
            t3 = clock()
            ph = self._phases["prefill" if plan.prefill else "decode"]
            ph.steps += bool(plan.n)
            ph.wall_s += t3 - t0
            ph.wait_s += runner_st.drain_s + runner_st.token_wait_s - waited
            if before is not None:
                ph.plan_s += (t1 - t0) + plan_ahead_s
                ph.collect_s += t3 - t2
                ph.device_ms += runner_st.device_ms - device_ms
                for k, b in zip(_RUNNER_SPLIT, before):
                    setattr(ph, k, getattr(ph, k) + getattr(runner_st, k) - b)
            inflight = handle
        self._wall_s += clock() - t_start
        return [self._result(r) for r in reqs]

    def _plan(self, pending: deque) -> tuple[StepPlan, list[Request]]:
        """This step's rows: every request in the batch decodes; pending ones are admitted
        (prefilled) while there is room. The step carries where its tokens go (and, when the
        call has stop tokens, each row's request and stop token): the batch changes before
        the tokens arrive."""
        b, geo = self._batch, self.model.geometry
        b.begin_step()
        n_dec = b.n
        admitted, prefill_tokens = [], 0
        while pending and n_dec + len(admitted) < self.config.serving_conc:
            req = pending[0]
            if admitted and prefill_tokens + req.prompt_len > self.max_prefill_tokens:
                break   # the next step prefills it
            blocks = self._blocks.alloc(-(-(req.prompt_len + req.max_new_tokens - 1) // geo.block_size))
            if blocks is None:
                break   # waits for running requests to free blocks (always possible: see refusal)
            pending.popleft()
            req.row, req.blocks = self._rows.alloc(), blocks
            admitted.append(req)
            prefill_tokens += req.prompt_len
        prefill = []
        for req in admitted:
            bt = np.full(geo.max_blocks, geo.scratch_block, np.int32)
            bt[:len(req.blocks)] = req.blocks
            prefill.append(PrefillSeq(req.row, req.prompt, bt, req.row, req.sampling))
        dest = b.dest()
        rid = stop = None
        if self._stops:
            rid, stop = b.rid[:n_dec].copy(), b.stop[:n_dec].copy()
        n_last = b.finishing()
        if admitted:
            dest = np.concatenate([dest, [r.base for r in admitted]])
            n_last += sum(r.max_new_tokens == 1 for r in admitted)
            if self._stops:
                rid = np.concatenate([rid, [r.index for r in admitted]])
                stop = np.concatenate([stop, [_stop_id(r) for r in admitted]])
        decode = BatchStep(b) if n_dec else None
        return StepPlan(decode, prefill, tag=(dest, rid, stop, n_last)), admitted

    def _after_launch(self, plan: StepPlan, admitted: list[Request]) -> None:
        """Move the batch past the launched step. A request whose last token was just
        launched leaves now: its row and blocks are free for the next plan already (device
        users of them are stream-ordered after this step). Admitted ones join."""
        for req in self._batch.end_step():
            self._leave(req)
        for req, seq in zip(admitted, plan.prefill):
            if req.max_new_tokens == 1:
                self._free(req)
            else:
                self._batch.add(req, req.row, seq.block_table, req.sampling, pos=req.prompt_len,
                                left=req.max_new_tokens - 1, dest=req.base + 1, stop=_stop_id(req))

    def _store(self, handle, tokens: np.ndarray) -> list[Request]:
        """Put a step's tokens where they belong; returns the requests that just stopped."""
        dest, rid, stop, n_last = handle.tag
        self._out[dest] = tokens
        if self._out_logits is not None:
            self._out_logits[dest] = handle.host_logits
        if rid is None:                 # no stop tokens in this call: every token counts
            self._tokens_out += len(tokens)
            self._finished += n_last
            return []
        limit = self._limit[rid]
        valid = dest < limit            # False: past a stop learned earlier
        stopped = []
        for i in np.flatnonzero((tokens == stop) & valid):
            req = self._reqs[rid[i]]
            req.end = int(dest[i]) + 1
            req.finish_reason = "stop"
            self._limit[req.index] = limit[i] = req.end
            stopped.append(req)
        self._tokens_out += int(np.count_nonzero(valid))
        self._finished += int(np.count_nonzero(dest + 1 == limit))
        return stopped

    def _leave(self, req: Request) -> None:
        """The request decodes no more: out of the batch, its row and blocks freed."""
        self._batch.remove(req)
        self._free(req)

    def _free(self, req: Request) -> None:
        if req.row >= 0:
            self._rows.free(req.row)
            self._blocks.free(req.blocks)
            req.row, req.blocks = -1, []

    def _result(self, req: Request) -> RequestResult:
        span = slice(req.base, req.end)
        logits = self._out_logits[span].copy() if self._out_logits is not None else None
        return RequestResult(req.index, req.prompt_len, self._out[span].tolist(),
                             req.finish_reason or "length", logits)

    def _reset_schedule(self) -> None:
        """Every row and KV block free, nothing running (construction, and after a failure)."""
        geo = self.model.geometry
        self._rows = RowAllocator(geo.max_seqs)
        self._blocks = BlockAllocator(geo.num_kv_blocks, geo.scratch_block)
        self._batch = DecodeBatch(geo.max_seqs, geo.max_blocks, geo.block_size)

    def _check_open(self):
        if self._closed:
            raise ClosedError("Engine is closed")


def _stop_id(req: Request) -> int:
    return -1 if req.stop_token is None else req.stop_token

