"""What the runner hands around per step: the plan of a step, the handle of a launched one,
and the runner's counters."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vt.graphs import ForwardLogits
from vt.step.contract import PrefillSeq


class StepPlan:
    """What one step runs: decode rows of running sequences (DecodeRows, or anything with
    len() and write_into(block, pad)) and/or prompts to prefill. `tag` is the caller's,
    handed back with the tokens; `admitted` the caller's requests behind `prefill`."""

    __slots__ = ("decode", "prefill", "tag", "n", "admitted")

    def __init__(self, decode=None, prefill: list[PrefillSeq] | None = None, tag=None,
                 admitted: list | None = None):
        self.decode, self.prefill, self.tag = decode, prefill or [], tag
        self.admitted = admitted or []
        self.n = (len(decode) if decode is not None else 0) + len(self.prefill)


class StepHandle:
    """A launched step. Its tokens are valid after Runner.collect(). (A plain class with
    slots: one is made per step, on the host's critical path.)"""

    __slots__ = ("index", "kind", "n", "size", "logits", "tag", "out_host", "done", "slot",
                 "timing", "host_logits", "tokens", "records")

    def __init__(self, index: int, kind: str, n: int, size: int, logits: ForwardLogits, tag,
                 out_host: np.ndarray, done, slot=None):
        self.index, self.kind, self.n, self.size = index, kind, n, size   # kind: graph|eager|mixed|prefill
        self.logits, self.tag = logits, tag
        self.out_host = out_host      # pinned [>= n, RECORD_WORDS]: the step's token records land here
        self.done = done              # event recorded after everything the step does
        self.slot = slot              # the graph slot (None: eager)
        self.timing = None            # (start, end) timing events with profile
        self.host_logits = None       # [n, vocab] when recorded
        self.tokens = None            # host copy, taken when the host saw `done`
        self.records = None           # [n, RECORD_WORDS] host copy of the token records, with tokens


@dataclass
class RunnerStats:
    steps: int = 0
    graph_steps: int = 0
    split_steps: int = 0      # graph steps whose forward was launched alone (launch(sample=False))
    eager_steps: int = 0      # pure decode above the largest captured size
    mixed_steps: int = 0      # prefill + decode
    prefill_steps: int = 0
    drains: int = 0
    drain_s: float = 0.0
    ring_waits: int = 0       # slot acquisitions that had to block on the slot's event
    # acquire_s, refresh_s, launch_s: with profile only (without it a step reads no clock);
    # drain_s and token_wait_s always (a wait measures itself, and only when it blocks)
    acquire_s: float = 0.0
    refresh_s: float = 0.0
    launch_s: float = 0.0
    eager_launch_s: float = 0.0   # with profile: host time launching every eager/mixed/prefill step
    token_waits: int = 0
    token_wait_s: float = 0.0
    device_ms: float = 0.0    # with profile only: device time of the timed steps
    device_steps: int = 0     # the steps device_ms covers
    # the same per engine phase: "prefill" (prefill and mixed steps) or "decode": [ms, steps]
    device_by_phase: dict = field(default_factory=lambda: {"decode": [0.0, 0], "prefill": [0.0, 0]})
    steps_by_size: dict = field(default_factory=dict)
    # why each drain happened: the kind of the step it waited for (graph: the mode does not
    # skip the drain; prefill, mixed, eager: that step owns its logits)
    drains_after: dict = field(default_factory=dict)

    @property
    def wait_s(self) -> float:
        """Seconds blocked on the device: drains and token waits."""
        return self.drain_s + self.token_wait_s

    def as_dict(self) -> dict:
        return dict(self.__dict__, steps_by_size=dict(self.steps_by_size),
                    device_by_phase={k: list(v) for k, v in self.device_by_phase.items()},
                    drains_after=dict(self.drains_after))
