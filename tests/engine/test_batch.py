"""DecodeBatch against a direct computation: after any joins, leaves and block crossings, the
rows a step writes hold each request's position, length and KV slot (vt.step.contract.kv_slot of its
block table at that position), whether few requests cross a block at once (one at a time) or
many (one vectorised update)."""
import types

import numpy as np
import pytest

from vt.engine.batch import BatchStep, DecodeBatch
from vt.step.inputblock import InputBlock
from vt.step.contract import GREEDY, PadRow, kv_slot

BS, MAX_BLOCKS, CAP = 4, 16, 40
PAD = PadRow(token_row=CAP, position=0, seq_len=1, slot=0, block=0, state_idx=CAP)


def _check_step(batch: DecodeBatch, live: dict) -> None:
    """Fill a block for the step at batch.t and compare every row with the direct formula."""
    block = InputBlock(np.zeros, CAP, MAX_BLOCKS)
    BatchStep(batch).write_into(block, PAD)
    inp = block.inputs
    for i in range(batch.n):
        req = batch.reqs[i]
        pos = live[req.index] + batch.t
        assert inp.positions[i] == pos and inp.seq_lens[i] == pos + 1, (req.index, batch.t)
        assert inp.slot_mapping[i] == kv_slot(batch.block_tables[i], pos, BS), (req.index, batch.t)


@pytest.mark.parametrize("group", [1, 3, 12, 30], ids=lambda g: f"join{g}")
def test_rows_follow_positions_across_block_crossings(group):
    rng = np.random.default_rng(group)
    batch = DecodeBatch(CAP, MAX_BLOCKS, BS)
    live, next_index = {}, 0            # request index -> its position - t
    for step in range(60):
        if step % 15 == 0:              # a group joins at once (same or different positions)
            for _ in range(min(group, CAP - batch.n)):
                req = types.SimpleNamespace(index=next_index, batch_index=-1, stop_tokens=())
                pos = int(rng.integers(1, 6)) if group < 12 else 3
                bt = rng.permutation(200)[:MAX_BLOCKS].astype(np.int32)
                batch.add(req, next_index % CAP, bt, GREEDY, pos=pos, left=int(rng.integers(5, 40)),
                          dest=0)
                live[next_index] = pos - batch.t
                next_index += 1
        batch.begin_step()
        _check_step(batch, live)
        for req in batch.end_step():    # leaves after the launch of its last token
            batch.remove(req)           # (a no-op for one that stopped before)
            live.pop(req.index, None)
        if step % 7 == 3 and batch.n > 2:   # and one stops early now and then
            gone = batch.reqs[int(rng.integers(0, batch.n))]
            batch.remove(gone)
            del live[gone.index]
    assert next_index > group
