"""Speculative decoding through the Engine (continuous batching) on the sim: greedy tokens
equal the target's alone for every proposer, mode and k, with requests admitted while others
run, mixed lengths, stops and budgets inside an accepted run, cancels, prefix caching; the
acceptance in stats(); what it refuses, by name."""
import threading

import numpy as np
import pytest

from vt.engine.engine import Engine
from vt.forward.speculative import SpeculativeConfig
from vt.hooks import Poison
from vt.config import ExecutorConfig
from vt.step.contract import SamplingParams

from ._causal import (MODES, SIZES, CausalToy, check_tokens,
                      config, record_steps, reference, workload)



def _engine(be, spec, mode="ring", *, hooks=None, prefix_cacheable=False, serving_conc=8):
    return Engine(be, CausalToy(be).step_model(prefix_cacheable=prefix_cacheable),
                  ExecutorConfig(mode=mode, capture_sizes=SIZES, serving_conc=serving_conc),
                  hooks=hooks, speculative=spec)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("method", ["ngram", "oracle", "draft"])
def test_engine_speculative_tokens_equal_the_targets(sim_backend, method, k, mode):
    """14 requests of mixed lengths over 8 rows (admitted as rows free up, into a batch that
    is decoding), under POISON: the tokens of the target decoding alone. The target as its
    own draft has every draft accepted, in rows that served an earlier request too."""
    prompts, budgets = workload(14, seed=20 + k, max_new=(1, 24))
    want = reference(sim_backend, prompts, budgets)
    draft = CausalToy(sim_backend).step_model() if method == "draft" else None
    spec = config(method, k, prompts, want if method == "oracle" else None, draft=draft)
    with _engine(sim_backend, spec, mode, hooks=Poison()) as eng:
        got = [r.tokens for r in eng.generate(prompts, max_new_tokens=budgets)]
        st = eng.stats()
    check_tokens(got, want)
    s = st["speculative"]
    assert (s["method"], s["k"]) == (method, k)
    assert s["verify_rows"] > 0 and s["drafts"] == k * s["verify_rows"]
    if method == "oracle":
        assert s["acceptance_rate"] > 0.75, s
    if method == "draft":
        assert s["acceptance_rate"] == 1.0 and s["mean_accepted_length"] == k + 1, s


def test_requests_submitted_while_others_decode_get_the_targets_tokens(sim_backend):
    """Requests submitted from another thread once the first ones have tokens join the
    running batch (verify steps in flight) and still get the target's tokens."""
    prompts, budgets = workload(12, seed=31, max_new=(8, 30))
    want = reference(sim_backend, prompts, budgets)
    with _engine(sim_backend, config("oracle", 4, prompts, want, accept=0.5), "ring",
                 serving_conc=4) as eng:
        first = [eng.submit(p, max_new_tokens=b) for p, b in zip(prompts[:4], budgets[:4])]
        late = []

        def submit_late():
            for p, b in zip(prompts[4:], budgets[4:]):
                late.append(eng.submit(p, max_new_tokens=b))

        assert eng._loop.wait_for_step(lambda: len(first[0].snapshot()[0]) > 0, timeout=30)
        t = threading.Thread(target=submit_late)
        t.start()
        t.join()
        got = [h.result(timeout=30).tokens for h in first + late]
    check_tokens(got, want)


@pytest.mark.parametrize("mode", ["sync", "ring"])
def test_stop_tokens_and_budgets_inside_an_accepted_run_end_the_request_there(sim_backend, mode):
    """Full acceptance at k = 4 emits five tokens a step: a stop token or the budget falling
    inside the run ends the request at that token (the rest of the run is dropped), and the
    finish reason says which."""
    prompts, budgets = workload(8, seed=41, max_new=(30, 30))
    full = reference(sim_backend, prompts, budgets)
    stop = int(full[0][6])
    want = reference(sim_backend, prompts, [30, 7, 3, 11, 30, 2, 30, 1], stop_token=stop)
    with _engine(sim_backend, config("oracle", 4, prompts, full), mode) as eng:
        res = eng.generate(prompts, max_new_tokens=[30, 7, 3, 11, 30, 2, 30, 1], stop_token=stop)
    check_tokens([r.tokens for r in res], want)
    for r, w, b in zip(res, want, [30, 7, 3, 11, 30, 2, 30, 1]):
        assert r.finish_reason == ("stop" if w[-1] == stop else "length"), r
        assert len(r.token_times) == len(r.tokens)
    assert res[0].tokens[-1] == stop and len(res[0].tokens) <= 7


def test_a_cancelled_request_keeps_the_tokens_collected_and_frees_its_row(sim_backend):
    """A request cancelled while verify steps run finishes "cancelled" with a prefix of its
    tokens; the others are exact, and the engine ends idle."""
    prompts, budgets = workload(6, seed=51, max_new=(40, 40))
    want = reference(sim_backend, prompts, budgets)
    with _engine(sim_backend, config("oracle", 2, prompts, want, accept=0.5), "ring") as eng:
        hs = [eng.submit(p, max_new_tokens=b) for p, b in zip(prompts, budgets)]
        assert eng._loop.wait_for_step(lambda: len(hs[0].snapshot()[0]) >= 3, timeout=30)
        hs[0].cancel()
        res = [h.result(timeout=30) for h in hs]
        assert eng._loop.wait_for_step(eng.idle, timeout=30)
    assert res[0].finish_reason in ("cancelled", "length")
    assert res[0].tokens == want[0][:len(res[0].tokens)]
    check_tokens([r.tokens for r in res[1:]], want[1:])


def test_prefix_caching_stays_exact_with_speculation(sim_backend):
    """A conversation's second turns (prompt + first answer + more) hit the cached blocks of
    the prompt and of the answer the verify steps wrote: the same tokens as without caching,
    with cached tokens counted."""
    prompts, budgets = workload(6, seed=61, max_len=12, max_new=(18, 18))
    first = reference(sim_backend, prompts, budgets)
    rng = np.random.default_rng(3)
    turn2 = [list(p) + list(a) + [int(x) for x in rng.integers(0, 32, 3)]
             for p, a in zip(prompts, first)]
    want = reference(sim_backend, turn2, 12)
    spec = config("ngram", 4)
    with _engine(sim_backend, spec, "ring", prefix_cacheable=True) as eng:
        assert eng.prefix_caching
        got1 = [r.tokens for r in eng.generate(prompts, max_new_tokens=budgets)]
        got2 = [r.tokens for r in eng.generate(turn2, max_new_tokens=12)]
        cache = eng.stats()["prefix_cache"]
    check_tokens(got1, first)
    check_tokens(got2, want)
    assert cache["cached_tokens"] >= 6 * 16, cache   # the prompt's and the answer's blocks


def test_the_oracle_at_half_acceptance_shows_in_stats(sim_backend):
    """accept 0.5 at k = 4: two of four drafts accepted, three tokens a verify row."""
    prompts, budgets = workload(4, seed=71, max_new=(48, 48))
    want = reference(sim_backend, prompts, budgets)
    with _engine(sim_backend, config("oracle", 4, prompts, want, accept=0.5)) as eng:
        check_tokens([r.tokens for r in eng.generate(prompts, max_new_tokens=budgets)], want)
        s = eng.stats()["speculative"]
    assert s["acceptance_rate"] == pytest.approx(0.5, abs=0.05)
    assert s["mean_accepted_length"] == pytest.approx(3.0, abs=0.2)


def test_the_engine_launches_verify_step_n_plus_1_before_it_reads_step_n(sim_backend, monkeypatch):
    """Ring mode: every verify step is launched before the step before it is collected (the
    host reads accepted counts one step late), and no verify step drains (the prefill step,
    with its own logits, is the one waited for)."""
    prompts, budgets = workload(3, seed=81, max_new=(20, 20))
    import vt.engine.engine as engine_module
    events = record_steps(monkeypatch, engine_module)
    with _engine(sim_backend, config("ngram", 2), "ring") as eng:
        eng.generate(prompts, max_new_tokens=budgets)
        st = eng.stats()
    launches = [i for e, i in events if e == "launch"]
    assert len(launches) > 4
    for i in launches[:-1]:
        assert events.index(("launch", i + 1)) < events.index(("collect", i))
    assert st["drains_after"].get("graph", 0) == 0, st["drains_after"]
    assert st["graph_steps"] > 4


class _AnyToken:
    """A grammar that allows every token."""

    def fill_mask(self, bits):
        bits[:] = -1

    def accept(self, token):
        return True


@pytest.mark.parametrize("kwargs,message", [
    (dict(sampling=SamplingParams(temperature=0.7, logprobs=2)), "logprobs=2"),
    (dict(sampling=SamplingParams(presence_penalty=0.5)), "penalties"),
    (dict(sampling=SamplingParams(grammar=_AnyToken())), "grammar"),
])
def test_what_speculation_cannot_serve_is_refused_by_name(sim_backend, kwargs, message):
    with _engine(sim_backend, config("ngram", 2)) as eng:
        with pytest.raises(ValueError, match=message):
            eng.submit([1, 2, 3], **kwargs)


def test_engine_arguments_speculation_cannot_take_are_refused_by_name(sim_backend):
    toy = CausalToy(sim_backend)
    cfg = ExecutorConfig(mode="ring", capture_sizes=SIZES)
    with pytest.raises(ValueError, match="record_logits=True"):
        Engine(sim_backend, toy.step_model(), cfg, record_logits=True,
               speculative=config("ngram", 2))
    with pytest.raises(TypeError, match="SpeculativeConfig"):
        Engine(sim_backend, toy.step_model(), cfg, speculative="ngram")
    with pytest.raises(ValueError, match="tensor_parallel=2"):
        Engine(sim_backend, toy.step_model(), cfg, tensor_parallel=2,
               speculative=config("ngram", 2))


def test_the_kv_reservation_counts_the_drafts(sim_backend):
    """A request holds KV for k positions past its tokens: one that fits the cache without
    speculation but not with k more is refused, naming them."""
    from vt.engine.errors import KVCacheExhaustedError
    from vt.forward.user import KVGeometry
    g = KVGeometry(max_seqs=2, num_kv_blocks=5, block_size=4, max_context=32)
    toy = CausalToy(sim_backend, geometry=g)
    with Engine(sim_backend, toy.step_model(), ExecutorConfig(mode="ring", capture_sizes=(1, 2), serving_conc=2),
                speculative=SpeculativeConfig("ngram", k=4)) as eng:
        with pytest.raises(KVCacheExhaustedError, match="4 speculative"):
            eng.submit([1] * 10, max_new_tokens=7)   # 16 positions: 4 blocks; + 4: 5 of 4 usable
        assert len(eng.generate([[1] * 10], max_new_tokens=3)[0].tokens) == 3
