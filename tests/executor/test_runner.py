"""Runner (vt/executor/runner.py) alone, without an engine, on the toy forward: hand-made step
plans go to the path that fits them (a captured graph, the eager path, a prefill, a mixed
step), every path gives the tokens the others give for the same rows, the depth-2 launch and
collect contract refuses what it must, and the drain is skipped exactly where the mode says."""
import numpy as np
import pytest

from vt.backend import ClosedError
from vt.forward.toy import ToyForward
from vt.graphs.slot import SizeSlot
from vt.config import ExecutorConfig
from vt.executor.plan import StepPlan
from vt.executor.runner import Runner
from vt.step.contract import DecodeRows, KVGeometry, PrefillSeq, kv_slot

GEO = KVGeometry(max_seqs=8, num_kv_blocks=40, block_size=4, max_context=16)
VOCAB = 64
PROMPTS = {0: [3, 1, 4], 1: [1, 5, 9, 2, 6], 2: [5, 3]}   # row -> prompt
TABLES = {row: np.arange(1 + 4 * row, 5 + 4 * row, dtype=np.int32) for row in range(GEO.max_seqs)}


def _runner(be, capture_sizes, mode="drain"):
    toy = ToyForward(be, vocab=VOCAB, geometry=GEO)
    config = ExecutorConfig(mode=mode, serving_conc=GEO.max_seqs, capture_sizes=capture_sizes)
    runner = Runner(be, toy.step_model(), config)
    runner.capture()
    runner.warm_up(GEO.max_context)
    return runner


class _Sequences:
    """Each row's next input position: a prefill of L tokens samples the input of position
    L; each decode step moves it one on."""

    def __init__(self):
        self.next_pos = {}

    def prefill(self, rows):
        seqs = [PrefillSeq(r, np.asarray(PROMPTS[r], np.int32), TABLES[r], r) for r in rows]
        self.next_pos.update({r: len(PROMPTS[r]) for r in rows})
        return seqs

    def decode(self, rows):
        pos = np.array([self.next_pos[r] for r in rows], np.int32)
        bt = np.stack([TABLES[r] for r in rows])
        for r in rows:
            self.next_pos[r] += 1
        rows = np.asarray(rows, np.int32)
        return DecodeRows(rows, pos, pos + 1, kv_slot(bt, pos, GEO.block_size).astype(np.int32),
                          bt, rows.copy())


def _serve_plans(runner):
    """Prefill, graph-sized decode, mixed, oversize decode, one-row decode: launched at depth
    2 (the next step launched before the previous one's tokens are collected), as the engine
    does. Returns each step's kind and tokens."""
    seq = _Sequences()
    plans = [lambda: StepPlan(prefill=seq.prefill([0, 1])),
             lambda: StepPlan(seq.decode([0, 1])),
             lambda: StepPlan(seq.decode([0, 1]), seq.prefill([2])),
             lambda: StepPlan(seq.decode([0, 1, 2])),
             lambda: StepPlan(seq.decode([1]))]
    kinds, tokens, prev = [], [], None
    for make in plans:
        handle = runner.launch(make())
        kinds.append(handle.kind)
        if prev is not None:
            tokens.append(runner.collect(prev).tolist())
        prev = handle
    tokens.append(runner.collect(prev).tolist())
    return kinds, tokens


@pytest.mark.parametrize("mode", ["drain", "ring"])
def test_every_path_gives_the_tokens_of_the_eager_one(sim_backend, monkeypatch, mode):
    """Graph sizes 1 and 2: two rows replay a graph, a mixed step's two decode rows too, three
    rows run eagerly (no size fits); a runner without graphs runs every step eagerly. Both
    give the same tokens, each over its own toy state."""
    replays = []
    for name in ("launch", "launch_forward"):   # a replay is one of them: the whole step, or
        launch = getattr(SizeSlot, name)        # its forward with the sampler to follow
        monkeypatch.setattr(SizeSlot, name, lambda self, *a, launch=launch:
                            (replays.append(self.size), launch(self, *a))[1])
    graphs, eager = _runner(sim_backend, (1, 2), mode), _runner(sim_backend, (), mode)
    try:
        kinds, tokens = _serve_plans(graphs)
        graph_replays, replays[:] = list(replays), []
        eager_kinds, eager_tokens = _serve_plans(eager)
        graph_steps = graphs.stats.graph_steps
    finally:
        graphs.close()
        eager.close()
    assert kinds == ["prefill", "graph", "mixed", "eager", "graph"]
    assert eager_kinds == ["prefill", "eager", "mixed", "eager", "eager"]
    assert graph_steps == 2 and graph_replays == [2, 2, 1] and replays == []
    assert [len(t) for t in tokens] == [2, 2, 3, 3, 1]
    assert all(0 <= tok < VOCAB for step in tokens for tok in step)
    assert tokens == eager_tokens
    assert len({tuple(t) for t in tokens}) > 1   # the steps differ: their inputs were read


def test_launch_and_collect_refuse_what_depth_2_cannot_do(sim_backend):
    runner = _runner(sim_backend, (1, 2))
    seq = _Sequences()
    try:
        with pytest.raises(ValueError, match="an empty step"):
            runner.launch(StepPlan())
        n, zero = GEO.max_seqs + 1, np.zeros(GEO.max_seqs + 1, np.int32)
        too_many = DecodeRows(zero, zero, zero + 1, zero, np.zeros((n, GEO.max_blocks), np.int32),
                              zero)
        with pytest.raises(ValueError, match="exceeds max_seqs=8"):
            runner.launch(StepPlan(too_many))
        first = runner.launch(StepPlan(prefill=seq.prefill([0])))
        second = runner.launch(StepPlan(seq.decode([0])))
        with pytest.raises(RuntimeError, match="two steps"):
            runner.launch(StepPlan(seq.decode([0])))
        with pytest.raises(ValueError, match="not the oldest step in flight"):
            runner.collect(second)
        assert runner.collect(first).shape == (1,) and runner.collect(second).shape == (1,)
    finally:
        runner.close()
    with pytest.raises(ClosedError):
        runner.launch(StepPlan(seq.decode([0])))


@pytest.mark.parametrize("mode,drains_after", [("drain", {"prefill": 1, "graph": 3}),
                                               ("ring", {"prefill": 1})])
def test_the_drain_is_skipped_only_after_graph_steps_of_a_ring_mode(sim_backend, mode,
                                                                   drains_after):
    """Launching with the previous step still in flight waits for it first, unless that
    step's logits are a graph's view and the mode skips the drain (the ring's slot events
    guard it); a prefill step owns its logits, so the step after it always drains."""
    runner = _runner(sim_backend, (1, 2), mode)
    seq = _Sequences()
    try:
        prev = runner.launch(StepPlan(prefill=seq.prefill([0, 1])))
        for _ in range(4):
            handle = runner.launch(StepPlan(seq.decode([0, 1])))
            runner.collect(prev)
            prev = handle
        runner.collect(prev)
        stats = runner.stats
    finally:
        runner.close()
    assert stats.drains_after == drains_after
    assert stats.drains == sum(drains_after.values())


@pytest.mark.parametrize("mode", ["sync", "drain", "ring", "staged"])
def test_a_decode_step_is_one_graph_launch_and_a_split_one_two(backend, monkeypatch, mode):
    """launch(plan) replays a graph step as ONE graph launch (the slot's joined step graph);
    launch(sample=False) then launch_sampler: the forward graph alone, then the sampler
    graph, with a step collected between them as the serving loop does. The tokens are those
    of whole launches, byte for byte, each run over its own toy state."""
    def serve(split: bool):
        runner, seq = _runner(backend, (1, 2), mode), _Sequences()
        graph_class = type(runner.driver.rings[2].peek().output.whole)
        real_launch, launched = graph_class.launch, []
        monkeypatch.setattr(graph_class, "launch", lambda self, stream:
                            (launched.append(self.name.rsplit(" ", 1)[1]), real_launch(self, stream))[1])
        try:
            tokens, per_step = [], []
            prev = runner.launch(StepPlan(prefill=seq.prefill([0, 1])))
            for _ in range(4):
                launched.clear()
                handle = runner.launch(StepPlan(seq.decode([0, 1])), sample=not split)
                tokens.append(runner.collect(prev).tobytes())
                if split:
                    runner.launch_sampler(handle)
                per_step.append(list(launched))
                prev = handle
            tokens.append(runner.collect(prev).tobytes())
            return tokens, per_step, runner.stats.split_steps
        finally:
            monkeypatch.undo()
            runner.close()
    whole, split = serve(False), serve(True)
    assert whole[1] == [["step"]] * 4 and split[1] == [["forward", "sampler"]] * 4
    assert whole[2] == 0 and split[2] == 4
    assert split[0] == whole[0] and len(set(whole[0])) > 1


def test_a_split_launch_refuses_what_it_cannot_do(sim_backend):
    """Only a graph step launches its forward alone; its sampler comes before the next launch
    and before its collect, and only for that step."""
    runner, seq = _runner(sim_backend, (1, 2)), _Sequences()
    try:
        with pytest.raises(ValueError, match="runs eagerly: only a graph step"):
            runner.launch(StepPlan(prefill=seq.prefill([0, 1])), sample=False)
        first = runner.launch(StepPlan(prefill=seq.prefill([0, 1, 2])))
        assert not runner.splits(0) and runner.splits(2) and not runner.splits(3)
        with pytest.raises(ValueError, match="3 rows runs eagerly"):
            runner.launch(StepPlan(seq.decode([0, 1, 2])), sample=False)
        runner.collect(first)
        handle = runner.launch(StepPlan(seq.decode([0, 1])), sample=False)
        with pytest.raises(RuntimeError, match=f"step {handle.index} was launched without its "
                                               f"sampler; launch_sampler\\(\\) it before the next"):
            runner.launch(StepPlan(seq.decode([0, 1])))
        with pytest.raises(RuntimeError, match="before collecting it"):
            runner.collect(handle)
        with pytest.raises(ValueError, match=f"step {first.index} has no forward awaiting"):
            runner.launch_sampler(first)
        runner.launch_sampler(handle)
        with pytest.raises(ValueError, match=f"step {handle.index} has no forward awaiting"):
            runner.launch_sampler(handle)
        assert runner.collect(handle).shape == (2,)
    finally:
        runner.close()


def test_abort_launches_the_sampler_of_a_split_step(sim_backend):
    """A failure between a step's forward and its sampler: abort() completes the step on the
    device, so the slot's next step launches its forward as usual."""
    runner, seq = _runner(sim_backend, (1, 2), "ring"), _Sequences()
    try:
        runner.collect(runner.launch(StepPlan(prefill=seq.prefill([0, 1]))))
        for _ in range(2):   # both slots of size 2 left with a forward awaiting its sampler
            runner.launch(StepPlan(seq.decode([0, 1])), sample=False)
            assert runner.abort(RuntimeError("a grammar failed")) is None
        assert runner.collect(runner.launch(StepPlan(seq.decode([0, 1])))).shape == (2,)
    finally:
        runner.close()
