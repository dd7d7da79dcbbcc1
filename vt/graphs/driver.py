"""DecodeGraphDriver: decode steps of any forward as captured graphs, one SlotRing per size.

The step is a StepHalves (vt/graphs/capture.py): `forward(stream, inputs, logits_out)`, which
only launches work (capturable: no host sync, no allocation outside the backend's pool),
reads its per-step inputs from `inputs` (DecodeInputs, device arrays) and writes
`logits_out` [S, vocab] f32, and `sample(stream, logits, inputs, out_tokens)`, the sampler
writing `out_tokens` [S]; each slot captures them as two graphs. Scheduling (drain, token readback) is the
runner's job; eager steps are vt/executor/eager.py's.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from vt.backend.errors import ClosedError
from vt.graphs.capture import StepHalves, capture_slot, logits_nbytes, warm_up
from vt.graphs.slot import SizeSlot, SlotRing
from vt.step.contract import PadRow
from vt.backend.timing import timed_ms
from vt.hooks import NULL_HOOKS, ExecutorHooks
from vt.validate import integer

MAX_SLOTS_PER_SIZE = 2   # a depth-2 pipeline has at most two steps in flight (vt/config.py)


@dataclass(frozen=True)
class GraphSettings:
    """What the driver needs to know of the executor's configuration (ExecutorConfig's
    properties of the same names)."""
    sizes: tuple[int, ...]        # padded batch sizes that get graphs, ascending
    slots_per_size: int           # k: 2 with the ring, 1 otherwise
    guarded: bool                 # acquire waits on the slot's event (the ring)
    staged: bool                  # the staged H2D: out-of-graph copy, one graph per size

    def __post_init__(self):
        integer("GraphSettings.slots_per_size", self.slots_per_size, 1, MAX_SLOTS_PER_SIZE)
        for s in self.sizes:
            integer("GraphSettings.sizes entry", s, 1)


class DecodeGraphDriver:
    """Captures every size, picks the padded size of a step and hands out its next slot.
    `hooks` (vt.hooks): the pool pre-grow goes through hooks.pre_grow_pool."""

    def __init__(self, be, stream, step: StepHalves, *, vocab: int, max_blocks: int, pad: PadRow,
                 settings: GraphSettings, hooks: ExecutorHooks = NULL_HOOKS):
        self.be, self.stream, self.step = be, stream, step
        self.vocab = integer("DecodeGraphDriver.vocab", vocab, 2)
        self.max_blocks = integer("DecodeGraphDriver.max_blocks", max_blocks, 1)
        self.pad, self.settings, self.hooks = pad, settings, hooks
        self.sizes = tuple(settings.sizes)
        self.rings: dict[int, SlotRing] = {}
        self._ring_by_rows: list[SlotRing | None] = []   # [n] -> the ring of padded_size(n)
        self._closed = False

    def capture(self, progress=None) -> None:
        """Warm up, pre-grow and capture every size, largest first (see capture.py).
        progress(done, total, detail): called before the first graph and after each."""
        self._check_open()
        st = self.settings
        per_size = 1 if st.staged else st.slots_per_size
        total, done = per_size * len(self.sizes), 0
        if progress is not None:
            progress(0, total)
        for size in sorted(self.sizes, reverse=True):
            first = SizeSlot(self.be, size, 0, self.max_blocks, self.pad, staged=st.staged)
            slots = [first] + [SizeSlot(self.be, size, i, self.max_blocks, self.pad,
                                        staged=st.staged, shared=first if st.staged else None)
                               for i in range(1, st.slots_per_size)]
            self.rings[size] = SlotRing(slots, guarded=st.guarded)   # close() frees it on failure
            warm_up(self.be, self.stream, self.step, first, self.vocab)
            self.hooks.pre_grow_pool(self.be.pool, logits_nbytes(size, self.vocab), per_size)
            for i in range(per_size):
                out = capture_slot(self.be, self.stream, self.step, slots[i], self.vocab,
                                   staged=st.staged)
                for slot in (slots if st.staged else [slots[i]]):
                    slot.output = out   # owned by the ring from here: close() frees it
                done += 1
                if progress is not None:
                    progress(done, total, f"size {size}" + (f", slot {i}" if per_size > 1 else ""))
        # A list lookup per step instead of a bisect (the step's host path is a few µs)
        top = max(self.rings, default=0)
        self._ring_by_rows = [self.rings.get(self.padded_size(n)) for n in range(top + 1)]

    def padded_size(self, n: int) -> int | None:
        """Smallest captured size >= n, or None (eager) above the largest."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) and self.sizes[i] in self.rings else None

    def ring_for(self, n: int) -> SlotRing | None:
        """The ring that serves a batch of n rows (None: eager, or not captured yet)."""
        return self._ring_by_rows[n] if n < len(self._ring_by_rows) else None

    def ceiling_us(self, n: int, replays: int) -> float:
        """µs per replay of the decode graph for n rows, back to back with no host work, timed
        with events. It replays ceiling_slot(n)'s last real step (the fullest of the size's
        last steps, its attention as long as that step's); a size that never ran gets an
        all-padding block (writes only scratch). Between steps only (it waits for the stream
        first): it rewrites the KV entries and token-table rows of finished requests, which a
        new request's prefill overwrites before reading."""
        self._check_open()
        slot = self.ceiling_slot(n)
        self.stream.synchronize()
        if slot.last_index < 0:
            slot.write_padding()
        # the replays repeat that step, so the slot's record (index, rows) stays that step's
        index, rows = slot.last_index, slot.last_rows
        ms = timed_ms(self.be, self.stream, lambda: slot.launch(self.stream, rows, index),
                      replays, 1, warmup=1)
        slot.collected(index)     # timed_ms waited for every replay
        return ms * 1e3

    def ceiling_slot(self, n: int) -> SizeSlot:
        """The slot ceiling_us(n) replays: of the padded size's ring, the slot whose last step
        had the most real rows (the later step on a tie). Each slot keeps its own last step's
        inputs, and a run's very last step may carry fewer rows than the one before it (its
        requests need not all end on one step)."""
        size = self.padded_size(n)
        if size is None:
            raise ValueError(f"no captured graph serves {n} rows (sizes {self.sizes})")
        return max(self.rings[size].slots, key=lambda s: (s.last_rows, s.last_index))

    def close(self) -> None:
        """Graphs and events first, then the buffers (dropped to the pool)."""
        if self._closed:
            return
        self._closed = True
        for ring in self.rings.values():
            ring.close()
        self.rings.clear()
        self._ring_by_rows = []

    def _check_open(self):
        if self._closed:
            raise ClosedError("DecodeGraphDriver is closed")
