"""What the engine reports while it starts, serves and after: the start-up and progress
callbacks' arguments and the per-phase time of its loop (Engine.stats()["phases"])."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class StartUpProgress:
    """Passed to Engine(start_up_progress=...) as a phase of its construction starts (done 0)
    and after each of the phase's `total` pieces; `detail` names the last one ("size 4").
    The phases: "capturing decode graphs" (one piece per graph), "warming up eager steps"
    (each eager decode size, then the prompt path). vt.serve.model_source reports its
    "loading weights" (one piece per tensor) the same way."""
    phase: str
    done: int
    total: int
    detail: str = ""


def phase_reporter(callback: Callable[[StartUpProgress], None] | None, phase: str):
    """report(done, total, detail) of one phase for the layers below the engine, which know
    pieces and counts but not the engine's types; None when there is no callback."""
    if callback is None:
        return None
    return lambda done, total, detail="": callback(StartUpProgress(phase, done, total, detail))


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
