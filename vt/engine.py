"""Engine: continuous batching of requests over the runner.

Each step decodes every running request one token and prefills the newly admitted ones
(admitted while fewer than `serving_conc` run, their KV blocks are free and the step's prompt
tokens stay within `max_prefill_tokens`, which bounds the prefill shapes warmed at
construction: after it, serving makes no driver malloc). The host knows
each sequence's length without its tokens, so it plans step N+1 before step N's tokens
arrive; it learns a stop token one step late and drops the extra token that step made.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from vt.backend.errors import ClosedError
from vt.graphs import DecodeRows
from vt.knobs import ExecutorConfig
from vt.requests import (BlockAllocator, KVCacheExhaustedError, PromptTooLongError, Request,
                         RequestResult, RowAllocator)
from vt.runner import Runner, StepPlan
from vt.stepmodel import PrefillSeq, as_step_model


@dataclass(frozen=True)
class Progress:
    """Passed to the progress callback after each step's tokens reach the host."""
    step: int
    finished: int
    total: int
    tokens: int
    elapsed_s: float


class Engine:
    """Engine(backend, model_or_forward, config): captures at construction; close() when done.

    model_or_forward: a vt.model.HybridModel, or a vt.ForwardModel wrapping a user forward.
    """

    def __init__(self, backend, model_or_forward, config: ExecutorConfig | None = None, *,
                 record_logits: bool = False, max_prefill_tokens: int | None = None):
        self.be = backend
        self.config = config if config is not None else ExecutorConfig.from_env()
        self.model = as_step_model(backend, model_or_forward)
        geo = self.model.geometry
        if self.config.serving_conc > geo.max_seqs:
            raise ValueError(f"serving_conc={self.config.serving_conc} exceeds the model's "
                             f"max_seqs={geo.max_seqs}")
        # A step prefills at most this many prompt tokens (one prompt always fits: a prompt of
        # up to max_context tokens is admitted alone).
        if max_prefill_tokens is not None and (isinstance(max_prefill_tokens, bool) or
                                               not isinstance(max_prefill_tokens, int) or
                                               max_prefill_tokens < 1):
            raise ValueError(f"max_prefill_tokens must be a positive int, got {max_prefill_tokens!r}")
        self.max_prefill_tokens = max(geo.max_context, max_prefill_tokens or 0)
        self.runner = Runner(backend, self.model, self.config, record_logits=record_logits)
        self._rows = RowAllocator(geo.max_seqs)
        self._blocks = BlockAllocator(geo.num_kv_blocks, geo.scratch_block)
        self._tokens_out = 0
        self._wall_s = 0.0
        self._closed = False
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

        max_new_tokens: one int for all prompts, or one per prompt. sampling: passed to the
        model's sampler (vt.model SamplingParams; None is greedy).
        """
        self._check_open()
        reqs = self._make_requests(prompts, max_new_tokens, stop_token)
        pending = [r for r in reqs if not r.done]
        running: list[Request] = []
        inflight = None
        t0 = time.perf_counter()
        depth = self.config.depth
        while pending or running or inflight is not None:
            plan = self._plan(pending, running)
            handle = self.runner.launch(plan, sampling) if plan.n else None
            if depth == 1:
                ready, handle = handle, None
            else:
                ready = inflight   # step N's tokens, read after step N+1 is launched
            if ready is not None:
                self._collect(ready, running)
                if progress is not None:
                    progress(Progress(ready.index, sum(r.done for r in reqs), len(reqs),
                                      self._tokens_out, time.perf_counter() - t0))
            elif handle is None:
                raise RuntimeError(f"scheduler stalled: {len(pending)} pending, "
                                   f"{len(running)} running, nothing launched or in flight")
            inflight = handle
        self._wall_s += time.perf_counter() - t0
        return [r.result() for r in reqs]

    def stats(self) -> dict:
        """Steps, graph vs eager steps, waits and their time, pool state."""
        self._check_open()
        st = self.runner.stats.as_dict()
        pool = self.be.pool.stats()
        st.update(tokens=self._tokens_out, wall_s=self._wall_s,
                  tokens_per_s=self._tokens_out / self._wall_s if self._wall_s else 0.0,
                  mode=self.mode, pool=pool.__dict__,
                  driver_mallocs_since_warm_up=pool.driver_mallocs - self._pool_after_warm_up.driver_mallocs)
        return st

    @property
    def mode(self) -> str:
        c = self.config
        base = ("sync" if c.depth == 1 else "ring" if c.async_executor else
                "no_dbuf" if c.no_dbuf else "drain")
        extra = [c.h2d] + (["inputs_read"] if c.inputs_read_event else []) + (["poison"] if c.poison else [])
        return "+".join([base] + extra)

    def close(self) -> str | None:
        """Idempotent. Returns the trace path when a trace was written."""
        if self._closed:
            return None
        self._closed = True
        return self.runner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- scheduling ---------------------------------------------------------------------
    def _make_requests(self, prompts, max_new_tokens, stop_token) -> list[Request]:
        prompts = list(prompts)
        budgets = (list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple, np.ndarray))
                   else [max_new_tokens] * len(prompts))
        if len(budgets) != len(prompts):
            raise ValueError(f"{len(budgets)} max_new_tokens values for {len(prompts)} prompts")
        for m in budgets:
            if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
                raise ValueError(f"max_new_tokens must be positive ints, got {m!r}")
        geo, reqs = self.model.geometry, []
        for i, (p, max_new) in enumerate(zip(prompts, budgets)):
            arr = np.asarray(p)
            if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"prompt {i} must be a non-empty 1-D sequence of token ids, got "
                                 f"shape {arr.shape} dtype {arr.dtype}")
            if arr.min() < 0 or arr.max() >= self.model.vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.model.vocab})")
            if arr.size > geo.max_context:
                raise PromptTooLongError(f"prompt {i} has {arr.size} tokens; the context holds "
                                         f"{geo.max_context}")
            req = Request(i, arr.astype(np.int32), int(max_new), stop_token)
            need = self._blocks_needed(req)
            if need > self._blocks.capacity:
                req.finish_reason = "error"
                req.error = KVCacheExhaustedError(
                    f"request {i} needs {need} KV blocks (prompt {arr.size} + {req.token_budget(geo.max_context)} "
                    f"new tokens, block size {geo.block_size}) but the cache has {self._blocks.capacity}; refused")
            reqs.append(req)
        return reqs

    def _blocks_needed(self, req: Request) -> int:
        geo = self.model.geometry
        slots = req.prompt_len + req.token_budget(geo.max_context) - 1
        return -(-slots // geo.block_size)

    def _plan(self, pending: list[Request], running: list[Request]) -> StepPlan:
        geo = self.model.geometry
        decode = [r for r in running if r.wants_decode(geo.max_context)]
        new, prefill_tokens = [], 0
        while pending and len(running) < self.config.serving_conc:
            req = pending[0]
            if new and prefill_tokens + req.prompt_len > self.max_prefill_tokens:
                break   # the next step prefills it
            blocks = self._blocks.alloc(self._blocks_needed(req))
            if blocks is None:
                break   # waits for running requests to free blocks (always possible: see refusal)
            row = self._rows.alloc()
            pending.pop(0)
            req.row, req.blocks = row, blocks
            req.block_table = np.zeros(geo.max_blocks, np.int32)
            req.block_table[:len(blocks)] = blocks
            running.append(req)
            new.append(req)
            prefill_tokens += req.prompt_len
        tag = decode + new
        for r in tag:
            r.launched += 1
        rows = self._decode_rows(decode) if decode else None
        prefill = [PrefillSeq(r.row, r.prompt, r.block_table, r.row) for r in new]
        for r in tag:
            if r.launched >= r.token_budget(geo.max_context):
                # Its last token is being sampled: the row and blocks are free for the next
                # plan already (device users of them are ordered after this step). Releasing
                # here, not when the token arrives, makes the schedule the same at depth 1
                # and 2, so the OFF path is byte-identical to the synchronous run.
                self._release(r, running)
        return StepPlan(decode=rows, prefill=prefill, tag=tag)

    def _release(self, req: Request, running: list[Request]) -> None:
        if req.row < 0:
            return
        self._rows.free(req.row)
        self._blocks.free(req.blocks)
        req.row, req.blocks = -1, []
        running.remove(req)

    def _decode_rows(self, reqs: list[Request]) -> DecodeRows:
        bs = self.model.geometry.block_size
        # The input is the token sampled last (position L + launched - 2 after this step's
        # increment); the device token table holds it, the host needs only where it sits.
        pos = np.array([r.prompt_len + r.launched - 2 for r in reqs], np.int32)
        bt = np.stack([r.block_table for r in reqs])
        slots = bt[np.arange(len(reqs)), pos // bs] * bs + pos % bs
        rows = np.array([r.row for r in reqs], np.int32)
        return DecodeRows(rows, pos, pos + 1, slots.astype(np.int32), bt, rows.copy())

    def _collect(self, handle, running: list[Request]) -> None:
        tokens = self.runner.collect(handle)
        geo = self.model.geometry
        for i, req in enumerate(handle.tag):
            if req.done:
                continue   # stopped at an earlier step; this token was computed past the stop
            tok = int(tokens[i])
            req.tokens.append(tok)
            if handle.host_logits is not None:
                req.logits.append(handle.host_logits[i].copy())
            self._tokens_out += 1
            if req.stop_token is not None and tok == req.stop_token:
                req.finish_reason = "stop"
            elif len(req.tokens) >= req.max_new_tokens:
                req.finish_reason = "length"
            elif len(req.tokens) >= req.token_budget(geo.max_context):
                req.finish_reason = "context"
            if req.done:
                # A stop token arrives one step late: the device may still run a queued step
                # on this row, and any later user of the row is ordered after it.
                self._release(req, running)

    def _check_open(self):
        if self._closed:
            raise ClosedError("Engine is closed")
