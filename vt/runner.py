"""Runner: one step at a time, depth-2 async, with the drain and its skip.

Step N+1 is launched before the host reads step N's sampled tokens: the tokens reach the
next step through the model's device token table, and the host copies them into a pinned
buffer (one per pipeline parity) guarded by that step's done event, read one step late.

Before Refresh(N+1) the host drains (waits for step N) unless the skip applies: the
previous step's logits are a non-owning graph view AND the ring is on (safe: the slot's
reuse event guards the host vectors) or NO_DBUF is set (unsafe: nothing guards them).
Eager, mixed and prefill steps own their logits and always drain.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from vt.backend.errors import ClosedError
from vt.graphs import DecodeGraphDriver, DecodeRows, ForwardLogits
from vt.graphs.capture import LOGITS_DTYPE
from vt.stepmodel import PrefillSeq, decode_rows
from vt.trace import Tracer


@dataclass
class StepPlan:
    """What one step runs: decode rows of running sequences and/or prompts to prefill."""
    decode: DecodeRows | None = None
    prefill: list[PrefillSeq] = field(default_factory=list)
    tag: object = None   # the caller's row -> request mapping, handed back with the tokens

    @property
    def n(self) -> int:
        return (len(self.decode) if self.decode is not None else 0) + len(self.prefill)


@dataclass
class StepHandle:
    """A launched step. Its tokens are valid after Runner.collect()."""
    index: int
    kind: str                 # "graph" | "eager" | "mixed" | "prefill"
    n: int
    size: int                 # padded size (n for eager steps)
    logits: ForwardLogits
    tag: object
    parity: int
    timing: tuple | None
    host_logits: np.ndarray | None = None   # [n, vocab] when recorded; reused two steps later
    completed: bool = False   # the host has observed the done event


@dataclass
class RunnerStats:
    steps: int = 0
    graph_steps: int = 0
    eager_steps: int = 0      # pure decode above the largest captured size
    mixed_steps: int = 0      # prefill + decode
    prefill_steps: int = 0
    drains: int = 0
    drain_s: float = 0.0
    ring_waits: int = 0       # slot acquisitions that had to block on the reuse event
    ring_wait_s: float = 0.0
    token_waits: int = 0
    token_wait_s: float = 0.0
    host_launch_s: float = 0.0   # refresh + launch, per step summed
    device_ms: float = 0.0
    steps_by_size: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dict(self.__dict__, steps_by_size=dict(self.steps_by_size))


class Runner:
    """Launches steps of a step model (vt.stepmodel) through the graph driver."""

    def __init__(self, be, model, config, *, record_logits: bool = False, device_timing: bool = True):
        self.be, self.model, self.config = be, model, config
        self.stream = be.stream(name="vt-decode")
        geo = model.geometry
        self.capacity = max(geo.max_seqs, max(config.capture_sizes, default=0))
        self.driver = DecodeGraphDriver(be, self.stream, model.decode, vocab=model.vocab,
                                        max_blocks=geo.max_blocks, pad=model.pad, config=config,
                                        eager_capacity=self.capacity)
        self.tracer = Tracer(be, self.stream, config.trace)
        self.record_logits = record_logits
        self.stats = RunnerStats()
        # One device token buffer is enough (stream order); host copies need one per parity:
        # step N+1's copy may land before the host has read step N's.
        self._out_tokens = be.empty((self.capacity,), np.int32)
        self._tok_host = [be.pinned_empty((self.capacity,), np.int32) for _ in range(2)]
        self._done = [be.event(blocking_sync=True) for _ in range(2)]
        # Recorded logits go through pinned buffers allocated once, like the tokens: a pinned
        # allocation (and its free) per step would add driver calls that serialize the host.
        self._logits_host = ([be.pinned_empty((self.capacity, model.vocab), LOGITS_DTYPE)
                              for _ in range(2)] if record_logits else None)
        # Eager, mixed and prefill steps own their logits: three [capacity, vocab] blocks used
        # in turn, allocated once (at most depth + 1 are alive: the steps in flight and the one
        # being launched; a later user of a block is ordered after them on the stream).
        self._eager_logits = [be.empty((self.capacity, model.vocab), LOGITS_DTYPE) for _ in range(3)]
        self._eager_turn = 0
        self._timing = ([self._timing_pair() for _ in range(2)]
                        if device_timing or self.tracer.enabled else [None, None])
        self._last: StepHandle | None = None
        self._inflight: list[StepHandle] = []
        self._steps = 0
        self._closed = False

    def capture(self) -> None:
        """Capture every graph (warm-up, pre-grow and capture per size: vt/graphs/capture.py)."""
        self._check_open()
        self.driver.capture()

    def warm_up(self, max_prefill_tokens: int) -> None:
        """Run every eager shape once, so that serving never calls the driver afterwards.

        Eager steps run at a fixed set of shapes: decode rows padded to a captured size or the
        eager capacity (driver.decode_buckets), prefill padded by the step model to its own
        buckets (powers of two) for up to `max_prefill_tokens` prompt tokens per step. Every
        temporary dies when its launch returns and goes back to the pool (stream-ordered
        reuse), so once each shape ran, the pool's free blocks cover any later step.
        Cost: one eager forward per bucket: about log2 of the largest size, not one per size.
        """
        self._check_open()
        block = self._eager_logits[0]
        none = np.zeros(0, np.int32)
        empty = DecodeRows(none, none, none, none, np.zeros((0, self.driver.max_blocks), np.int32), none)
        for size in self.driver.decode_buckets():
            inputs = self.driver.stage_eager(empty, size)   # all padding: writes only scratch
            self.driver.launch_eager(inputs, block[:size])
            self.model.sample(self.stream, block[:size], inputs, self._out_tokens[:size], None)
            self.stream.synchronize()   # the staging area is reused by the next bucket
        warm = getattr(self.model, "warm_up_prefill", None)
        if warm is not None:
            warm(self.stream, max_prefill_tokens, block)
        self.stream.synchronize()

    # -- launch -------------------------------------------------------------------------
    def launch(self, plan: StepPlan, sampling=None) -> StepHandle:
        self._check_open()
        if plan.n == 0:
            raise ValueError("an empty step: nothing to decode or prefill")
        if plan.n > self.capacity:
            raise ValueError(f"a step of {plan.n} rows exceeds max_seqs={self.capacity}")
        if len(self._inflight) >= 2:
            raise RuntimeError(f"two steps ({[h.index for h in self._inflight]}) are launched and "
                               f"not collected; collect the oldest before launching (depth 2)")
        self._maybe_drain()
        t0 = time.perf_counter()
        parity = self._steps % 2
        slot = None
        if not plan.prefill:
            slot, waited = self.driver.acquire(plan.n)
            if waited:
                self.stats.ring_waits += 1
                self.stats.ring_wait_s += waited
                self.tracer.host_span("ring wait", t0, t0 + waited, slot=slot.name)
        t1 = time.perf_counter()
        timing = self._timing[parity]
        if timing is not None:
            timing[0].record(self.stream)
        if slot is not None:
            t_refresh = time.perf_counter()
            self.driver.refresh(slot, plan.decode)
            self.tracer.host_span("refresh", t_refresh, time.perf_counter(), step=self._steps,
                                  slot=slot.name)
            logits = self.driver.replay(slot, plan.n)
            kind, size = "graph", slot.size
            # Padded rows are sampled too (into the scratch row): one fixed shape per size.
            self.model.sample(self.stream, logits.array, slot.device, self._out_tokens[:size],
                              sampling)
        else:
            logits, kind = self._launch_eager(plan, sampling)
            size = plan.n
        handle = StepHandle(self._steps, kind, plan.n, size, logits, plan.tag, parity, timing)
        if self.record_logits:
            handle.host_logits = self._logits_host[parity][:plan.n]
            self.be.copy_d2h(handle.host_logits, logits.rows, self.stream)
        self.be.copy_d2h(self._tok_host[parity][:plan.n], self._out_tokens[:plan.n], self.stream)
        if timing is not None:
            timing[1].record(self.stream)
        self._done[parity].record(self.stream)
        t2 = time.perf_counter()
        self.tracer.host_span(f"launch {kind} S={size}", t1, t2, step=handle.index, n=plan.n,
                              slot=slot.name if slot is not None else None)
        if slot is not None and self.config.poison:
            self._poison_next(slot, handle)
        self._count(handle, t2 - t1)
        self._last = handle
        self._inflight.append(handle)
        self._steps += 1
        return handle

    def _launch_eager(self, plan: StepPlan, sampling):
        """Eager decode rows and/or prefill, sampled, into logits the step owns.

        Decode rows run padded to driver.decode_bucket and are sampled first; the prefill then
        writes its logits after them (rows [n_dec, n)), over the padded rows' logits, which
        the stream has already sampled: rows [:n] of the block are the step's logits.
        """
        n_dec = len(plan.decode) if plan.decode is not None else 0
        block = self._eager_logits[self._eager_turn % 3]   # [capacity, vocab]
        self._eager_turn += 1
        if n_dec:
            size = self.driver.decode_bucket(n_dec)
            inputs = self.driver.stage_eager(plan.decode, size)
            self.driver.launch_eager(inputs, block[:size])
            self.model.sample(self.stream, block[:size], inputs, self._out_tokens[:size], sampling)
        if plan.prefill:
            rows = decode_rows(plan.prefill, self.model.geometry.block_size,
                               [len(s.tokens) - 1 for s in plan.prefill])
            inputs = self.driver.stage_eager(rows, region=1)
            self.model.prefill(self.stream, plan.prefill, block[n_dec:plan.n])
            self.model.sample(self.stream, block[n_dec:plan.n], inputs,
                              self._out_tokens[n_dec:plan.n], sampling)
        kind = "eager" if not plan.prefill else ("mixed" if n_dec else "prefill")
        return ForwardLogits(block[:plan.n], plan.n), kind

    def _maybe_drain(self) -> None:
        prev = self._last
        if prev is None or prev.completed:
            return
        if prev.logits.non_owning_view and self.config.skips_graph_drain:
            return
        self._wait_done(prev, "drain")

    def _poison_next(self, slot, handle: StepHandle) -> None:
        """Write poison into the slot the next step of this size will use, as soon as this
        mode lets the host write it: the ring after its guard, OFF after the drain, NO_DBUF
        at once. A sound mode never lets a replay read the poison."""
        nxt = self.driver.next_slot(slot)
        ring = self.driver.rings[slot.size]
        if ring.guarded:
            t0 = time.perf_counter()
            waited = nxt.wait_reusable()
            if waited:
                self.stats.ring_waits += 1
                self.stats.ring_wait_s += waited
                self.tracer.host_span("ring wait (poison)", t0, t0 + waited, slot=nxt.name)
        elif not self.config.skips_graph_drain:
            self._wait_done(handle, "drain")
        nxt.poison(self.model.pad)

    # -- collect ------------------------------------------------------------------------
    def collect(self, handle: StepHandle) -> np.ndarray:
        """Wait for the step and return its sampled tokens [n] (a host copy)."""
        self._check_open()
        if handle not in self._inflight:
            raise ValueError(f"step {handle.index} is not in flight (already collected?)")
        if handle is not self._inflight[0]:
            raise ValueError(f"collect steps in launch order: step {self._inflight[0].index} first")
        self._inflight.pop(0)
        if not handle.completed:
            self._wait_done(handle, "tokens")
        tokens = self._tok_host[handle.parity][:handle.n].copy()
        if handle.timing is not None:
            ms = (self.tracer.device_span(f"{handle.kind} S={handle.size}", handle.timing,
                                          step=handle.index) if self.tracer.enabled
                  else handle.timing[1].elapsed_ms(handle.timing[0]))
            self.stats.device_ms += ms
            handle.timing = None
        return tokens

    def _wait_done(self, handle: StepHandle, why: str) -> None:
        t0 = time.perf_counter()
        self._done[handle.parity].synchronize()
        dt = time.perf_counter() - t0
        handle.completed = True
        if why == "drain":
            self.stats.drains += 1
            self.stats.drain_s += dt
        else:
            self.stats.token_waits += 1
            self.stats.token_wait_s += dt
        self.tracer.host_span(f"wait {why}", t0, t0 + dt, step=handle.index)

    def _count(self, handle: StepHandle, host_s: float) -> None:
        st = self.stats
        st.steps += 1
        st.host_launch_s += host_s
        setattr(st, f"{handle.kind}_steps", getattr(st, f"{handle.kind}_steps") + 1)
        if handle.kind == "graph":
            st.steps_by_size[handle.size] = st.steps_by_size.get(handle.size, 0) + 1

    def _timing_pair(self):
        return (self.be.event(blocking_sync=True, timing_enabled=True),
                self.be.event(blocking_sync=True, timing_enabled=True))

    # -- teardown -----------------------------------------------------------------------
    def synchronize(self) -> None:
        self._check_open()
        self.stream.synchronize()

    def close(self) -> str | None:
        """Wait for the device, write the trace, then free graphs, events, stream (idempotent)."""
        if self._closed:
            return None
        self._closed = True
        try:
            self.stream.synchronize()
            path = self.tracer.write()
        finally:
            self.driver.close()
            for ev in self._done + [e for pair in self._timing if pair for e in pair]:
                ev.close()
            self.model.release_stream(self.stream)   # after the graphs that used it are gone
            self.stream.close()
        return path

    def _check_open(self):
        if self._closed:
            raise ClosedError("Runner is closed")
