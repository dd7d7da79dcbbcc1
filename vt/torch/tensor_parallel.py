"""TensorParallel: a rank's place in a tensor-parallel group and its collectives."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    size: int
    group: object = None

    def _group(self):
        import torch.distributed as dist
        return self.group if self.group is not None else dist.group.WORLD

    def all_reduce(self, x):
        if self.size == 1:
            return x
        import torch.distributed._functional_collectives as funcol
        return funcol.all_reduce(x, "sum", self._group())

    def all_gather(self, x, dim: int = -1):
        if self.size == 1:
            return x
        import torch.distributed._functional_collectives as funcol
        return funcol.all_gather_tensor(x, dim % x.dim(), self._group())

    def shard(self, n: int, what: str) -> slice:
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {self.size}")
        k = n // self.size
        return slice(self.rank * k, (self.rank + 1) * k)
