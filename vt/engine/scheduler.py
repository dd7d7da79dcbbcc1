"""Scheduler: which requests run where. It owns the sequence rows, the KV blocks and the
DecodeBatch of running requests, plans each step (every running request decodes; pending ones
are admitted and prefilled while there is room) and moves the batch past each launched step.

A request joins the batch after its prefill step launches and leaves when the step of its last
token launches (its row and blocks are free for the next plan at once: device users of them
are stream-ordered after that step) or when a stop token is seen.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from vt.engine.batch import BatchStep, DecodeBatch
from vt.engine.requests import BlockAllocator, Request, RowAllocator
from vt.step.contract import KVGeometry, PrefillSeq
from vt.runner.plan import StepPlan


class Scheduler:
    def __init__(self, geo: KVGeometry, serving_conc: int, max_prefill_tokens: int):
        self.geo, self.serving_conc, self.max_prefill_tokens = geo, serving_conc, max_prefill_tokens
        self.reset()

    def reset(self) -> None:
        """Every row and KV block free, nothing running (construction, and after a failure)."""
        geo = self.geo
        self.rows = RowAllocator(geo.max_seqs)
        self.blocks = BlockAllocator(geo.num_kv_blocks, geo.scratch_block)
        self.batch = DecodeBatch(geo.max_seqs, geo.max_blocks, geo.block_size)

    def plan(self, pending: deque, stops: bool) -> StepPlan:
        """This step's rows: every request in the batch decodes; pending ones are admitted
        (prefilled) while there is room. The step's tag carries where its tokens go (dest),
        with `stops` each row's request and stop token (rid, stop), and how many requests
        it finishes (n_last): the batch changes before the tokens arrive. When nobody can
        be admitted (the usual decode step) the plan is the batch's rows and tag alone."""
        b, geo = self.batch, self.geo
        b.begin_step()
        n_dec = b.n
        if not pending or n_dec >= self.serving_conc:
            return StepPlan(BatchStep(b) if n_dec else None, None, self.decode_tag(stops))
        admitted, prefill_tokens = [], 0
        while pending and n_dec + len(admitted) < self.serving_conc:
            req = pending[0]
            if admitted and prefill_tokens + req.prompt_len > self.max_prefill_tokens:
                break   # the next step prefills it
            blocks = self.blocks.alloc(-(-(req.prompt_len + req.max_new_tokens - 1) // geo.block_size))
            if blocks is None:
                break   # waits for running requests to free blocks (always possible: see refusal)
            pending.popleft()
            req.row, req.blocks = self.rows.alloc(), blocks
            admitted.append(req)
            prefill_tokens += req.prompt_len
        prefill = []
        for req in admitted:
            bt = np.full(geo.max_blocks, geo.scratch_block, np.int32)
            bt[:len(req.blocks)] = req.blocks
            prefill.append(PrefillSeq(req.row, req.prompt, bt, req.row, req.sampling))
        dest, rid, stop, n_last = self.decode_tag(stops)
        if admitted:
            dest = np.concatenate([dest, [r.base for r in admitted]])
            n_last += sum(r.max_new_tokens == 1 for r in admitted)
            if stops:
                rid = np.concatenate([rid, [r.index for r in admitted]])
                stop = np.concatenate([stop, [stop_id(r) for r in admitted]])
        decode = BatchStep(b) if n_dec else None
        return StepPlan(decode, prefill, (dest, rid, stop, n_last), admitted)

    def decode_tag(self, stops: bool) -> tuple:
        """The tag of the batch's decode rows at this step (copies: the batch moves on before
        the tokens arrive): (dest, rid, stop, n_last), rid and stop None without `stops`."""
        b = self.batch
        if stops:
            return b.dest(), b.rid[:b.n].copy(), b.stop[:b.n].copy(), b.finishing()
        return b.dest(), None, None, b.finishing()

    def after_launch(self, plan: StepPlan) -> None:
        """Move the batch past the launched step: the requests whose last token it was leave,
        the admitted ones join."""
        for req in self.batch.end_step():
            self.leave(req)
        for req, seq in zip(plan.admitted, plan.prefill):
            if req.max_new_tokens == 1:
                self._free(req)
            else:
                self.batch.add(req, req.row, seq.block_table, req.sampling, pos=req.prompt_len,
                               left=req.max_new_tokens - 1, dest=req.base + 1, stop=stop_id(req))

    def leave(self, req: Request) -> None:
        """The request decodes no more: out of the batch, its row and blocks freed."""
        self.batch.remove(req)
        self._free(req)

    def _free(self, req: Request) -> None:
        if req.row >= 0:
            self.rows.free(req.row)
            self.blocks.free(req.blocks)
            req.row, req.blocks = -1, []


def stop_id(req: Request) -> int:
    return -1 if req.stop_token is None else req.stop_token
