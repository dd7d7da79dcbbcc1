"""RankGroup: the processes of one tensor-parallel engine, started and stopped together.

Rank 0 is the caller's process: its Engine schedules. Ranks 1..N-1 are worker processes
(multiprocessing's "spawn": a fresh interpreter each, as CUDA needs) that build their shard
of the model with the same `build(backend, tp)` and replay rank 0's runner calls
(vt/parallel/worker.py). The ranks meet twice: in torch.distributed's process group, whose
collectives run inside every step's forward (gloo on the sim, NCCL on cuda), and in a
shared-memory Broadcast that carries rank 0's per-step plan (vt/parallel/channel.py).

Failure is bounded, never a hang:
- a worker that raises sends its error through its status pipe, then exits; one that dies
  (killed, crashed) closes its sentinel. A monitor thread in rank 0 waits on both and marks
  the group failed with the reason; every later launch on rank 0 raises TensorParallelError
  with it, and a step blocked in a collective with the dead rank fails (gloo: the peer's
  connection closes at once; NCCL: the communicator is aborted, which ends the collective);
- a step that fails on rank 0 (the runner's abort) stops the group: rank 0 sends STOP, and
  terminates the workers that have not exited after STOP_GRACE_S (one may be blocked in a
  collective that rank 0 will never join);
- a worker whose rank 0 is gone finds out at its next wait for a plan (its parent process
  changed) or in its next collective, and exits.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Callable

import vt.parallel.wire as wire
from vt import env
from vt.parallel.channel import SPIN_S, Broadcast, PeerLostError
from vt.parallel.communicator import abort_communicators, warm_communicator
from vt.parallel.errors import TensorParallelError
from vt.parallel.worker import worker_main
from vt.validate import integer

STARTUP_TIMEOUT_S = 600.0     # a rank building its shard (reading a checkpoint) may take minutes
STOP_GRACE_S = 5.0            # workers still running this long after STOP are terminated
CLOSE_TIMEOUT_S = 60.0        # a clean close: each worker closes its runner and exits
# How long a failed step waits to see whether a worker died. A killed process shows as dead
# only once the kernel has torn down its memory, which for a torch process on a loaded 2-core
# machine was seen to take over 3 s; only the error path pays this wait, and it ends as soon
# as a worker shows as dead or the monitor thread has named the failure.
DEATH_WAIT_S = 10.0
# NVLink multicast (NVLS) stays off: the machines vt runs on do not lend it to every process.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass
class WorkerSpec:
    """What a worker process needs to become rank `rank` (pickled into it)."""
    rank: int
    size: int
    backend: str                 # the vt backend's name: "sim" or "cuda"
    dist_backend: str            # "gloo" or "nccl"
    init_method: str             # torch.distributed's rendezvous (tcp://127.0.0.1:port)
    channel: str                 # the Broadcast's shared-memory name
    build: Callable              # build(backend, tp) -> the rank's model (a step model or forward)
    config: object               # the engine's ExecutorConfig (no trace)
    hooks: object                # the engine's test hooks (vt.hooks)
    parent_pid: int
    collective_timeout_s: float
    env: dict
    status: object = None        # the sending end of the rank's status pipe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_picklable(build) -> None:
    if not callable(build):
        raise TypeError(f"tensor_parallel: the model must be given as build(backend, tp), a "
                        f"callable, got {type(build).__name__}")
    try:
        pickle.dumps(build)
    except Exception as exc:   # noqa: BLE001 (any pickling failure means the same)
        raise TypeError(f"tensor_parallel: build must be picklable (a module-level function, or "
                        f"a functools.partial of one): each rank builds its shard in its own "
                        f"process. Pickling it failed: {exc}") from exc


def _check_gpus(size: int) -> None:
    """One GPU per rank, refused before anything starts where there are fewer."""
    import torch
    count = torch.cuda.device_count()
    if count < size:
        raise ValueError(f"tensor_parallel={size} needs {size} GPUs, one per rank; this process "
                         f"sees {count} (CUDA_VISIBLE_DEVICES="
                         f"{env.foreign('CUDA_VISIBLE_DEVICES')!r})")


def worker_env(rank: int, backend: str) -> dict:
    """The variables a worker sets before anything else: on cuda, NCCL's switches and its own
    GPU as its device 0 (the rank-th of rank 0's visible ones)."""
    if backend != "cuda":
        return {}
    values = dict(NCCL_ENV)
    visible = env.foreign("CUDA_VISIBLE_DEVICES")
    ids = [i.strip() for i in visible.split(",")] if visible else [str(i) for i in range(rank + 1)]
    if rank >= len(ids):
        raise ValueError(f"tensor_parallel: rank {rank} has no GPU (CUDA_VISIBLE_DEVICES="
                         f"{visible!r})")
    values["CUDA_VISIBLE_DEVICES"] = ids[rank]
    return values


class RankGroup:
    """RankGroup(backend, build, size, config=..., hooks=...) spawns ranks 1..size-1, joins
    torch.distributed's group as rank 0, builds rank 0's model (`model`) and waits until
    every rank has built its own; if any of that fails it stops what it started and raises.
    `failure` is the reason the group stopped (None while healthy); `send(message)`
    publishes a runner call to every worker."""

    def __init__(self, backend, build, size: int, *, config, hooks,
                 collective_timeout_s: float = 60.0,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S):
        integer("tensor_parallel", size, 2)
        _check_picklable(build)
        import torch.distributed as dist
        if dist.is_initialized():
            raise RuntimeError("tensor_parallel: torch.distributed is already initialized in "
                               "this process; vt starts its own process group for the ranks "
                               "it spawns")
        if backend.name == "cuda":
            _check_gpus(size)
        self.size = size
        self.model = None
        self.failure: str | None = None
        self.dist_backend = "nccl" if backend.name == "cuda" else "gloo"
        self.spin_s = SPIN_S if backend.name == "cuda" else 0.0
        self._procs: list = []
        self._status: list = []
        self._channel: Broadcast | None = None
        self._monitor: threading.Thread | None = None
        self._closing = threading.Event()
        self._dist_up = False
        self._lock = threading.Lock()
        self.worker_reports: dict[int, dict] = {}   # rank -> its report at a clean close
        try:
            self._spawn(backend, build, config, hooks, collective_timeout_s, startup_timeout_s)
        except BaseException:
            self._shut_down(wire.simple(wire.STOP), STOP_GRACE_S)
            raise

    def _spawn(self, backend, build, config, hooks, collective_timeout_s, startup_timeout_s):
        import torch.distributed as dist
        from vt.torch.tensor_parallel import TensorParallel
        if self.dist_backend == "nccl":
            env.set_foreign(NCCL_ENV, keep_set=True)
        self._channel = Broadcast.create(self.size - 1)
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = multiprocessing.get_context("spawn")
        worker_config = replace(config, trace=None)   # rank 0 writes the trace
        for rank in range(1, self.size):
            recv, send = ctx.Pipe(duplex=False)
            spec = WorkerSpec(rank, self.size, backend.name, self.dist_backend, init_method,
                              self._channel.name, build, worker_config, hooks, os.getpid(),
                              collective_timeout_s, worker_env(rank, backend.name), send)
            proc = ctx.Process(target=worker_main, args=(spec,), name=f"vt-rank{rank}",
                               daemon=True)
            proc.start()
            send.close()
            self._procs.append(proc)
            self._status.append(recv)
        self._await("started", startup_timeout_s)
        dist.init_process_group(self.dist_backend, init_method=init_method, rank=0,
                                world_size=self.size,
                                timeout=timedelta(seconds=collective_timeout_s))
        self._dist_up = True
        warm_communicator(backend)
        self.model = build(backend, TensorParallel(0, self.size))
        self._await("ready", startup_timeout_s)
        self._monitor = threading.Thread(target=self._watch, name="vt-rank-monitor", daemon=True)
        self._monitor.start()

    def _await(self, what: str, timeout_s: float) -> None:
        """Wait for every worker's `what` message; a worker's error or death raises."""
        deadline = time.monotonic() + timeout_s
        waiting = dict(enumerate(self._status, start=1))
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TensorParallelError(f"ranks {sorted(waiting)} did not report {what!r} "
                                          f"within {timeout_s:g} s")
            sentinels = {self._procs[r - 1].sentinel: r for r in waiting}
            ready = multiprocessing.connection.wait([*waiting.values(), *sentinels], left)
            for obj in ready:
                if obj in sentinels:
                    rank = sentinels[obj]
                    if self._status[rank - 1].poll():
                        continue   # its last message first
                    raise TensorParallelError(self._death(rank))
                rank = next(r for r, conn in waiting.items() if conn is obj)
                message = _read(obj)
                if message is None:
                    raise TensorParallelError(self._death(rank))
                if message[0] == "error":
                    raise TensorParallelError(message[1])
                if message[0] == what:
                    del waiting[rank]

    def _death(self, rank: int) -> str:
        proc = self._procs[rank - 1]
        proc.join(1.0)
        code = proc.exitcode
        how = (f"killed by signal {-code}" if code is not None and code < 0 else
               f"exit code {code}" if code is not None else "its pipe closed")
        return f"tensor-parallel rank {rank} (pid {proc.pid}) died: {how}"

    def _watch(self) -> None:
        """The monitor thread: the first worker error or death marks the group failed."""
        conns = {conn: rank for rank, conn in enumerate(self._status, start=1)}
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs, start=1)}
        while not self._closing.is_set():
            ready = multiprocessing.connection.wait([*conns, *sentinels], 0.5)
            for obj in ready:
                if self._closing.is_set():
                    return
                if obj in conns:
                    message = _read(obj)
                    if message is not None and message[0] != "error":
                        continue
                    rank = conns.pop(obj)
                    self.fail(message[1] if message else self._death(rank))
                else:
                    rank = sentinels.pop(obj)
                    self.fail(self._death(rank))
            if self.failure is not None:
                return

    def fail(self, reason: str) -> None:
        """Mark the group failed (the first reason stays) and unblock rank 0's collectives."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
        if self.dist_backend == "nccl":
            abort_communicators()

    def check(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(f"the tensor-parallel group has stopped: {self.failure}")

    def alive(self) -> bool:
        return self.failure is None and all(p.is_alive() for p in self._procs)

    def send(self, message: bytes) -> None:
        """Publish a runner call to every worker; a lost worker fails the group."""
        self.check()
        try:
            self._channel.publish(message, alive=self.alive, spin_s=self.spin_s)
        except PeerLostError as exc:
            self.fail(str(exc))
            self.check()

    def stop(self, reason: str) -> None:
        """A step failed on rank 0: stop every rank (module docstring). A worker found dead
        by then is the better reason (a collective with it is what failed)."""
        if self.failure is None and not self._closing.is_set():
            # A killed worker's sockets close before its exit can be seen: a collective with it
            # may fail first. Give a dying worker a moment to show as dead.
            deadline = time.monotonic() + DEATH_WAIT_S
            dead = []
            while not dead and self.failure is None and time.monotonic() < deadline:
                multiprocessing.connection.wait([p.sentinel for p in self._procs], 0.1)
                dead = [rank for rank, p in enumerate(self._procs, start=1) if not p.is_alive()]
            if dead:
                reason = self._death(dead[0])
        self.fail(reason)
        self._shut_down(wire.simple(wire.STOP), STOP_GRACE_S)

    def close(self) -> None:
        """Clean close: every worker closes its runner and exits; then rank 0 leaves the
        process group. Idempotent."""
        self._shut_down(wire.simple(wire.CLOSE), CLOSE_TIMEOUT_S)

    def _shut_down(self, message: bytes, grace_s: float) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        if self._channel is not None and any(p.is_alive() for p in self._procs):
            try:   # a ring a stuck worker keeps full is waited on for the grace only
                self._channel.publish(message, alive=self.alive, timeout_s=grace_s)
            except PeerLostError:
                pass
        deadline = time.monotonic() + grace_s
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(2.0)
        for rank, conn in enumerate(self._status, start=1):
            while True:
                message = _read(conn) if conn.poll() else None
                if message is None:
                    break
                if message[0] == "report":
                    self.worker_reports[rank] = message[1]
            conn.close()
        if self._channel is not None:
            self._channel.close()
        if self._dist_up:
            import torch.distributed as dist
            dist.destroy_process_group()
            self._dist_up = False

    @property
    def worker_pids(self) -> list[int]:
        """The worker processes' ids, rank 1 first."""
        return [p.pid for p in self._procs]

    def worker_exit_codes(self) -> list:
        """Each worker's exit code, rank 1 first (None while it runs)."""
        return [p.exitcode for p in self._procs]


def _read(conn):
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None
