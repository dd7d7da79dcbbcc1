"""Capture with pool warm-up: the order that lets every capture run without a driver malloc.

Per size, largest first (nano-vllm's order; the arena then only grows once):
  1. warm-up: one eager forward under `pool.scratch_warmup`, so the shared scratch arena is
     sized for the forward's temporaries; its eager logits block returns to the pool;
  2. pre-grow: `pool.reserve(logits_bytes, count=k)`, one retained block per slot;
  3. capture each slot; the retained [S, vocab] block is allocated INSIDE the capture, so
     it is the graph's output and is served from the blocks pre-grown in 2.
Skipping 2 with the ring on: slot 0 gets the block the warm-up returned, slot 1 finds no
free block and the pool raises CaptureAllocationError (the test of the pre-grow).
"""
from __future__ import annotations

import numpy as np

from vt.graphs.inputs import copy_inputs_h2d, poison_host
from vt.graphs.logits import GraphOutput

LOGITS_DTYPE = np.float32


def logits_nbytes(size: int, vocab: int) -> int:
    return size * vocab * np.dtype(LOGITS_DTYPE).itemsize


def warm_up(be, stream, forward, slot, vocab: int, pad) -> None:
    """Eager forward of an all-padding batch (writes only scratch rows), then wait."""
    poison_host(slot.host, pad)
    copy_inputs_h2d(be, slot.device, slot.host, stream)
    logits = be.empty((slot.size, vocab), LOGITS_DTYPE)   # [S, vocab], outside the scratch count
    with be.pool.scratch_warmup(f"warm-up {slot.name}"):
        forward(stream, slot.device, logits)
        stream.synchronize()
    del logits   # back to the pool's free list: the first capture of this size may take it


def capture_slot(be, stream, forward, slot, vocab: int, *, staged: bool) -> GraphOutput:
    """Capture one slot's graph: [H2D nodes, inputs-read event,] forward -> retained logits."""
    with be.capture(stream, name=slot.name) as cap:
        if not staged:
            # Baked H2D: every replay re-reads slot.host when these nodes run (hazard-C).
            copy_inputs_h2d(be, slot.device, slot.host, stream)
            if slot.inputs_read_event is not None:
                slot.inputs_read_event.record(stream, external=True)
        logits = be.empty((slot.size, vocab), LOGITS_DTYPE, retained=True)   # [S, vocab]
        forward(stream, slot.device, logits)
    graph = cap.graph
    graph.upload(stream)
    return GraphOutput(graph, logits, slot.name)
