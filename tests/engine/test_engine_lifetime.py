"""An Engine's lifetime and its model: dropped engines free their threads and memory, engines
over one model take turns instead of sampling wrong tokens, and the API's argument errors
name the argument.

| defect class                                            | test                                                        |
|---------------------------------------------------------|-------------------------------------------------------------|
| an Engine dropped without close() leaks its thread      | test_engines_dropped_in_a_loop_keep_threads_and_memory_flat, |
|                                                         | test_a_dropped_engine_is_closed_by_its_finalizer            |
| a handle outliving its Engine: its request never ends,  | test_a_handle_outliving_its_engine_is_served_then_frees_it  |
|   or the runner is closed under it                      |                                                             |
| a dropped backend keeps its stream threads              | test_a_dropped_backend_ends_its_stream_threads              |
| two Engines over one model in two threads: wrong tokens | test_two_engines_over_one_model_in_two_threads_never_give_wrong_tokens |
| the busy message suggests a setup that is unsafe        | test_the_second_engine_is_refused_while_the_first_drives_the_model |
| engines used one after the other refused by a race with | test_engines_used_one_after_the_other_wait_for_the_handover |
|   the first one's wind-down                             |                                                             |
| a NaN or huge sim delay kills the stream worker         | test_sim_delays_that_cannot_be_slept_are_refused_and_workers_survive |
| API argument errors are not ValueError/TypeError naming | test_engine_argument_errors_name_the_argument,              |
|   the argument                                          | test_engine_refuses_a_backend_that_is_not_one,              |
|                                                         | test_generate_argument_errors_name_the_argument,            |
|                                                         | test_forward_model_checks_vocab_and_token_table,            |
|                                                         | test_config_bounds_and_types_name_the_field                 |
"""
import gc
import threading
import time
import tracemalloc
import weakref

import numpy as np
import pytest

from vt.backend import get_backend
from vt.engine import Engine
from vt.config import MAX_CAPTURE_SIZE, MAX_SERVING_CONC, ExecutorConfig
from vt.engine.model_lease import HANDOVER_S
from vt.engine.errors import EngineBusyError
from vt.forward.user import ForwardModel, KVGeometry
from vt.forward.toy import ToyForward

from engine_runs import VOCAB, workload

CONFIG = ExecutorConfig(mode="ring", serving_conc=4, capture_sizes=(1, 2, 4))


def _vt_threads() -> int:
    return sum(t.name.startswith("vt-") for t in threading.enumerate())


def _vt_threads_once_serving_ended(since) -> int:
    """_vt_threads() once the serving threads started after `since` (a set of threads) ended:
    a dropped engine's finalizer wakes its serving thread, which ends a moment later. Each is
    waited for up to 5 s; one still running then is counted."""
    for t in threading.enumerate():
        if t.name == "vt-engine" and t not in since:
            t.join(5)
    return _vt_threads()


def test_engines_dropped_in_a_loop_keep_threads_and_memory_flat(sim_backend):
    """Dropped without close(): the finalizer closes the runner (its stream thread ends) and
    nothing the engine allocated stays: vt threads, pool bytes in use and Python memory
    after 8 more engines are what they were after the first 2."""
    toy = ToyForward(sim_backend, vocab=VOCAB)
    prompts, budgets = workload(3, seed=1)

    def one_engine():
        eng = Engine(sim_backend, toy.step_model(), CONFIG)
        eng.generate(prompts, max_new_tokens=budgets)
        return weakref.ref(eng)

    started = set(threading.enumerate())
    tracemalloc.start()
    try:
        for _ in range(2):
            one_engine()
        gc.collect()
        threads = _vt_threads_once_serving_ended(started)
        in_use = sim_backend.pool.stats().bytes_in_use
        py_bytes = tracemalloc.get_traced_memory()[0]
        refs = [one_engine() for _ in range(8)]
        gc.collect()
        assert all(r() is None for r in refs), "a dropped Engine is still alive"
        assert _vt_threads_once_serving_ended(started) == threads
        assert sim_backend.pool.stats().bytes_in_use == in_use
        grown = tracemalloc.get_traced_memory()[0] - py_bytes
    finally:
        tracemalloc.stop()
    assert grown < 256 * 1024, f"8 dropped engines left {grown} bytes of Python memory"


def test_a_dropped_engine_is_closed_by_its_finalizer(sim_backend):
    toy = ToyForward(sim_backend, vocab=VOCAB)
    eng = Engine(sim_backend, toy.step_model(), CONFIG)
    stream = eng.runner.stream
    del eng
    gc.collect()
    assert stream.closed


def test_a_handle_outliving_its_engine_is_served_then_frees_it(delayed_sim):
    """A handle is all the caller keeps of an Engine dropped while its request runs: the request
    is served to its end with the tokens of an engine kept alive, and once the handle goes
    too the runner is closed and the serving thread ends."""
    toy = ToyForward(delayed_sim, vocab=VOCAB)
    threads = _vt_threads()
    with Engine(delayed_sim, toy.step_model(), CONFIG) as kept:
        want = kept.generate([[1, 2, 3]], max_new_tokens=[40])[0].tokens
    toy = ToyForward(delayed_sim, vocab=VOCAB)
    eng = Engine(delayed_sim, toy.step_model(), CONFIG)
    stream = eng.runner.stream
    handle = eng.submit([1, 2, 3], max_new_tokens=40)
    del eng
    gc.collect()
    assert not stream.closed
    assert handle.result(timeout=60).tokens == want
    del handle
    deadline = time.monotonic() + 10
    while (not stream.closed or _vt_threads() != threads) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert stream.closed and _vt_threads() == threads


def test_a_dropped_backend_ends_its_stream_threads():
    before = _vt_threads()
    be = get_backend("sim")
    streams = [be.stream(name=f"s{i}") for i in range(3)]
    assert _vt_threads() == before + 3
    del be, streams
    gc.collect()
    assert _vt_threads() == before


def _reference(be, prompts, budgets):
    """The tokens one engine alone samples for the workload (a fresh toy: state at zero)."""
    toy = ToyForward(be, vocab=VOCAB)
    with Engine(be, toy.step_model(), CONFIG) as eng:
        return [r.tokens for r in eng.generate(prompts, max_new_tokens=budgets)]


def test_two_engines_over_one_model_in_two_threads_never_give_wrong_tokens(delayed_sim):
    """Each thread loops generate() on its own Engine over one shared model: every call either
    returns exactly the tokens of an engine alone or is refused with EngineBusyError, and
    both happen (the threads do collide, and do take turns)."""
    prompts, budgets = workload(4, seed=2, max_new=(4, 8))
    want = _reference(delayed_sim, prompts, budgets)
    toy = ToyForward(delayed_sim, vocab=VOCAB)
    engines = [Engine(delayed_sim, toy.step_model(), CONFIG) for _ in range(2)]
    outcomes, start = [[], []], threading.Barrier(2)

    def drive(i):
        start.wait()
        for _ in range(6):
            try:
                got = [r.tokens for r in engines[i].generate(prompts, max_new_tokens=budgets)]
                outcomes[i].append("ok" if got == want else "WRONG")
            except EngineBusyError as e:
                assert "another Engine over the same model" in str(e)
                outcomes[i].append("busy")

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for eng in engines:
        eng.close()
    flat = outcomes[0] + outcomes[1]
    assert len(flat) == 12 and "WRONG" not in flat, outcomes
    assert "busy" in flat and "ok" in flat, outcomes


def test_the_second_engine_is_refused_while_the_first_drives_the_model(delayed_sim):
    """While one engine serves the model (a request of it is still decoding), a second
    Engine over the model is refused at construction and its generate() fails with
    EngineBusyError; once the first is idle the second serves, with the right tokens. The
    message does not suggest another Engine over the same model."""
    toy = ToyForward(delayed_sim, vocab=VOCAB)
    first = Engine(delayed_sim, toy.step_model(), CONFIG)
    second = Engine(delayed_sim, toy.step_model(), CONFIG)   # first is idle: allowed
    prompts, budgets = workload(2, seed=3)
    want = _reference(delayed_sim, prompts, budgets)
    busy = first.submit([1, 2], max_new_tokens=40)      # ~40 steps of >= 1 ms each
    next(iter(busy.stream()))                          # its first token: the first serves now
    seen = []
    for attempt in (lambda: Engine(delayed_sim, toy.step_model(), CONFIG),
                    lambda: second.generate(prompts, max_new_tokens=budgets)):
        with pytest.raises(EngineBusyError, match="build one model per thread") as e:
            attempt()
        seen.append(str(e.value))
    assert not busy.done()                             # the refusals came while it served
    busy.result()
    assert len(seen) == 2 and all("give each thread its own Engine" not in m for m in seen)
    assert [r.tokens for r in second.generate(prompts, max_new_tokens=budgets)] == want
    nested = []   # one Engine serves calls from any thread, its own progress callback too
    first.generate(prompts, max_new_tokens=budgets, progress=lambda p: nested.append(
        [r.tokens for r in first.generate(prompts, max_new_tokens=budgets)]) if not nested else None)
    assert nested == [want]
    first.close()
    second.close()


def test_engines_used_one_after_the_other_wait_for_the_handover(sim_backend, monkeypatch):
    """generate() returns when its last request is finished; the serving thread lets the
    model go a moment later. The next engine's call in that moment waits for the release
    instead of failing with EngineBusyError (the wind-down is slowed here to 30 ms so the
    moment is always hit), and gets the right tokens."""
    import vt.engine.serving as serving
    release = serving.release_model

    def slow_release(key):
        time.sleep(0.03)
        release(key)

    monkeypatch.setattr(serving, "release_model", slow_release)
    toy = ToyForward(sim_backend, vocab=VOCAB)
    prompts, budgets = workload(2, seed=4)
    want = _reference(sim_backend, prompts, budgets)
    engines = [Engine(sim_backend, toy.step_model(), CONFIG) for _ in range(2)]
    try:
        for i in range(6):
            t0 = time.perf_counter()
            got = [r.tokens for r in engines[i % 2].generate(prompts, max_new_tokens=budgets)]
            assert got == want, i
        assert time.perf_counter() - t0 < HANDOVER_S
    finally:
        for eng in engines:
            eng.close()


@pytest.mark.parametrize("delay", [float("nan"), float("inf"), -1.0, 1e308, 61.0])
def test_sim_delays_that_cannot_be_slept_are_refused_and_workers_survive(delay):
    with pytest.raises(ValueError, match="device_delay_s must be a finite number of seconds"):
        get_backend("sim", device_delay_s=delay)
    be = get_backend("sim")
    s = be.stream()
    with pytest.raises(ValueError, match="busy_wait: seconds must be a finite number"):
        be.busy_wait(s, delay)
    be.busy_wait(s, 0.001)
    s.synchronize()   # the worker still runs: a dead one would hang here
    be.close()


@pytest.mark.parametrize("kwargs,error,needle", [
    (dict(config="ring"), TypeError, "config must be a vt.ExecutorConfig"),
    (dict(profile=1), TypeError, "profile must be a bool"),
    (dict(record_logits="yes"), TypeError, "record_logits must be a bool"),
    (dict(max_prefill_tokens=2.5), TypeError, "max_prefill_tokens (None: the default) must be an integer"),
    (dict(max_prefill_tokens=0), ValueError, "max_prefill_tokens (None: the default) must be an integer in [1, "),
])
def test_engine_argument_errors_name_the_argument(sim_backend, kwargs, error, needle):
    toy = ToyForward(sim_backend, vocab=VOCAB)
    with pytest.raises(error) as e:
        Engine(sim_backend, toy.step_model(), **kwargs)
    assert needle in str(e.value)


def test_engine_refuses_a_backend_that_is_not_one(sim_backend):
    toy = ToyForward(sim_backend, vocab=VOCAB)
    with pytest.raises(TypeError, match="backend must be a vt backend"):
        Engine("sim", toy.step_model(), CONFIG)


@pytest.mark.parametrize("call,error,needle", [
    (lambda e: e.generate(5), TypeError, "prompts must be a list"),
    (lambda e: e.generate("abc"), TypeError, "prompts must be a list"),
    (lambda e: e.generate([[1, 2]], progress=3), TypeError, "progress must be a callable"),
    (lambda e: e.generate([[1, 2]], max_new_tokens=0), ValueError, "max_new_tokens"),
    (lambda e: e.generate([[1, VOCAB]]), ValueError, "prompt 0 has token ids outside"),
])
def test_generate_argument_errors_name_the_argument(sim_backend, call, error, needle):
    toy = ToyForward(sim_backend, vocab=VOCAB)
    with Engine(sim_backend, toy.step_model(), CONFIG) as eng:
        with pytest.raises(error, match=needle):
            call(eng)
        assert eng.generate([[1, 2]], max_new_tokens=2)[0].finish_reason == "length"


@pytest.mark.parametrize("change,error,needle", [
    (dict(vocab=0), ValueError, r"vocab must be an integer in \[2, 2147483647\], got 0"),
    (dict(vocab=2.0), TypeError, r"vocab must be an integer in \[2, 2147483647\], got 2.0"),
    (dict(vocab=2**31), ValueError, "vocab must be an integer in"),
    (dict(token_dtype=np.float32), TypeError, "token_table must be a 1-D int32"),
    (dict(token_dtype=np.int64), TypeError, "token_table must be a 1-D int32"),
    (dict(token_shape=(65, 2)), TypeError, "token_table must be a 1-D int32"),
    (dict(forward=None), TypeError, "forward must be callable"),
    (dict(geometry=(64, 512, 4, 64)), TypeError, "geometry must be a vt.KVGeometry"),
])
def test_forward_model_checks_vocab_and_token_table(sim_backend, change, error, needle):
    toy = ToyForward(sim_backend, vocab=VOCAB)
    g = toy.geometry
    table = sim_backend.empty(change.get("token_shape", (g.max_seqs + 1,)),
                              change.get("token_dtype", np.int32))
    with pytest.raises(error, match=needle):
        ForwardModel(sim_backend, change.get("forward", toy), vocab=change.get("vocab", VOCAB),
                     token_table=table, geometry=change.get("geometry", g))


@pytest.mark.parametrize("kwargs,error,needle", [
    (dict(serving_conc=MAX_SERVING_CONC + 1), ValueError, rf"in \[1, {MAX_SERVING_CONC}\]"),
    (dict(serving_conc=2.0), TypeError, r"serving_conc must be an integer in \[1, 1024\], got 2.0"),
    (dict(mode="ring", ring_depth=3), TypeError, "unexpected keyword argument 'ring_depth'"),
    (dict(mode="fast"), ValueError, "mode must be one of"),
    (dict(mode="no_dbuf"), ValueError, "mode must be one of"),
    (dict(capture_sizes=(1, MAX_CAPTURE_SIZE + 1)), ValueError, rf"in \[1, {MAX_CAPTURE_SIZE}\]"),
    (dict(capture_sizes=tuple(range(1, 100))), ValueError, "at most 64 get a graph"),
    (dict(capture_sizes="1,2"), TypeError, "capture_sizes must be a sequence of ints"),
])
def test_config_bounds_and_types_name_the_field(kwargs, error, needle):
    with pytest.raises(error, match=needle):
        ExecutorConfig(**kwargs)


def test_geometry_is_checked_by_kvgeometry():
    with pytest.raises(ValueError, match="KVGeometry.max_seqs"):
        KVGeometry(max_seqs=0, num_kv_blocks=4, block_size=4, max_context=8)
