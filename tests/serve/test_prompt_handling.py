"""The prompt's way to the engine: a body larger than any prompt that fits is refused without
holding up the server, the tokenizer runs off the event loop (/health and the streams in flight
go on meanwhile), and a chat template that refuses the messages (raise_exception) is the
client's 400 with the template's message, streamed or not."""
import json
import threading
import time

import httpx
import pytest

from vt.backend import get_backend
from vt.serve.model_source import load_checkpoint

from ._live import InProcessServer

# Mistral's and Llama-2's templates refuse a system message and roles that do not alternate.
REFUSING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
ENCODE_S = 1.0      # how long the test's tokenizer takes


@pytest.fixture(scope="module")
def live(checkpoint):
    be = get_backend("sim")
    served = load_checkpoint(be, checkpoint, max_seqs=2, max_context=64, block_size=4,
                             name="tiny")
    served.text.tokenizer.chat_template = REFUSING_TEMPLATE
    server = InProcessServer(be, served, conc=2, max_queued=2)
    yield server, served
    server.close()
    be.close()


def _latencies(url, stop: threading.Event, out: list):
    """GET /health every 20 ms until `stop`; each answer's status and seconds."""
    while not stop.is_set():
        t0 = time.perf_counter()
        r = httpx.get(url + "/health", timeout=30)
        out.append((r.status_code, time.perf_counter() - t0))
        time.sleep(0.02)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("messages, words", [
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
     "System role not supported"),
    ([{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi again"}],
     "roles must alternate"),
], ids=["a system message", "roles that do not alternate"])
def test_a_chat_template_that_raises_refuses_the_request_with_its_message(live, messages, words,
                                                                          stream):
    server, _ = live
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "stream": stream}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and err["type"] == "invalid_request_error"
    assert words in err["message"] and "chat template" in err["message"], err
    ok = {**body, "messages": [{"role": "user", "content": "Hi"}]}
    assert httpx.post(server.url + "/v1/chat/completions", json=ok, timeout=30).status_code == 200


def test_the_tokenizer_runs_off_the_event_loop(live, monkeypatch):
    """A prompt whose tokenizing takes ENCODE_S: /health answers meanwhile in a fraction of it,
    and the request is then served."""
    server, served = live
    encode, tokenizing = served.text.encode, threading.Event()

    def slow_encode(text):
        tokenizing.set()
        time.sleep(ENCODE_S)
        return encode(text)

    monkeypatch.setattr(served.text, "encode", slow_encode)
    got = []
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    t = threading.Thread(target=lambda: got.append(
        httpx.post(server.url + "/v1/completions", json=body, timeout=30)))
    t.start()
    assert tokenizing.wait(30)
    t0 = time.perf_counter()
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    assert time.perf_counter() - t0 < ENCODE_S / 3
    t.join(30)
    assert got[0].status_code == 200 and got[0].json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("megabytes", [2, 10])
def test_a_huge_prompt_is_refused_without_holding_up_the_server(served_url, megabytes):
    """While a stream runs, a prompt of 2 or 10 MB is refused (413) at once, /health answers
    all along within 0.5 s, and the stream is served whole."""
    stop, health = threading.Event(), []
    poller = threading.Thread(target=_latencies, args=(served_url, stop, health))
    chunks = []

    def stream():
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 40, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", served_url + "/v1/completions", json=body, timeout=60) as r:
            chunks.extend(json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: {"))

    streamer = threading.Thread(target=stream)
    poller.start()
    streamer.start()
    try:
        t0 = time.perf_counter()
        body = {"model": "tiny", "prompt": "lorem ipsum " * (megabytes * 2**20 // 12)}
        r = httpx.post(served_url + "/v1/completions", json=body, timeout=60)
        refused_s = time.perf_counter() - t0
        streamer.join(60)
    finally:
        stop.set()
        poller.join(30)
    assert health and all(status == 200 and s < 0.5 for status, s in health), max(health)
    assert refused_s < 1.0
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 40
