"""The engine's one decode loop: admissions, prefill, stop tokens, block crossings and a
shrinking batch all run through it, and every mode gives the same tokens and logits, byte for
byte, as the synchronous run (the toy's KV blocks hold 4 tokens, so requests cross blocks;
budgets differ, so the batch shrinks through the graph sizes). Profiling wraps the same loop:
its tokens are the same and its host split adds up to the wall time it measured."""
import pytest

from vt.engine.engine import Engine
from vt.forward.toy import ToyForward
from vt.config import SAFE_MODES, ExecutorConfig
from vt.hooks import Poison

from engine_runs import VOCAB, mismatches, run_toy, undelayed_reference, workload

DEVICE_WORK_S = 0.002


@pytest.mark.parametrize("stop", [None, 3])
@pytest.mark.parametrize("mode", [m for m in SAFE_MODES if m != "sync"])
def test_every_mode_equals_the_synchronous_run(backend, mode, stop):
    prompts, budgets = workload(24, seed=21, max_new=(2, 30))   # more prompts than rows: admissions interleave
    ref, ref_st = run_toy(backend, prompts, budgets, serving_conc=8, mode="sync", stop_token=stop)
    got, st = run_toy(backend, prompts, budgets, serving_conc=8, device_work_s=DEVICE_WORK_S,
                      stop_token=stop, mode=mode)
    assert st["phases"]["prefill"]["steps"] > 1        # admissions interleaved with decoding
    assert st["graph_steps"] > st["phases"]["prefill"]["steps"]
    assert mismatches(ref, got) == 0
    assert st["steps"] == ref_st["steps"]   # the same schedule (a stop leaves at the same step)
    if stop is not None:
        assert any(r.finish_reason == "stop" for r in got)   # the stop was exercised


@pytest.mark.parametrize("mode", ["ring", "staged"])
def test_ring_with_poison_matches_off_with_the_host_far_ahead(delayed_sim, mode):
    """The host far ahead of the device and POISON writing every next slot as early as the
    ring allows: every decode step is guarded."""
    prompts, budgets = workload(16, seed=22, max_new=(4, 24))
    off, _ = undelayed_reference(prompts, budgets, serving_conc=16)
    ring, st = run_toy(delayed_sim, prompts, budgets, serving_conc=16, mode=mode,
                       hooks=Poison())
    assert st["graph_steps"] > 0
    assert mismatches(off, ring) == 0


def test_a_profiled_run_gives_the_same_tokens_and_a_split_that_adds_up(sim_backend):
    """profile=True times the same loop: same tokens and logits; per phase, the parts of the
    host split are non-negative and add up to at most the iterations' wall time."""
    prompts, budgets = workload(8, seed=23)
    ref, _ = run_toy(sim_backend, prompts, budgets, serving_conc=8, mode="ring")
    toy = ToyForward(sim_backend, vocab=VOCAB)
    with Engine(sim_backend, toy.step_model(), ExecutorConfig(mode="ring", serving_conc=8),
                record_logits=True, profile=True) as eng:
        profiled = eng.generate(prompts, max_new_tokens=budgets)
        phases = eng.stats()["phases"]
    assert mismatches(ref, profiled) == 0
    for name, ph in phases.items():
        parts = [ph[k] for k in ("plan_s", "collect_s", "acquire_s", "refresh_s", "launch_s",
                                 "drain_s")]
        assert all(p >= 0 for p in parts), (name, ph)
        # a phase's wall time starts after the plan that chose its kind of step, so that
        # plan may sit in the other phase's wall time
        assert ph["steps"] > 0 and 0 < sum(parts) <= ph["wall_s"] + ph["plan_s"], (name, ph)
    assert phases["decode"]["device_ms"] > 0


def test_a_profiled_run_times_every_prefill_step_on_the_device(sim_backend):
    """The profile samples decode steps for device time, but times every step that prefills:
    those are few and unlike each other (the first wave's prefill is the longest), so a
    sample of them would misstate their device time (it once put GPU busy above 1)."""
    prompts, budgets = workload(40, seed=5, max_new=(2, 40))
    toy = ToyForward(sim_backend, vocab=VOCAB)
    with Engine(sim_backend, toy.step_model(), ExecutorConfig(mode="ring", serving_conc=4),
                profile=True) as eng:
        eng.generate(prompts, max_new_tokens=budgets)
        phases = eng.stats()["phases"]
    pre, dec = phases["prefill"], phases["decode"]
    assert pre["steps"] > 16 and pre["device_steps"] == pre["steps"], pre
    assert 0 < dec["device_steps"] < dec["steps"], dec     # decode steps: a sample


def test_the_loop_reports_progress_per_step(sim_backend):
    """The progress callback sees every step's tokens, in order."""
    seen = []
    toy = ToyForward(sim_backend, vocab=VOCAB)
    with Engine(sim_backend, toy.step_model(), ExecutorConfig(mode="ring", serving_conc=4)) as eng:
        eng.generate([[1, 2]] * 4, max_new_tokens=12, progress=seen.append)
    assert [p.step for p in seen] == list(range(len(seen)))      # one call per step, in order
    assert seen[-1].tokens == 48 and seen[-1].finished == 4



def _profiled_plan(monkeypatch, costs):
    """A LoopProfile over iterations whose plan costs `costs` (a fake clock); the phase."""
    from types import SimpleNamespace

    import vt.engine.profile as profile
    from vt.engine.progress import Phase
    from vt.executor.plan import RunnerStats

    clock = [0.0]
    monkeypatch.setattr(profile.time, "perf_counter", lambda: clock[0])
    runner = SimpleNamespace(stats=RunnerStats(), timer=SimpleNamespace(every_step=False, armed=False))
    prof, phase = profile.LoopProfile(runner), Phase()
    prof.start_call((phase,))
    for cost in costs:
        timed = prof.begin()
        clock[0] += cost
        if timed:
            prof.planned()
            prof.launched()
        phase.steps += 1
        if timed:
            prof.end(phase)
    return phase


def test_the_split_weighs_each_timed_iteration_by_the_steps_it_stands_for(monkeypatch):
    """The first iterations of a busy period are all timed and run slower; the later ones are
    sampled one in EVERY. Each sample weighs the iterations it stands for, so the split per
    step is the true mean (here the plan costs 10 in the first 16 iterations, 1 after)."""
    from vt.engine.profile import EVERY, FIRST
    n = 11 * EVERY   # the last iteration is a timed one
    phase = _profiled_plan(monkeypatch, [10.0 if i <= FIRST else 1.0 for i in range(1, n + 1)])
    assert phase.sampled_steps == FIRST + n // EVERY
    assert phase.timed_steps == n
    assert phase.plan_s / phase.timed_steps == pytest.approx((10.0 * FIRST + (n - FIRST)) / n)


def test_the_sample_does_not_alias_with_block_crossings(monkeypatch):
    """A lockstep batch crosses a KV block every block_size steps (a power of two) and plans
    slower then; the sampled iterations must not all fall on those steps."""
    from vt.engine.profile import EVERY
    costs = [50.0 if i % 16 == 0 else 1.0 for i in range(1, 64 * EVERY + 1)]
    phase = _profiled_plan(monkeypatch, costs)
    assert phase.plan_s / phase.timed_steps == pytest.approx(sum(costs) / len(costs), rel=0.05)
