"""StepPipeline: the serving loop's depth, kept out of its body.

The loop launches a step, then collects one. At depth 2 (the async pipeline) that is the
step launched before, so the host plans step N+1 while the device runs step N; at depth 1
it is the step just launched. Either way a request that samples a stop token in step N
leaves the batch after step N+1 is launched (depth 2 cannot know sooner), so both depths
plan the same steps and give the same tokens.

A request with a grammar needs its token of step N on the host (its mask of step N+1 is built
from it) before step N+1's sampler runs: at depth 2 the loop launches step N+1's forward,
collects step N, queues the masks, then launches step N+1's sampler; a step that cannot be
split so (prefill, mixed, eager) is planned only after the step in flight is collected
(take_in_flight): vt/engine/serving.py.
"""
from __future__ import annotations

from typing import Callable


class StepPipeline:
    """What has been launched and not yet collected, and the stops not yet applied."""

    __slots__ = ("leave", "in_flight", "stopped")
    depth = 0   # steps in flight after a launch: the subclass's

    def __init__(self, leave: Callable):
        self.leave = leave      # leave(request): out of the batch (Scheduler.leave)
        self.in_flight = None   # the handle of a launched step not yet collected (depth 2)
        self.stopped: list = []  # requests that sampled a stop token, to leave after a launch

    def launched(self, handle) -> object | None:
        """A step was launched (handle; None when the plan was empty): returns the step to
        collect now, or None."""
        raise NotImplementedError

    def collected(self, stopped: list) -> None:
        """The requests that sampled a stop token in the step just collected (called only
        when there are some: the stops of a step are applied once, after the next launch)."""
        raise NotImplementedError

    def take_in_flight(self):
        """The step in flight, to be collected now (None: none); nothing is in flight after."""
        ready, self.in_flight = self.in_flight, None
        return ready

    def empty(self) -> bool:
        return self.in_flight is None and not self.stopped

    def drop(self) -> None:
        """A step failed: nothing in flight any more (the runner was aborted)."""
        self.in_flight, self.stopped = None, []


class CollectNextStep(StepPipeline):
    """Depth 2: step N is collected after step N+1 is launched; its stops apply at once."""

    __slots__ = ()
    depth = 2

    def launched(self, handle):
        ready, self.in_flight = self.in_flight, handle
        return ready

    def collected(self, stopped):
        for req in stopped:
            self.leave(req)


class CollectAtOnce(StepPipeline):
    """Depth 1: step N is collected right after its launch; its stops apply after step N+1
    is launched, as at depth 2."""

    __slots__ = ()
    depth = 1

    def launched(self, handle):
        if self.stopped:
            for req in self.stopped:
                self.leave(req)
            self.stopped = []
        return handle

    def collected(self, stopped):
        self.stopped = stopped


def step_pipeline(depth: int, leave: Callable) -> StepPipeline:
    """The pipeline of `depth` steps; leave(request) takes a stopped request out of the batch."""
    if depth == 1:
        return CollectAtOnce(leave)
    if depth == 2:
        return CollectNextStep(leave)
    raise ValueError(f"pipeline depth must be 1 or 2, got {depth}")
