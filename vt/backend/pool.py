"""DevicePool: a caching device-memory pool that never calls the driver while a graph is captured.

Backend-agnostic: it sits on a raw provider with `malloc(nbytes) -> int` and `free(ptr) -> None`
(cudaMalloc/cudaFree on cuda, numpy blocks on sim). Every block is one raw allocation; free
blocks are cached by size class (`pool.size_class`) and served by exact class. During a
capture, `alloc` bumps through the shared scratch arena and `alloc_retained` takes cached
blocks only.

Debug mode (compute-sanitizer) keeps every one of those semantics (free lists, reserve,
retained blocks served from the cache during capture) and changes only the size class: the
exact request, so each buffer is a driver allocation of exactly its size and an overrun by
one element falls outside it. Its scratch arena is one block per request index.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from collections import defaultdict
from dataclasses import dataclass

from ._handle import HandleOwner
from .errors import CaptureAllocationError

ALIGN = 512


def round_size(nbytes: int) -> int:
    """Size class of a request: a multiple of 512 bytes, at least 512."""
    if nbytes < 0:
        raise ValueError(f"cannot allocate {nbytes} bytes")
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


@dataclass(frozen=True)
class PoolStats:
    bytes_reserved: int          # all raw memory the pool holds (in use + free + scratch arena)
    bytes_in_use: int            # blocks handed out (scratch excluded)
    free_bytes: int              # cached free blocks
    driver_mallocs: int          # raw.malloc calls so far
    mallocs_during_capture: int  # raw.malloc calls while capturing: must stay 0
    scratch_bytes: int           # capture scratch arena, retired arenas included
    captures: int                # captures entered


class DeviceBuffer:
    """A piece of device memory. `free()` is idempotent; garbage collection frees it too.

    Scratch buffers (served during a capture) belong to the arena: their free() does nothing.
    Not a HandleOwner: a scratch buffer, made on every request during a capture, carries no
    finalizer at all, and a block's finalizer must not run at exit.
    """

    def __init__(self, ptr: int, nbytes: int, block_ptr: int, offset: int, release=None):
        self.ptr = ptr
        self.nbytes = nbytes
        self.block_ptr = block_ptr
        self.offset = offset
        self.scratch = release is None
        self._finalizer = None if release is None else weakref.finalize(self, release, block_ptr)
        if self._finalizer is not None:
            self._finalizer.atexit = False  # at exit the process frees memory; the driver may be gone

    def free(self) -> None:
        if self._finalizer is not None:
            self._finalizer()

    close = free

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    def __repr__(self):
        kind = "scratch" if self.scratch else "block"
        return f"DeviceBuffer(ptr={self.ptr:#x}, nbytes={self.nbytes}, {kind})"


class DevicePool(HandleOwner):
    """Caching pool; `debug=True` gives every buffer its own raw allocation of its exact size."""

    def __init__(self, raw, *, debug: bool = False):
        self.raw = raw
        self.debug = debug
        self._lock = threading.Lock()
        self._pending: list[int] = []            # blocks released while the lock was busy
        self._free: dict[int, list[int]] = defaultdict(list)   # size -> block ptrs
        self._used: dict[int, int] = {}          # block ptr -> size, handed out
        self._scratch: dict[int, int] = {}       # every arena block ever made: graphs keep its addresses
        self._arena: tuple[int, int] | None = None   # (ptr, size) the bump allocator serves from
        self._debug_slots: list[tuple[int, int]] = []  # debug: one scratch block per request index
        self._bump = 0
        self._request_index = 0
        self._capture: str | None = None
        self._warmup: list[int] | None = None
        self._counts = {"mallocs": 0, "capture_mallocs": 0, "captures": 0}
        self._own(_free_all, raw, self._free, self._used, self._scratch)

    # -- allocation ---------------------------------------------------------------------
    def alloc(self, nbytes: int) -> DeviceBuffer:
        """Working memory: cached blocks outside capture, the scratch arena during capture."""
        with self._locked():
            if self._capture is not None:
                return self._alloc_scratch(nbytes)
            if self._warmup is not None:
                self._warmup.append(self.size_class(nbytes))
            return self._alloc_block(nbytes)

    def alloc_retained(self, nbytes: int) -> DeviceBuffer:
        """A block that outlives the capture (graph output); never taken from the arena."""
        with self._locked():
            return self._alloc_block(nbytes)

    def reserve(self, nbytes: int, count: int = 1) -> None:
        """Pre-grow: leave at least `count` free blocks that serve requests of `nbytes`."""
        with self._locked():
            self._refuse_growth_in_capture("reserve")
            size = self.size_class(nbytes)
            while len(self._free[size]) < count:
                self._free[size].append(self._malloc(size))

    def reserve_scratch(self, nbytes: int) -> None:
        """Pre-grow the arena so that a capture whose scratch requests total `nbytes` fits."""
        with self._locked():
            self._refuse_growth_in_capture("reserve_scratch")
            self._grow_arena(round_size(nbytes))

    # -- capture state ------------------------------------------------------------------
    @contextlib.contextmanager
    def capturing(self, name: str):
        """Capture state, entered by the backends' capture: the arena bump restarts at 0."""
        with self._locked():
            if self._capture is not None or self._warmup is not None:
                raise RuntimeError(f"pool is busy with {self._capture or 'a warm-up'!r}; cannot "
                                   f"capture {name!r}: vt's pool serves one capture at a time")
            self._capture, self._bump, self._request_index = name, 0, 0
            self._counts["captures"] += 1
        try:
            yield self
        finally:
            with self._lock:
                self._capture = None

    @contextlib.contextmanager
    def scratch_warmup(self, name: str):
        """Eager warm-up of a capture: records its alloc() sizes, then grows the arena to fit."""
        with self._locked():
            if self._capture is not None or self._warmup is not None:
                raise RuntimeError(f"cannot warm up {name!r}: the pool is busy with "
                                   f"{self._capture or 'another warm-up'!r}")
            self._warmup = []
        try:
            yield self
        finally:
            with self._lock:
                sizes, self._warmup = self._warmup, None
        with self._locked():
            if self.debug:
                self._grow_debug_slots(sizes)
            elif sizes:
                self._grow_arena(sum(sizes))

    def size_class(self, nbytes: int) -> int:
        """The block size that serves a request: round_size(nbytes), or in debug mode the
        exact request (at least 1 byte) so the sanitizer sees an overrun past it."""
        if self.debug:
            if nbytes < 0:
                raise ValueError(f"cannot allocate {nbytes} bytes")
            return max(1, nbytes)
        return round_size(nbytes)

    @property
    def capture_name(self) -> str | None:
        return self._capture

    @property
    def capture_counts(self) -> tuple[int, int]:
        """(captures entered, raw mallocs made while capturing): readable after close(), so a
        test suite can check every pool it made, closed or not, for the must-stay-0 count."""
        return self._counts["captures"], self._counts["capture_mallocs"]

    # -- reporting and teardown -----------------------------------------------------------
    def stats(self) -> PoolStats:
        with self._locked():
            in_use = sum(self._used.values())
            free = sum(size * len(ptrs) for size, ptrs in self._free.items())
            scratch = sum(self._scratch.values())
            return PoolStats(in_use + free + scratch, in_use, free, self._counts["mallocs"],
                             self._counts["capture_mallocs"], scratch, self._counts["captures"])

    def close(self) -> None:
        """Free every raw block (idempotent). Buffers still alive become dangling."""
        # Under the lock, so an allocation in another thread sees the pool open or closed,
        # never with its blocks half freed.
        with self._lock:
            super().close()

    # -- private --------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self):
        with self._lock:
            self._require_open()
            self._drain()
            yield

    def _closed_message(self) -> str:
        return "DevicePool is closed"

    def _alloc_block(self, nbytes: int) -> DeviceBuffer:
        size = self.size_class(nbytes)
        if self._free.get(size):
            ptr = self._free[size].pop()
        elif self._capture is not None:
            raise CaptureAllocationError(nbytes, self._free_bytes(), self._capture, "retained",
                                         self._summary())
        else:
            ptr = self._malloc(size)
        self._used[ptr] = size
        return DeviceBuffer(ptr, nbytes, ptr, 0, self._release)

    def _alloc_scratch(self, nbytes: int) -> DeviceBuffer:
        index, self._request_index = self._request_index, self._request_index + 1
        if index < len(self._debug_slots) and self._debug_slots[index][1] >= self.size_class(nbytes):
            ptr = self._debug_slots[index][0]
            return DeviceBuffer(ptr, nbytes, ptr, 0)
        size = round_size(nbytes)   # the bump arena keeps 512-byte alignment in both modes
        arena_ptr, arena_size = self._arena or (0, 0)
        if self._bump + size > arena_size:
            raise CaptureAllocationError(nbytes, arena_size - self._bump, self._capture, "scratch",
                                         self._summary())
        offset, self._bump = self._bump, self._bump + size
        return DeviceBuffer(arena_ptr + offset, nbytes, arena_ptr, offset)

    def _grow_arena(self, size: int) -> None:
        # The old arena is retired, not freed: graphs captured against it still use its addresses.
        if self._arena is None or self._arena[1] < size:
            self._arena = (self._malloc(size), size)
            self._scratch[self._arena[0]] = size

    def _grow_debug_slots(self, sizes: list[int]) -> None:
        for index, size in enumerate(sizes):
            if index < len(self._debug_slots) and self._debug_slots[index][1] >= size:
                continue
            slot = (self._malloc(size), size)
            self._scratch[slot[0]] = size
            if index < len(self._debug_slots):
                self._debug_slots[index] = slot
            else:
                self._debug_slots.append(slot)

    def _malloc(self, size: int) -> int:
        if self._capture is not None:
            self._counts["capture_mallocs"] += 1
        self._counts["mallocs"] += 1
        return self.raw.malloc(size)

    def _refuse_growth_in_capture(self, what: str) -> None:
        if self._capture is not None:
            raise RuntimeError(f"{what}() during capture {self._capture!r} would call the driver; "
                               f"pre-grow the pool before the capture begins")

    def _release(self, block_ptr: int) -> None:
        # Called by a buffer's free() or its finalizer, from any thread, possibly while this
        # thread already holds the lock (GC inside an allocation): never block, defer instead.
        self._pending.append(block_ptr)
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self) -> None:
        while self._pending:
            ptr = self._pending.pop()
            size = self._used.pop(ptr, None)
            if size is None:
                continue  # the pool was closed after this buffer was handed out
            self._free[size].append(ptr)

    def _free_bytes(self) -> int:
        return sum(size * len(ptrs) for size, ptrs in self._free.items())

    def _summary(self) -> str:
        free = {size: len(ptrs) for size, ptrs in sorted(self._free.items()) if ptrs}
        arena = self._arena[1] if self._arena else 0
        return (f"pool state: {len(self._used)} blocks in use ({sum(self._used.values())} B), "
                f"free blocks by size {free}, scratch arena {arena} B with {self._bump} B used "
                f"by this capture, debug={self.debug}")


def _free_all(raw, free, used, scratch) -> None:
    for ptrs in free.values():
        for ptr in ptrs:
            raw.free(ptr)
    for table in (used, scratch):
        for ptr in table:
            raw.free(ptr)
    for table in (free, used, scratch):
        table.clear()
