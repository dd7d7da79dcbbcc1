"""Scheduler (vt/engine/scheduler.py) alone, on bare Requests and no device: admission into
rows and KV blocks, the prefill budget (whole prompts, or chunks with a chunked step model),
the batch a launched step leaves behind (who joins, who leaves on its budget), the stop sets a
step's tag carries, and what leave() and reset() give back.

A step here is what the serving loop does with it: plan(pending), then after_launch(plan)."""
from collections import deque

import numpy as np

from vt.engine.requests import Request, RequestPhase
from vt.engine.scheduler import Scheduler
from vt.step.contract import KVGeometry

# 3 rows of 16 tokens, blocks of 4 tokens: 8 blocks besides the scratch block 0.
GEO = KVGeometry(max_seqs=3, num_kv_blocks=9, block_size=4, max_context=16)


def _request(index, prompt_len, max_new_tokens, stop_tokens=()):
    prompt = np.arange(1, prompt_len + 1, dtype=np.int32) + 100 * index
    return Request(index, prompt, max_new_tokens, stop_tokens=tuple(stop_tokens))


def _step(sched, pending):
    """One step as the loop runs it at depth 1: the plan, then, when it has rows to launch,
    the batch moved past its launch and the step seen complete (its collect)."""
    plan = sched.plan(pending)
    if plan.n:
        sched.after_launch(plan)
        sched.completed(plan.tag.t)
    return plan


def _blocks_for(req):
    """KV blocks of every position a request writes: its prompt and all but its last token."""
    return -(-(req.prompt_len + req.max_new_tokens - 1) // GEO.block_size)


def test_admission_gives_each_request_a_row_its_token_span_and_its_kv_blocks():
    sched = Scheduler(GEO, serving_conc=3, max_prefill_tokens=16)
    a, b = _request(0, 5, 4), _request(1, 2, 3)
    pending = deque([a, b])
    plan = sched.plan(pending)
    assert not pending and plan.admitted == [a, b] and plan.decode is None
    assert len({a.row, b.row}) == 2 and {a.row, b.row} <= set(range(GEO.max_seqs))
    for req in (a, b):
        assert req.span_start == req.row * GEO.max_context
        assert req.span_end == req.span_start + req.max_new_tokens
        assert req.first_step == 0 and req.prefilled == req.prompt_len
        assert len(req.blocks) == _blocks_for(req)      # 2 for a (8 positions), 1 for b
    assert not set(a.blocks) & set(b.blocks) and GEO.scratch_block not in a.blocks + b.blocks
    assert sched.blocks.free_count == sched.blocks.capacity - 3
    assert sched.rows.free_count == GEO.max_seqs - 2
    for req, seq in zip((a, b), plan.prefill):
        assert seq.row == req.row and seq.start == 0
        np.testing.assert_array_equal(seq.tokens, req.prompt)
        assert seq.block_table.tolist() == req.blocks + [GEO.scratch_block] * (
            GEO.max_blocks - len(req.blocks))
    assert plan.tag.t == 0 and plan.tag.dest.tolist() == [a.span_start, b.span_start]
    sched.after_launch(plan)
    assert sched.batch.n == 2 and list(plan.tag.leaving) == []
    nxt = sched.plan(deque())     # both decode; their next tokens go right after the first
    assert len(nxt.decode) == 2 and nxt.prefill == []
    assert nxt.tag.t == 1 and sorted(nxt.tag.dest.tolist()) == [a.span_start + 1, b.span_start + 1]


def test_serving_conc_bounds_admission_and_the_queue_stays_in_order():
    sched = Scheduler(GEO, serving_conc=2, max_prefill_tokens=16)
    reqs = [_request(i, 2, 4) for i in range(3)]
    pending = deque(reqs)
    assert _step(sched, pending).admitted == reqs[:2]
    assert list(pending) == [reqs[2]] and sched.rows.free_count == 1
    plan = _step(sched, pending)     # two running: nobody else is admitted
    assert plan.admitted == [] and plan.prefill == [] and len(plan.decode) == 2
    assert list(pending) == [reqs[2]]


def test_a_request_waits_for_kv_blocks_until_a_running_one_leaves():
    """4 blocks in all: the first request holds 3, so the second (2 blocks) waits, and the
    third (1 block, which would fit) waits behind it: admission is first come, first served.
    Both are admitted the step after the first one's last token launched."""
    geo = KVGeometry(max_seqs=3, num_kv_blocks=5, block_size=4, max_context=16)
    sched = Scheduler(geo, serving_conc=3, max_prefill_tokens=16)
    first, second, third = _request(0, 8, 5), _request(1, 4, 2), _request(2, 1, 2)
    assert (_blocks_for(first), _blocks_for(second), _blocks_for(third)) == (3, 2, 1)
    pending = deque([first, second, third])
    admitted_at, left_at = {}, {}
    for t in range(8):
        plan = _step(sched, pending)
        admitted_at.update({r.index: t for r in plan.admitted})
        left_at.update({r.index: t for r in plan.tag.leaving})
    # the first's tokens: 1 from its prefill (step 0), 4 from decode steps 1..4
    assert left_at[0] == 4 and admitted_at == {0: 0, 1: 5, 2: 5}
    assert left_at[1] == 6 and left_at[2] == 6
    assert sched.idle()


def test_whole_prompts_wait_for_a_step_with_prefill_budget_left():
    """Without chunks: the first prompt of a step is taken whole even past the budget; a
    later one that does not fit in what is left waits for the next step, and the queue
    behind it too."""
    sched = Scheduler(GEO, serving_conc=3, max_prefill_tokens=6)
    long, first, second, short = (_request(0, 10, 1), _request(1, 4, 1), _request(2, 3, 2),
                                  _request(3, 1, 2))
    pending = deque([long, first, second, short])
    plans = [_step(sched, pending) for _ in range(3)]
    assert [p.admitted for p in plans] == [[long], [first], [second, short]]
    assert [[len(s.tokens) for s in p.prefill] for p in plans] == [[10], [4], [3, 1]]


def test_chunked_prefill_splits_prompts_by_the_budget_and_joins_after_the_last_chunk():
    """max_prefill_tokens=4: a 10-token prompt comes as [0, 4), [4, 8), [8, 10); its
    non-final chunks' tokens go to the scratch entry, it joins the batch after its last
    chunk; the next prompt starts in the budget the last chunk left."""
    sched = Scheduler(GEO, serving_conc=3, max_prefill_tokens=4, chunked=True)
    a, b = _request(0, 10, 3), _request(1, 3, 2)
    pending = deque([a, b])
    plans = [_step(sched, pending) for _ in range(4)]
    chunks = [[(s.row, s.start, len(s.tokens)) for s in p.prefill] for p in plans]
    assert chunks[:3] == [[(a.row, 0, 4)], [(a.row, 4, 8)], [(a.row, 8, 10), (b.row, 0, 2)]]
    assert chunks[3] == [(b.row, 2, 3)]
    assert all(sum(end - start for _, start, end in c) <= 4 for c in chunks)
    assert [p.tag.dest.tolist() for p in plans[:2]] == [[sched.scratch_dest]] * 2
    assert plans[2].tag.dest.tolist() == [a.span_start, sched.scratch_dest]
    # step 3: a decodes (its second token), b's last chunk samples b's first token
    assert plans[3].tag.dest.tolist() == [a.span_start + 1, b.span_start]
    assert a.first_step == 2 and b.first_step == 3
    assert a.row is not None and len(a.blocks) == _blocks_for(a)   # held from the first chunk on
    assert [len(p.decode) if p.decode is not None else 0 for p in plans] == [0, 0, 0, 1]
    assert sched.batch.n == 2 and sched.prefilling == []


def test_a_request_walks_its_phases_and_its_positions_name_its_tokens():
    """WAITING until admitted; PREFILLING (a row and its blocks held) while chunks remain;
    DECODING from the plan of its last chunk, whose step is its first token's; its token of
    batch step t goes to entry(t) and the steps before t sample tokens_by(t) of them."""
    W, P, D = RequestPhase.WAITING, RequestPhase.PREFILLING, RequestPhase.DECODING
    sched = Scheduler(GEO, serving_conc=3, max_prefill_tokens=4, chunked=True)
    a, b = _request(0, 10, 3), _request(1, 3, 2)
    pending = deque([a, b])
    assert (a.phase, b.phase) == (W, W) and a.row is None and a.first_step is None
    phases = []
    for _ in range(4):
        _step(sched, pending)
        phases.append((a.phase, b.phase))
    assert phases == [(P, W), (P, W), (D, P), (D, D)]
    assert sched.prefilling == [] and a.first_step == 2 and b.first_step == 3
    assert [a.entry(t) for t in (2, 3, 4)] == [a.span_start + i for i in range(3)]
    assert [a.tokens_by(t) for t in (0, 2, 3, 5, 9)] == [0, 0, 1, 3, 3]   # at most max_new_tokens
    assert b.tokens_by(3) == 0 and b.tokens_by(4) == 1


def test_a_cancelled_prefilling_request_leaves_the_prefilling_list_and_its_row():
    sched = Scheduler(GEO, serving_conc=3, max_prefill_tokens=4, chunked=True)
    a = _request(0, 10, 3)
    _step(sched, deque([a]))
    assert a.phase is RequestPhase.PREFILLING and sched.prefilling == [a]
    sched.leave(a)
    assert sched.prefilling == [] and a.row is None and sched.idle()


def test_a_one_token_request_leaves_at_its_prefill_and_others_after_their_budget():
    sched = Scheduler(GEO, serving_conc=3, max_prefill_tokens=16)
    one, three = _request(0, 4, 1), _request(1, 4, 3)
    pending = deque([one, three])
    plan = _step(sched, pending)
    assert list(plan.tag.leaving) == [one]
    assert one.row is None and one.blocks == [] and sched.batch.n == 1
    assert sched.rows.free_count == GEO.max_seqs - 1
    leaving = [list(_step(sched, pending).tag.leaving) for _ in range(3)]
    assert leaving == [[], [three], []]
    assert sched.idle() and three.row is None


def test_a_steps_tag_carries_each_rows_request_and_stop_set():
    """A step whose rows have stop tokens names each row's request and its stops (-1 padded);
    a non-final chunk's row has none (its token is not the request's). leave(), what the
    loop does with a request that sampled a stop token, frees its row and blocks at once;
    with no stop set left in the batch, the tags carry none."""
    sched = Scheduler(GEO, serving_conc=3, max_prefill_tokens=6, chunked=True)
    stopping, plain, chunked = _request(0, 2, 5, stop_tokens=(7, 9)), _request(1, 3, 5), \
        _request(2, 4, 5, stop_tokens=(11,))
    pending = deque([stopping, plain, chunked])
    plan = _step(sched, pending)     # budget 6: 2 + 3 whole, 1 token of the third
    assert plan.tag.reqs == [stopping, plain, chunked]
    assert plan.tag.stops.tolist() == [[7, 9], [-1, -1], [-1, -1]]
    plan = _step(sched, pending)     # two decode rows, then the third's last chunk
    assert plan.tag.reqs == [stopping, plain, chunked]
    assert plan.tag.stops.tolist() == [[7, 9], [-1, -1], [11, -1]]
    sched.leave(stopping)
    sched.leave(chunked)
    assert sched.batch.n == 1 and sched.batch.reqs[0] is plain and plain.batch_index == 0
    assert stopping.row is chunked.row is None
    assert sched.blocks.free_count == sched.blocks.capacity - _blocks_for(plain)
    plan = _step(sched, pending)
    assert plan.tag.reqs is None and plan.tag.stops is None
    assert plan.tag.dest.tolist() == [plain.span_start + 2]


def test_reset_frees_everything_and_the_step_count_goes_on():
    """After a failure: every row and block free, nothing running, and step numbers never
    reused (the token buffer counts stored steps by them)."""
    sched = Scheduler(GEO, serving_conc=3, max_prefill_tokens=16)
    pending = deque([_request(0, 3, 6), _request(1, 2, 6)])
    for _ in range(3):
        _step(sched, pending)
    assert sched.batch.t == 3 and not sched.idle()
    sched.reset()
    assert sched.idle() and sched.batch.t == 3
    plan = _step(sched, deque([_request(2, 2, 2)]))
    assert plan.tag.t == 3 and plan.admitted[0].first_step == 3


def test_blocks_released_while_their_step_runs_wait_for_its_completion():
    """At depth 2 the host plans step t + 1 before it has seen step t complete: the blocks of
    a request whose last token step t samples are not reusable by that plan, only once step
    t is collected (vt/engine/kv_blocks.py's fence)."""
    geo = KVGeometry(max_seqs=3, num_kv_blocks=5, block_size=4, max_context=16)
    sched = Scheduler(geo, serving_conc=3, max_prefill_tokens=16)
    first, second = _request(0, 8, 2), _request(1, 8, 2)
    pending = deque([first, second])
    plan0 = sched.plan(pending)
    sched.after_launch(plan0)            # step 0: first's prefill (its first token)
    plan1 = sched.plan(pending)
    sched.after_launch(plan1)            # step 1: its last token; it leaves, step 1 in flight
    assert first in plan1.tag.leaving and sched.blocks.free_count == 4
    sched.completed(plan0.tag.t)
    assert sched.plan(pending).admitted == []      # step 1 not seen complete: second waits
    sched.completed(plan1.tag.t)
    assert sched.plan(pending).admitted == [second]
