"""DecodeBatch: the running requests' per-step state, persistent across steps.

Entries [0, n) are the requests that decode in the next step, in batch order. Every running
request decodes at every step, so its position is an offset plus the batch's step counter
`t`: a step writes positions, sequence lengths and KV slots straight into a slot's pinned
block with ONE `np.add(offsets, t, out=...)` (the three vectors are adjacent in the block,
and their offsets are the rows of one [3, capacity] array), and nothing is advanced per row. What
changes at known steps is scheduled when a request joins: the step that launches its last
token (it leaves) and the steps where it enters a new KV block (its slot offset moves).
Per-row vectors that change only when the batch does (rows, sampling, block tables) are
copied into a slot only when the batch's `version` moved since that slot's last fill.
Python work per request happens only when one joins, crosses a block, or leaves.
"""
from __future__ import annotations

import numpy as np

from vt.sampling.params import NO_LOGPROBS
from vt.step.contract import SamplingParams, kv_slot


# Requests crossing into a new KV block at one step: one at a time below this many (~1 µs
# each), one vectorised update from it on (~7 µs whatever the count; requests that joined
# together cross together).
_VECTOR_FROM = 8


class DecodeBatch:
    def __init__(self, capacity: int, max_blocks: int, block_size: int, *, first_step: int = 0):
        self.capacity, self.block_size = capacity, block_size
        self.n = 0
        self.t = first_step        # the batch step the next launch is (steps launched so far)
        # t again as 0-d arrays of each operand's dtype, for the per-step adds (BatchStep's
        # and dest()): numpy converts a Python int (or casts a scalar of another dtype) on
        # every call, which costs more than the add itself (~0.7 µs). Read-only outside.
        self.t_int32 = np.full((), first_step, np.int32)
        self.t_int64 = np.full((), first_step, np.int64)
        self.version = 0           # bumped whenever an entry joins, leaves or moves
        self.reqs: list = [None] * capacity
        self.rows = np.zeros(capacity, np.int32)        # token-table row = recurrent state slot
        # Rows: position of the input token - t; sequence length - t (= the first + 1); its
        # KV slot - t (until the next block). The order of InputBlock.advancing.
        self.offsets = np.zeros((3, capacity), np.int32)
        self.pos_off, self.len_off, self.slot_off = self.offsets
        self.block_tables = np.zeros((capacity, max_blocks), np.int32)
        self.temperature = np.zeros(capacity, np.float32)
        self.top_k = np.zeros(capacity, np.int32)
        self.top_p = np.ones(capacity, np.float32)
        self.min_p = np.zeros(capacity, np.float32)
        self.seed = np.zeros(capacity, np.uint64)
        self.logprobs = np.full(capacity, NO_LOGPROBS, np.int32)
        self.penalized = np.zeros(capacity, np.int32)
        self.penalties = np.zeros((3, capacity), np.float32)   # presence, frequency, repetition
        self.dest_off = np.zeros(capacity, np.int64)    # where its next token goes - t (intp: an index)
        # Stop tokens, -1 padded: [capacity, widest set so far] (widened when a request with
        # more joins); n_stopping entries have at least one.
        self.stops = np.full((capacity, 1), -1, np.int32)
        self.n_stopping = 0
        self._leaving: dict[int, list] = {}             # t -> requests whose last token it launches
        self._crossing: dict[int, list] = {}            # t -> requests entering a new KV block

    def add(self, req, row: int, block_table: np.ndarray, sampling: SamplingParams, *,
            pos: int, left: int, dest: int, stops: tuple = ()) -> None:
        """A request joins at the end; it decodes from the next step on, `left` tokens."""
        i, t, bs = self.n, self.t, self.block_size
        if i >= self.capacity:
            raise RuntimeError(f"DecodeBatch is full ({self.capacity} requests)")
        self.reqs[i] = req
        self.rows[i], self.pos_off[i], self.len_off[i] = row, pos - t, pos + 1 - t
        self.block_tables[i] = block_table
        self.slot_off[i] = kv_slot(block_table, pos, bs) - t
        self.temperature[i], self.top_k[i], self.seed[i] = sampling.temperature, sampling.top_k or 0, sampling.seed
        self.top_p[i], self.min_p[i] = sampling.top_p, sampling.min_p
        self.logprobs[i] = NO_LOGPROBS if sampling.logprobs is None else sampling.logprobs
        self.penalized[i] = sampling.penalize_stages
        self.penalties[:, i] = (sampling.presence_penalty, sampling.frequency_penalty,
                                sampling.repetition_penalty)
        self.dest_off[i] = dest - t
        if len(stops) > self.stops.shape[1]:
            wider = np.full((self.capacity, len(stops)), -1, np.int32)
            wider[:, :self.stops.shape[1]] = self.stops
            self.stops = wider
        self.stops[i] = -1
        self.stops[i, :len(stops)] = stops
        self.n_stopping += bool(stops)
        req.batch_index = i
        self._leaving.setdefault(t + left - 1, []).append(req)
        # The step at t + j has input position pos + j: it enters block b at j = b * bs - pos.
        for b in range(pos // bs + 1, (pos + left - 1) // bs + 1):
            self._crossing.setdefault(t + b * bs - pos, []).append(req)
        self.n = i + 1
        self.version += 1

    def remove(self, req) -> None:
        """The request leaves (finished or stopped); the last entry moves into its place."""
        i, last = req.batch_index, self.n - 1
        if i < 0:
            return
        req.batch_index = -1
        self.n_stopping -= bool(req.stop_tokens)
        if i != last:
            moved = self.reqs[last]
            self.reqs[i] = moved
            moved.batch_index = i
            for a in (self.rows, self.pos_off, self.len_off, self.slot_off, self.block_tables,
                      self.temperature, self.top_k, self.top_p, self.min_p, self.seed, self.logprobs,
                      self.penalized, self.dest_off,
                      self.stops):
                a[i] = a[last]
            self.penalties[:, i] = self.penalties[:, last]
        self.reqs[last] = None
        self.n = last
        self.version += 1

    def begin_step(self) -> None:
        """Before the step at t is planned: move the slot offsets of requests entering a new
        KV block at this step (scheduled at join; a request that left is skipped). Idempotent
        within a step (the schedule entry is consumed)."""
        crossing = self._crossing.pop(self.t, None)
        if crossing is None:
            return
        t, bs = self.t, self.block_size
        if len(crossing) < _VECTOR_FROM:
            for req in crossing:
                i = req.batch_index
                if i >= 0:
                    self.slot_off[i] = kv_slot(self.block_tables[i], int(self.pos_off[i]) + t, bs) - t
            return
        idx = np.fromiter([r.batch_index for r in crossing if r.batch_index >= 0], np.intp)
        pos = self.pos_off[idx] + t
        self.slot_off[idx] = kv_slot(self.block_tables, pos, bs, rows=idx) - t

    def end_step(self):
        """The step at t was launched: t moves on. Returns the requests whose last token it was."""
        leaving = self._leaving.pop(self.t, ())
        self.t += 1
        self.t_int32.fill(self.t)
        self.t_int64.fill(self.t)
        return leaving

    def dest(self) -> np.ndarray:
        """Where each entry's token of the step at t goes (a copy: the batch changes after)."""
        return self.dest_off[:self.n] + self.t_int64


class BatchStep:
    """The decode rows of the step at t, as the runner sees them: len() and a fast fill of an
    input block (a graph slot's, or the eager path's staging block)."""

    __slots__ = ("batch", "n")

    def __init__(self, batch: DecodeBatch):
        self.batch, self.n = batch, batch.n

    def __len__(self) -> int:
        return self.n

    def write_into(self, block, pad) -> None:
        """Write this step into `block` (an InputBlock's pinned twin): one add every step, the
        rest only when the batch or the row count changed since the block's last fill."""
        b, n = self.batch, self.n
        views = block.step_views
        if views is None or views[0] is not b or views[1] != n:
            # [:n] views made once per (block, n): slicing costs as much as the add below
            views = block.step_views = (b, n, b.offsets[:, :n], block.advancing[:, :n])
        if block.filled != (b, b.version, n):
            inp = block.inputs
            inp.token_rows[:n] = b.rows[:n]
            inp.state_idx[:n] = b.rows[:n]
            inp.temperature[:n] = b.temperature[:n]
            inp.top_k[:n] = b.top_k[:n]
            inp.top_p[:n] = b.top_p[:n]
            inp.min_p[:n] = b.min_p[:n]
            inp.seed[:n] = b.seed[:n]
            inp.logprobs[:n] = b.logprobs[:n]
            inp.penalized[:n] = b.penalized[:n]
            inp.presence_penalty[:n] = b.penalties[0, :n]
            inp.frequency_penalty[:n] = b.penalties[1, :n]
            inp.repetition_penalty[:n] = b.penalties[2, :n]
            inp.block_tables[:n] = b.block_tables[:n]
            block.pad_from(n, pad)
            block.filled = (b, b.version, n)
        np.add(views[2], b.t_int32, out=views[3])   # positions, seq_lens, slot_mapping
