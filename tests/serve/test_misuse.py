"""Bad requests to `vt serve`: each is a 400 (404 for an unknown model or route) with an
OpenAI-style error body naming the parameter, and nothing else is affected: a streamed request
running meanwhile gets its whole, right answer, and no row or KV block stays held."""
import json
import threading

import httpx
import pytest

from ._live import metrics, wait_for
from .conftest import CONTEXT

GOOD = {"model": "tiny", "prompt": "Hello, world", "max_tokens": 8, "temperature": 0}
BAD = [   # (name, body bytes, status, param, words in the message)
    ("malformed JSON", b'{"model": "tiny", "prompt": ', 400, None, "not valid JSON"),
    ("not an object", b'["tiny"]', 400, None, "JSON object"),
    ("unknown field", {**GOOD, "frobnicate": 1}, 400, "frobnicate", "unknown field"),
    ("string for an int", {**GOOD, "max_tokens": "8"}, 400, "max_tokens", "valid integer"),
    ("float for an int", {**GOOD, "max_tokens": 8.0}, 400, "max_tokens", "valid integer"),
    ("bool for a string", {**GOOD, "prompt": True}, 400, "prompt", "valid"),
    ("prompt over the context", {**GOOD, "prompt": [5] * (CONTEXT + 1)}, 400, "prompt",
     f"context holds {CONTEXT}"),
    ("max_tokens over the budget", {**GOOD, "prompt": [5] * 10, "max_tokens": CONTEXT}, 400,
     "max_tokens", f"at most {CONTEXT - 9}"),
    ("token id outside the vocabulary", {**GOOD, "prompt": [10**6]}, 400, "prompt", "token ids"),
    ("n past 16", {**GOOD, "n": 17}, 400, "n", "[1, 16]"),
    ("logprobs past 20", {**GOOD, "logprobs": 21}, 400, "logprobs", "[0, 20]"),
    ("temperature out of range", {**GOOD, "temperature": 3}, 400, "temperature", "[0, 2]"),
    ("a penalty out of range", {**GOOD, "presence_penalty": 2.5}, 400, "presence_penalty", "[-2, 2]"),
    ("a logit_bias key not a token id", {**GOOD, "logit_bias": {"x": 1}}, 400, "logit_bias", "token ids"),
    ("a logit_bias value out of range", {**GOOD, "logit_bias": {"3": 101}}, 400, "logit_bias", "[-100, 100]"),
    ("more prompts than a request takes", {**GOOD, "prompt": ["a"] * 65}, 400, "prompt",
     "at most 64 choices"),
    ("unknown model", {**GOOD, "model": "gpt-4"}, 404, "model", "does not exist"),
    ("a lone surrogate in the prompt", b'{"model": "tiny", "prompt": "a\\ud800b"}', 400, "prompt",
     "lone surrogate (U+D800)"),
    ("a lone surrogate in a stop string", b'{"model": "tiny", "prompt": "a", "stop": ["\\udfff"]}',
     400, "stop.0", "lone surrogate (U+DFFF)"),
    ("a lone surrogate in a key", b'{"model": "tiny", "prompt": "a", "\\ud800": 1}', 400, None,
     "lone surrogate"),
    ("JSON nested 100,000 deep", b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000
     + b"}", 400, None, "too deeply"),
    ("a prompt longer than any that fits", {**GOOD, "prompt": "x" * 200_000}, 400, "prompt",
     "characters"),
    ("a body larger than any prompt that fits", {**GOOD, "prompt": "x" * 3_000_000}, 413, None,
     "bytes"),
]
CHAT_BAD = [
    ("no messages", {"model": "tiny", "messages": []}, 400, "messages", "at least 1"),
    ("unknown role", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages.0.role", "Input should be"),
    ("content not text", {"model": "tiny", "messages": [{"role": "user", "content": 3}]}, 400,
     "messages.0.content", "valid"),
    ("a lone surrogate in the content",
     b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d"}]}', 400,
     "messages.0.content", "lone surrogate (U+D83D)"),
    ("contents longer than any prompt that fits",
     {"model": "tiny", "messages": [{"role": "user", "content": "x" * 100_000}] * 2}, 400,
     "messages", "characters"),
]


def _post(url, path, body):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=raw, headers={"Content-Type": "application/json"},
                      timeout=30)


@pytest.mark.parametrize("path,case", [("/v1/completions", c) for c in BAD] +
                         [("/v1/chat/completions", c) for c in CHAT_BAD],
                         ids=lambda v: v[0] if isinstance(v, tuple) else v)
def test_a_bad_request_gets_an_openai_error_body(served_url, path, case):
    _, body, status, param, words = case
    r = _post(served_url, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and words in err["message"], err
    assert err["type"] == "invalid_request_error"


def test_unknown_route_is_an_openai_error(served_url):
    r = httpx.get(served_url + "/v1/nothing", timeout=10)
    assert r.status_code == 404 and "message" in r.json()["error"]


def test_bad_requests_leave_a_running_stream_untouched(served_url, reference):
    """A streamed request runs while every bad request above is sent: its text is the
    reference's, and afterwards no row or KV block is held."""
    tok, greedy = reference
    prompt = "The quick brown fox"
    expect = tok.decode(greedy(tok(prompt).input_ids, 40, ignore_eos=True), skip_special_tokens=True)
    got, started = [], threading.Event()

    def stream():
        body = {**GOOD, "prompt": prompt, "max_tokens": 40, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", served_url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                started.set()
                if line.startswith("data: {"):
                    got.append(json.loads(line[6:])["choices"][0]["text"])

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(30)
    for _, body, status, _, _ in BAD:
        assert _post(served_url, "/v1/completions", body).status_code == status
    t.join(60)
    assert not t.is_alive() and "".join(got) == expect
    wait_for(lambda: metrics(served_url)["vt_kv_blocks_in_use"] == 0, what="KV blocks freed")
    assert metrics(served_url)["vt_requests_rejected_total{reason=invalid}"] >= len(BAD)
