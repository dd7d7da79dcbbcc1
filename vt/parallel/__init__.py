"""Tensor parallelism across processes: rank 0's engine schedules, every rank replays its
runner calls (vt/parallel/rank.py), the plan travels through shared memory
(vt/parallel/channel.py) and the model's collectives through torch.distributed."""
from vt.parallel.errors import RanksDivergedError, TensorParallelError
from vt.parallel.group import RankGroup
from vt.parallel.rank import RankZeroRunner

__all__ = ["RankGroup", "RankZeroRunner", "RanksDivergedError", "TensorParallelError"]
