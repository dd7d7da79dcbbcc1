"""Live servers for the tests: `vt serve` as a subprocess (what a user runs), and the same app
in a thread of the test process over a model whose forward the test controls (a valve that
stalls the device, a token that makes the step fail). Every wait is bounded."""
from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import httpx

from vt.bench.serve_http import spawn_vt_serve, stop_vt_serve

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120.0


def spawn_server(args: list[str]) -> tuple[subprocess.Popen, str]:
    """`python -m vt serve ARGS --host 127.0.0.1 --port 0`; (process, base URL) once it listens.
    Its stderr is proc.stderr, for the test to read."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return spawn_vt_serve(args, START_TIMEOUT_S, env=env, cwd=ROOT, capture_stderr=True)


def stop_server(proc: subprocess.Popen, sig, timeout_s: float = 30.0) -> int:
    """Send `sig`; its exit code. One that does not exit within timeout_s is killed and fails
    the test."""
    rc = stop_vt_serve(proc, timeout_s, sig)
    if rc == -9:
        raise AssertionError(f"vt serve did not exit within {timeout_s:g} s of {sig!r}")
    return rc


class Valve:
    """Wraps a torch forward: stall_after(n) lets n more forward calls run, then each waits
    until open(); a call whose input ids hold `fail_token` raises."""

    def __init__(self):
        self._cv = threading.Condition()
        self._budget: int | None = None    # None: open
        self.fail_token: int | None = None

    def stall_after(self, calls: int) -> None:
        with self._cv:
            self._budget = calls

    def open(self) -> None:
        with self._cv:
            self._budget = None
            self._cv.notify_all()

    def wrap(self, module):
        def forward(inputs, logits_out):
            with self._cv:
                if not self._cv.wait_for(lambda: self._budget is None or self._budget > 0, 30):
                    raise TimeoutError("the test's valve stayed shut")
                if self._budget is not None:
                    self._budget -= 1
            if self.fail_token is not None and bool((inputs.input_ids == self.fail_token).any()):
                raise RuntimeError(f"injected failure at token {self.fail_token}")
            module(inputs, logits_out)
        return forward


class InProcessServer:
    """The vt serve app over `served` on a uvicorn thread; .url, .engine, .server; close()
    stops all. tensor_parallel > 1: served.step_model is the ranks' build."""

    def __init__(self, be, served, *, conc: int, max_queued: int, tensor_parallel: int = 1):
        from vt.engine.engine import Engine
        from vt.config import ExecutorConfig
        from vt.serve.generation import GenerationService
        from vt.serve.metrics import ServeMetrics
        from vt.serve.server import address, bind, make_server

        self.engine = Engine(be, served.step_model, ExecutorConfig(
            mode="ring", serving_conc=conc, capture_sizes=tuple(s for s in (1, 2, 4, 8) if s <= conc)),
            tensor_parallel=tensor_parallel)
        self.service = GenerationService(self.engine, served, ServeMetrics(served.name),
                                         serving_conc=conc, max_queued=max_queued)
        self._sock = bind("127.0.0.1", 0)
        self.url = address(self._sock)
        self.server = make_server(self.service, shutdown_timeout_s=5.0)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        self.engine.close()
        self._sock.close()


def metrics(url: str) -> dict[str, float]:
    """GET /metrics parsed by prometheus_client: {sample name + labels: value}."""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def wait_for(cond, timeout_s: float = 10.0, what: str = "condition"):
    """Poll cond() every 20 ms until truthy (its value) or fail after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what} not reached within {timeout_s} s")
