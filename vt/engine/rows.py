"""RowAllocator: the host's record of which sequence rows are free.

A row is a running request's index into the model's per-sequence device state (its row of
the token table and its recurrent-state slot) and its span of the token buffer; each row
is free here or held by exactly one request, from admission until it leaves.
"""
from __future__ import annotations


class RowAllocator:
    """Sequence rows 0..n-1."""

    def __init__(self, n: int):
        self._free = list(range(n - 1, -1, -1))

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        self._free.append(row)

    @property
    def free_count(self) -> int:
        return len(self._free)
