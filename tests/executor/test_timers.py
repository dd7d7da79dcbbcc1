"""The runner's profiling is its timer (vt/executor/timers.py): unprofiled, the hot path reads
no clock and records no timing event; profiled, armed graph steps and every eager step get
their split and events; a trace adds every span; and the slot API the graph and mixed steps
share is the runner's only way to write a slot."""
import json

import pytest

import vt.executor.timers as timers
from vt.engine.engine import Engine
from vt.forward.toy import ToyForward
from vt.config import ExecutorConfig
from vt.executor.timers import NULL_TIMER, SampledTimer, TracingTimer

from engine_runs import VOCAB, mismatches, run_toy, workload


def _engine(be, **kw):
    profile = kw.pop("profile", False)
    config = ExecutorConfig(serving_conc=4, capture_sizes=(1, 2, 4), **kw)
    return Engine(be, ToyForward(be, vocab=VOCAB).step_model(), config, profile=profile,
                  record_logits=True)


@pytest.mark.parametrize("mode", ["sync", "drain", "ring", "staged"])
def test_unprofiled_steps_read_no_clock_and_record_no_timing_event(sim_backend, monkeypatch, mode):
    """The null timer's hooks do nothing: a clock read or a timing event in the timer module
    during an unprofiled run fails the test."""
    def forbidden():
        raise AssertionError("the profile's clock was read with profile off")
    with _engine(sim_backend, mode=mode) as eng:
        assert eng.runner.timer is NULL_TIMER
        monkeypatch.setattr(timers, "_clock", forbidden)
        monkeypatch.setattr(SampledTimer, "_start", lambda self: pytest.fail("a timing event"))
        eng.generate([[1, 2], [3], [4, 5, 6]], max_new_tokens=6)
        st = eng.stats()
    assert st["device_steps"] == 0 and st["acquire_s"] == st["refresh_s"] == st["launch_s"] == 0
    assert st["eager_launch_s"] == 0 and st["graph_steps"] > 0


def test_set_profile_swaps_the_timer_and_keeps_its_events(sim_backend):
    with _engine(sim_backend, mode="ring") as eng:
        runner = eng.runner
        assert runner.timer is NULL_TIMER
        eng.set_profile(True)
        sampled = runner.timer
        assert type(sampled) is SampledTimer and not sampled.every_step
        eng.set_profile(False)
        assert runner.timer is NULL_TIMER
        eng.set_profile(True)
        assert runner.timer is sampled   # its timing events are made once


@pytest.mark.parametrize("mode", ["drain", "ring"])
def test_a_standalone_runner_times_every_step(sim_backend, mode):
    """Without the engine's sampling the timer stays armed: every graph step gets its host
    split and device events, read once the host waited for it."""
    import numpy as np

    from vt.executor.plan import StepPlan
    from vt.executor.runner import Runner
    from vt.step.contract import DecodeRows
    toy = ToyForward(sim_backend, vocab=VOCAB)
    runner = Runner(sim_backend, toy.step_model(),
                    ExecutorConfig(mode=mode, serving_conc=4, capture_sizes=(4,)), profile=True)
    runner.capture()
    n, z = 3, np.zeros(3, np.int32)
    rows = DecodeRows(np.arange(n, dtype=np.int32), z, z + 1, np.arange(n, dtype=np.int32) + 4,
                      np.ones((n, toy.geometry.max_blocks), np.int32), np.arange(n, dtype=np.int32))
    prev = runner.launch(StepPlan(rows))
    for _ in range(5):
        handle = runner.launch(StepPlan(rows))
        runner.collect(prev)
        prev = handle
    runner.collect(prev)
    st = runner.stats
    runner.close()
    assert st.graph_steps == st.device_steps == 6 and st.device_ms > 0
    assert st.acquire_s > 0 and st.refresh_s > 0 and st.launch_s > 0
    assert st.device_by_phase["decode"][1] == 6


@pytest.mark.parametrize("mode", ["drain", "ring", "staged", "sync"])
def test_profiled_and_traced_runs_give_the_unprofiled_tokens(sim_backend, tmp_path, mode):
    """The same tokens and logits bytes with the null, sampled and tracing timers; every
    step's device time is read once (device_steps counts each step at most once)."""
    prompts, budgets = workload(10, seed=32)
    ref, _ = run_toy(sim_backend, prompts, budgets, serving_conc=4, mode=mode)
    for trace in (None, str(tmp_path / f"{mode}.json")):
        toy = ToyForward(sim_backend, vocab=VOCAB)
        config = ExecutorConfig(serving_conc=4, mode=mode, trace=trace)
        with Engine(sim_backend, toy.step_model(), config, record_logits=True,
                    profile=True) as eng:
            assert type(eng.runner.timer) is (TracingTimer if trace else SampledTimer)
            got = eng.generate(prompts, max_new_tokens=budgets)
            st = eng.stats()
        assert mismatches(ref, got) == 0
        assert 0 < st["device_steps"] <= st["steps"]
        if trace:
            assert st["device_steps"] == st["steps"]   # a trace times every step
            events = json.loads((tmp_path / f"{mode}.json").read_text())["traceEvents"]
            device = [e for e in events if e.get("cat") == "device"]
            assert len(device) == st["steps"]


def test_graph_and_mixed_steps_share_the_slot_api(sim_backend, monkeypatch):
    """Every slot launch, a graph step's or a mixed step's decode rows, comes right after a
    write through the slot's own API; the runner and the eager path touch no slot internals
    (its host block, its device buffers) themselves."""
    import pathlib

    import vt.executor
    from vt.graphs.slot import SizeSlot
    calls = []
    write = SizeSlot.write
    monkeypatch.setattr(SizeSlot, "write", lambda self, rows: (calls.append("w"), write(self, rows))[1])
    for name in ("launch", "launch_forward"):   # the whole step, or its forward alone
        launch = getattr(SizeSlot, name)
        monkeypatch.setattr(SizeSlot, name, lambda self, *a, launch=launch:
                            (calls.append("l"), launch(self, *a))[1])
    prompts, budgets = workload(24, seed=8)
    toy = ToyForward(sim_backend, vocab=VOCAB)
    with Engine(sim_backend, toy.step_model(), ExecutorConfig(serving_conc=6, mode="ring")) as eng:
        eng.generate(prompts, max_new_tokens=budgets)
        st = eng.stats()
    assert st["mixed_steps"] > 0 and st["graph_steps"] > 0
    assert calls == ["w", "l"] * (st["graph_steps"] + st["mixed_steps"])
    for path in pathlib.Path(vt.executor.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert "slot.host" not in text and "slot.device" not in text, path
