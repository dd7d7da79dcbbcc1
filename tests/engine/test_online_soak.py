"""Soak of the online API: one engine, thousands of steps under random arrivals (a client
thread submitting at random moments) and random cancels. Python memory (tracemalloc), the
process's threads and the pool stay flat after warm-up; at the end every row and KV block is
free; finished requests equal their tokens alone, cancelled ones are prefixes of them. CI
runs a short soak; `--run-slow` / VT_SLOW=1 the 10,000-step one."""
import random
import threading
import time
import tracemalloc

import numpy as np
import pytest

from vt.backend import get_backend
from vt.engine.engine import Engine
from vt.forward.toy import ToyForward
from vt.config import ExecutorConfig

from .test_failures import GEO, SIZES

VOCAB = 64
SLACK_BYTES = 256 * 1024   # tracemalloc noise: frames, small caches


def soak(steps: int, mode: str, seed: int = 0) -> dict:
    be = get_backend("sim")
    rnd = random.Random(seed)
    checks = []
    try:
        threads_before = {t.ident for t in threading.enumerate()}
        eng = Engine(be, ToyForward(be, vocab=VOCAB, geometry=GEO).step_model(),
                     ExecutorConfig(mode=mode, serving_conc=6, capture_sizes=SIZES))
        sample, stop = [], threading.Event()

        def client():
            outstanding = []
            while not stop.is_set():
                time.sleep(rnd.uniform(0, 0.002))
                prompt = [rnd.randrange(VOCAB) for _ in range(rnd.randint(1, 8))]
                h = eng.submit(prompt, max_new_tokens=rnd.randint(1, 20),
                               stop_token=rnd.choice([None, rnd.randrange(VOCAB)]))
                if len(sample) < 40 and rnd.random() < 0.05:
                    sample.append((prompt, h))
                outstanding.append(h)
                if rnd.random() < 0.2:
                    rnd.choice(outstanding).cancel()
                outstanding = [h for h in outstanding if not h.done()][-24:]
                while len(outstanding) >= 20 and not stop.is_set():
                    outstanding[0].result(timeout=60)
                    outstanding = [h for h in outstanding if not h.done()]
            for h in outstanding:
                h.result(timeout=60)

        t = threading.Thread(target=client)
        tracemalloc.start()
        t.start()
        marks = np.linspace(steps / 4, steps, 7).astype(int)
        for mark in marks:
            while eng.stats()["steps"] < mark:
                time.sleep(0.005)
            checks.append(dict(step=eng.stats()["steps"], traced=tracemalloc.get_traced_memory()[0],
                               threads=threading.active_count(),
                               mallocs=eng.stats()["driver_mallocs_since_warm_up"]))
        stop.set()
        t.join(120)
        tracemalloc.stop()
        st = eng.stats()
        out = dict(checks=checks, stats=st, idle=eng.idle(), threads_before=threads_before,
                   sample=[(p, h.result(timeout=60)) for p, h in sample])
        eng.close()
        with Engine(be, ToyForward(be, vocab=VOCAB, geometry=GEO).step_model(),
                    ExecutorConfig(serving_conc=6, capture_sizes=SIZES)) as ref:
            out["alone"] = [ref.generate([p], max_new_tokens=20)[0].tokens
                            for p, _ in out["sample"]]
        out["threads_after"] = {t.ident for t in threading.enumerate()}
        return out
    finally:
        be.close()


def _check(rep: dict, steps: int) -> None:
    checks, st = rep["checks"], rep["stats"]
    assert st["steps"] >= steps and rep["idle"]
    assert st["rows_free"] == GEO.max_seqs and st["kv_blocks_free"] == st["kv_blocks_total"]
    base = checks[1]        # after warm-up
    for c in checks[2:]:
        assert c["traced"] - base["traced"] < SLACK_BYTES, checks
        assert c["threads"] == base["threads"], checks
        assert c["mallocs"] == 0, checks
    assert rep["threads_after"] <= rep["threads_before"], "a thread outlived the engine"
    assert st["requests_finished"] > steps // 20
    for (prompt, res), alone in zip(rep["sample"], rep["alone"]):
        # the same prompt with 20 new tokens: a finished or cancelled request is a prefix of it
        # up to its stop token (its own budget may be shorter)
        assert res.tokens == alone[:len(res.tokens)], (prompt, res, alone)


@pytest.mark.parametrize("mode", ["sync", "ring"])
def test_short_online_soak_is_flat(mode):
    rep = soak(1500, mode)
    _check(rep, 1500)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["drain", "ring"])
def test_online_soak_10000_steps_is_flat(mode):
    rep = soak(10_000, mode, seed=1)
    _check(rep, 10_000)
