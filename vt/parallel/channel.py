"""Broadcast: one writer, several reader processes, byte messages through shared memory.

Rank 0 publishes each step's plan here and every other rank reads it (docs/parallel.md).
A collective of torch.distributed would do too, but costs tens to hundreds
of microseconds per call on the host; a ring in shared memory costs a copy and a flag.

Layout of the one shared-memory segment (little-endian, 8-byte words):

    consumed[readers]                     chunks each reader has finished with
    closed                                1 once the writer closed the channel
    per slot (SLOTS of them): seq, nbytes, last, pad, payload[SLOT_BYTES]

A message is one or more chunks, chunk k in slot k % SLOTS. The writer fills a slot's payload
and length, then stores seq = k + 1; a reader waits for seq == k + 1, copies the payload out,
and stores consumed = k + 1. The writer reuses a slot only once every reader has consumed
the chunk that held it (consumed > k - SLOTS). The stores that publish come after the stores
they publish, in program order; x86-64 keeps stores in order and loads in order, so a reader
that sees seq sees the payload. (On a weakly ordered CPU the flag would need a fence; vt
refuses to start the channel there rather than risk it.)

Waiting: a reader spins for `spin_s` (where a step comes every few milliseconds and a core
per rank is there to spare) and then sleeps in growing steps up to 1 ms, checking every
`check_s` that the writer's process lives (`alive()`); the writer, when every slot is still
unread, waits the same way and checks its readers. Neither waits past `timeout_s`: a peer
that is gone or stuck becomes a PeerLostError naming it, never a hang.
"""
from __future__ import annotations

import platform
import time
from multiprocessing import shared_memory
from typing import Callable

import numpy as np

SLOTS = 64
# How long a rank on a GPU spins for the next message before it sleeps: about a decode step,
# so that a worker launches each step within microseconds of rank 0 (one core per rank).
SPIN_S = 0.05
SLOT_BYTES = 64 * 1024
_HEAD_WORDS = 4          # seq, nbytes, last, pad
_MAX_SLEEP_S = 1e-3


class PeerLostError(RuntimeError):
    """The other side of a Broadcast is gone (its process ended) or did not answer in time."""


def _check_platform() -> None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"vt.parallel's shared-memory broadcast relies on x86-64's ordering "
                           f"of stores; this machine is {platform.machine()}")


class Broadcast:
    """Create with Broadcast.create(readers) in the writer; open in each reader with
    Broadcast.attach(name, readers, reader_index). `alive` (no arguments) says whether the
    other side still runs; the writer's is a check of every reader."""

    def __init__(self, shm: shared_memory.SharedMemory, readers: int, reader: int | None,
                 owner: bool):
        self.shm, self.readers, self.reader, self.owner = shm, readers, reader, owner
        words = np.ndarray((shm.size // 8,), np.int64, buffer=shm.buf)
        self.consumed = words[:readers]
        self._closed_flag = words[readers:readers + 1]
        base = readers + 1
        stride = _HEAD_WORDS + SLOT_BYTES // 8
        self._heads = [words[base + i * stride: base + i * stride + _HEAD_WORDS] for i in range(SLOTS)]
        raw = np.ndarray((shm.size,), np.uint8, buffer=shm.buf)
        self._payloads = [raw[(base + i * stride + _HEAD_WORDS) * 8:
                              (base + i * stride + _HEAD_WORDS) * 8 + SLOT_BYTES]
                          for i in range(SLOTS)]
        self.chunks = 0          # chunks written (writer) or read (reader) so far
        self.closed = False

    @classmethod
    def create(cls, readers: int) -> "Broadcast":
        _check_platform()
        if readers < 1:
            raise ValueError(f"Broadcast needs at least one reader, got {readers}")
        size = 8 * (readers + 1 + SLOTS * (_HEAD_WORDS + SLOT_BYTES // 8))
        shm = shared_memory.SharedMemory(create=True, size=size)
        np.ndarray((size // 8,), np.int64, buffer=shm.buf)[:] = 0
        return cls(shm, readers, None, owner=True)

    @classmethod
    def attach(cls, name: str, readers: int, reader: int) -> "Broadcast":
        _check_platform()
        # The writer owns the segment: a reader's resource tracker must not unlink it when
        # the reader exits first. Python >= 3.13 says so with track=False; before, a spawned
        # reader shares its parent's tracker, which the writer's unlink settles.
        try:
            shm = shared_memory.SharedMemory(name=name, track=False)
        except TypeError:
            shm = shared_memory.SharedMemory(name=name)
        return cls(shm, readers, reader, owner=False)

    @property
    def name(self) -> str:
        return self.shm.name

    # -- the writer ---------------------------------------------------------------------
    def publish(self, payload, *, alive: Callable[[], bool], spin_s: float = 0.0,
                timeout_s: float = 60.0, check_s: float = 0.5) -> None:
        """Write one message (bytes-like) for every reader."""
        view = memoryview(payload).cast("B")
        total, at = len(view), 0
        while True:
            k = self.chunks
            if k - int(self.consumed.min()) >= SLOTS:
                _wait(lambda: k - int(self.consumed.min()) < SLOTS, alive, spin_s, timeout_s,
                      check_s, "a tensor-parallel rank stopped reading the step plans")
            slot = k % SLOTS
            n = min(SLOT_BYTES, total - at)
            self._payloads[slot][:n] = np.frombuffer(view[at:at + n], np.uint8)
            head = self._heads[slot]
            head[1], head[2] = n, at + n == total
            head[0] = k + 1                      # publish: after the payload and length
            self.chunks = k + 1
            at += n
            if at == total:
                return

    def close(self) -> None:
        """Tell readers the writer is done, then drop the segment (the writer's, at the end)."""
        if self.closed:
            return
        self.closed = True
        if self.owner:
            self._closed_flag[0] = 1
        self._release()
        if self.owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass

    # -- a reader -----------------------------------------------------------------------
    def receive(self, *, alive: Callable[[], bool], spin_s: float = 0.0,
                timeout_s: float | None = None, check_s: float = 0.5) -> bytes | None:
        """The next message, or None once the writer has closed the channel."""
        parts = []
        while True:
            k = self.chunks
            head = self._heads[k % SLOTS]
            if head[0] != k + 1:
                ready = lambda: head[0] == k + 1 or self._closed_flag[0]   # noqa: E731
                _wait(ready, alive, spin_s, timeout_s, check_s,
                      "rank 0 stopped sending step plans")
                if head[0] != k + 1:
                    return None                  # closed
            n, last = int(head[1]), bool(head[2])
            parts.append(self._payloads[k % SLOTS][:n].tobytes())
            self.chunks = k + 1
            self.consumed[self.reader] = k + 1   # the slot is the writer's again
            if last:
                return parts[0] if len(parts) == 1 else b"".join(parts)

    def detach(self) -> None:
        """A reader's end: unmap the segment (the writer unlinks it)."""
        if not self.closed:
            self.closed = True
            self._release()

    def _release(self) -> None:
        # numpy views into the buffer must go before the mapping can close
        self.consumed = self._closed_flag = None
        self._heads = self._payloads = []
        try:
            self.shm.close()
        except BufferError:   # a view still held by a caller: the mapping goes with the process
            pass


def _wait(ready: Callable[[], bool], alive: Callable[[], bool], spin_s: float,
          timeout_s: float | None, check_s: float, what: str) -> None:
    """Spin for spin_s, then sleep in growing steps; PeerLostError when the peer is gone or
    timeout_s passed (None: no limit while the peer lives)."""
    clock = time.perf_counter
    start = clock()
    if spin_s > 0:
        while clock() - start < spin_s:
            if ready():
                return
    sleep, next_check = 2e-5, start + check_s
    while not ready():
        time.sleep(sleep)
        sleep = min(sleep * 2, _MAX_SLEEP_S)
        now = clock()
        if now >= next_check:
            next_check = now + check_s
            if not alive():
                if ready():
                    return
                raise PeerLostError(f"{what}: its process has ended")
            if timeout_s is not None and now - start > timeout_s:
                raise PeerLostError(f"{what}: nothing for {timeout_s:g} s")
