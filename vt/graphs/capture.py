"""Capture with pool warm-up: the order that lets every capture run without a driver malloc.

Per size, largest first (the scratch arena then only grows once):
  1. warm-up: one eager step under `pool.scratch_warmup`, so the shared scratch arena is
     sized for the forward's and the sampler's temporaries; its logits block returns to the pool;
  2. pre-grow: `pool.reserve(logits_bytes, count=k)`, one retained block per slot;
  3. capture each slot; the retained [S, vocab] block is allocated INSIDE the capture, so
     it is the graph's output and is served from the blocks pre-grown in 2.
Skipping 2 with the ring on (vt.hooks.NoPoolPreGrow): slot 0 gets the block the warm-up
returned, slot 1 finds no free block and the pool raises CaptureAllocationError (the test of
the pre-grow).

A captured step is the whole decode step as two graphs: the forward graph ([the input
block's H2D,] the forward, into the retained logits) and the sampler graph (the sampler,
which also feeds the token table, [the tokens' D2H into the slot's pinned output, the
slot's done event]). The bracketed parts are outside the graphs in staged mode. Two graphs,
so that the host can queue work between the halves of one step (a grammar's masks for the
sampler, built while the forward runs: vt/engine/serving.py). A third graph joins them
(be.join_graphs: two child-graph nodes, nothing captured again), so that a step with
nothing to queue between its halves, the usual one, is one graph launch, not two: one
driver call less on the host and no gap between two dependent graphs on the device.
Inside the graph both copies are kernels that read or write the pinned buffers
directly (be.copy_h2d_mapped / copy_d2h_mapped): with no memcpy node, launching the graph
costs the host ~3.7 µs less (docs/design.md).
"""
from __future__ import annotations

import numpy as np

from dataclasses import dataclass
from typing import Callable

from vt.graphs.logits import GraphOutput
from vt.step.contract import LOGITS_DTYPE


@dataclass(frozen=True)
class StepHalves:
    """The decode step a slot captures, in its two halves: forward(stream, inputs, logits)
    writes logits [S, vocab] from the step's inputs (DecodeInputs), sample(stream, logits,
    inputs, out_tokens) samples them into out_tokens and the token table."""
    forward: Callable
    sample: Callable


def logits_nbytes(size: int, vocab: int) -> int:
    return size * vocab * np.dtype(LOGITS_DTYPE).itemsize


def warm_up(be, stream, step: StepHalves, slot, vocab: int) -> None:
    """One eager step of an all-padding batch (writes only scratch rows), then wait."""
    slot.write_padding()
    # The input copy as the captured step makes it: in graph mode a kernel, whose module is
    # then loaded here and not inside the capture.
    slot.host.copy_to(be, slot.device, stream, mapped=not slot.staged)
    logits = be.empty((slot.size, vocab), LOGITS_DTYPE)   # [S, vocab], outside the scratch count
    with be.pool.scratch_warmup(f"warm-up {slot.name}"):
        step.forward(stream, slot.device.inputs, logits)
        step.sample(stream, logits, slot.device.inputs, slot.out_device)
        stream.synchronize()
    del logits   # back to the pool's free list: the first capture of this size may take it


def capture_slot(be, stream, step: StepHalves, slot, vocab: int, *, staged: bool) -> GraphOutput:
    """Capture one slot's decode step (see the module docstring) into a GraphOutput."""
    with be.capture(stream, name=f"{slot.name} forward") as cap:
        if not staged:
            # Baked H2D: every replay re-reads slot.host when this node runs (the host-overwrite
            # hazard). A kernel reading the pinned block, not a memcpy node: the graph
            # launches faster.
            slot.host.copy_to(be, slot.device, stream, mapped=True)
        logits = be.empty((slot.size, vocab), LOGITS_DTYPE, retained=True)   # [S, vocab]
        step.forward(stream, slot.device.inputs, logits)
    forward = cap.graph
    with be.capture(stream, name=f"{slot.name} sampler") as cap:
        step.sample(stream, logits, slot.device.inputs, slot.out_device)
        if not staged:
            be.copy_d2h_mapped(slot.out_host, slot.out_device, stream)
            # `done` as the graph's last node: the sampler's launch is then one driver call,
            # not a launch and an event record (docs/design.md, launch cost).
            slot.done.record(stream, external=True)
    sampler = cap.graph
    whole = be.join_graphs(forward, sampler, name=f"{slot.name} step")
    for graph in (whole, forward, sampler):
        graph.upload(stream)
    return GraphOutput(forward, sampler, whole, logits, slot.name)


def capture_warmed(be, stream, launch, name: str):
    """Capture `launch()` (launches only) as a graph, uploaded, after one eager run of it under
    `pool.scratch_warmup` (so its temporaries fit the arena: no driver malloc in the capture).
    For work outside the decode slots: the bundled model's prefill buckets, the tools."""
    with be.pool.scratch_warmup(name):
        launch()
        stream.synchronize()
    with be.capture(stream, name=name) as cap:
        launch()
    graph = cap.graph
    graph.upload(stream)
    return graph
