"""Greedy tokens with speculation equal those without: every proposer, every mode, k in
{1, 2, 4}, on the causal toy (tests/speculative/_causal.py) over the sim."""
import numpy as np
import pytest

from vt.engine.speculative import generate_speculative
from vt.config import ExecutorConfig
from vt.hooks import Poison

from ._causal import MODES, SIZES, check_tokens, record_steps, reference, speculative, workload



@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("method", ["ngram", "oracle"])
def test_speculative_greedy_tokens_equal_the_targets(sim_backend, method, k, mode):
    """Every proposer, mode and k: the same tokens as the target decoding alone."""
    prompts, budgets = workload(6, seed=k)
    want = reference(sim_backend, prompts, budgets)
    model = speculative(sim_backend, method, k, prompts, want if method == "oracle" else None)
    got, st = generate_speculative(sim_backend, model, ExecutorConfig(mode=mode, capture_sizes=SIZES),
                                   prompts, budgets, hooks=Poison())
    check_tokens(got, want)
    if method == "oracle":   # every draft right: k + 1 tokens a step until the end
        assert st.acceptance_rate > 0.6, st
    assert st.runner["graph_steps"] > 0


@pytest.mark.parametrize("accept", [0.0, 0.5, 1.0])
def test_the_oracle_accepts_the_fraction_it_is_set_to(sim_backend, accept):
    """accept 0.5 at k = 4: two drafts right a step, mean accepted length 3 (ends aside)."""
    prompts, budgets = workload(4, seed=7, max_new=(40, 40))
    want = reference(sim_backend, prompts, budgets)
    model = speculative(sim_backend, "oracle", 4, prompts, want, accept=accept)
    got, st = generate_speculative(sim_backend, model, ExecutorConfig(mode="ring", capture_sizes=SIZES),
                                   prompts, budgets)
    check_tokens(got, want)
    right = int(round(accept * 4))
    assert st.acceptance_rate == pytest.approx(right / 4, abs=0.08)
    assert st.mean_accepted_length == pytest.approx(right + 1, abs=0.35)


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there(sim_backend):
    """The stop token is the request's last token even when drafts after it were accepted."""
    prompts, budgets = workload(6, seed=11, max_new=(30, 30))
    full = reference(sim_backend, prompts, budgets)
    stop = int(full[0][7])
    want = reference(sim_backend, prompts, budgets, stop_token=stop)
    model = speculative(sim_backend, "oracle", 4, prompts, full)
    got, _ = generate_speculative(sim_backend, model, ExecutorConfig(mode="ring", capture_sizes=SIZES),
                                  prompts, budgets, stop_token=stop)
    check_tokens(got, want)
    assert len(got[0]) <= 8 and got[0][-1] == stop


def test_the_poison_arm_catches_an_unguarded_verify_step(delayed_sim):
    """Mode unguarded + POISON, the host ahead of the device: a verify step reads its slot's
    poisoned rows (the scratch row) and the tokens differ; the ring, same arm, stays exact."""
    prompts, budgets = workload(8, seed=5, max_new=(12, 12))
    want = reference(delayed_sim, prompts, budgets)
    cfg = dict(capture_sizes=SIZES)
    ring, st = generate_speculative(delayed_sim, speculative(delayed_sim, "oracle", 2, prompts, want),
                                    ExecutorConfig(mode="ring", **cfg), prompts, budgets, hooks=Poison())
    check_tokens(ring, want)
    assert st.runner["drains"] == 0   # the prefill step is read before the first verify step
    bad, _ = generate_speculative(delayed_sim, speculative(delayed_sim, "oracle", 2, prompts, want),
                                  ExecutorConfig(mode="unguarded", **cfg), prompts, budgets,
                                  hooks=Poison())
    assert sum(not np.array_equal(a, b) for a, b in zip(bad, want)) > 0


def test_the_host_launches_step_n_plus_1_before_reading_step_n(sim_backend, monkeypatch):
    """Ring mode: every decode step after the first is launched before the step before it
    is collected (the accepted counts are read one step late), with no drain."""
    prompts, budgets = workload(4, seed=9)
    want = reference(sim_backend, prompts, budgets)
    model = speculative(sim_backend, "ngram", 2)
    import vt.engine.speculative as spec
    events = record_steps(monkeypatch, spec)
    got, st = generate_speculative(sim_backend, model, ExecutorConfig(mode="ring", capture_sizes=SIZES),
                                   prompts, budgets)
    check_tokens(got, want)
    collects = [i for e, i in events if e == "collect"][1:]   # the prefill step's aside
    assert collects
    for i in collects:
        if ("launch", i + 1) in events:
            assert events.index(("launch", i + 1)) < events.index(("collect", i))
    assert st.runner["drains"] == 0
