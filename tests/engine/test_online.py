"""The online API: submit() from several threads at any moment, streams, cancel, a failing
step, close() with work in flight, asyncio; on the sim, with GPU twins at the end."""
import asyncio
import random
import threading
import time

import numpy as np
import pytest

from vt.backend import ClosedError, get_backend
from vt.engine.engine import Engine
from vt.engine.serving import ServingLoop
from vt.forward.toy import ToyForward
from vt.config import ExecutorConfig
from vt.step.contract import SamplingParams

from .test_failures import GEO, SIZES, FaultyForward, KernelFault

VOCAB = 64
MODES = ["sync", "drain", "ring", "staged"]


def _config(mode, **kw):
    return ExecutorConfig(mode=mode, **{"serving_conc": 6, "capture_sizes": SIZES, **kw})


def _engine(be, mode="ring", fwd=None, **kw):
    fwd = fwd or ToyForward(be, vocab=VOCAB, geometry=GEO)
    return Engine(be, fwd.step_model(), _config(mode, **kw))


def _requests(seed, n=16):
    """Fresh random prompts, budgets, greedy and seeded sampling, 0-2 stop tokens each."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(0, VOCAB, size=int(rng.integers(1, 9))).tolist()
        sampling = (SamplingParams() if i % 2 else
                    SamplingParams(temperature=0.9, top_k=int(rng.integers(2, 30)), seed=7 + i))
        stops = [int(s) for s in rng.choice(VOCAB, size=int(rng.integers(0, 3)), replace=False)]
        out.append(dict(prompt=prompt, max_new_tokens=int(rng.integers(1, 20)), sampling=sampling,
                        stop_token=stops or None))
    return out


def _alone(be, reqs):
    """Each request served alone on a fresh engine (the reference)."""
    with _engine(be, "sync") as eng:
        return [eng.generate([r["prompt"]], max_new_tokens=r["max_new_tokens"],
                             sampling=r.get("sampling"), stop_token=r.get("stop_token"))[0]
                for r in reqs]


def _threads_now():
    return {t.ident for t in threading.enumerate()}


@pytest.mark.parametrize("mode", MODES)
def test_submits_from_several_threads_at_random_times_equal_each_request_alone(sim_backend, mode):
    """Four threads submit at random moments while the engine serves: every request's tokens
    and finish reason are those it gets alone (greedy and seeded, with stop tokens)."""
    reqs = _requests(seed=11, n=24)
    ref = _alone(sim_backend, reqs)
    got = [None] * len(reqs)
    with _engine(sim_backend, mode) as eng:
        def client(k):
            rnd = random.Random(k)
            handles = []
            for i in range(k, len(reqs), 4):
                time.sleep(rnd.uniform(0, 0.01))
                handles.append((i, eng.submit(**reqs[i])))
            for i, h in handles:
                got[i] = h.result(timeout=60)
        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert eng.idle()
    for i, (a, b) in enumerate(zip(ref, got)):
        assert (b.tokens, b.finish_reason) == (a.tokens, a.finish_reason), i


def test_several_stop_tokens_end_at_the_first_one_sampled(sim_backend):
    with _engine(sim_backend) as eng:
        free = eng.submit([3, 1, 4], max_new_tokens=20).result(timeout=30).tokens
        stops = {free[6], free[2]}
        got = eng.submit([3, 1, 4], max_new_tokens=20, stop_token=stops).result(timeout=30)
    cut = min(free.index(s) for s in stops) + 1
    assert got.tokens == free[:cut] and got.finish_reason == "stop"


@pytest.mark.parametrize("mode", MODES)
def test_streamed_tokens_equal_the_final_result(sim_backend, mode):
    reqs = _requests(seed=12, n=8)
    with _engine(sim_backend, mode) as eng:
        handles = [eng.submit(**r) for r in reqs]
        streamed = [list(h.stream(timeout=30)) for h in handles]
        results = [h.result() for h in handles]
    assert streamed == [r.tokens for r in results]
    assert any(len(s) > 1 for s in streamed)


@pytest.mark.parametrize("mode", MODES)
def test_cancel_frees_rows_and_kv_blocks(sim_backend, mode):
    """Cancel running and queued requests: finish_reason 'cancelled' with the tokens so far
    (a prefix of what they get alone), every row and KV block back, the rest unaffected."""
    reqs = [dict(prompt=[i + 1, 2], max_new_tokens=30) for i in range(10)]
    ref = _alone(sim_backend, reqs)
    with _engine(sim_backend, mode) as eng:
        handles = [eng.submit(**r) for r in reqs]
        first = handles[0].stream(timeout=30)
        next(first), next(first)          # request 0 runs
        for h in handles[::2]:
            h.cancel()
            h.cancel()                    # idempotent
        results = [h.result(timeout=30) for h in handles]
        assert eng.idle()
        st = eng.stats()
        assert st["rows_free"] == GEO.max_seqs and st["kv_blocks_free"] == st["kv_blocks_total"]
    for i, (a, b) in enumerate(zip(ref, results)):
        if i % 2:
            assert (b.tokens, b.finish_reason) == (a.tokens, "length")
        else:
            assert b.finish_reason == "cancelled" and b.tokens == a.tokens[:len(b.tokens)]
    assert len(results[0].tokens) >= 2


def test_cancel_of_a_finished_request_changes_nothing(sim_backend):
    with _engine(sim_backend) as eng:
        h = eng.submit([1, 2], max_new_tokens=3)
        r = h.result(timeout=30)
        h.cancel()
        assert h.done() and h.result() == r and r.finish_reason == "length"


@pytest.mark.parametrize("mode", ["drain", "ring", "staged"])
def test_a_raising_step_fails_its_requests_and_the_engine_serves_the_next(sim_backend, mode):
    """A kernel raises at the 4th graph replay: the requests of that step get the error from
    result() and stream(); a request submitted after is served as it is alone. The first
    prefill waits until all three are submitted, so all three are in the failing step."""
    fwd = FaultyForward(sim_backend)
    with _engine(sim_backend, mode, fwd=fwd) as eng:
        fwd.graph_bomb.arm(4)
        fwd.host_gate = gate = threading.Event()
        failing = [eng.submit([1, 2, 3], max_new_tokens=12) for _ in range(3)]
        gate.set()
        for h in failing:
            with pytest.raises(RuntimeError, match="graph_bomb raised on call"):
                h.result(timeout=30)
            with pytest.raises(RuntimeError, match="graph_bomb"):
                list(h.stream(timeout=30))
        assert eng.stats()["failed_steps"] == 1
        after = eng.submit([5, 6], max_new_tokens=9).result(timeout=30)
        assert eng.idle()
    assert after.tokens == _alone(sim_backend, [dict(prompt=[5, 6], max_new_tokens=9)])[0].tokens


def test_validation_raises_in_the_callers_thread(sim_backend):
    with _engine(sim_backend) as eng:
        with pytest.raises(ValueError, match="max_new_tokens must be positive"):
            eng.submit([1], max_new_tokens=0)
        with pytest.raises(ValueError, match=r"stop_token must be a token id in \[0, 64\)"):
            eng.submit([1], stop_token=[3, 99])
        with pytest.raises(TypeError, match="must be a vt.SamplingParams"):
            eng.submit([1], sampling="greedy")
        assert eng.stats()["steps"] == 0


@pytest.mark.parametrize("finish", [False, True])
def test_close_with_work_in_flight_neither_hangs_nor_leaks_threads(finish):
    """close() while requests run and wait (a delayed sim, so they are mid-way): it returns,
    the serving thread is gone, every handle is done (cancelled, or served with finish=True)
    and a blocked result() and stream() return."""
    be = get_backend("sim", device_delay_s=1e-4)
    try:
        before = _threads_now()
        eng = _engine(be)
        handles = [eng.submit([i + 1], max_new_tokens=25) for i in range(12)]
        next(handles[0].stream(timeout=30))
        out = {}
        waiter = threading.Thread(target=lambda: out.update(r=handles[-1].result(timeout=60)))
        waiter.start()
        eng.close(finish=finish)
        waiter.join(30)
        assert not waiter.is_alive() and all(h.done() for h in handles)
        reasons = {h.result().finish_reason for h in handles}
        assert reasons == ({"length"} if finish else {"cancelled"} | (reasons & {"length"}))
        assert "cancelled" in reasons or finish
        assert _threads_now() - before == set()
        with pytest.raises(ClosedError):
            eng.submit([1])
        assert eng.close() is None     # idempotent
    finally:
        be.close()


def test_generate_in_another_thread_raises_closed_error_when_the_engine_closes():
    be = get_backend("sim", device_delay_s=1e-4)
    try:
        eng = _engine(be)
        out = {}

        def call():
            try:
                eng.generate([[1, 2]] * 6, max_new_tokens=25)
            except BaseException as e:  # noqa: BLE001 (asserted below)
                out["error"] = e
        t = threading.Thread(target=call)
        t.start()
        while eng.stats()["steps"] < 3 and t.is_alive():
            time.sleep(0.001)
        eng.close()
        t.join(30)
        assert isinstance(out.get("error"), ClosedError)
    finally:
        be.close()


@pytest.mark.parametrize("mode", ["drain", "ring"])
def test_stream_async_from_asyncio_tasks_equals_the_results_alone(sim_backend, mode):
    reqs = _requests(seed=13, n=6)
    ref = _alone(sim_backend, reqs)

    async def one(eng, r):
        return [tok async for tok in eng.stream_async(**r)]

    async def main(eng):
        return await asyncio.gather(*(one(eng, r) for r in reqs))

    with _engine(sim_backend, mode) as eng:
        got = asyncio.run(main(eng))
        assert eng.idle()
    assert got == [r.tokens for r in ref]


def test_leaving_stream_async_early_cancels_the_request(sim_backend):
    async def main(eng):
        got = []
        async for tok in eng.stream_async([1, 2], max_new_tokens=25):
            got.append(tok)
            if len(got) == 3:
                break
        return got

    with _engine(sim_backend) as eng:
        assert len(asyncio.run(main(eng))) == 3
        deadline = time.monotonic() + 30
        while not eng.idle() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert eng.idle() and eng.stats()["requests_finished"] == 1


# -- on the GPU --------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["drain", "ring"])
def test_cuda_submits_from_threads_equal_alone_and_cancel_frees_everything(mode):
    be = get_backend("cuda")
    try:
        reqs = _requests(seed=21, n=16)
        ref = _alone(be, reqs)
        with _engine(be, mode) as eng:
            handles = [None] * len(reqs)

            def client(k):
                for i in range(k, len(reqs), 4):
                    time.sleep(random.Random(i).uniform(0, 0.005))
                    handles[i] = eng.submit(**reqs[i])
            threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            got = [h.result(timeout=60) for h in handles]
            extra = [eng.submit([9, 9], max_new_tokens=25) for _ in range(4)]
            for h in extra:
                h.cancel()
            assert all(h.result(timeout=60).finish_reason in ("cancelled", "length") for h in extra)
            assert eng.idle()
        assert [(r.tokens, r.finish_reason) for r in got] == [(r.tokens, r.finish_reason) for r in ref]
    finally:
        be.close()


@pytest.mark.gpu
def test_cuda_a_raising_eager_step_fails_alone():
    be = get_backend("cuda")
    try:
        fwd = FaultyForward(be)
        with _engine(be, "ring", fwd=fwd) as eng:
            fwd.eager_bomb.arm(2)
            with pytest.raises(KernelFault):
                eng.submit([1, 2, 3], max_new_tokens=8).result(timeout=60)
            assert len(eng.submit([4], max_new_tokens=5).result(timeout=60).tokens) == 5
            assert eng.idle()
    finally:
        be.close()


def test_serving_doc_example_prints_its_stated_output():
    """docs/engine.md's example (two threads, asyncio, a cancel) runs and prints what it says."""
    import contextlib
    import io
    import pathlib
    import re
    doc = pathlib.Path(__file__).parents[2] / "docs" / "engine.md"
    code = re.search(r"```python\n(.*?)```", doc.read_text(), re.S).group(1)
    expected = re.search(r"^# (True .*)$", code, re.M).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(doc), "exec"), {})
    assert out.getvalue().strip() == expected


def test_a_broken_loop_fails_its_requests_instead_of_hanging_them(sim_backend, monkeypatch):
    """Should the loop itself raise (outside a step), every request it holds fails with that
    error, a blocked result() returns, and submit() refuses afterwards."""
    with _engine(sim_backend) as eng:
        eng.submit([1, 2], max_new_tokens=3).result(timeout=30)     # the thread runs
        boom = RuntimeError("loop bug")

        def broken(*a, **k):
            raise boom
        monkeypatch.setattr(ServingLoop, "_take_arrivals", broken)
        h = eng.submit([3, 4], max_new_tokens=3)
        with pytest.raises(RuntimeError, match="loop bug"):
            h.result(timeout=30)
        with pytest.raises(ClosedError):
            eng.submit([1])


def test_generate_of_no_prompts_returns_at_once(sim_backend):
    with _engine(sim_backend) as eng:
        assert eng.generate([], progress=lambda p: None) == [] == eng.generate([])


@pytest.mark.parametrize("mode", ["sync", "drain", "ring"])
def test_chunked_prefill_keeps_every_step_within_the_budget_and_the_tokens(sim_backend, mode):
    """max_prefill_tokens=3 on a forward that prefills from a position: long prompts come in
    chunks of at most 3 tokens per step (all prefills of a step together), decoding requests
    go on between them, and every request's tokens equal those of an unchunked engine."""
    reqs = [dict(prompt=list(range(1, 1 + n)), max_new_tokens=6, stop_token=[63]) for n in
            (9, 1, 14, 5, 2, 11)]
    ref = _alone(sim_backend, reqs)
    fwd = ToyForward(sim_backend, vocab=VOCAB, geometry=GEO)
    model = fwd.step_model()
    chunks = []
    real = model.prepare_prefill     # the runner's entry to a step's prompt chunks

    def recording(seqs):
        chunks.append(sum(len(s.tokens) - s.start for s in seqs))
        return real(seqs)
    model.prepare_prefill = recording
    with Engine(sim_backend, model, _config(mode), max_prefill_tokens=3) as eng:
        chunks.clear()                                  # (the warm-up's prefills)
        handles = [eng.submit(**r) for r in reqs]
        got = [h.result(timeout=60) for h in handles]
        assert eng.idle()
        first = list(chunks)
        h = eng.submit(list(range(20)), max_new_tokens=4)
        h.cancel()                                      # possibly mid-way through its chunks
        assert h.result(timeout=60).finish_reason == "cancelled" and eng.idle()
    assert max(chunks) <= 3 and sum(first) == sum(len(r["prompt"]) for r in reqs)
    assert [(r.tokens, r.finish_reason) for r in got] == [(r.tokens, r.finish_reason) for r in ref]
