"""The server under load and faults, in the test process over a forward the test controls
(vt serve's app on a uvicorn thread; the engine on the sim): more requests than it takes get
429 + Retry-After at once; a client that goes away mid-stream has its request cancelled at the
next step, its row and KV blocks freed; a failing step gets its request a 500 (a streamed one,
an error event) and the server goes on serving."""
import json
import threading

import httpx
import openai
import pytest

from vt.backend import get_backend
from vt.serve.model_source import load_checkpoint

from ._live import InProcessServer, Valve, metrics, wait_for

CONC, QUEUED = 2, 1
TRIGGER = 7   # a token id the valve fails on


@pytest.fixture(scope="module")
def live(checkpoint):
    valve = Valve()
    be = get_backend("sim")
    served = load_checkpoint(be, checkpoint, max_seqs=CONC, max_context=64, block_size=4,
                             name="tiny", wrap_forward=valve.wrap)
    server = InProcessServer(be, served, conc=CONC, max_queued=QUEUED)
    yield server, valve
    valve.open()
    server.close()
    be.close()


def _stream(url, body, out):
    """POST a streamed completion; append each data line's text to `out`."""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        out.append(r.status_code)
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out.append(json.loads(line[6:]))


BODY = {"model": "tiny", "prompt": "Hello", "max_tokens": 20, "temperature": 0,
        "ignore_eos": True, "stream": True}


def test_more_requests_than_the_server_takes_get_429_with_retry_after(live):
    server, valve = live
    valve.stall_after(0)      # the device stalls: admitted requests stay in the server
    outs = [[] for _ in range(CONC + QUEUED)]
    threads = [threading.Thread(target=_stream, args=(server.url, BODY, o)) for o in outs]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: (lambda m: m["vt_requests_running"] + m["vt_requests_waiting"])(
            metrics(server.url)) == CONC + QUEUED, what="every request admitted")
        r = httpx.post(server.url + "/v1/completions", json={**BODY, "stream": False}, timeout=10)
        assert r.status_code == 429, r.text
        assert r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "overloaded"
    finally:
        valve.open()
    for t in threads:
        t.join(60)
    assert all(o[0] == 200 and o[-1]["choices"][0]["finish_reason"] == "length" for o in outs)
    assert metrics(server.url)["vt_requests_rejected_total{reason=overloaded}"] >= 1


def test_a_client_gone_mid_stream_is_cancelled_and_its_blocks_freed(live):
    server, valve = live
    before = metrics(server.url)
    prompt = [0, 50, 60]
    # Prefill runs the forward once per prompt position (its last one samples the first
    # token): stall right after it, so the request cannot run to its end by itself while the
    # client reads its first token and leaves.
    valve.stall_after(len(prompt))
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", server.url + "/v1/completions",
                           json={**BODY, "prompt": prompt, "max_tokens": 50}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break
    # leaving the client closed the connection
    try:
        wait_for(lambda: metrics(server.url)["vt_requests_total{finish_reason=abort}"] ==
                 before["vt_requests_total{finish_reason=abort}"] + 1, what="the request cancelled")
    finally:
        valve.open()
    after = wait_for(lambda: (lambda m: m if m["vt_kv_blocks_in_use"] == 0 and
                              m["vt_requests_running"] == 0 else None)(metrics(server.url)),
                     what="its row and KV blocks freed")
    assert after["vt_engine_steps_total"] - before["vt_engine_steps_total"] < 10   # not its 50
    assert after["vt_requests_total{finish_reason=length}"] == before["vt_requests_total{finish_reason=length}"]


def test_a_failing_step_is_a_500_and_the_server_goes_on(live):
    server, valve = live
    valve.fail_token = TRIGGER
    try:
        r = httpx.post(server.url + "/v1/completions",
                       json={**BODY, "stream": False, "prompt": [3, TRIGGER, 4]}, timeout=30)
        assert r.status_code == 500, r.text
        assert r.json()["error"]["type"] == "server_error"
        assert "injected failure" in r.json()["error"]["message"]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIError, match="injected failure"):
            list(client.completions.create(model="tiny", prompt=[3, TRIGGER], max_tokens=5,
                                           stream=True))
    finally:
        valve.fail_token = None
    ok = httpx.post(server.url + "/v1/completions", json={**BODY, "stream": False}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 20
    m = metrics(server.url)
    assert m["vt_failed_steps_total"] >= 2 and m["vt_kv_blocks_in_use"] == 0
