"""InputBlock: every per-step vector of S rows in ONE contiguous buffer.

The host twin is pinned memory, the device twin pool memory, and a step's inputs travel in
one copy (one H2D node inside a graph, or one staged memcpy); refreshing the host twin is a
few numpy slice writes. Layout, in int32 words (seed first: its uint64 view stays 8-byte
aligned): seed[2S] | token_rows | positions | seq_lens | slot_mapping | state_idx | top_k |
logprobs | penalized | temperature | top_p | min_p | presence_penalty | frequency_penalty |
repetition_penalty (the last six f32 bits) | block_tables[S * max_blocks].
"""
from __future__ import annotations

import numpy as np

from vt.sampling.params import NO_LOGPROBS
from vt.step.contract import FIELDS, DecodeInputs, DecodeRows, PadRow

# positions, seq_lens, slot_mapping adjacent and in this order: InputBlock.advancing
_PER_ROW = ("token_rows", "positions", "seq_lens", "slot_mapping", "state_idx", "top_k", "logprobs",
            "penalized", "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty")
_F32 = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
# What a row without logprobs, penalties or bias holds (a DecodeRows without those vectors).
_PLAIN = {"logprobs": NO_LOGPROBS, "penalized": 0, "presence_penalty": 0, "frequency_penalty": 0,
          "repetition_penalty": 1}


class InputBlock:
    """`alloc(shape, dtype)` gives the buffer (be.pinned_empty or be.empty); `inputs` are the
    DecodeInputs views into it."""

    def __init__(self, alloc, size: int, max_blocks: int):
        self.size, self.max_blocks = size, max_blocks
        self.raw = alloc((size * (2 + len(_PER_ROW) + max_blocks),), np.int32)
        views, at = {"seed": self.raw[:2 * size].view(np.uint64)}, 2 * size
        for f in _PER_ROW:
            views[f] = self.raw[at:at + size]
            at += size
        for f in _F32:
            views[f] = views[f].view(np.float32)
        views["block_tables"] = self.raw[at:].reshape(size, max_blocks)
        self.inputs = DecodeInputs(**views)
        # positions | seq_lens | slot_mapping as one [3, S] view: the vectors a decode step
        # advances, written with one numpy call (vt/engine/batch.py)
        p0 = 2 * size + _PER_ROW.index("positions") * size
        self.advancing = self.raw[p0:p0 + 3 * size].reshape(3, size)
        self._padded_from: int | None = None   # rows [n:] hold the pad row since the last fill
        self.filled = None   # what BatchStep.write_into last wrote; None: unknown
        self.step_views = None   # a fast fill's cached [:n] views (it owns their meaning)

    def fill(self, rows: DecodeRows, pad: PadRow) -> None:
        """Write the step's rows into [:n] and pad the tail (host twin only). The engine's
        batch writes itself instead (BatchStep.write_into), faster."""
        n = len(rows)
        if n > self.size:
            raise ValueError(f"{n} rows do not fit an input block of {self.size} rows")
        self.filled = None
        self._write(0, rows)
        if self._padded_from != n:            # the tail only changes when n does
            self.pad_from(n, pad)

    def fill_range(self, start: int, rows: DecodeRows, stop: int, pad: PadRow) -> None:
        """Rows into [start, start + n), padding up to `stop` (a block holding several steps)."""
        self._write(start, rows)
        self.pad_from(start + len(rows), pad, stop)
        self._padded_from = self.filled = None

    def pad_from(self, start: int, pad: PadRow, stop: int | None = None) -> None:
        """Rows [start:stop] point at the scratch row and sample greedily."""
        inp, span = self.inputs, slice(start, stop)
        inp.token_rows[span] = pad.token_row
        inp.positions[span] = pad.position
        inp.seq_lens[span] = pad.seq_len
        inp.slot_mapping[span] = pad.slot
        inp.block_tables[span] = pad.block
        inp.state_idx[span] = pad.state_idx
        _greedy(inp, span)
        self._padded_from = start

    def poison(self, pad: PadRow) -> None:
        """Redirect every row to the scratch row. In range on purpose: a replay that reads the
        poison computes wrong rows (detectable) instead of faulting the device."""
        self.pad_from(0, pad)
        self._padded_from = self.filled = None   # the next fill rewrites everything

    def copy_to(self, be, dst: "InputBlock", stream, *, mapped: bool = False) -> None:
        """One async copy of the whole block (H2D; captured when the stream captures).
        mapped: a kernel reads the pinned block instead of a memcpy (the graph's form: see
        be.copy_h2d_mapped)."""
        (be.copy_h2d_mapped if mapped else be.copy_h2d)(dst.raw, self.raw, stream)

    def copy_rows_to(self, be, dst: "InputBlock", stream, n: int) -> None:
        """Rows [:n] of every vector, one copy each: for big blocks used partly (eager)."""
        for f in FIELDS:
            be.copy_h2d(getattr(dst.inputs, f)[:n], getattr(self.inputs, f)[:n], stream)

    def _write(self, start: int, rows: DecodeRows) -> None:
        n, inp = len(rows), self.inputs
        for f in FIELDS:
            value = getattr(rows, f)
            if value is not None:
                getattr(inp, f)[start:start + n] = value
        if rows.temperature is None:          # no sampling given: greedy
            _greedy(inp, slice(start, start + n))
        else:
            for f, value in _PLAIN.items():
                if getattr(rows, f) is None:
                    getattr(inp, f)[start:start + n] = value


def _greedy(inp, span) -> None:
    """Rows `span` sample greedily (the other knobs are then unused; set for determinism)."""
    inp.temperature[span] = 0
    inp.top_k[span] = 0
    inp.top_p[span] = 1
    inp.min_p[span] = 0
    inp.seed[span] = 0
    for f, value in _PLAIN.items():
        getattr(inp, f)[span] = value
