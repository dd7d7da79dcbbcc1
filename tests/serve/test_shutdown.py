"""However `vt serve` is stopped, every request it accepted gets a well-formed answer: a whole
completion its JSON body, a stream its last chunk and [DONE] in a terminated chunked body, both
with finish_reason "abort" when the stop cut them short, and no traceback in the log. Served
with --preset (token ids only: no checkpoint to load)."""
import json
import signal
import threading

import httpx
import pytest

from ._live import metrics, spawn_server, wait_for

MAX_TOKENS = 250    # a few hundred steps on the sim: still running when the signal comes


def _stream(url, lines):
    body = {"model": "tiny-dense", "prompt": [5, 6, 7], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        lines.append(r.status_code)
        lines.extend(line for line in r.iter_lines() if line)


def _whole(url, out):
    body = {"model": "tiny-dense", "prompt": [8, 9], "max_tokens": MAX_TOKENS, "temperature": 0}
    out.append(httpx.post(url + "/v1/completions", json=body, timeout=30))


def _refused(url) -> bool:
    try:
        httpx.get(url + "/health", timeout=5)
    except httpx.ConnectError:
        return True
    except (httpx.ReadError, httpx.RemoteProtocolError):
        # accepted from the backlog just before the socket closed, then reset: ask again
        return False
    return False


@pytest.mark.parametrize("timeout_s, signals", [("0", [signal.SIGTERM]),
                                                ("30", [signal.SIGINT, signal.SIGINT])],
                         ids=["SIGTERM, no grace", "SIGINT twice"])
def test_requests_cut_by_a_stop_end_with_finish_reason_abort(timeout_s, signals):
    proc, url = spawn_server(["--preset", "tiny-dense", "--backend", "sim", "--max-concurrency",
                              "2", "--shutdown-timeout", timeout_s])
    try:
        lines, whole = [], []
        threads = [threading.Thread(target=_stream, args=(url, lines)),
                   threading.Thread(target=_whole, args=(url, whole))]
        for t in threads:
            t.start()
        wait_for(lambda: metrics(url)["vt_requests_running"] == 2 and len(lines) > 2,
                 what="both requests running")
        for sig in signals:
            proc.send_signal(sig)
            # the next signal once this one is handled (two pending SIGINTs are one)
            wait_for(lambda: _refused(url), what="the listening socket closed")
        assert proc.wait(30) == 0
        for t in threads:
            t.join(30)
            assert not t.is_alive()
        stderr = proc.stderr.read()
        assert "Traceback" not in stderr and "Exception" not in stderr, stderr

        (r,) = whole
        assert r.status_code == 200, r.text
        choice, use = r.json()["choices"][0], r.json()["usage"]
        assert choice["finish_reason"] == "abort"
        assert 0 < use["completion_tokens"] == len(choice["token_ids"]) < MAX_TOKENS

        assert lines[0] == 200 and lines[-1] == "data: [DONE]", lines[-3:]
        chunks = [json.loads(line[6:]) for line in lines[1:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks[:-2]] == [None] * (len(chunks) - 2)
        assert chunks[-2]["choices"][0]["finish_reason"] == "abort"
        ids = [t for c in chunks[:-1] for t in c["choices"][0]["token_ids"]]
        assert 0 < chunks[-1]["usage"]["completion_tokens"] == len(ids) < MAX_TOKENS
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
