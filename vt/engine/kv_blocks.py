"""BlockPool: the host's record of the KV-cache blocks: who holds each, which full blocks
hold a known prefix (prefix caching), and when a released block may be written again.

Every block but the scratch block (where padded rows write) is held (reference count > 0:
listed in the `blocks` of that many requests), fenced (released, but a step that may read
it is not known to be done), or reusable: free (no known content) or evictable (a cached
prefix nobody holds, kept until an allocation needs its memory, least recently released
first).

Prefix caching. A full block of a sequence is named by a chained hash of its parent's hash
and its token ids, the root salted with the model's identity and the block size, so equal
names mean equal KV (the model's KV of a position depends only on the tokens up to it:
StepModel.prefix_cacheable). A request whose prompt starts with cached blocks takes them
(their count goes up) instead of computing them; only full blocks are shared, never the
last, partial one, and never the block of the last prompt token (its logits are needed, so
at least that token is computed). A hit compares the block's token ids too: a hash
collision is a miss, never another prompt's KV.

Blocks written by decoding are named too, once the host knows their tokens: when a request
finishes with its tokens (a stop or its length), the full blocks of its prompt and all but
its last token (whose KV no step wrote) are named, chained from its prompt's hashes, so a
conversation's next turn, which sends that history again, finds the answer cached. At that
moment its blocks are still held or fenced (the loop names them before it lifts the fence
of the step it collected), so their KV is the request's.

Reuse is fenced by the device, not by the host's word. A block released after step t was
launched may still be read (or written) by step t in flight: it becomes reusable only once
the host has seen step t complete (`complete(t)`, after the loop collects step t, i.e.
after waiting on that step's done event). Every KV write of vt's own steps is ordered
after step t on the one decode stream anyway; the fence makes the rule hold for any
writer, and the test arm with a writer that is not stream-ordered (vt.hooks.KVPoison),
run with the fence removed (fence=False), shows what it prevents.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np


@dataclass
class PrefixCacheStats:
    """Counts of prefix caching, kept across the pools of one scheduler (a failed step makes
    a new pool). prompt_tokens: of the requests admitted with caching on; cached_tokens: of
    those, the ones served from cached blocks (not computed); evictions: cached blocks whose
    memory an allocation took."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def root_hash(identity: int, block_size: int) -> int:
    """The parent hash of a sequence's first block: what else the KV depends on."""
    return hash(("vt-prefix", identity, block_size))


def block_hashes(tokens: np.ndarray, block_size: int, parent: int, first: int = 0) -> list[int]:
    """The chained hashes of the full blocks first, first + 1, ... of a sequence's tokens;
    parent: the hash of block first - 1 (the root for block 0)."""
    out = []
    data = tokens.tobytes()
    step = block_size * tokens.itemsize
    for i in range(first, len(tokens) // block_size):
        parent = hash((parent, data[i * step:(i + 1) * step]))
        out.append(parent)
    return out


class BlockPool:
    """KV blocks 0..num_blocks-1 except the scratch block of padded rows.

    fenced=False is the test arm without the fence (module docstring): a released block is
    reusable at once. on_reuse(blocks): called with the blocks an allocation hands out, the
    moment it does (a test arm's poison writer); None: nothing."""

    def __init__(self, num_blocks: int, scratch_block: int, *, stats: PrefixCacheStats | None = None,
                 fenced: bool = True, on_reuse=None):
        self._free = [b for b in range(num_blocks - 1, -1, -1) if b != scratch_block]
        self.capacity = len(self._free)
        self._evictable: OrderedDict[int, None] = OrderedDict()   # LRU first
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._tokens: list[bytes | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}                          # hash -> block
        self._fences: deque = deque()      # (step, blocks) released while step t may read them
        self._fence_of = [-1] * num_blocks
        self._held = 0
        self._fenced = fenced
        self._on_reuse = on_reuse
        self.completed = -1                # the last step known complete
        self.stats = stats if stats is not None else PrefixCacheStats()

    # -- counts ---------------------------------------------------------------------------
    @property
    def free_count(self) -> int:
        """Blocks nobody holds (reusable, cached or fenced): all of them when idle."""
        return self.capacity - self._held

    @property
    def available(self) -> int:
        """Blocks an allocation may take now."""
        return len(self._free) + len(self._evictable)

    @property
    def cached_count(self) -> int:
        """Blocks holding a known prefix (held, fenced or evictable)."""
        return len(self._cached)

    @property
    def evictable_count(self) -> int:
        """Cached blocks nobody holds (evictable now or once their fence lifts)."""
        return sum(1 for b in self._cached.values() if self._ref[b] == 0)

    # -- allocation -----------------------------------------------------------------------
    def alloc(self, n: int) -> list[int] | None:
        """n blocks for a new owner (count 1 each), or None (nothing taken) when fewer are
        reusable: free ones first, then the least recently released cached ones (evicted:
        their prefix is forgotten)."""
        if n > len(self._free) + len(self._evictable):
            return None
        free, out = self._free, []
        while len(out) < n and free:
            out.append(free.pop())
        while len(out) < n:
            b, _ = self._evictable.popitem(last=False)
            del self._cached[self._hash[b]]
            self._hash[b] = self._tokens[b] = None
            self.stats.evictions += 1
            out.append(b)
        ref = self._ref
        for b in out:
            ref[b] = 1
        self._held += n
        if self._on_reuse is not None:
            self._on_reuse(out)
        return out

    def match(self, hashes: list[int], prompt: np.ndarray, block_size: int, limit: int) -> list[int]:
        """The cached blocks of the longest chain of `hashes` (at most `limit` blocks) whose
        token ids equal the prompt's; nothing is taken."""
        out, cached, tokens = [], self._cached, self._tokens
        step = block_size * prompt.itemsize
        data = None
        for i, h in enumerate(hashes[:limit]):
            b = cached.get(h)
            if b is None:
                break
            if data is None:
                data = prompt.tobytes()
            if tokens[b] != data[i * step:(i + 1) * step]:
                break          # a hash collision: another prompt's block
            out.append(b)
        return out

    def reusable_among(self, blocks: list[int]) -> int:
        """How many of `blocks` an allocation could take now (evictable ones)."""
        ev = self._evictable
        return sum(1 for b in blocks if b in ev)

    def take(self, blocks: list[int]) -> None:
        """One more holder of each of these (cached) blocks."""
        ref, ev = self._ref, self._evictable
        for b in blocks:
            if ref[b] == 0:
                ev.pop(b, None)        # a fenced one stays on its fence's list: see _lift
                self._held += 1
            ref[b] += 1

    def register(self, block: int, h: int, tokens: bytes) -> None:
        """The block, held or fenced, now holds the full block named h (its tokens' KV is
        computed by a launched step or the step being planned, before any later step reads
        it). A prefix cached in another block already keeps that one. A reusable block is
        not named: an allocation may have handed it out, its KV is not known."""
        if h in self._cached or self._hash[block] is not None:
            return
        if self._ref[block] == 0 and self._fence_of[block] == -1:
            return
        self._cached[h] = block
        self._hash[block], self._tokens[block] = h, tokens

    def release(self, blocks: list[int], step: int) -> None:
        """One holder fewer of each; step: the last step launched, which may read them.
        Blocks nobody holds become reusable once step is complete, the last block first
        (a sequence's tail is the least likely to be shared)."""
        ref, done = self._ref, []
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                done.append(b)
        if not done:
            return
        self._held -= len(done)
        if step <= self.completed or not self._fenced:
            self._reusable(done)
        else:
            for b in done:
                self._fence_of[b] = step
            self._fences.append((step, done))

    def complete(self, step: int) -> None:
        """Step `step` (and every one before it) is known complete: lift their fences."""
        self.completed = step
        fences = self._fences
        while fences and fences[0][0] <= step:
            t, blocks = fences.popleft()
            ref, fence_of = self._ref, self._fence_of
            self._reusable([b for b in blocks if ref[b] == 0 and fence_of[b] == t])

    def _reusable(self, blocks: list[int]) -> None:
        h, ev, free = self._hash, self._evictable, self._free
        for b in blocks:
            self._fence_of[b] = -1
            if h[b] is None:
                free.append(b)
            else:
                ev[b] = None
