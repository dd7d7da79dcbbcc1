"""The executor (what ExecutorConfig configures and VT_ASYNC_EXECUTOR switches): the runner, one
step at a time, depth-2 async, the drain and its skip (runner.py), over the captured graphs of
vt.graphs (slots, rings, capture); the eager path (eager.py), what it hands around per step (plan.py), its profiling (timers.py) and the
Chrome trace (trace.py), recorded logits (logits_record.py)."""
from vt.executor.plan import RunnerStats, StepHandle, StepPlan
from vt.executor.runner import Runner

__all__ = ["Runner", "RunnerStats", "StepHandle", "StepPlan"]
