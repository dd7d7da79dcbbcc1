"""A worker rank: build the shard, then make every runner call rank 0 makes, in its order.

worker_main runs in a process RankGroup spawned. It joins torch.distributed's group, builds
the rank's model with the user's build(backend, tp), makes a Runner with the engine's
config and hooks, and reports "ready" through its status pipe. Then it replays rank 0's
runner calls (vt/parallel/wire.py) until CLOSE, STOP, or rank 0's end. Any exception is
sent to rank 0 as ("error", message) before the process exits with code 1: rank 0's
monitor turns it into the group's failure (vt/parallel/group.py).
"""
from __future__ import annotations

import os
import traceback
from collections import deque

import numpy as np

import vt.parallel.wire as wire
from vt import env
from vt.parallel.channel import SPIN_S, Broadcast
from vt.parallel.errors import RanksDivergedError


def worker_main(spec) -> None:
    env.set_foreign(spec.env)   # before anything initializes CUDA
    status = spec.status
    try:
        status.send(("started",))
        _serve(spec, status)
    except BaseException as exc:   # noqa: BLE001 (reported to rank 0, then the process ends)
        detail = traceback.format_exc(limit=8)
        try:
            status.send(("error", f"tensor-parallel rank {spec.rank} failed: "
                                  f"{type(exc).__name__}: {exc}\n{detail}"))
        except OSError:
            pass
        os._exit(1)


def _serve(spec, status) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from vt.backend import get_backend
    from vt.forward.adapt import as_step_model
    from vt.parallel.communicator import warm_communicator
    from vt.executor.runner import Runner
    from vt.torch.tensor_parallel import TensorParallel

    if spec.backend == "sim":   # the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.size))
    dist.init_process_group(spec.dist_backend, init_method=spec.init_method, rank=spec.rank,
                            world_size=spec.size,
                            timeout=timedelta(seconds=spec.collective_timeout_s))
    be = get_backend(spec.backend)
    warm_communicator(be)
    model = as_step_model(be, spec.build(be, TensorParallel(spec.rank, spec.size)))
    runner = Runner(be, model, spec.config, hooks=spec.hooks)
    channel = Broadcast.attach(spec.channel, spec.size - 1, spec.rank - 1)
    try:
        status.send(("ready",))
        be.bind_thread()
        how, warm_mallocs = replay(runner, channel, model.geometry.max_blocks,
                                   alive=lambda: os.getppid() == spec.parent_pid,
                                   spin_s=SPIN_S if spec.backend == "cuda" else 0.0)
        if how == "closed":
            status.send(("report", report(runner, be, warm_mallocs)))
    finally:
        try:
            runner.close()
        finally:
            channel.detach()
            dist.destroy_process_group()


def report(runner, be, warm_mallocs: int | None) -> dict:
    """What a worker tells rank 0 at a clean close: the steps it ran by kind and size, and
    the driver mallocs since its warm-up (0: no capture or step of this rank grew the pool)."""
    st = runner.stats
    return dict(steps=st.steps, graph_steps=st.graph_steps, eager_steps=st.eager_steps,
                mixed_steps=st.mixed_steps, prefill_steps=st.prefill_steps,
                steps_by_size=dict(st.steps_by_size),
                driver_mallocs_since_warm_up=None if warm_mallocs is None else
                be.pool.stats().driver_mallocs - warm_mallocs)


def replay(runner, channel: Broadcast, max_blocks: int, *, alive,
           spin_s: float) -> tuple[str, int | None]:
    """Make rank 0's runner calls on `runner` until CLOSE ("closed"), STOP ("stopped") or
    the channel's end ("closed"); returns that and the pool's driver mallocs after the
    warm-up (None: none came). A COLLECT whose tokens differ from this rank's raises
    RanksDivergedError."""
    rows = wire.MirrorRows(runner.capacity, max_blocks)
    warm_mallocs = None
    inflight: deque = deque()
    while True:
        message = channel.receive(alive=alive, spin_s=spin_s)
        if message is None:
            return "closed", warm_mallocs
        op, _, n, value = wire.header(message)
        if op == wire.LAUNCH:
            inflight.append(runner.launch(wire.decode_launch(message, rows)))
        elif op == wire.COLLECT:
            handle = inflight.popleft()
            tokens = runner.collect(handle)
            expected = np.frombuffer(wire.body(message), np.int32)
            if not np.array_equal(tokens, expected):
                raise RanksDivergedError(f"step {handle.index}: this rank sampled "
                                         f"{tokens.tolist()[:8]}..., rank 0 "
                                         f"{expected.tolist()[:8]}...")
        elif op == wire.CAPTURE:
            runner.capture()
        elif op == wire.WARM_UP:
            runner.warm_up(value)
            warm_mallocs = runner.be.pool.stats().driver_mallocs
        elif op == wire.CEILING:
            runner.ceiling_us(n, value)
        elif op == wire.STOP:
            runner.abort()
            return "stopped", warm_mallocs
        elif op == wire.CLOSE:
            return "closed", warm_mallocs
        else:
            raise ValueError(f"unknown runner call {op} from rank 0")
