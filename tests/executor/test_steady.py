"""The engine's steady loop (Engine._steady): the decode-only steps it takes give the same
tokens and logits, byte for byte, as the synchronous run (depth 1, which never uses it), in
every mode, with and without stop tokens, while requests cross KV blocks (the toy's blocks
hold 4 tokens), leave at different steps and shrink the batch through the graph sizes."""
import pytest

from vt.engine.engine import Engine
from vt.knobs import MODES, ExecutorConfig
from vt.forward.toy import ToyForward

from ._util import VOCAB, mismatches, run_toy, workload

DEVICE_WORK_S = 0.002
_STEADY_MODES = [m for m in MODES if m not in ("sync", "no_dbuf", "ring_prepare")]


def _steady_steps(stats) -> int:
    return stats["phases"]["decode"]["steady_steps"]


@pytest.mark.parametrize("stop", [None, 3])
@pytest.mark.parametrize("mode", _STEADY_MODES)
def test_steady_loop_equals_the_synchronous_run(backend, mode, stop):
    prompts, budgets = workload(24, seed=21, max_new=(2, 30))   # more prompts than rows: admissions interleave
    ref, ref_st = run_toy(backend, prompts, budgets, serving_conc=8, depth=1, stop_token=stop)
    got, st = run_toy(backend, prompts, budgets, serving_conc=8, device_work_s=DEVICE_WORK_S,
                      stop_token=stop, **MODES[mode])
    assert _steady_steps(ref_st) == 0
    assert 0 < _steady_steps(st) <= st["phases"]["decode"]["steps"], st["phases"]
    assert st["phases"]["prefill"]["steps"] > 1        # the general loop ran the admissions
    assert mismatches(ref, got) == 0
    assert st["steps"] == ref_st["steps"]   # the same schedule (a stop leaves at the same step)
    if stop is not None:
        assert any(r.finish_reason == "stop" for r in got)   # the stop was exercised


@pytest.mark.parametrize("h2d", ["graph", "staged"])
def test_steady_loop_with_poison_matches_off_on_a_delayed_sim(delayed_sim, h2d):
    """The host far ahead of the device and POISON writing every next slot as early as the
    ring allows: the steady loop's steps are guarded like the others."""
    prompts, budgets = workload(16, seed=22, max_new=(4, 24))
    off, _ = run_toy(delayed_sim, prompts, budgets, serving_conc=16)
    ring, st = run_toy(delayed_sim, prompts, budgets, serving_conc=16, async_executor=True,
                       poison=True, h2d=h2d)
    assert _steady_steps(st) > 0
    assert mismatches(off, ring) == 0


def test_steady_loop_is_off_with_profile_and_prepare_ahead(sim_backend):
    """Profiling (its clocks are what the steady loop leaves out) and prepare-ahead run the
    general loop, with the same tokens."""
    prompts, budgets = workload(8, seed=23)
    ref, _ = run_toy(sim_backend, prompts, budgets, serving_conc=8, async_executor=True)
    ahead, st = run_toy(sim_backend, prompts, budgets, serving_conc=8, async_executor=True,
                        ring_depth=3)
    assert _steady_steps(st) == 0 and mismatches(ref, ahead) == 0
    toy = ToyForward(sim_backend, vocab=VOCAB)
    with Engine(sim_backend, toy.step_model(), ExecutorConfig(async_executor=True, serving_conc=8),
                record_logits=True, profile=True) as eng:
        profiled = eng.generate(prompts, max_new_tokens=budgets)
        assert _steady_steps(eng.stats()) == 0
    assert mismatches(ref, profiled) == 0


def test_steady_loop_reports_progress_per_step(sim_backend):
    """The progress callback sees every step's tokens from the steady loop too."""
    seen = []
    toy = ToyForward(sim_backend, vocab=VOCAB)
    with Engine(sim_backend, toy.step_model(), ExecutorConfig(async_executor=True, serving_conc=4)) as eng:
        eng.generate([[1, 2]] * 4, max_new_tokens=12, progress=seen.append)
        st = eng.stats()
    assert _steady_steps(st) > 0
    assert [p.step for p in seen] == list(range(len(seen)))      # one call per step, in order
    assert seen[-1].tokens == 48 and seen[-1].finished == 4
