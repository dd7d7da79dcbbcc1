"""Engine behaviour a server relies on: finish reasons, refusals, errors, trace, lifecycle."""
import json

import numpy as np
import pytest

from vt.backend import ClosedError
from vt.engine.engine import Engine
from vt.config import ExecutorConfig
from vt.engine.errors import KVCacheExhaustedError, PromptTooLongError, RequestTooLargeError
from vt.forward.user import KVGeometry
from vt.forward.toy import ToyForward

from engine_runs import run_toy, workload


def _engine(be, profile=False, **cfg):
    return Engine(be, ToyForward(be).step_model(), ExecutorConfig(**cfg), profile=profile)


def test_results_come_back_in_prompt_order_with_their_budgets(sim_backend):
    prompts, budgets = workload(10, seed=1)
    results, st = run_toy(sim_backend, prompts, budgets, mode="ring", serving_conc=3)
    assert [r.index for r in results] == list(range(10))
    assert [len(r.tokens) for r in results] == budgets
    assert all(r.finish_reason == "length" for r in results)
    assert st["tokens"] == sum(budgets) and st["mixed_steps"] > 0


def test_stop_token_ends_a_request_and_drops_the_token_past_it(sim_backend):
    """The stop token is learned one step late; the extra token is not returned."""
    prompts, budgets = workload(6, seed=2, max_new=(20, 20))
    free, _ = run_toy(sim_backend, prompts, budgets, mode="ring")
    stop = free[0].tokens[3]
    stopped, _ = run_toy(sim_backend, prompts, budgets, mode="ring", stop_token=stop)
    for a, b in zip(free, stopped):
        cut = a.tokens.index(stop) + 1 if stop in a.tokens else len(a.tokens)
        assert b.tokens == a.tokens[:cut]
        assert b.finish_reason == ("stop" if stop in a.tokens else "length")


def test_a_request_beyond_the_context_is_refused_before_any_step(sim_backend):
    """Policy: a request that cannot be served whole raises; nothing runs, the engine stays usable."""
    geo = KVGeometry(max_seqs=4, num_kv_blocks=64, block_size=4, max_context=8)
    with Engine(sim_backend, ToyForward(sim_backend, geometry=geo).step_model(),
                ExecutorConfig(serving_conc=2, capture_sizes=(1, 2))) as eng:
        with pytest.raises(RequestTooLargeError, match=r"request 1: prompt 5 \+ max_new_tokens 50 - 1 "
                           r"= 54 tokens exceed the context of 8: lower max_new_tokens to at most 4"):
            eng.generate([[1], [1, 2, 3, 4, 5]], max_new_tokens=[3, 50])
        assert eng.stats()["steps"] == 0
        (r,) = eng.generate([[1, 2, 3, 4, 5]], max_new_tokens=4)
    assert len(r.tokens) == 4 and r.finish_reason == "length"


def test_prompt_longer_than_the_context_is_a_clear_error(sim_backend):
    with _engine(sim_backend) as eng:
        with pytest.raises(PromptTooLongError, match="prompt 1 has 65 tokens; the context holds 64"):
            eng.generate([[1], [1] * 65])
        assert len(eng.generate([[1, 2]], max_new_tokens=2)[0].tokens) == 2   # still usable


def test_request_larger_than_the_kv_cache_is_refused_by_name(sim_backend):
    """Same policy as the context: KVCacheExhaustedError (a RequestTooLargeError) before any step."""
    geo = KVGeometry(max_seqs=4, num_kv_blocks=5, block_size=4, max_context=64)
    with Engine(sim_backend, ToyForward(sim_backend, geometry=geo).step_model(),
                ExecutorConfig(serving_conc=2, capture_sizes=(1, 2))) as eng:
        with pytest.raises(KVCacheExhaustedError, match="request 1 needs 8 KV blocks .* the whole "
                                                        "cache has 4: lower max_new_tokens"):
            eng.generate([[1, 2], [3] * 10], max_new_tokens=[3, 20])
        assert eng.stats()["steps"] == 0
        (small,) = eng.generate([[1, 2]], max_new_tokens=3)
    assert small.finish_reason == "length" and len(small.tokens) == 3


def test_requests_wait_for_blocks_when_the_cache_is_full(sim_backend):
    """Each request fits alone but not together: they run one after the other."""
    geo = KVGeometry(max_seqs=4, num_kv_blocks=5, block_size=4, max_context=64)
    with Engine(sim_backend, ToyForward(sim_backend, geometry=geo).step_model(),
                ExecutorConfig(serving_conc=4, capture_sizes=(1, 2))) as eng:
        results = eng.generate([[1, 2, 3]] * 3, max_new_tokens=10)
        assert eng.stats()["prefill_steps"] == 3
    assert all(len(r.tokens) == 10 for r in results)


@pytest.mark.parametrize("prompt,match", [([], "non-empty"), ([[1, 2]], "1-D"),
                                          ([1, 99], "outside"), ([0.5], "token ids")])
def test_malformed_prompts_are_rejected(sim_backend, prompt, match):
    with _engine(sim_backend) as eng:
        with pytest.raises(ValueError, match=match):
            eng.generate([prompt])


def test_bad_max_new_tokens_is_rejected(sim_backend):
    with _engine(sim_backend) as eng:
        with pytest.raises(ValueError, match="max_new_tokens"):
            eng.generate([[1]], max_new_tokens=0)
        with pytest.raises(ValueError, match="2 max_new_tokens values for 1 prompts"):
            eng.generate([[1]], max_new_tokens=[1, 2])


def test_progress_callback_sees_every_step(sim_backend):
    seen = []
    with _engine(sim_backend, mode="ring") as eng:
        eng.generate([[1, 2], [3]], max_new_tokens=5, progress=seen.append)
        steps = eng.stats()["steps"]
    assert len(seen) == steps and seen[-1].finished == 2 and seen[-1].tokens == 10


def test_stats_report_steps_waits_and_pool(sim_backend):
    with _engine(sim_backend, mode="ring", profile=True) as eng:
        eng.generate([[1, 2]] * 4, max_new_tokens=6)
        st = eng.stats()
    assert st["steps"] == st["graph_steps"] + st["eager_steps"] + st["mixed_steps"] + st["prefill_steps"]
    assert st["mode"] == "ring" and st["pool"]["mallocs_during_capture"] == 0
    assert st["token_waits"] > 0 and st["device_ms"] > 0
    dec, pre = st["phases"]["decode"], st["phases"]["prefill"]
    assert dec["steps"] + pre["steps"] == st["steps"] and pre["steps"] == st["prefill_steps"]
    assert dec["wall_s"] > 0 and dec["refresh_s"] > 0 and dec["launch_s"] > 0 and dec["device_ms"] > 0


def test_set_profile_times_the_same_engine_only_while_on(sim_backend, delayed_sim):
    """set_profile switches the timing of one engine between calls: the host split and the
    device time grow only over the profiled call, the tokens are the same in all three, and
    switching while the engine serves is refused."""
    with _engine(sim_backend, mode="ring") as eng:
        runs, timed = [], []
        for on in (False, True, False):
            eng.set_profile(on)
            assert eng.profile is on
            runs.append([r.tokens for r in eng.generate([[1, 2], [3]], max_new_tokens=8)])
            dec = eng.stats()["phases"]["decode"]
            timed.append((dec["timed_steps"], dec["device_steps"]))
    assert runs[0] == runs[1] == runs[2]
    assert timed[0] == (0, 0) and timed[1][0] > 0 and timed[1][1] > 0 and timed[2] == timed[1]
    with _engine(delayed_sim, mode="ring") as eng:
        busy = eng.submit([1, 2], max_new_tokens=40)
        next(iter(busy.stream()))
        with pytest.raises(RuntimeError, match="call it while it is idle"):
            eng.set_profile(True)
        busy.result()
        eng.set_profile(True)


def test_trace_is_chrome_json_with_host_and_device_spans(sim_backend, tmp_path):
    """The trace is Chrome JSON with host spans (refresh, launch, waits) and device spans."""
    path = tmp_path / "trace.json"
    eng = _engine(sim_backend, mode="ring", trace=str(path))
    eng.generate([[1, 2, 3]] * 3, max_new_tokens=4)
    assert eng.close() == str(path)
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["cat"] for e in spans} == {"host", "device"}
    assert any(e["name"].startswith("launch graph") for e in spans)
    assert any(e["name"] == "refresh" and e["args"]["slot"] for e in spans)
    assert any(e["name"] == "wait tokens" for e in spans)
    assert all(e["dur"] >= 0 for e in spans)


def test_closed_engine_refuses_use(sim_backend):
    eng = _engine(sim_backend)
    eng.close()
    eng.close()
    with pytest.raises(ClosedError, match="Engine is closed"):
        eng.generate([[1]])


def test_engine_refuses_something_that_is_not_a_model(sim_backend):
    with pytest.raises(TypeError, match="ForwardModel"):
        Engine(sim_backend, lambda s, i, o: None, ExecutorConfig())


def test_user_forward_example_runs_on_the_ring(backend):
    """The docs example: a user forward wrapped as a ForwardModel, ring on."""
    from vt.forward.user import ForwardModel
    toy = ToyForward(backend, vocab=32)
    model = ForwardModel(backend, toy, vocab=32, token_table=toy.token_table, geometry=toy.geometry)
    with Engine(backend, model, ExecutorConfig(mode="ring", serving_conc=4)) as eng:
        results = eng.generate([np.array([1, 2, 3]), np.array([4])], max_new_tokens=8)
        assert eng.stats()["graph_steps"] > 0
    assert all(len(r.tokens) == 8 and max(r.tokens) < 32 for r in results)
