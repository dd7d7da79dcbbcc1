"""Scheduler: which requests run where. It owns the sequence rows, the KV blocks and the
DecodeBatch of running requests, plans each step (every running request decodes; pending ones
are admitted and prefilled while there is room) and moves the batch past each launched step.

The scheduler moves a request through its phases (vt/engine/requests.py): admitted, a WAITING
request takes a row and its KV blocks and is PREFILLING until the plan of its last prompt
chunk, which makes it DECODING (its first token is that step's). It joins the batch after
that step launches and leaves when the step of its last token launches, when a stop token
is seen or when it is cancelled; the token buffer finishes it. Its row is free for the next
plan at once (device users of the row are stream-ordered after that step); its KV blocks
are released, and reusable once the host has seen the last step that may read them
complete (`completed`, vt/engine/kv_blocks.py).

With prefix caching, an admitted request first takes the cached blocks of its prompt's
longest cached prefix (vt/engine/kv_blocks.py) and is prefilled from the first token they
do not hold; the full prompt blocks each plan computes are named (registered) after the
plan, so a request admitted in the same plan never reads a block that step writes: one
whose next block that step computes waits for the next plan, which finds it cached. The
full blocks its decoding writes are named when it finishes (`cache_generated`), so the next
turn of a conversation finds its answer cached too.

Each row owns a span of max_context tokens in the engine's token buffer (a request's tokens go
to [row * max_context, ...)): a row's next request writes its first token one step after the
last write of the row's previous request, which has been read out by then (token_buffer.py).
"""
from __future__ import annotations

from collections import deque

import numpy as np

from vt.engine.batch import BatchStep, DecodeBatch
from vt.engine.kv_blocks import BlockPool, PrefixCacheStats, block_hashes, root_hash
from vt.engine.requests import Request, RequestPhase
from vt.engine.rows import RowAllocator
from vt.step.contract import KVGeometry, PrefillSeq
from vt.executor.plan import StepPlan


def kv_blocks_needed(prompt_len: int, max_new_tokens: int, geo: KVGeometry, k: int = 0) -> int:
    """The KV blocks a request holds: its prompt and every generated token but the last (no
    step writes that one's KV), plus k positions with speculation (a verify step writes its
    last token's and k drafts'), within the block table."""
    need = -(-(prompt_len + max_new_tokens - 1) // geo.block_size)
    if k:
        need = min(-(-(prompt_len + max_new_tokens - 1 + k) // geo.block_size), geo.max_blocks)
    return need


class StepTag:
    """What the host needs to place a step's tokens, fixed at plan time (the batch moves on
    before the tokens arrive): t, the batch step; dest, where each row's token goes in the
    token buffer; with stop tokens in the step, each row's request and stop set (reqs,
    stops); leaving, the requests whose last token this step samples (set at launch)."""

    __slots__ = ("t", "dest", "reqs", "stops", "leaving", "n_decode")

    def __init__(self, t: int, dest: np.ndarray, reqs=None, stops=None, n_decode: int = 0):
        self.t, self.dest, self.reqs, self.stops = t, dest, reqs, stops
        self.n_decode = n_decode   # speculative: the verify rows, first (reqs has every row's)
        self.leaving = ()


class Scheduler:
    """chunked: the step model prefills from a position (PrefillSeq.start), so a prompt longer
    than the step's prefill budget is prefilled in chunks over several steps (its row and
    KV blocks held from the first) and joins the batch after the last.

    prefix_caching: share cached prompt blocks (needs chunked: a hit is prefilled from a
    position); identity: what the cached KV depends on besides the tokens (the model's).
    kv_fenced, on_kv_reuse: BlockPool's fenced and on_reuse (the test arms' way in).

    speculative: k, the drafts of a verify step (0: none). A request's blocks then cover k
    positions past its last token's (a verify step writes k + 1; docs/speculative.md), its
    tokens are counted as they are collected (Request.emitted), and every step's tag names
    every row's request (StepTag.reqs, the verify rows first: n_decode). The batch's leave
    schedule stays an upper bound (a verify step emits at least one token a row); a request
    ends at its budget or stop token when its tokens are collected, as a stopped one does."""

    def __init__(self, geo: KVGeometry, serving_conc: int, max_prefill_tokens: int,
                 chunked: bool = False, *, prefix_caching: bool = False, identity: int = 0,
                 kv_fenced: bool = True, on_kv_reuse=None, speculative: int = 0):
        self.geo, self.serving_conc, self.max_prefill_tokens = geo, serving_conc, max_prefill_tokens
        self.k = speculative
        self.chunked = chunked
        if prefix_caching and not chunked:
            raise ValueError("Scheduler: prefix_caching needs chunked prefill (a cached prompt "
                             "is prefilled from its first uncached token)")
        self.caching = prefix_caching
        self._root = root_hash(identity, geo.block_size)
        self._kv_fenced, self._on_kv_reuse = kv_fenced, on_kv_reuse
        self.cache_stats = PrefixCacheStats()
        self.launched = -1   # the batch step of the last launched step
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
        # After a failure nothing is in flight (the runner waited for the stream): every step
        # launched so far is complete.
        self.blocks = BlockPool(geo.num_kv_blocks, geo.scratch_block, stats=self.cache_stats,
                                fenced=self._kv_fenced, on_reuse=self._on_kv_reuse)
        self.blocks.completed = self.launched
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
        if self.decode_only_next(pending):
            return StepPlan(BatchStep(b) if n_dec else None, None, self.decode_tag())
        chunks, budget = [], self.max_prefill_tokens     # (request, end of its chunk)
        for req in self.prefilling:
            if budget <= 0:
                break
            end = min(req.prompt_len, req.prefilled + budget)
            budget -= end - req.prefilled
            chunks.append((req, end))
        held = n_dec + len(self.prefilling)
        planned = self._planned(chunks) if self.caching else None
        while pending and held < self.serving_conc and budget > 0:
            req = pending[0]
            if not self.chunked and chunks and req.prompt_len > budget:
                break   # the next step prefills it
            need = kv_blocks_needed(req.prompt_len, req.max_new_tokens, geo, self.k)
            if self.caching:
                blocks = self._admit_cached(req, need, planned)
            else:
                blocks = self.blocks.alloc(need)
            if blocks is None:
                break   # waits for running requests to free blocks (always possible: see refusal)
            pending.popleft()
            req.row, req.blocks = self.rows.alloc(), blocks
            req.phase = RequestPhase.PREFILLING
            req.span_start = req.row * self.span
            req.span_end = req.span_start + req.max_new_tokens
            end = min(req.prompt_len, req.prefilled + budget) if self.chunked else req.prompt_len
            budget -= end - req.prefilled
            held += 1
            if planned is not None:
                planned.update(req.block_hashes[req.cached_blocks:end // geo.block_size])
            if end < req.prompt_len:
                self.prefilling.append(req)
            chunks.append((req, end))
        prefill, dest, admitted = [], [], []
        for req, end in chunks:
            bt = np.full(geo.max_blocks, geo.scratch_block, np.int32)
            bt[:len(req.blocks)] = req.blocks
            prefill.append(PrefillSeq(req.row, req.prompt[:end], bt, req.row, req.sampling,
                                      start=req.prefilled, stop_tokens=req.stop_tokens))
            req.prefilled = end
            if end == req.prompt_len:
                req.phase, req.first_step = RequestPhase.DECODING, b.t
                if self.k:
                    req.emitted = 0
                dest.append(req.span_start)
            else:
                dest.append(self.scratch_dest)   # no token yet: the next chunk goes on
            admitted.append(req)
        if self.prefilling:
            self.prefilling = [r for r in self.prefilling if r.phase is RequestPhase.PREFILLING]
        if self.caching:
            self._register(chunks)
        tag = self.decode_tag(admitted)
        tag.dest = np.concatenate([tag.dest, np.asarray(dest, np.int64)])
        decode = BatchStep(b) if n_dec else None
        return StepPlan(decode, prefill, tag, admitted)

    # -- prefix caching (vt/engine/kv_blocks.py) ------------------------------------------
    def decode_only_next(self, pending: deque) -> bool:
        """Whether the next plan is the batch's decode rows alone (no prompt chunk goes on and
        nobody is admitted): its rows are the batch's n."""
        return not self.prefilling and (not pending or self.batch.n >= self.serving_conc)

    def _planned(self, chunks) -> set:
        """The hashes of the full prompt blocks this plan's continuing chunks compute."""
        bs, out = self.geo.block_size, set()
        for req, end in chunks:
            out.update(req.block_hashes[req.cached_blocks:end // bs])
        return out

    def _admit_cached(self, req: Request, need: int, planned: set) -> list[int] | None:
        """The request's blocks: its longest cached prefix (taken), then new ones; None
        (nothing taken) when too few are reusable, or when the block after its cached prefix
        is computed by the step being planned (the next plan finds it cached). Sets where its
        prefill starts."""
        bs, pool = self.geo.block_size, self.blocks
        hashes = req.block_hashes
        if hashes is None:
            hashes = req.block_hashes = block_hashes(req.prompt, bs, self._root)
        limit = (req.prompt_len - 1) // bs     # the last prompt token is always computed
        hits = pool.match(hashes, req.prompt, bs, limit)
        n_hit = len(hits)
        if n_hit < limit and hashes[n_hit] in planned:
            return None
        if pool.available - pool.reusable_among(hits) < need - n_hit:
            return None
        pool.take(hits)
        blocks = hits + pool.alloc(need - n_hit)
        req.cached_blocks = n_hit
        req.cached_tokens = req.prefilled = n_hit * bs
        stats = self.cache_stats
        stats.prompt_tokens += req.prompt_len
        stats.cached_tokens += req.cached_tokens
        return blocks

    def _register(self, chunks) -> None:
        """Name the full prompt blocks this plan computes (their KV is written by this step,
        stream-ordered before any later step that reads them)."""
        bs, pool = self.geo.block_size, self.blocks
        for req, end in chunks:
            full = end // bs
            if full > req.cached_blocks:
                hashes, blocks, prompt = req.block_hashes, req.blocks, req.prompt
                for i in range(req.cached_blocks, full):
                    pool.register(blocks[i], hashes[i], prompt[i * bs:(i + 1) * bs].tobytes())
                req.cached_blocks = full

    def cache_generated(self, reqs) -> None:
        """Name the full blocks the decoding of these just-finished requests wrote (the
        prompt's are named already): those of the prompt and every token but the last (no
        step wrote its KV), chained from the prompt's hashes. Only for a stop or a length
        (a cancelled or failed request's tokens may not be the ones its KV holds), and
        before the loop lifts the fence of the step it collected, while the blocks are held
        or fenced (kv_blocks.py)."""
        bs, pool = self.geo.block_size, self.blocks
        for req in reqs:
            blocks = req.blocks or req.released_blocks
            req.released_blocks = None
            hashes = req.block_hashes
            if (not blocks or hashes is None or req.final is None or
                    req.finish_reason not in ("stop", "length")):
                continue
            seq = np.concatenate([req.prompt, req.final[:-1].astype(req.prompt.dtype)])
            first = req.prompt_len // bs
            more = block_hashes(seq, bs, hashes[-1] if hashes else self._root, first)
            for i, h in enumerate(more, first):
                pool.register(blocks[i], h, seq[i * bs:(i + 1) * bs].tobytes())

    def completed(self, t: int) -> None:
        """The host has seen batch step t complete (the loop collected it): the blocks
        released while it could read them are reusable."""
        self.blocks.complete(t)

    def decode_tag(self, admitted=()) -> StepTag:
        """The tag of the batch's decode rows at this step (copies: the batch moves on before
        the tokens arrive), plus the prefilled requests' stop sets when any row has one (a
        non-final chunk's row has none: its token is not one of the request's)."""
        b = self.batch
        if self.k:
            return StepTag(b.t, b.dest(), b.reqs[:b.n] + [r if r.first_step == b.t else None
                                                          for r in admitted], n_decode=b.n)
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
        self.launched = plan.tag.t
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
            self.blocks.release(req.blocks, self.launched)
            # Named once its tokens are known (cache_generated). One that finished before it
            # leaves (a stop token, or a verify step's tokens ahead of the length schedule)
            # was named then, holding its blocks: its scheduled last step, later, must not
            # name them again, when they may hold another request's KV.
            if self.caching and not req.finished:
                req.released_blocks = req.blocks
            req.row, req.blocks = None, []
