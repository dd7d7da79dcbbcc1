"""Scheduler: which requests run where. It owns the sequence rows, the KV blocks and the
DecodeBatch of running requests, plans each step (every running request decodes; pending ones
are admitted and prefilled while there is room) and moves the batch past each launched step.

The scheduler moves a request through its phases (vt/engine/requests.py): admitted, a WAITING
request takes a row and its KV blocks and is PREFILLING until the plan of its last prompt
chunk, which makes it DECODING (its first token is that step's). It joins the batch after
that step launches and leaves when the step of its last token launches (its row and blocks
are free for the next plan at once: device users of them are stream-ordered after that
step), when a stop token is seen or when it is cancelled; the token buffer finishes it.

Each row owns a span of max_context tokens in the engine's token buffer (a request's tokens go
to [row * max_context, ...)): a row's next request writes its first token one step after the
last write of the row's previous request, which has been read out by then (outputs.py).
"""
from __future__ import annotations

from collections import deque

import numpy as np

from vt.engine.batch import BatchStep, DecodeBatch
from vt.engine.kv_blocks import BlockAllocator
from vt.engine.requests import Request, RequestPhase
from vt.engine.rows import RowAllocator
from vt.step.contract import KVGeometry, PrefillSeq
from vt.executor.plan import StepPlan


class StepTag:
    """What the host needs to place a step's tokens, fixed at plan time (the batch moves on
    before the tokens arrive): t, the batch step; dest, where each row's token goes in the
    token buffer; with stop tokens in the step, each row's request and stop set (reqs,
    stops); leaving, the requests whose last token this step samples (set at launch)."""

    __slots__ = ("t", "dest", "reqs", "stops", "leaving")

    def __init__(self, t: int, dest: np.ndarray, reqs=None, stops=None):
        self.t, self.dest, self.reqs, self.stops = t, dest, reqs, stops
        self.leaving = ()


class Scheduler:
    """chunked: the step model prefills from a position (PrefillSeq.start), so a prompt longer
    than the step's prefill budget is prefilled in chunks over several steps (its row and
    KV blocks held from the first) and joins the batch after the last."""

    def __init__(self, geo: KVGeometry, serving_conc: int, max_prefill_tokens: int,
                 chunked: bool = False):
        self.geo, self.serving_conc, self.max_prefill_tokens = geo, serving_conc, max_prefill_tokens
        self.chunked = chunked
        self.span = geo.max_context     # token-buffer entries per row
        self.scratch_dest = geo.max_seqs * self.span   # where a non-final chunk's token goes
        self.batch: DecodeBatch | None = None
        self.reset()

    def reset(self) -> None:
        """Every row and KV block free, nothing running (construction, and after a failure).
        The batch step counter goes on from where it was, never back: the token buffer
        counts its stored steps by it, so a step numbered again would make a new request's
        span read as already stored (another request's old tokens)."""
        geo = self.geo
        first_step = self.batch.t if self.batch is not None else 0
        self.rows = RowAllocator(geo.max_seqs)
        self.blocks = BlockAllocator(geo.num_kv_blocks, geo.scratch_block)
        self.batch = DecodeBatch(geo.max_seqs, geo.max_blocks, geo.block_size,
                                 first_step=first_step)
        self.prefilling: list[Request] = []   # the PREFILLING requests, in admission order

    def idle(self) -> bool:
        """Every row and KV block is free (what a cancel or a finished request gives back)."""
        return (self.batch.n == 0 and not self.prefilling and
                self.rows.free_count == self.geo.max_seqs and
                self.blocks.free_count == self.blocks.capacity)

    def plan(self, pending: deque) -> StepPlan:
        """This step's rows: every request in the batch decodes; prompts being prefilled in
        chunks go on, and pending ones are admitted (prefilled) while there is room. When
        nobody can be admitted (the usual decode step) the plan is the batch's rows and tag
        alone."""
        b, geo = self.batch, self.geo
        b.begin_step()
        n_dec = b.n
        if not self.prefilling and (not pending or n_dec >= self.serving_conc):
            return StepPlan(BatchStep(b) if n_dec else None, None, self.decode_tag())
        chunks, budget = [], self.max_prefill_tokens     # (request, end of its chunk)
        for req in self.prefilling:
            if budget <= 0:
                break
            end = min(req.prompt_len, req.prefilled + budget)
            budget -= end - req.prefilled
            chunks.append((req, end))
        held = n_dec + len(self.prefilling)
        while pending and held < self.serving_conc and budget > 0:
            req = pending[0]
            if not self.chunked and chunks and req.prompt_len > budget:
                break   # the next step prefills it
            blocks = self.blocks.alloc(-(-(req.prompt_len + req.max_new_tokens - 1) // geo.block_size))
            if blocks is None:
                break   # waits for running requests to free blocks (always possible: see refusal)
            pending.popleft()
            req.row, req.blocks = self.rows.alloc(), blocks
            req.phase = RequestPhase.PREFILLING
            req.span_start = req.row * self.span
            req.span_end = req.span_start + req.max_new_tokens
            end = min(req.prompt_len, budget) if self.chunked else req.prompt_len
            budget -= end
            held += 1
            if end < req.prompt_len:
                self.prefilling.append(req)
            chunks.append((req, end))
        prefill, dest, admitted = [], [], []
        for req, end in chunks:
            bt = np.full(geo.max_blocks, geo.scratch_block, np.int32)
            bt[:len(req.blocks)] = req.blocks
            prefill.append(PrefillSeq(req.row, req.prompt[:end], bt, req.row, req.sampling,
                                      start=req.prefilled))
            req.prefilled = end
            if end == req.prompt_len:
                req.phase, req.first_step = RequestPhase.DECODING, b.t
                dest.append(req.span_start)
            else:
                dest.append(self.scratch_dest)   # no token yet: the next chunk goes on
            admitted.append(req)
        if self.prefilling:
            self.prefilling = [r for r in self.prefilling if r.phase is RequestPhase.PREFILLING]
        tag = self.decode_tag(admitted)
        tag.dest = np.concatenate([tag.dest, np.asarray(dest, np.int64)])
        decode = BatchStep(b) if n_dec else None
        return StepPlan(decode, prefill, tag, admitted)

    def decode_tag(self, admitted=()) -> StepTag:
        """The tag of the batch's decode rows at this step (copies: the batch moves on before
        the tokens arrive), plus the prefilled requests' stop sets when any row has one (a
        non-final chunk's row has none: its token is not one of the request's)."""
        b = self.batch
        if not b.n_stopping and not (admitted and any(r.stop_tokens for r in admitted)):
            return StepTag(b.t, b.dest())
        reqs = b.reqs[:b.n] + list(admitted)
        stops = b.stops[:b.n]
        if admitted:
            width = max(stops.shape[1], max(len(r.stop_tokens) for r in admitted))
            extra = np.full((len(admitted), width), -1, np.int32)
            for i, r in enumerate(admitted):
                if r.first_step == b.t:
                    extra[i, :len(r.stop_tokens)] = r.stop_tokens
            wide = np.full((b.n, width), -1, np.int32)
            wide[:, :stops.shape[1]] = stops
            stops = np.concatenate([wide, extra])
        else:
            stops = stops.copy()
        return StepTag(b.t, b.dest(), reqs, stops)

    def after_launch(self, plan: StepPlan) -> None:
        """Move the batch past the launched step: the requests whose last token it was leave
        (and are named on its tag), the admitted ones join."""
        leaving = self.batch.end_step()
        for req in leaving:
            self.leave(req)
        if not plan.admitted:      # a decode step: skip the two list builds below
            plan.tag.leaving = leaving
            return
        joining = [(r, s) for r, s in zip(plan.admitted, plan.prefill)
                   if len(s.tokens) == r.prompt_len]   # its last chunk: it has its first token
        last = [r for r, _ in joining if r.max_new_tokens == 1]
        plan.tag.leaving = list(leaving) + last if last else leaving
        for req, seq in joining:
            if req.max_new_tokens == 1:
                self._free(req)
            else:
                self.batch.add(req, req.row, seq.block_table, req.sampling, pos=req.prompt_len,
                               left=req.max_new_tokens - 1, dest=req.span_start + 1,
                               stops=req.stop_tokens)

    def leave(self, req: Request) -> None:
        """The request decodes (or prefills) no more: out of the batch, its row and blocks
        freed (its phase stays until the token buffer finishes it)."""
        self.batch.remove(req)
        if req.phase is RequestPhase.PREFILLING:
            self.prefilling.remove(req)
        self._free(req)

    def running(self) -> list[Request]:
        """The requests holding a row: prefilling, then decoding in batch order."""
        return [*self.prefilling, *self.batch.reqs[:self.batch.n]]

    def _free(self, req: Request) -> None:
        if req.row is not None:
            self.rows.free(req.row)
            self.blocks.free(req.blocks)
            req.row, req.blocks = None, []
