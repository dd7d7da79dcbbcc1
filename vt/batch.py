"""DecodeBatch: the running requests' per-step state, persistent across steps.

Entries [0, n) are the requests that decode in the next step, in batch order. Each vector is
preallocated for max_seqs entries; a step reads views of them (no copies), advances them in
place with a few vectorised numpy operations, and Python work per request happens only when
one joins (admission) or leaves (finish: the last entry moves into its place). A block-table
row is written once, at admission: every block a request can need is allocated then.
"""
from __future__ import annotations

import numpy as np

from vt.step import DecodeRows, SamplingParams, kv_slot


class DecodeBatch:
    def __init__(self, capacity: int, max_blocks: int, block_size: int):
        self.capacity, self.block_size = capacity, block_size
        self.n = 0
        self.reqs: list = [None] * capacity
        self.rows = np.zeros(capacity, np.int32)        # token-table row = recurrent state slot
        self.pos = np.zeros(capacity, np.int32)         # position of the next step's input token
        self.seq_lens = np.ones(capacity, np.int32)     # pos + 1
        self.slots = np.zeros(capacity, np.int32)       # KV slot of pos
        self.block_tables = np.zeros((capacity, max_blocks), np.int32)
        self.temperature = np.zeros(capacity, np.float32)
        self.top_k = np.ones(capacity, np.int32)
        self.seed = np.zeros(capacity, np.uint64)
        self.left = np.zeros(capacity, np.int32)        # tokens still to launch
        self.dest = np.zeros(capacity, np.int64)        # where its next token goes (engine's buffer)
        self.stop = np.full(capacity, -1, np.int32)     # stop token, -1: none
        self.rid = np.zeros(capacity, np.int64)         # the request's index in its generate()

    def add(self, req, row: int, block_table: np.ndarray, sampling: SamplingParams, *,
            pos: int, left: int, dest: int, stop: int) -> None:
        """A request joins at the end; it decodes from the next step on."""
        i = self.n
        if i >= self.capacity:
            raise RuntimeError(f"DecodeBatch is full ({self.capacity} requests)")
        self.reqs[i] = req
        self.rows[i], self.pos[i], self.seq_lens[i] = row, pos, pos + 1
        self.block_tables[i] = block_table
        self.slots[i] = kv_slot(block_table, pos, self.block_size)
        self.temperature[i], self.top_k[i], self.seed[i] = sampling.temperature, sampling.k, sampling.seed
        self.left[i], self.dest[i], self.stop[i], self.rid[i] = left, dest, stop, req.index
        req.batch_index = i
        self.n = i + 1

    def remove(self, i: int) -> None:
        """The entry at i leaves; the last one moves into its place."""
        last = self.n - 1
        self.reqs[i].batch_index = -1
        if i != last:
            moved = self.reqs[last]
            self.reqs[i] = moved
            moved.batch_index = i
            for a in (self.rows, self.pos, self.seq_lens, self.slots, self.block_tables,
                      self.temperature, self.top_k, self.seed, self.left, self.dest, self.stop, self.rid):
                a[i] = a[last]
        self.reqs[last] = None
        self.n = last

    def step_rows(self) -> DecodeRows:
        """The next decode step's rows: views, valid until the batch changes."""
        n = self.n
        return DecodeRows(self.rows[:n], self.pos[:n], self.seq_lens[:n], self.slots[:n],
                          self.block_tables[:n], self.rows[:n], self.temperature[:n],
                          self.top_k[:n], self.seed[:n])

    def advance(self, n: int) -> np.ndarray:
        """Entries [0, n) launched one token: move them one position on. Returns the indices
        whose last token that was (ascending)."""
        pos, slots = self.pos[:n], self.slots[:n]
        pos += 1
        self.seq_lens[:n] += 1
        slots += 1
        self.dest[:n] += 1
        left = self.left[:n]
        left -= 1
        # Into a new KV block (an entry that launched its last token has no next position).
        crossed = np.flatnonzero((pos % self.block_size == 0) & (left > 0))
        if crossed.size:
            slots[crossed] = kv_slot(self.block_tables[crossed], pos[crossed], self.block_size)
        return np.flatnonzero(left == 0)
