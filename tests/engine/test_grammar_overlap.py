"""Constrained requests keep the ring's overlap: while one is live, a decode step that replays
a graph launches its forward before the step in flight is collected, and only its sampler
waits for the masks built from that step's tokens (vt/engine/serving.py). The tokens are
those of every other mode, sync included, byte for byte, and a request without a grammar
samples what it samples alone. The mask staging the host rewrites while a queued copy may
still read it has a guard, and vt.hooks.MaskPoison is its detector (vt/sampling/token_mask.py)."""
import numpy as np
import pytest

from engine_runs import VOCAB
from toy_grammar import ToyGrammar, follows
from vt import SamplingParams
from vt.config import SAFE_MODES, ExecutorConfig
from vt.engine.engine import Engine
from vt.executor.runner import Runner
from vt.forward.toy import ToyForward
from vt.hooks import NULL_HOOKS, MaskPoison, with_device_work

PROMPTS = [[3, 9, 9], [12, 4], [7, 7, 7, 1], [20], [2, 2, 5, 8, 1], [9, 1]]
PLAIN = [SamplingParams(0.0), SamplingParams(0.9, seed=4), SamplingParams(0.0),
         SamplingParams(1.3, seed=2), SamplingParams(0.7, seed=9), SamplingParams(1.0, seed=5)]
CONSTRAINED = (1, 2, 5)
BUDGETS = [12, 10, 12, 9, 11, 12]


def _asks(constrained=CONSTRAINED):
    return [SamplingParams(sp.temperature, seed=sp.seed, grammar=ToyGrammar(VOCAB)) if i in constrained
            else sp for i, sp in enumerate(PLAIN)]


def _run(be, mode, sampling, *, hooks=NULL_HOOKS, device_work_s=0.0):
    """Results (tokens, finish reason, recorded logits) and the runner's stats of one
    generate() on a fresh toy forward, 8 rows, graphs of 1, 2, 4 and 8 rows."""
    step = with_device_work(ToyForward(be, vocab=VOCAB).step_model(), device_work_s)
    config = ExecutorConfig(mode=mode, serving_conc=8, capture_sizes=(1, 2, 4, 8))
    with Engine(be, step, config, hooks=hooks, record_logits=True) as eng:
        results = eng.generate(PROMPTS, max_new_tokens=BUDGETS, sampling=sampling)
        stats = eng.stats()
    return results, stats


def _same(a, b) -> bool:
    return (a.tokens == b.tokens and a.finish_reason == b.finish_reason
            and a.logits.tobytes() == b.logits.tobytes())


def test_constrained_tokens_are_byte_identical_in_every_mode_and_neighbours_unchanged(backend):
    alone, _ = _run(backend, "sync", PLAIN)
    by_mode = {mode: _run(backend, mode, _asks()) for mode in SAFE_MODES}
    ref = by_mode["sync"][0]
    for mode, (results, stats) in by_mode.items():
        assert stats["split_steps"] == (0 if mode == "sync" else stats["graph_steps"]), mode
        for i, (got, r, a) in enumerate(zip(results, ref, alone)):
            assert _same(got, r), (mode, i)
            if i in CONSTRAINED:
                assert len(got.tokens) == BUDGETS[i] and follows(got.tokens, VOCAB), (mode, i)
                assert not follows(a.tokens, VOCAB), i   # unconstrained, the same request strays
            else:
                assert _same(got, a), (mode, i)   # a constrained neighbour changes nothing


def test_a_constrained_step_launches_its_forward_before_the_step_in_flight_is_collected(
        sim_backend, monkeypatch):
    """At depth 2 with a constrained request live, each decode graph step goes: its forward,
    then the collect of the step before (its tokens feed the grammars), then its sampler."""
    events = []
    launch, sampler, collect = Runner.launch, Runner.launch_sampler, Runner.collect

    def logged_launch(self, plan, *, sample=True):
        handle = launch(self, plan, sample=sample)
        events.append(("launch" if sample else "forward", handle.index))
        return handle
    monkeypatch.setattr(Runner, "launch", logged_launch)
    monkeypatch.setattr(Runner, "launch_sampler",
                        lambda self, h: (sampler(self, h), events.append(("sampler", h.index)))[0])
    monkeypatch.setattr(Runner, "collect",
                        lambda self, h: (events.append(("collect", h.index)), collect(self, h))[1])
    results, stats = _run(sim_backend, "ring", _asks())
    assert all(follows(results[i].tokens, VOCAB) for i in CONSTRAINED)
    forwards = [i for kind, i in events if kind == "forward"]
    assert len(forwards) == stats["split_steps"] >= max(BUDGETS) - 2
    for i in forwards:
        at = events.index(("forward", i))
        assert events[at + 1:at + 3] == [("collect", i - 1), ("sampler", i)], events[at - 2:at + 4]


@pytest.mark.parametrize("fence", [True, False])
def test_mask_staging_guard_keeps_a_poisoned_staging_row_from_the_sampler(backend, fence):
    """MaskPoison zeroes each row's staging right after its copy was queued (behind a forward
    given 20 ms of device time, so the copy is still queued): fenced, it waits for the copy
    first and nothing changes; unfenced, the copy reads the zeroed mask (every token
    disallowed) and the constrained rows end in error."""
    clean, _ = _run(backend, "ring", _asks(), device_work_s=0.02)
    arm = MaskPoison(lambda staging, row: staging.fill(0), fence=fence)
    poisoned, stats = _run(backend, "ring", _asks(), hooks=arm, device_work_s=0.02)
    assert arm.poisoned >= stats["split_steps"] > 0
    bad = [i for i, (a, b) in enumerate(zip(clean, poisoned)) if not _same(a, b)]
    if fence:
        assert bad == []
    else:
        assert set(bad) == set(CONSTRAINED)
        assert all(poisoned[i].finish_reason == "error" for i in CONSTRAINED)
