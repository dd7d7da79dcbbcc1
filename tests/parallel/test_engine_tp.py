"""Engine(..., tensor_parallel=2) on the sim: two processes, gloo collectives inside every
step's forward, rank 0's plans replayed by rank 1. Its tokens must equal the one-process
model's in every mode (with the poison arm, and chunked prefill splitting the prompts), and
a rank that fails or dies must stop the engine with a clear error within a bound."""
from __future__ import annotations

import functools
import os
import signal
import time

import numpy as np
import pytest

pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("this PyTorch build has no torch.distributed", allow_module_level=True)

from ._models import VOCAB, build, build_failing_on_rank_1, reference  # noqa: E402
from vt.backend import get_backend  # noqa: E402
from vt.engine import Engine  # noqa: E402
from vt.config import SAFE_MODES, ExecutorConfig  # noqa: E402
from vt.parallel import TensorParallelError  # noqa: E402
from vt.hooks import Poison  # noqa: E402

MAX_PREFILL = 8     # prompts of up to 19 tokens: most are split over steps


def _prompts(seed=0, n=6):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=int(rng.integers(1, 20))).tolist() for _ in range(n)]


def _config(mode):
    return ExecutorConfig(mode=mode, serving_conc=4, capture_sizes=(1, 2, 4))


@functools.lru_cache(maxsize=None)
def _expected(new: int) -> list:
    be = get_backend("sim")
    with Engine(be, reference(be), _config("sync"), max_prefill_tokens=MAX_PREFILL) as eng:
        return [list(map(int, r.tokens)) for r in eng.generate(_prompts(), max_new_tokens=new)]


@pytest.mark.parametrize("mode", SAFE_MODES)
def test_tokens_equal_one_process_in_every_mode_with_poison(mode):
    be = get_backend("sim")
    eng = Engine(be, build, _config(mode), max_prefill_tokens=MAX_PREFILL, hooks=Poison(),
                 tensor_parallel=2)
    try:
        got = [list(map(int, r.tokens)) for r in eng.generate(_prompts(), max_new_tokens=10)]
        st = eng.stats()
        group = eng.runner.group
        # the graph replayed back to back: every rank replays it too, or its collectives hang
        assert eng.device_ceiling_us(2, replays=3) > 0
    finally:
        eng.close()
    assert got == _expected(10)
    # the step kinds the comparison covers: graphs, and prompts in chunks beside decodes
    assert st["graph_steps"] > 0 and st["mixed_steps"] + st["prefill_steps"] > 0
    assert group.worker_exit_codes() == [0]
    # rank 1 launched what rank 0 did, graph for graph, and grew no pool after its warm-up
    (rank1,) = group.worker_reports.values()
    for key in ("steps", "graph_steps", "eager_steps", "mixed_steps", "prefill_steps"):
        assert rank1[key] == st[key], key
    assert rank1["steps_by_size"] == st["steps_by_size"]
    assert rank1["driver_mallocs_since_warm_up"] == 0 == st["driver_mallocs_since_warm_up"]


def test_a_killed_worker_stops_the_engine_within_30s():
    be = get_backend("sim", device_delay_s=0.002)   # steps long enough to kill one midway
    eng = Engine(be, build, _config("ring"), tensor_parallel=2)
    try:
        handle = eng.submit([1, 2, 3], max_new_tokens=40)
        deadline = time.monotonic() + 30
        while len(handle.snapshot()[0]) < 2:
            assert time.monotonic() < deadline, "no token before the kill"
            time.sleep(0.005)
        (pid,) = eng.runner.group.worker_pids
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(Exception) as failure:
            handle.result(timeout=30)
        assert time.monotonic() - killed < 30
        assert "rank 1" in str(failure.value) or "rank 1" in str(eng.runner.group.failure)
        with pytest.raises(TensorParallelError, match="rank 1 .*died: killed by signal 9"):
            eng.submit([1, 2], max_new_tokens=2)
    finally:
        t0 = time.monotonic()
        eng.close()
        assert time.monotonic() - t0 < 30


def test_a_worker_killed_while_idle_is_reported_at_the_next_submit():
    be = get_backend("sim")
    eng = Engine(be, build, _config("drain"), tensor_parallel=2)
    try:
        assert eng.generate([[5, 6]], max_new_tokens=3)[0].finish_reason == "length"
        (pid,) = eng.runner.group.worker_pids
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while eng.runner.group.failure is None:
            assert time.monotonic() < deadline, "the monitor did not see the death"
            time.sleep(0.01)
        with pytest.raises(TensorParallelError, match="killed by signal 9"):
            eng.generate([[5, 6]], max_new_tokens=3)
    finally:
        eng.close()


def test_a_worker_that_fails_to_build_fails_the_engine_with_its_error():
    be = get_backend("sim")
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1 failed: RuntimeError: this rank "
                                                  "cannot load its shard"):
        Engine(be, build_failing_on_rank_1, _config("ring"), tensor_parallel=2)
    assert time.monotonic() - t0 < 60
    assert not dist.is_initialized()   # rank 0 left the process group it joined


def test_the_builder_must_be_picklable():
    be = get_backend("sim")
    with pytest.raises(TypeError, match="build must be picklable"):
        Engine(be, lambda be, tp: build(be, tp), _config("ring"), tensor_parallel=2)


@pytest.mark.parametrize("value, error", [(0, ValueError), (True, TypeError), (1.5, TypeError)])
def test_tensor_parallel_is_a_positive_int(value, error):
    with pytest.raises(error, match="tensor_parallel"):
        Engine(get_backend("sim"), build, _config("ring"), tensor_parallel=value)


def test_online_submits_cancels_and_sampling_keep_the_ranks_together():
    """Requests submitted from threads at random moments, some cancelled midway, greedy and
    seeded sampling mixed: rank 0 alone decides every step, so rank 1 replays them whatever
    the timing, and every request gets the one-process model's tokens (a cancelled one a
    prefix of them)."""
    import threading

    from vt.sampling.params import GREEDY, SamplingParams

    prompts = _prompts(seed=5, n=10)
    sampling = [GREEDY if i % 2 else SamplingParams(temperature=0.9, top_k=20, seed=100 + i)
                for i in range(len(prompts))]
    be = get_backend("sim")
    with Engine(be, reference(be), _config("sync"), max_prefill_tokens=MAX_PREFILL) as eng:
        expected = [list(map(int, r.tokens)) for r in
                    eng.generate(prompts, max_new_tokens=16, sampling=sampling)]
    rng = np.random.default_rng(9)
    delays = rng.uniform(0, 0.05, size=len(prompts))
    eng = Engine(be, build, _config("ring"), max_prefill_tokens=MAX_PREFILL, hooks=Poison(),
                 tensor_parallel=2)
    handles = [None] * len(prompts)
    try:
        def client(i):
            time.sleep(delays[i])
            handles[i] = eng.submit(prompts[i], max_new_tokens=16, sampling=sampling[i])
            if i % 3 == 0:   # cancel once it has a token or two
                deadline = time.monotonic() + 30
                while len(handles[i].snapshot()[0]) < 2 and not handles[i].done():
                    assert time.monotonic() < deadline
                    time.sleep(0.001)
                handles[i].cancel()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        results = [h.result(timeout=60) for h in handles]
        group = eng.runner.group
    finally:
        eng.close()
    for i, r in enumerate(results):
        if r.finish_reason == "cancelled":
            assert list(r.tokens) == expected[i][:len(r.tokens)], i
        else:
            assert r.finish_reason == "length" and list(r.tokens) == expected[i], i
    assert any(r.finish_reason == "cancelled" for r in results)
    assert group.worker_exit_codes() == [0]


RANK_0_SCRIPT = """
import sys, time
from tests.parallel._models import build
from vt.backend import get_backend
from vt.engine import Engine
from vt.config import ExecutorConfig

if __name__ == "__main__":
    eng = Engine(get_backend("sim"), build, ExecutorConfig(mode="ring", serving_conc=2,
                 capture_sizes=(1, 2)), tensor_parallel=2)
    eng.generate([[1, 2, 3]], max_new_tokens=3)
    print(eng.runner.group.worker_pids[0], flush=True)
    time.sleep(300)
"""


def _running(pid: int) -> bool:
    """Whether the process runs (a zombie nobody reaped has ended)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc to see the worker end")
def test_the_workers_end_when_rank_0_is_killed(tmp_path):
    """Rank 0's process killed while its engine is idle: its worker, reparented, finds its
    parent gone at its next wait for a plan and exits, well within 30 s."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    script = tmp_path / "rank0.py"
    script.write_text(RANK_0_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-W", "ignore", str(script)], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    worker = None
    try:
        line = proc.stdout.readline()
        assert line.strip().isdigit(), proc.stderr.read() if proc.poll() is not None else line
        worker = int(line)
        assert _running(worker)
        proc.kill()
        proc.wait(10)
        killed = time.monotonic()
        while _running(worker):
            assert time.monotonic() - killed < 30, "the worker outlived rank 0 by 30 s"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if worker is not None and _running(worker):   # failed: leave no orphan behind
            os.kill(worker, signal.SIGKILL)
