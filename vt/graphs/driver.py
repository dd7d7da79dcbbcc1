"""DecodeGraphDriver: decode steps of any forward as captured graphs, one SlotRing per size.

The forward is any callable `forward(stream, inputs: DecodeInputs, logits_out)` that only
launches work (capturable: no host sync, no allocation outside the backend's pool), reads
its per-step inputs from `inputs` (device arrays) and writes `logits_out` [S, vocab] f32.
The bundled model's `decode` is one such callable; a user-written one is another.
"""
from __future__ import annotations

import bisect

from vt.backend.errors import ClosedError
from vt.graphs.capture import LOGITS_DTYPE, capture_slot, logits_nbytes, warm_up
from vt.graphs.inputs import DecodeInputs, DecodeRows, PadRow, allocate_inputs, copy_inputs_h2d, fill_host
from vt.graphs.logits import ForwardLogits
from vt.graphs.slot import SizeSlot, SlotRing


class DecodeGraphDriver:
    """Picks the padded size, refreshes and launches a slot, or runs eagerly above the largest
    captured size. Scheduling (drain, poison, token readback) is the runner's job."""

    def __init__(self, be, stream, forward, *, vocab: int, max_blocks: int, pad: PadRow,
                 config, eager_capacity: int):
        self.be, self.stream, self.forward = be, stream, forward
        self.vocab, self.max_blocks, self.pad, self.config = vocab, max_blocks, pad, config
        self.sizes = tuple(config.capture_sizes)
        self.rings: dict[int, SlotRing] = {}
        # Eager steps own their logits and always drain, so one staging area is enough: the
        # next eager Refresh happens after the drain that waited for this one's copy. Two
        # regions of eager_capacity rows: a mixed step stages its padded decode rows in the
        # first and its prefill rows (for sampling) in the second.
        self.eager_capacity = max(eager_capacity, max(self.sizes, default=0))
        self._eager_host = allocate_inputs(be.pinned_empty, 2 * self.eager_capacity, max_blocks)
        self._eager_device = allocate_inputs(be.empty, 2 * self.eager_capacity, max_blocks)
        self._closed = False

    # -- set-up -------------------------------------------------------------------------
    def capture(self) -> None:
        """Warm up, pre-grow and capture every size, largest first (see capture.py)."""
        self._check_open()
        k, staged = self.config.slots_per_size, self.config.h2d == "staged"
        for size in sorted(self.sizes, reverse=True):
            shared = allocate_inputs(self.be.empty, size, self.max_blocks) if staged else None
            slots = [SizeSlot(self.be, size, i, self.max_blocks, staged=staged,
                              inputs_read=self.config.inputs_read_event, device=shared)
                     for i in range(k)]
            ring = SlotRing(slots, guarded=self.config.async_executor)
            self.rings[size] = ring   # registered first so close() frees it if a capture fails
            warm_up(self.be, self.stream, self.forward, slots[0], self.vocab, self.pad)
            graphs = 1 if staged else k
            if not self.config.skip_pool_reserve:
                self.be.pool.reserve(logits_nbytes(size, self.vocab), count=graphs)
            for i in range(graphs):
                out = capture_slot(self.be, self.stream, self.forward, slots[i], self.vocab,
                                   staged=staged)
                for slot in (slots if staged else [slots[i]]):
                    slot.output = out   # owned by the ring from here: close() frees it

    # -- per step -----------------------------------------------------------------------
    def padded_size(self, n: int) -> int | None:
        """Smallest captured size >= n, or None (eager) above the largest."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) and self.sizes[i] in self.rings else None

    def acquire(self, n: int) -> tuple[SizeSlot | None, float]:
        """The slot for a batch of n rows (None: eager) and the seconds its guard waited."""
        self._check_open()
        size = self.padded_size(n)
        return (None, 0.0) if size is None else self.rings[size].acquire()

    def launch_graph(self, slot: SizeSlot, rows: DecodeRows) -> ForwardLogits:
        """Refresh the slot's host vectors and replay it."""
        self.refresh(slot, rows)
        return self.replay(slot, len(rows))

    def refresh(self, slot: SizeSlot, rows: DecodeRows) -> None:
        """Write the step's rows (tail padded) into the slot's pinned vectors."""
        slot.refresh(rows, self.pad)

    def replay(self, slot: SizeSlot, n: int) -> ForwardLogits:
        """Replay the slot's graph; its first `n` logits rows are the real ones."""
        return slot.launch(self.stream, n)

    def stage_eager(self, rows: DecodeRows, size: int | None = None, *,
                    region: int = 0) -> DecodeInputs:
        """Copy rows into the eager device buffers (out of graph), the tail padded up to `size`
        rows (default len(rows)); returns the [size] views. region 0 or 1 (see __init__)."""
        self._check_open()
        n = len(rows)
        size = n if size is None else size
        if not n <= size <= self.eager_capacity:
            raise ValueError(f"an eager step of {n} rows padded to {size} exceeds the eager "
                             f"capacity {self.eager_capacity} (max_seqs)")
        start = region * self.eager_capacity
        host, dev = self._eager_host.rows(start, start + size), self._eager_device.rows(start, start + size)
        fill_host(host, rows, self.pad)
        copy_inputs_h2d(self.be, dev, host, self.stream)
        return dev

    def decode_bucket(self, n: int) -> int:
        """Rows an eager decode of n rows runs at: the padded captured size, else the eager
        capacity. A fixed set of shapes, so warming each once (Runner.warm_up) covers every
        later eager step's temporaries and serving never grows the pool."""
        size = self.padded_size(n)
        return self.eager_capacity if size is None else size

    def decode_buckets(self) -> list[int]:
        return sorted(set(self.rings) | {self.eager_capacity})

    def launch_eager(self, inputs: DecodeInputs, logits_out) -> None:
        """The forward, launched directly (no graph) into logits the caller owns."""
        self.forward(self.stream, inputs, logits_out)

    def new_logits(self, n: int):
        return self.be.empty((n, self.vocab), LOGITS_DTYPE)   # [n, vocab], owned by the step

    def next_slot(self, slot: SizeSlot) -> SizeSlot:
        """The slot the next step of this size will use (slot itself without the ring)."""
        return self.rings[slot.size].peek()

    # -- teardown -----------------------------------------------------------------------
    def close(self) -> None:
        """Graphs and events first, then the buffers (dropped to the pool)."""
        if self._closed:
            return
        self._closed = True
        for ring in self.rings.values():
            ring.close()
        self.rings.clear()
        self._eager_host = self._eager_device = None

    def _check_open(self):
        if self._closed:
            raise ClosedError("DecodeGraphDriver is closed")
