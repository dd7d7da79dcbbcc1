"""Tensor parallelism for vt.torch models, Megatron-style: what one rank of a group holds and
the two collectives a sharded decoder needs (vt.torch.llama uses them; docs/torch.md,
"Tensor parallelism", draws the sharding).

The collectives are torch's functional collectives (torch.distributed._functional_collectives,
as gpt-fast's tp.py uses them): each is a dispatched op pair, `_c10d_functional.<collective>`
then `_c10d_functional.wait_tensor`, with the group passed by name. A CUDA graph capture holds
them as NCCL kernels, and vt's sim capture (vt/torch/simcapture.py) records and replays them
like any aten op, so a sharded decode step is captured as it is. At size 1 each is the
identity and no op is dispatched: a size-1 model is the unsharded one.

torch.distributed is imported only by a collective of a group of more than one rank, so the
module imports on any torch build.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vt.validate import integer


@dataclass(frozen=True)
class TensorParallel:
    """Rank `rank` of a tensor-parallel group of `size` ranks. group: the
    torch.distributed ProcessGroup the collectives run over; None: the default group
    (dist.group.WORLD). Its size and this rank's place in it must be `size` and `rank`."""
    rank: int
    size: int
    group: object = None

    def __post_init__(self):
        integer("TensorParallel.size", self.size, 1)
        integer("TensorParallel.rank", self.rank, 0, self.size - 1)

    def local(self, n: int, what: str) -> int:
        """This rank's count of `n` things split evenly over the group (n / size); ValueError
        naming `what` when size does not divide n."""
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size "
                             f"{self.size}")
        return n // self.size

    def shard(self, n: int, what: str) -> slice:
        """This rank's contiguous share of range(n): [rank * n / size, (rank + 1) * n / size)."""
        k = self.local(n, what)
        return slice(self.rank * k, (self.rank + 1) * k)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks, a new tensor (x itself at size 1)."""
        if self.size == 1:
            return x
        funcol = _funcol()
        return _waited(funcol, funcol.all_reduce(x, "sum", self._group()))

    def row_parallel(self, linear, x: torch.Tensor, matmul=F.linear) -> torch.Tensor:
        """linear(x) of a row-parallel layer (an nn.Linear holding this rank's columns, x its
        share of the features): the partial products summed over the ranks, then the bias,
        added once. At size 1: matmul(x, weight, bias). matmul: what computes x @ weight.T
        (+ bias), with F.linear's signature."""
        if self.size == 1:
            return matmul(x, linear.weight, linear.bias)
        out = self.all_reduce(matmul(x, linear.weight))
        return out if linear.bias is None else out + linear.bias

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' x concatenated along `dim` in rank order (x itself at size 1). Every
        rank's x must have the same shape."""
        if self.size == 1:
            return x
        funcol = _funcol()
        # The collective gathers along dim 0; other dims go through a transposed copy.
        rows = x.movedim(dim, 0).contiguous()
        gathered = _waited(funcol, funcol.all_gather_single(rows, 0, self._group()))
        return gathered.movedim(0, dim)

    def _group(self):
        """The process group, checked against size and rank (one line if it disagrees)."""
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"TensorParallel(rank={self.rank}, size={self.size}): "
                               f"torch.distributed is not initialised (init_process_group)")
        group = dist.group.WORLD if self.group is None else self.group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if (size, rank) != (self.size, self.rank):
            raise RuntimeError(f"TensorParallel(rank={self.rank}, size={self.size}): the "
                               f"process group has {size} ranks and this process is rank {rank}")
        return group


def _funcol():
    import torch.distributed._functional_collectives as funcol
    return funcol


def _waited(funcol, t: torch.Tensor) -> torch.Tensor:
    """The collective's result as a plain tensor: eagerly torch wraps it in an
    AsyncCollectiveTensor that waits at its first use, which kernels reading raw pointers
    (Triton) cannot take; its wait() is the one wait_tensor op."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t
