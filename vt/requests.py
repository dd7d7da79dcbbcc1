"""Requests, their results, and the host-side allocators of sequence rows and KV blocks."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class PromptTooLongError(ValueError):
    """A prompt does not fit the model's context."""


class KVCacheExhaustedError(RuntimeError):
    """A request needs more KV blocks than the cache can ever give it (it is refused)."""


@dataclass
class RequestResult:
    """tokens: generated ids; finish_reason: "stop" | "length" | "context" | "error"."""
    index: int
    prompt_len: int
    tokens: list[int]
    finish_reason: str
    error: Exception | None = None
    logits: np.ndarray | None = None   # [len(tokens), vocab] when the engine recorded logits


@dataclass
class Request:
    index: int
    prompt: np.ndarray        # [L] int32
    max_new_tokens: int
    stop_token: int | None
    row: int = -1
    blocks: list[int] = field(default_factory=list)
    block_table: np.ndarray | None = None
    launched: int = 0         # tokens whose sampling has been launched (prefill included)
    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)
    finish_reason: str | None = None
    error: Exception | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def token_budget(self, max_context: int) -> int:
        """Tokens this request may generate: max_new_tokens, cut where the context ends
        (the last generated token needs no KV slot)."""
        return min(self.max_new_tokens, max_context - self.prompt_len + 1)

    def wants_decode(self, max_context: int) -> bool:
        return not self.done and self.row >= 0 and 0 < self.launched < self.token_budget(max_context)

    def result(self) -> RequestResult:
        logits = np.stack(self.logits) if self.logits else None
        return RequestResult(self.index, self.prompt_len, list(self.tokens), self.finish_reason,
                             self.error, logits)


class RowAllocator:
    """Sequence rows (token-table row = recurrent-state slot) 0..n-1."""

    def __init__(self, n: int):
        self._free = list(range(n - 1, -1, -1))

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        self._free.append(row)

    @property
    def available(self) -> int:
        return len(self._free)


class BlockAllocator:
    """KV blocks 0..num_blocks-1 except the scratch block of padded rows."""

    def __init__(self, num_blocks: int, scratch_block: int):
        self._free = [b for b in range(num_blocks - 1, -1, -1) if b != scratch_block]
        self.capacity = len(self._free)

    @property
    def available(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n blocks, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
