"""What a tensor-parallel engine raises when its ranks cannot go on together."""

from vt.errors import VtError


class TensorParallelError(VtError, RuntimeError):
    """The tensor-parallel group stopped: a rank failed, died or diverged (the reason says)."""


class RanksDivergedError(TensorParallelError):
    """A worker sampled other tokens than rank 0 for the same step."""
