"""The executor's modes against each other on the toy forward, on every backend.

The toy queues DEVICE_WORK_S of device time per decode, so the host runs ahead of the
device on sim and cuda alike: the regime where the host-overwrite hazard shows if a mode lets
it.
"""
import numpy as np
import pytest

from vt.engine.engine import Engine
from vt.forward.toy import ToyForward
from vt.config import ExecutorConfig
from vt.hooks import Poison

from engine_runs import VOCAB, mismatches, run_toy, undelayed_reference, workload

DEVICE_WORK_S = 0.002


@pytest.mark.parametrize("conc", [1, 32])
def test_off_path_is_byte_identical_to_a_synchronous_run(backend, conc):
    """Mode drain (single slot, drain) == mode sync: tokens and logits bytes."""
    prompts, budgets = workload(conc * 2 if conc > 1 else 4, seed=conc)
    ref, ref_stats = run_toy(backend, prompts, budgets, mode="sync", serving_conc=conc)
    off, off_stats = run_toy(backend, prompts, budgets, device_work_s=DEVICE_WORK_S,
                             serving_conc=conc)
    assert off_stats["graph_steps"] > 0 and ref_stats["graph_steps"] > 0
    assert all(len(r.tokens) == b for r, b in zip(ref, budgets))
    assert mismatches(ref, off) == 0


@pytest.mark.parametrize("mode", ["ring", "staged"])
@pytest.mark.parametrize("conc", [4, 32])
def test_ring_with_poison_matches_the_off_path(backend, conc, mode):
    """Ring ON + POISON, host running ahead: identical to OFF, and the drain really skipped."""
    prompts, budgets = workload(conc * 2, seed=10 + conc)
    off, _ = run_toy(backend, prompts, budgets, serving_conc=conc)
    ring, st = run_toy(backend, prompts, budgets, device_work_s=DEVICE_WORK_S, serving_conc=conc,
                       mode=mode, hooks=Poison())
    assert mismatches(off, ring) == 0
    owned = st["eager_steps"] + st["mixed_steps"] + st["prefill_steps"]
    assert st["graph_steps"] > owned
    assert st["drains"] <= owned   # only steps after owning steps drain


@pytest.mark.needs_overlap
def test_unguarded_with_poison_is_detected(backend):
    """Mode unguarded + POISON (no ring, no drain): replays read poisoned vectors, outputs
    differ."""
    prompts, budgets = workload(32, seed=3)
    off, _ = run_toy(backend, prompts, budgets, serving_conc=16)
    bad_results, st = run_toy(backend, prompts, budgets, device_work_s=DEVICE_WORK_S,
                              serving_conc=16, mode="unguarded", hooks=Poison())
    bad = mismatches(off, bad_results)
    print(f"unguarded+poison on {backend.name}: {bad} of {len(prompts)} requests mismatched")
    assert bad > 0


def test_unguarded_races_on_a_delayed_sim_even_without_poison(delayed_sim):
    """Mode unguarded alone: Refresh(N+1) overwrites the slot before Replay(N)'s H2D ran."""
    prompts, budgets = workload(16, seed=4)
    off, _ = undelayed_reference(prompts, budgets, serving_conc=16)
    raced, _ = run_toy(delayed_sim, prompts, budgets, serving_conc=16, mode="unguarded")
    bad = mismatches(off, raced)
    print(f"unguarded on a delayed sim: {bad} of {len(prompts)} requests mismatched")
    assert bad > 0


@pytest.mark.parametrize("mode", ["ring", "staged"])
def test_ring_with_poison_matches_off_on_a_delayed_sim(delayed_sim, mode):
    """The same race conditions as above, with the ring: no mismatch."""
    prompts, budgets = workload(16, seed=4)
    off, _ = undelayed_reference(prompts, budgets, serving_conc=16)
    # Two slots: the slot a step reuses is the one of the step before the last, often still
    # queued, so the guard has to block
    ring, st = run_toy(delayed_sim, prompts, budgets, serving_conc=16, mode=mode, hooks=Poison())
    assert mismatches(off, ring) == 0
    if mode == "ring":   # staged slots wait only for their short out-of-graph copy
        assert st["ring_waits"] > 0   # the guard had to block: it was exercised


def test_eager_only_matches_graphs(backend):
    """With no captured sizes every step is eager, and the tokens and logits are the same."""
    prompts, budgets = workload(8, seed=6)
    graphs, _ = run_toy(backend, prompts, budgets, serving_conc=8)
    eager, st = run_toy(backend, prompts, budgets, serving_conc=8, capture_sizes=())
    assert st["graph_steps"] == 0 and st["eager_steps"] > 0
    assert mismatches(graphs, eager) == 0


@pytest.mark.parametrize("mode", ["drain", "ring"])
def test_mixed_steps_replay_the_decode_graph(backend, mode):
    """A mixed step (prefill + decode) runs its decode rows as their captured graph: every
    graph replay is a graph step or a mixed step, and the tokens and recorded logits bytes
    equal an all-eager run's (the decode rows' logits are copied out of the graph's block)."""
    prompts, budgets = workload(24, seed=8)
    eager, _ = run_toy(backend, prompts, budgets, serving_conc=6, capture_sizes=())
    config = ExecutorConfig(serving_conc=6, mode=mode)
    toy = ToyForward(backend, vocab=VOCAB)
    hooks = Poison() if config.guarded else None
    with Engine(backend, toy.step_model(), config, hooks=hooks, record_logits=True) as eng:
        mixed = eng.generate(prompts, max_new_tokens=budgets)
        st = eng.stats()
        replays = sum(slot.output.generation for ring in eng.runner.driver.rings.values()
                      for slot in ring.slots)
    assert st["mixed_steps"] > 0 and st["graph_steps"] > 0
    assert replays == st["graph_steps"] + st["mixed_steps"]
    assert mismatches(eager, mixed) == 0


@pytest.mark.parametrize("budgets", [[6, 7], [7, 8]], ids=["full-in-slot-0", "full-in-slot-1"])
def test_the_ceiling_replays_the_fullest_of_the_sizes_last_steps(backend, budgets):
    """Two prompts of one length whose budgets differ by one: their last decode step carries
    one row, the step before it both, and the ring puts the two in different slots (size 2
    only, so one row pads to 2; which slot gets which follows the budgets' parity).
    Engine.device_ceiling_us(2) replays the slot whose last step had both rows, and leaves
    each slot's record of its last step as it was."""
    toy = ToyForward(backend, vocab=VOCAB)
    config = ExecutorConfig(serving_conc=2, mode="ring", capture_sizes=(2,))
    with Engine(backend, toy.step_model(), config) as eng:
        eng.generate([[1, 2, 3], [4, 5, 6]], max_new_tokens=budgets)
        slots = eng.runner.driver.rings[2].slots
        assert sorted(s.last_rows for s in slots) == [1, 2]
        before = {s.index: (s.output.generation, s.last_rows, s.last_index) for s in slots}
        assert eng.device_ceiling_us(2, replays=3) > 0
        replayed = [s for s in slots if s.output.generation != before[s.index][0]]
        assert [s.last_rows for s in replayed] == [2]
        assert all((s.last_rows, s.last_index) == before[s.index][1:] for s in slots)


def test_oversize_batch_falls_back_to_eager(backend):
    """Batches above the largest captured size run eagerly, with the same results."""
    prompts, budgets = workload(12, seed=7)
    ref, _ = run_toy(backend, prompts, budgets, serving_conc=12)
    small, st = run_toy(backend, prompts, budgets, serving_conc=12, capture_sizes=(1, 2, 4),
                        mode="ring")
    assert st["eager_steps"] > 0 and st["graph_steps"] > 0
    assert max(st["steps_by_size"]) <= 4
    assert mismatches(ref, small) == 0


@pytest.mark.parametrize("capture_sizes", [(1, 2, 4, 8), (1, 2)], ids=["graphs", "eager"])
def test_serving_run_makes_no_driver_malloc_after_warm_up(backend, capture_sizes):
    """From the first generate() on, with prompts of every length up to the context, serving
    calls the driver 0 times: prefill, mixed and eager steps run at warmed shapes."""
    from vt.engine.engine import Engine
    from vt.config import ExecutorConfig
    from vt.forward.toy import ToyForward
    rng = np.random.default_rng(8)
    toy = ToyForward(backend)
    lengths = [1, 2, 3, 64, 63, 33, 17, 5] + [int(n) for n in rng.integers(1, 65, size=16)]
    prompts = [rng.integers(0, toy.vocab, size=n) for n in lengths]
    budgets = [min(int(b), 65 - n) for b, n in zip(rng.integers(2, 10, size=len(prompts)), lengths)]
    config = ExecutorConfig(mode="ring", serving_conc=8, capture_sizes=capture_sizes)
    with Engine(backend, toy.step_model(), config) as eng:
        before = backend.pool.stats()
        results = eng.generate(prompts, max_new_tokens=budgets)
        after = backend.pool.stats()
        st = eng.stats()
    assert all(r.finish_reason == "length" for r in results)
    assert st["prefill_steps"] + st["mixed_steps"] > 0
    assert (st["eager_steps"] if capture_sizes == (1, 2) else st["graph_steps"]) > 0
    assert after.mallocs_during_capture == 0
    assert after.driver_mallocs == before.driver_mallocs, (before, after)
    assert st["driver_mallocs_since_warm_up"] == 0


def test_ring_wait_is_load_bearing(delayed_sim, monkeypatch):
    """The same ring with its reuse-event wait removed fails under POISON: the test can fail."""
    from vt.graphs.slot import SizeSlot
    monkeypatch.setattr(SizeSlot, "wait_reusable", lambda self, poll_s=0.0: 0.0)
    prompts, budgets = workload(16, seed=5)
    off, _ = undelayed_reference(prompts, budgets, serving_conc=16)
    broken, _ = run_toy(delayed_sim, prompts, budgets, serving_conc=16,
                        mode="ring", hooks=Poison())
    assert mismatches(off, broken) > 0
