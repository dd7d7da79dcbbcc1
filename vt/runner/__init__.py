"""The runner: one step at a time, depth-2 async, the drain and its skip (runner.py), the eager
path (eager.py), what it hands around per step (plan.py), its profiling (timers.py) and the
Chrome trace (trace.py), recorded logits (logits_record.py)."""
from vt.runner.plan import RunnerStats, StepHandle, StepPlan
from vt.runner.runner import Runner

__all__ = ["Runner", "RunnerStats", "StepHandle", "StepPlan"]
