"""SizeSlot and SlotRing: what keeps Refresh(N+1) from writing host vectors Replay(N) has not
read yet (hazard-C, DESIGN.md)."""
from __future__ import annotations

import time

from vt.graphs.inputs import DecodeInputs, PadRow, allocate_inputs, copy_inputs_h2d, fill_host, poison_host
from vt.graphs.logits import ForwardLogits, GraphOutput


class SizeSlot:
    """One ring position of one padded size: pinned host vectors, their device twins, the
    graph (with its retained logits) and the events that say when the host may write again.

    h2d="graph": the graph's own H2D nodes read `host` AT REPLAY, so `host` is busy until the
    replay has run (reuse_event, or inputs_read_event right after the H2D nodes).
    h2d="staged": slots of one size share `device` and `output`; the out-of-graph copy reads
    `host`, so `host` is busy until that copy has run (reuse_event is recorded after it).
    """

    def __init__(self, be, size: int, index: int, max_blocks: int, *, staged: bool,
                 inputs_read: bool, device: DecodeInputs | None = None):
        self.be, self.size, self.index, self.staged = be, size, index, staged
        self.name = f"S={size} slot={index}"
        self.host = allocate_inputs(be.pinned_empty, size, max_blocks)
        self.device = device if device is not None else allocate_inputs(be.empty, size, max_blocks)
        self.output: GraphOutput | None = None
        # Blocking sync: the host sleeps in the driver instead of spinning a core (DESIGN.md
        # measured 0.5 ms CPU vs 202 ms for a 200 ms wait).
        self.reuse_event = be.event(blocking_sync=True)
        self.inputs_read_event = be.event(blocking_sync=True) if inputs_read else None

    @property
    def generation(self) -> int:
        return self.output.generation if self.output is not None else 0

    def wait_reusable(self) -> float:
        """Block until the host vectors are no longer read by the device; seconds waited."""
        ev = self.inputs_read_event or self.reuse_event
        if ev.query():
            return 0.0
        t0 = time.perf_counter()
        ev.synchronize()
        return time.perf_counter() - t0

    def refresh(self, rows, pad: PadRow) -> None:
        fill_host(self.host, rows, pad)

    def poison(self, pad: PadRow) -> None:
        poison_host(self.host, pad)

    def launch(self, stream, n: int) -> ForwardLogits:
        """Replay on `stream`; the returned view is valid until this graph's next launch."""
        if self.staged:
            copy_inputs_h2d(self.be, self.device, self.host, stream)
            self.reuse_event.record(stream)
            gen = self.output.launch(stream)
        else:
            gen = self.output.launch(stream)
            self.reuse_event.record(stream)
        return ForwardLogits(self.output.logits, n, output=self.output, generation=gen)

    def close(self):
        for ev in (self.reuse_event, self.inputs_read_event):
            if ev is not None:
                ev.close()
        self.output = None   # the ring closes outputs: staged slots share one


class SlotRing:
    """k SizeSlots of one size used in turn. With `guarded`, acquiring a slot first waits on
    its event, so the host never rewrites vectors a queued replay will still read. Unguarded
    (k=1) is the OFF path, whose drain protects the slot, or NO_DBUF, the unsafe arm."""

    def __init__(self, slots: list[SizeSlot], guarded: bool):
        self.slots, self.guarded, self._next = slots, guarded, 0

    def peek(self) -> SizeSlot:
        """The slot the next acquire returns."""
        return self.slots[self._next]

    def acquire(self) -> tuple[SizeSlot, float]:
        slot = self.slots[self._next]
        self._next = (self._next + 1) % len(self.slots)
        return slot, (slot.wait_reusable() if self.guarded else 0.0)

    def close(self):
        outputs = {id(s.output): s.output for s in self.slots if s.output is not None}
        for s in self.slots:
            s.close()
        for out in outputs.values():
            out.close()
