"""BlockAllocator: the host's record of which KV-cache blocks are free.

Every block but the scratch block (where padded rows write) is either free here or listed in
exactly one running request's `blocks`; the scheduler takes a request's blocks all at once
at admission and gives them back when it leaves, so a step never waits on a block.
"""
from __future__ import annotations


class BlockAllocator:
    """KV blocks 0..num_blocks-1 except the scratch block of padded rows."""

    def __init__(self, num_blocks: int, scratch_block: int):
        self._free = [b for b in range(num_blocks - 1, -1, -1) if b != scratch_block]
        self.capacity = len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n blocks, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    @property
    def free_count(self) -> int:
        return len(self._free)
