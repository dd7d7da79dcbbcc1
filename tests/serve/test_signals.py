"""SIGINT and SIGTERM stop `vt serve` cleanly: a stream in flight ends (finished, or cut
after --shutdown-timeout), the listening socket closes, the engine is closed and the process
exits 0, within a bound. Served with --preset (token ids only: no checkpoint to load)."""
import json
import signal
import threading
import time

import httpx
import pytest

from ._live import spawn_server, stop_server


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_server_with_exit_0(sig):
    proc, url = spawn_server(["--preset", "tiny-dense", "--backend", "sim",
                              "--max-concurrency", "2", "--shutdown-timeout", "2"])
    try:
        got, first = [], threading.Event()

        def stream():
            body = {"model": "tiny-dense", "prompt": [5, 6, 7], "max_tokens": 250,
                    "temperature": 0, "stream": True}
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            got.append(json.loads(line[6:]))
                            first.set()
            except httpx.HTTPError:     # cut at the shutdown timeout
                pass

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(30)
        t0 = time.monotonic()
        rc = stop_server(proc, sig, timeout_s=30)
        assert rc == 0, proc.stderr.read()
        assert time.monotonic() - t0 < 15
        t.join(30)
        assert not t.is_alive() and got[0]["choices"][0]["token_ids"]
        assert "vt serve: stopped" in proc.stderr.read()
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_right_after_the_listening_line_is_a_clean_stop(sig):
    """"listening" is printed once the server handles signals and accepts connections: a stop
    asked for the moment the line appears exits 0, without an unawaited coroutine."""
    proc, url = spawn_server(["--preset", "tiny-dense", "--backend", "sim", "--max-concurrency", "1"])
    rc = stop_server(proc, sig)
    err = proc.stderr.read()
    assert rc == 0, (rc, err)
    assert "never awaited" not in err and "Traceback" not in err, err
    assert "vt serve: stopped" in err, err
