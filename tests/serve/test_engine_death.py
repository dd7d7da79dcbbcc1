"""A tensor-parallel engine whose worker dies can serve no more: /health says so (503) and every
request gets an OpenAI error body (503), a stream in flight its error event and [DONE], and
`vt serve` exits 1 (docs/serve.md: a supervisor starts it again). On the sim: two processes,
gloo collectives."""
import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("this PyTorch build has no torch.distributed", allow_module_level=True)

from starlette.testclient import TestClient  # noqa: E402

from tests.parallel._models import GEO, VOCAB, build  # noqa: E402
from vt.backend import get_backend  # noqa: E402
from vt.engine import Engine  # noqa: E402
from vt.config import ExecutorConfig  # noqa: E402
from vt.serve.app import create_app  # noqa: E402
from vt.serve.generation import GenerationService  # noqa: E402
from vt.serve.metrics import ServeMetrics  # noqa: E402
from vt.serve.model_source import ServedModel  # noqa: E402
from vt.serve.server import make_server  # noqa: E402

from ._live import spawn_server  # noqa: E402
from .conftest import BLOCK, CONTEXT  # noqa: E402


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s} s"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def dead_service():
    """A GenerationService over a tensor-parallel engine that served, then lost rank 1."""
    be = get_backend("sim")
    engine = Engine(be, build, ExecutorConfig(mode="ring", serving_conc=2,
                                                       capture_sizes=(1, 2)), tensor_parallel=2)
    try:
        served = ServedModel("toy", build, GEO, VOCAB, None, ())
        service = GenerationService(engine, served, ServeMetrics("toy"), serving_conc=2,
                                    max_queued=2)
        assert engine.generate([[1, 2, 3]], max_new_tokens=2)[0].finish_reason == "length"
        (pid,) = engine.runner.group.worker_pids
        os.kill(pid, signal.SIGKILL)
        _wait(lambda: engine.runner.group.failure is not None, 30, "the death seen")
        yield service
    finally:
        engine.close()
        be.close()


def test_health_and_every_request_answer_503_once_the_engine_is_dead(dead_service):
    client = TestClient(create_app(dead_service), raise_server_exceptions=False)
    r = client.get("/health")
    assert r.status_code == 503, r.text
    assert r.json()["status"] == "engine_stopped" and "rank 1" in r.json()["reason"]
    for stream in (False, True):
        r = client.post("/v1/completions", json={"model": "toy", "prompt": [1, 2], "max_tokens": 2,
                                                 "stream": stream})
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "engine_stopped" and err["type"] == "server_error"
        assert "killed by signal 9" in err["message"], err


def test_the_server_stops_by_itself_saying_why(dead_service):
    with socket.create_server(("127.0.0.1", 0)) as sock:
        server = make_server(dead_service, shutdown_timeout_s=30)
        runner = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        t0 = time.monotonic()
        runner.start()
        runner.join(10)
        assert not runner.is_alive(), "the server went on serving a dead engine"
    assert time.monotonic() - t0 < 5
    assert "rank 1" in server.engine_failure and "died" in server.engine_failure


def _worker_pid(server_pid: int) -> int:
    """The server's spawned rank (its resource tracker is a child too)."""
    with open(f"/proc/{server_pid}/task/{server_pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    workers = []
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                workers.append(pid)
    assert len(workers) == 1, children
    return workers[0]


@pytest.mark.skipif(not os.path.isfile(f"/proc/{os.getpid()}/task/{os.getpid()}/children"),
                    reason="finds the server's worker through /proc")
def test_vt_serve_exits_1_when_a_rank_dies_mid_stream(checkpoint):
    # one row, one graph: the fewest captures, for each of the two processes
    proc, url = spawn_server(["--model", str(checkpoint), "--served-model-name", "tiny",
                              "--tensor-parallel", "2", "--backend", "sim", "--max-context",
                              str(CONTEXT), "--block-size", str(BLOCK), "--max-concurrency", "1"])
    try:
        lines, first = [], threading.Event()

        def stream():
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 60, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(30)
        os.kill(_worker_pid(proc.pid), signal.SIGKILL)
        assert proc.wait(30) == 1
        t.join(30)
        assert not t.is_alive()
        stderr = proc.stderr.read()
        assert "vt serve: exiting, the engine stopped:" in stderr and "rank 1" in stderr, stderr
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(line[6:]) for line in lines[:-1]]
        assert events[-1]["error"]["type"] == "server_error", events[-1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
