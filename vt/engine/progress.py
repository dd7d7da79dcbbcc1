"""What the engine reports while and after it serves: the progress callback's argument and the
per-phase time of its loop (Engine.stats()["phases"])."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    """Passed to the progress callback after each step's tokens reach the host. `step` and
    `tokens` are the engine's (they count on across generate() calls); `finished`, `total`
    and `elapsed_s` are this call's."""
    step: int
    finished: int
    total: int
    tokens: int
    elapsed_s: float


@dataclass
class Phase:
    """Host and device time of the engine-loop iterations that launched one kind of step
    ("decode": pure decode; "prefill": any step that prefills). The host split is filled with
    profile=True only; steps, wall_s and wait_s (blocked on the device: drains and token
    waits, which the runner times anyway) always."""
    steps: int = 0
    wall_s: float = 0.0
    wait_s: float = 0.0
    plan_s: float = 0.0
    acquire_s: float = 0.0
    refresh_s: float = 0.0
    launch_s: float = 0.0
    collect_s: float = 0.0
    drain_s: float = 0.0
    timed_steps: int = 0      # the steps the split above stands for (vt/engine/profile.py)
    sampled_steps: int = 0    # the iterations timed: a sample of those steps
