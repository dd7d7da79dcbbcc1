"""SizeSlot and SlotRing: what keeps Refresh(N+1) from writing host vectors Replay(N) has not
read yet (the host-overwrite hazard, docs/design.md).

A step on a slot, graph step or a mixed step's decode rows alike: `ring.acquire()` (the
guard), `slot.write(rows)` (the refresh), `slot.launch(stream, n, index)` (one graph launch;
or its two halves, `launch_forward` then `launch_sampler`, with host work queued between
them), and once the host saw it done, `slot.collected(index)`."""
from __future__ import annotations

import numpy as np

from vt.graphs.logits import ForwardLogits, GraphOutput
from vt.step.contract import RECORD_WORDS, PadRow
from vt.step.inputblock import InputBlock
from vt.backend.waits import wait_event


class SizeSlot:
    """One ring position of one padded size: the pinned input block, its device twin, the
    graph (with its retained logits), the pinned tokens it returns and the events that say
    when the host may write the block again and when the step is done.

    H2D in the graph: the graph's own H2D node reads `host` AT REPLAY, so `host` is busy until
    the replay has run (`done`).
    Staged H2D: slots of one size share `device`, `out_device` and `output`; the out-of-graph
    copy reads `host`, so `host` is busy until that copy has run (`staged_read`).
    """

    def __init__(self, be, size: int, index: int, max_blocks: int, pad: PadRow, *, staged: bool,
                 shared: "SizeSlot | None" = None):
        self.be, self.size, self.index, self.pad, self.staged = be, size, index, pad, staged
        self.name = f"S={size} slot={index}"
        self.host = InputBlock(be.pinned_empty, size, max_blocks)
        self.device = shared.device if shared else InputBlock(be.empty, size, max_blocks)
        # [S, RECORD_WORDS]: each row's token and the logprobs it asks for (vt/sampling/logprobs.py)
        self.out_device = shared.out_device if shared else be.empty((size, RECORD_WORDS), np.int32)
        self.out_host = be.pinned_empty((size, RECORD_WORDS), np.int32)   # this slot's records
        self.output: GraphOutput | None = None
        # Blocking sync: the host sleeps in the driver instead of spinning a core (docs/design.md:
        # 0.5 ms of CPU against 202 ms for a 200 ms wait).
        self.done = be.event(blocking_sync=True)
        self.staged_read = be.event(blocking_sync=True) if staged else None
        # True once the host saw this slot's last step done (collected()): the next acquire
        # then needs no event query at all (with k slots that is the usual case).
        self.idle = True
        self.last_index = -1   # the runner's index of the last step launched on this slot
        self.last_rows = 0     # that step's real rows (the rest of the block is padding)

    def wait_reusable(self, poll_s: float = 0.0) -> float:
        """Block until the device no longer reads the host block; seconds waited (0: free)."""
        if self.idle:
            return 0.0
        return wait_event(self.staged_read or self.done, poll_s)

    def write(self, rows) -> None:
        """Refresh: the step's rows (DecodeRows, or anything with write_into(block, pad))
        into the host block, the tail padded. Only once the guard (or the drain) passed."""
        rows.write_into(self.host, self.pad)

    def write_padding(self) -> None:
        """Every row of the host block redirected to the scratch row: a replay of it writes
        only scratch."""
        self.host.poison(self.pad)

    def launch(self, stream, n: int, index: int) -> ForwardLogits:
        """Replay step `index` (the runner's count) on `stream`, in one graph launch (the
        output's whole step); `done` completes once the tokens are in out_host (graph mode:
        the step graph's last node records it; staged: recorded after the copies). The
        returned view is valid until this slot's next launch."""
        self._inputs_in(stream, n, index)
        gen = self.output.launch(stream)
        self._tokens_out(stream)
        return ForwardLogits(self.output.logits, n, self.output, gen)

    def launch_forward(self, stream, n: int, index: int) -> ForwardLogits:
        """launch() in two: this half, the inputs' H2D and the forward graph; work the host
        queues on `stream` before launch_sampler() runs after the forward and before the
        sampler."""
        self._inputs_in(stream, n, index)
        gen = self.output.launch_forward(stream)
        return ForwardLogits(self.output.logits, n, self.output, gen)

    def launch_sampler(self, stream) -> None:
        """The second half of a split launch: the sampler graph, the tokens' D2H and `done`."""
        self.output.launch_sampler(stream)
        self._tokens_out(stream)

    def copy_tokens(self, dst, stream) -> None:
        """The last launch's token records [len(dst)] into the device array `dst`, on
        `stream` (a mixed step gathers its decode rows' tokens with its prefill's)."""
        self.be.copy_d2d(dst, self.out_device[:len(dst)], stream)

    def collected(self, index: int) -> None:
        """The host saw step `index` done: if it is still this slot's last step, the slot is
        idle and its next acquire waits for nothing."""
        if self.last_index == index:
            self.idle = True

    def close(self):
        for ev in (self.done, self.staged_read):
            if ev is not None:
                ev.close()
        self.output = None   # the ring closes outputs: staged slots share one

    def _inputs_in(self, stream, n: int, index: int) -> None:
        """What comes before the forward: the slot's record of the step and, staged, the
        out-of-graph H2D (the graph reads the inputs itself otherwise)."""
        self.idle, self.last_index, self.last_rows = False, index, n
        if self.staged:
            self.host.copy_to(self.be, self.device, stream)
            self.staged_read.record(stream)

    def _tokens_out(self, stream) -> None:
        """What comes after the sampler, staged: the tokens' D2H and `done` (in the graph
        otherwise)."""
        if self.staged:
            self.be.copy_d2h(self.out_host, self.out_device, stream)
            self.done.record(stream)


class SlotRing:
    """k SizeSlots of one size used in turn. With `guarded`, acquiring a slot first waits on
    its event, so the host never rewrites a block a queued replay will still read. Unguarded
    (k=1) is the drain path, whose drain protects the slot, or the unguarded mode, the unsafe
    arm."""

    def __init__(self, slots: list[SizeSlot], guarded: bool):
        self.slots, self.guarded, self._next = slots, guarded, 0

    def peek(self) -> SizeSlot:
        """The slot the next acquire returns."""
        return self.slots[self._next]

    def acquire(self, poll_s: float = 0.0) -> tuple[SizeSlot, float]:
        slot = self.slots[self._next]
        self._next = (self._next + 1) % len(self.slots)
        return slot, (slot.wait_reusable(poll_s) if self.guarded else 0.0)

    def close(self):
        outputs = {id(s.output): s.output for s in self.slots if s.output is not None}
        for s in self.slots:
            s.close()
        for out in outputs.values():
            out.close()
