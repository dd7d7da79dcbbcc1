"""What rank 0's per-step plan costs to broadcast to a tensor-parallel worker (vt.parallel).

Rank 0 writes a decode step of S rows (the engine's DecodeBatch, as the runner would see it)
into its encoder and publishes it; a worker process (spawned, as the engine spawns them)
receives it, applies it to its mirror of the rows, writes them into an input block as its
runner would, and answers through a second broadcast. Reported per step, over `--steps`
steps after a warm-up:

  send_us      rank 0's host time: encode + publish (on its critical path every step)
  one_way_us   half the round trip: publish, receive, decode, the block write, the answer
  change_us    the same round trip's half for a step whose batch changed (a request left and
               another joined: the token rows, sampling and block tables travel too)

Both sides spin while waiting (as the cuda backend's ranks do), so each needs a core.

  python3 tools/plan_broadcast_cost.py --rows 64 --max-context 4096 --block-size 16
  python3 tools/plan_broadcast_cost.py --rows 1 8 64 --json cost.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

import numpy as np

from vt.engine.batch import BatchStep, DecodeBatch
from vt.parallel import wire
from vt.parallel.channel import Broadcast
from vt.executor.plan import StepPlan
from vt.step import KVGeometry
from vt.step.contract import GREEDY
from vt.step.inputblock import InputBlock

SPIN_S = 1.0


class _Req:
    def __init__(self, row: int):
        self.row, self.batch_index, self.stop_tokens = row, -1, ()


def _echo(down: str, up: str, capacity: int, max_blocks: int, parent: int) -> None:
    """The worker: receive, apply, write into a block, answer with one byte."""
    rx, tx = Broadcast.attach(down, 1, 0), Broadcast.attach(up, 1, 0)
    mirror = wire.MirrorRows(capacity, max_blocks)
    block = InputBlock(np.zeros, capacity, max_blocks)
    alive = lambda: os.getppid() == parent   # noqa: E731
    pad = KVGeometry(max_seqs=capacity, num_kv_blocks=2, block_size=1, max_context=1).pad
    while (message := rx.receive(alive=alive, spin_s=SPIN_S)) is not None:
        plan = wire.decode_launch(message, mirror)
        plan.decode.write_into(block, pad)
        tx.publish(b"\x01", alive=alive, spin_s=SPIN_S)
    rx.detach()
    tx.detach()


def measure(rows: int, max_context: int, block_size: int, steps: int) -> dict:
    max_blocks = -(-max_context // block_size)
    capacity = max(rows, 1)
    geo = KVGeometry(max_seqs=capacity, num_kv_blocks=capacity * max_blocks + 1,
                     block_size=block_size, max_context=max_context)
    batch = DecodeBatch(capacity, max_blocks, block_size)
    rng = np.random.default_rng(0)

    def join(row: int) -> None:
        """A request of random length joins in `row` (continuous batching: when one leaves)."""
        table = rng.integers(1, geo.num_kv_blocks, size=max_blocks).astype(np.int32)
        pos = int(rng.integers(0, max_context // 2))
        batch.add(_Req(row), row, table, GREEDY, pos=pos, left=max_context - pos - 1, dest=0)
    for i in range(rows):
        join(i)
    down, up = Broadcast.create(1), Broadcast.create(1)
    # the answer channel's writer is the worker: here, the reader of `up`
    back = Broadcast.attach(up.name, 1, 0)
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_echo, args=(down.name, up.name, capacity, max_blocks, os.getpid()),
                       daemon=True)
    proc.start()
    encoder = wire.PlanEncoder(capacity, max_blocks, geo.pad)
    alive = proc.is_alive
    send, trip, change = [], [], []
    clock = time.perf_counter
    for step in range(steps + 200):
        batch.begin_step()
        t0 = clock()
        message = encoder.launch(StepPlan(BatchStep(batch)))
        down.publish(message, alive=alive, spin_s=SPIN_S)
        t1 = clock()
        back.receive(alive=alive, spin_s=SPIN_S)
        t2 = clock()
        for req in batch.end_step():   # leaves; another request takes its row
            batch.remove(req)
            join(req.row)
        if step >= 200:
            changed = wire.header(message)[1] & wire.STATIC
            (change if changed else trip).append((t2 - t0) / 2)
            if not changed:
                send.append(t1 - t0)
    down.close()
    proc.join(10)
    back.detach()
    up.close()
    us = lambda xs, q: round(float(np.percentile(xs, q)) * 1e6, 2)   # noqa: E731
    return dict(rows=rows, max_context=max_context, block_size=block_size, steps=steps,
                message_bytes=len(encoder.launch(StepPlan(BatchStep(batch)))),
                send_us_p50=us(send, 50), send_us_p99=us(send, 99),
                one_way_us_p50=us(trip, 50), one_way_us_p99=us(trip, 99),
                change_us_p50=us(change, 50) if change else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    out = []
    for rows in args.rows:
        r = measure(rows, args.max_context, args.block_size, args.steps)
        out.append(r)
        print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(results=out, cpus=os.cpu_count()), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
