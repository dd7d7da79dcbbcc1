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

Naming: the segment is named after its writer, vt-tp-PID-START-RANDOM (START: the process's
start time, so that a later process given the same pid is not taken for it). A writer that
exits unlinks it; one killed with its whole process group (SIGKILL also takes the resource
tracker that would have unlinked it) leaves it behind, and the next Broadcast.create on the
machine removes every vt-tp segment whose writer no longer runs.

Waiting: a reader spins for `spin_s` (where a step comes every few milliseconds and a core
per rank is there to spare) and then sleeps in growing steps up to 1 ms, checking every
`check_s` that the writer's process lives (`alive()`); the writer, when every slot is still
unread, waits the same way and checks its readers. Neither waits past `timeout_s`: a peer
that is gone or stuck becomes a PeerLostError naming it, never a hang.
"""
from __future__ import annotations

import os
import platform
import re
import secrets
import time
from multiprocessing import shared_memory
from typing import Callable
from vt.errors import VtError

SLOTS = 64
# How long a rank on a GPU spins for the next message before it sleeps: about a decode step,
# so that a worker launches each step within microseconds of rank 0 (one core per rank).
SPIN_S = 0.05
SLOT_BYTES = 64 * 1024
_HEAD_WORDS = 4          # seq, nbytes, last, pad
_SLOT_WORDS = _HEAD_WORDS + SLOT_BYTES // 8
_MAX_SLEEP_S = 1e-3
SEGMENT_PREFIX = "vt-tp-"
_SEGMENT_NAME = re.compile(re.escape(SEGMENT_PREFIX) + r"(\d+)-(\d+)-[0-9a-f]+")
SHM_DIR = "/dev/shm"      # where Linux keeps POSIX shared memory as files


class PeerLostError(VtError, RuntimeError):
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
        # Plain memoryviews: an item or a slice store through one costs tens of nanoseconds,
        # a numpy call on a few words a microsecond.
        self._bytes = shm.buf
        self._words = shm.buf.cast("q")
        self._closed_at = readers                        # the word of the closed flag
        self._base = readers + 1                         # the first slot's first word
        self.chunks = 0          # chunks written (writer) or read (reader) so far
        self.closed = False

    @classmethod
    def create(cls, readers: int) -> "Broadcast":
        _check_platform()
        if readers < 1:
            raise ValueError(f"Broadcast needs at least one reader, got {readers}")
        size = 8 * (readers + 1 + SLOTS * _SLOT_WORDS)
        remove_orphaned_segments()
        pid = os.getpid()
        name = f"{SEGMENT_PREFIX}{pid}-{_start_time(pid) or 0}-{secrets.token_hex(4)}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        shm.buf[:size] = bytes(size)
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
        words, total, at = self._words, len(view), 0
        while True:
            k = self.chunks
            if k - self._slowest() >= SLOTS:
                _wait(lambda: k - self._slowest() < SLOTS, alive, spin_s, timeout_s,
                      check_s, "a tensor-parallel rank stopped reading the step plans")
            head = self._base + (k % SLOTS) * _SLOT_WORDS
            n = min(SLOT_BYTES, total - at)
            start = (head + _HEAD_WORDS) * 8
            self._bytes[start:start + n] = view[at:at + n]
            words[head + 1], words[head + 2] = n, at + n == total
            words[head] = k + 1                  # publish: after the payload and length
            self.chunks = k + 1
            at += n
            if at == total:
                return

    def _slowest(self) -> int:
        """The fewest chunks any reader has consumed."""
        words = self._words
        return min(words[r] for r in range(self.readers)) if self.readers > 1 else words[0]

    def close(self) -> None:
        """Tell readers the writer is done, then drop the segment (the writer's, at the end)."""
        if self.closed:
            return
        self.closed = True
        if self.owner:
            self._words[self._closed_at] = 1
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
        words, parts = self._words, []
        while True:
            k = self.chunks
            head = self._base + (k % SLOTS) * _SLOT_WORDS
            if words[head] != k + 1:
                closed = self._closed_at
                _wait(lambda: words[head] == k + 1 or words[closed], alive, spin_s, timeout_s,
                      check_s, "rank 0 stopped sending step plans")
                if words[head] != k + 1:
                    return None                  # closed
            n, last = words[head + 1], words[head + 2]
            start = (head + _HEAD_WORDS) * 8
            parts.append(bytes(self._bytes[start:start + n]))
            self.chunks = k + 1
            words[self.reader] = k + 1           # the slot is the writer's again
            if last:
                return parts[0] if len(parts) == 1 else b"".join(parts)

    def detach(self) -> None:
        """A reader's end: unmap the segment (the writer unlinks it)."""
        if not self.closed:
            self.closed = True
            self._release()

    def __del__(self):
        # Dropped without close()/detach(): let go of the word view, or the segment's own
        # finalizer cannot unmap it.
        words = getattr(self, "_words", None)
        if words is not None:
            words.release()

    def _release(self) -> None:
        # views into the buffer must go before the mapping can close
        self._words.release()
        self._bytes = self._words = None
        try:
            self.shm.close()
        except BufferError:   # a view still held by a caller: the mapping goes with the process
            pass


def remove_orphaned_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the Broadcast segments in `shm_dir` whose writer no longer runs (module
    docstring); returns their names. A segment of another user's live or dead writer that
    this user may not unlink is left. Nothing to do where the segments are not files, or
    where processes cannot be looked up (no /proc)."""
    if not (os.path.isdir(shm_dir) and os.path.isdir("/proc/self")):
        return []
    removed = []
    for name in os.listdir(shm_dir):
        match = _SEGMENT_NAME.fullmatch(name)
        if match is None or _start_time(int(match.group(1))) == match.group(2):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
        except (FileNotFoundError, PermissionError):   # gone meanwhile, or not ours
            continue
        removed.append(name)
    return removed


def _start_time(pid: int) -> str | None:
    """When process `pid` started, in clock ticks since boot (/proc/PID/stat's 22nd field);
    None when it does not run or /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the fields after the command name, whose ")" closes field 2, begin with field 3
    return stat.rsplit(b")", 1)[1].split()[19].decode()


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
