"""RankZeroRunner: rank 0's runner, which sends each of its calls to the other ranks first.

Every rank runs the same Runner over its shard of the model, and the forward of each step
meets the other ranks in its collectives; so every rank must launch the same steps, graph
for graph, in the same order, with the same inputs. Rank 0's engine is the only scheduler:
its runner publishes every call (vt/parallel/wire.py) before making it, and the workers make
the same call on theirs (vt/parallel/worker.py). No admission timing, cancellation or stop
token can make the ranks differ: those decide rank 0's plans, and the plans are what travel.

The tokens: the lm_head's logits are gathered whole on every rank before the sampler
(vt/torch/tensor_parallel.py), bitwise equal, so every rank samples the same token into its
own token table, which the next decode step reads on the device. Rank 0 sends the tokens it
collected with each COLLECT and every worker compares them with its own: ranks that
diverged stop the group with an error instead of serving on.

A step that fails on rank 0 (abort) stops the group: the ranks may have parted ways inside
a collective, and no step is safe after it. Every later launch raises TensorParallelError.
"""
from __future__ import annotations

import vt.parallel.wire as wire
from vt.parallel.errors import TensorParallelError
from vt.parallel.group import RankGroup
from vt.executor.plan import StepHandle, StepPlan
from vt.executor.runner import Runner


class RankZeroRunner(Runner):
    """A Runner whose calls every rank of `group` makes too (module docstring)."""

    def __init__(self, group: RankGroup, be, model, config, **kwargs):
        super().__init__(be, model, config, **kwargs)
        self.group = group
        self._encoder = wire.PlanEncoder(self.capacity, model.geometry.max_blocks, model.pad)

    def check_usable(self) -> None:
        self.group.check()

    def capture(self, progress=None) -> None:
        self._check_open()
        self.group.send(wire.simple(wire.CAPTURE))
        super().capture(progress)

    def warm_up(self, max_prefill_tokens: int, progress=None) -> None:
        self._check_open()
        self.group.send(wire.simple(wire.WARM_UP, max_prefill_tokens))
        super().warm_up(max_prefill_tokens, progress)

    def launch(self, plan: StepPlan) -> StepHandle:
        self.group.check()
        self.check_launch(plan)   # refused here, the step must not reach the other ranks
        self.group.send(self._encoder.launch(plan))
        return super().launch(plan)

    def collect(self, handle: StepHandle):
        tokens = super().collect(handle)
        self.group.send(wire.collect(tokens))
        return tokens

    def ceiling_us(self, n: int, replays: int) -> float:
        self._check_open()
        self.group.send(wire.ceiling(n, replays))
        return super().ceiling_us(n, replays)

    def abort(self, cause: BaseException | None = None) -> BaseException | None:
        what = f": {type(cause).__name__}: {cause}" if cause is not None else ""
        self.group.stop(self.group.failure or f"a step failed on rank 0{what}")
        return super().abort(cause)

    def close(self) -> str | None:
        if self.group.failure is not None:
            # Stop the workers first: a step of this rank still waiting in a collective with
            # one of them then fails at once instead of waiting out the collective's timeout.
            self.group.stop(self.group.failure)
        try:
            return super().close()   # the graphs go before the communicator they use
        finally:
            if self.group.failure is None:
                self.group.close()
            else:
                self.group.stop(self.group.failure)


__all__ = ["RankZeroRunner", "TensorParallelError"]
