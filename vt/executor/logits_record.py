"""record_logits=True (a test and debug option): every step's logits copied to the host."""
from __future__ import annotations

from vt.step.contract import LOGITS_DTYPE


class LogitsRecord:
    """Two pinned [capacity, vocab] blocks used in turn (two steps may be in flight), each
    with its own event: a recorded step's `done` becomes the event after its copy, so the host
    reads the logits once it saw the step done."""

    def __init__(self, be, stream, capacity: int, vocab: int):
        self.be, self.stream = be, stream
        self._blocks = [be.pinned_empty((capacity, vocab), LOGITS_DTYPE) for _ in range(2)]
        self._done = [be.event(blocking_sync=True) for _ in range(2)]

    def record(self, handle) -> None:
        """Copy `handle`'s logits [n, vocab] into handle.host_logits after the step."""
        parity = handle.index % 2
        handle.host_logits = self._blocks[parity][:handle.n]
        self.be.copy_d2h(handle.host_logits, handle.logits.rows, self.stream)
        handle.done = self._done[parity]
        handle.done.record(self.stream)

    def close(self) -> None:
        for ev in self._done:
            ev.close()
