"""The step plan on the wire: what a worker writes into its blocks from rank 0's messages is
byte for byte what rank 0's runner writes from the plan itself, step after step, while
requests join, cross KV blocks and leave; and the shared-memory broadcast delivers every
message whole, in order, to every reader, however far the readers lag."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from vt.engine.batch import BatchStep, DecodeBatch
from vt.parallel import wire
from vt.parallel.channel import SLOT_BYTES, SLOTS, Broadcast, PeerLostError
from vt.executor.plan import StepPlan
from vt.sampling.params import SamplingParams
from vt.step.contract import GREEDY, DecodeRows, PrefillSeq
from vt.step.inputblock import InputBlock
from vt.step import KVGeometry

GEO = KVGeometry(max_seqs=16, num_kv_blocks=80, block_size=4, max_context=64)
CAP, MB = GEO.max_seqs, GEO.max_blocks


class _Req:
    def __init__(self, stops=()):
        self.batch_index, self.stop_tokens = -1, stops


def _block():
    return InputBlock(np.zeros, CAP, MB)


def test_a_worker_writes_the_blocks_rank_0_writes_while_the_batch_changes():
    rng = np.random.default_rng(3)
    batch = DecodeBatch(CAP, MB, GEO.block_size)
    encoder, mirror = wire.PlanEncoder(CAP, MB, GEO.pad), wire.MirrorRows(CAP, MB)
    # two blocks each side, used in turn, as a ring's two slots are
    direct, replayed = [_block(), _block()], [_block(), _block()]
    live, sent_static = [], 0
    for step in range(120):
        batch.begin_step()
        if rng.random() < 0.3 and batch.n < CAP:       # a request joins
            req = _Req()
            table = rng.integers(1, GEO.num_kv_blocks, size=MB).astype(np.int32)
            pos = int(rng.integers(0, 20))
            sampling = SamplingParams(temperature=float(rng.random()), top_k=int(rng.integers(0, 9)),
                                      seed=int(rng.integers(0, 2**40))) if rng.random() < 0.5 else GREEDY
            batch.add(req, int(rng.integers(0, CAP)), table, sampling, pos=pos,
                      left=int(rng.integers(1, 30)), dest=0)
            live.append(req)
        if batch.n == 0:
            batch.end_step()
            continue
        plan = StepPlan(BatchStep(batch))
        message = encoder.launch(plan)
        sent_static += bool(wire.header(message)[1] & wire.STATIC)
        decoded = wire.decode_launch(message, mirror)
        plan.decode.write_into(direct[step % 2], GEO.pad)
        decoded.decode.write_into(replayed[step % 2], GEO.pad)
        n = batch.n
        for f in ("raw",):
            a, b = getattr(direct[step % 2], f), getattr(replayed[step % 2], f)
            assert np.array_equal(a, b), f"step {step}: the replayed block differs"
        for req in batch.end_step():
            batch.remove(req)
        assert n == len(decoded.decode)
    assert 5 < sent_static < 100   # statics travel only when the batch changed


def test_prompts_and_plain_rows_travel_whole():
    encoder, mirror = wire.PlanEncoder(CAP, MB, GEO.pad), wire.MirrorRows(CAP, MB)
    seqs = [PrefillSeq(row=3, tokens=np.arange(37, dtype=np.int32),
                       block_table=np.arange(MB, dtype=np.int32), state_idx=3,
                       sampling=SamplingParams(temperature=0.7, seed=9), start=8)]
    z = np.zeros(2, np.int32)
    rows = DecodeRows(np.array([1, 2], np.int32), np.array([5, 9], np.int32),
                      np.array([6, 10], np.int32), np.array([21, 40], np.int32),
                      np.ones((2, MB), np.int32), z)
    plan = wire.decode_launch(encoder.launch(StepPlan(rows, seqs)), mirror)
    (seq,) = plan.prefill
    assert seq.start == 8 and seq.sampling == seqs[0].sampling
    assert np.array_equal(seq.tokens, seqs[0].tokens)
    a, b = _block(), _block()
    rows.write_into(a, GEO.pad)
    plan.decode.write_into(b, GEO.pad)
    assert np.array_equal(a.raw, b.raw)
    only_prompts = wire.decode_launch(encoder.launch(StepPlan(None, seqs)), mirror)
    assert only_prompts.decode is None and only_prompts.n == 1


def test_the_broadcast_delivers_every_message_in_order_to_every_reader():
    writer = Broadcast.create(2)
    readers = [Broadcast.attach(writer.name, 2, r) for r in range(2)]
    rng = np.random.default_rng(0)
    # more messages than slots, some spanning several slots
    messages = [rng.integers(0, 256, size=int(n), dtype=np.uint8).tobytes()
                for n in rng.choice([0, 1, 100, SLOT_BYTES, 3 * SLOT_BYTES + 17], size=3 * SLOTS)]
    got = [[], []]

    def read(r):
        while (m := readers[r].receive(alive=lambda: True, timeout_s=30)) is not None:
            got[r].append(m)
    threads = [threading.Thread(target=read, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for m in messages:
        writer.publish(m, alive=lambda: True, timeout_s=30)
    writer.close()
    for t in threads:
        t.join(30)
    assert got == [messages, messages]
    for r in readers:
        r.detach()


def test_a_lost_peer_is_an_error_not_a_hang():
    writer = Broadcast.create(1)
    reader = Broadcast.attach(writer.name, 1, 0)
    with pytest.raises(PeerLostError, match="its process has ended"):
        reader.receive(alive=lambda: False, check_s=0.01)
    for _ in range(SLOTS):                 # fill every slot; the reader reads none
        writer.publish(b"x", alive=lambda: True)
    with pytest.raises(PeerLostError, match="stopped reading"):
        writer.publish(b"x", alive=lambda: False, check_s=0.01)
    with pytest.raises(PeerLostError, match="nothing for 0.05 s"):
        writer.publish(b"x", alive=lambda: True, timeout_s=0.05, check_s=0.01)
    reader.detach()
    writer.close()


def test_each_cuda_worker_sees_its_own_gpu_as_device_0(monkeypatch):
    from vt.parallel.group import NCCL_ENV, worker_env
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert worker_env(1, "sim") == {}
    assert worker_env(3, "cuda") == dict(NCCL_ENV, CUDA_VISIBLE_DEVICES="3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 6,7")
    assert worker_env(1, "cuda")["CUDA_VISIBLE_DEVICES"] == "6"
    with pytest.raises(ValueError, match="rank 3 has no GPU"):
        worker_env(3, "cuda")
