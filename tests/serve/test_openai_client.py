"""`vt serve --model DIR` on the sim, driven by the official openai client: completions and
chat, whole and streamed, give the text of transformers' greedy generate decoded by the same
tokenizer, with usage and finish_reason; stop strings are cut; /v1/models, /health, /metrics."""
import httpx
import pytest

from ._live import metrics

PROMPTS = ["Hello, world", "The quick brown fox", "Caf\u00e9 \u65e5\u672c"]


def _expected(reference, ids, n, **kw):
    tok, greedy = reference
    out = greedy(ids, n, **kw)
    return tok.decode(out, skip_special_tokens=True), out


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_equals_transformers_greedy(client, reference, prompt):
    """Whole and streamed: the text of greedy generate, usage and finish_reason counted."""
    tok, _ = reference
    ids = tok(prompt).input_ids
    text, out = _expected(reference, ids, 24)
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    assert whole.choices[0].text == text
    assert whole.usage.prompt_tokens == len(ids)
    assert whole.usage.completion_tokens == len(out)
    assert whole.choices[0].finish_reason == ("stop" if len(out) < 24 else "length")
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == len(out)


def test_every_streamed_piece_is_a_prefix_of_the_whole_text(client, reference):
    """A multi-byte prompt's continuation: no chunk carries a character that the whole decode
    does not have at that place (a broken UTF-8 sequence is held back, never sent)."""
    tok, _ = reference
    text, _ = _expected(reference, tok(PROMPTS[2]).input_ids, 40, ignore_eos=True)
    sent = ""
    for c in client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=40,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True}):
        sent += c.choices[0].text
        assert text.startswith(sent)
    assert sent == text


def test_chat_equals_transformers_greedy_through_the_chat_template(client, reference):
    tok, _ = reference
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False).input_ids
    text, out = _expected(reference, ids, 20)
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20,
                                           temperature=0)
    assert whole.choices[0].message.content == text
    assert whole.choices[0].message.role == "assistant"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), len(out))
    streamed = list(client.chat.completions.create(model="tiny", messages=messages,
                                                   max_tokens=20, temperature=0, stream=True))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text
    assert streamed[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_stop_strings_are_cut_across_token_boundaries(client, reference):
    """A stop string taken from the middle of the greedy text (spanning tokens): the answer
    ends right before it, finish_reason "stop", whole and streamed alike."""
    tok, _ = reference
    ids = tok(PROMPTS[1]).input_ids
    text, out = _expected(reference, ids, 30, ignore_eos=True)
    pieces = [tok.decode(out[:i], skip_special_tokens=True) for i in range(len(out) + 1)]
    # the first stop candidate that does not start at a token's first character
    start = next(i for i in range(4, len(text) - 3)
                 if text[i] != "\ufffd" and all(len(p) != i for p in pieces))
    stop = text[start:start + 3]
    expect = text[:text.find(stop)]
    for stream in (False, True):
        res = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=30,
                                        temperature=0, stop=[stop, "no such stop"], stream=stream,
                                        extra_body={"ignore_eos": True})
        if stream:
            chunks = list(res)
            got = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            got, reason = res.choices[0].text, res.choices[0].finish_reason
        assert (got, reason) == (expect, "stop"), stream


def test_sampled_requests_follow_their_seed(client):
    kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=1.0, top_p=0.9,
              extra_body={"top_k": 50, "ignore_eos": True})
    a = client.completions.create(seed=7, **kw).choices[0]
    b = client.completions.create(seed=7, **kw).choices[0]
    assert a.text == b.text and len(a.model_extra["token_ids"]) == 12


def test_models_health_and_metrics(client, served_url):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(served_url + "/health", timeout=10).json() == {"status": "ok"}
    m = metrics(served_url)
    assert m["vt_generation_tokens_total"] > 0 and m["vt_engine_steps_total"] > 0
    assert m["vt_time_to_first_token_seconds_count"] > 0
    assert m["vt_kv_blocks"] > 0 and "vt_drained_steps_total" in m
    assert m["vt_requests_total{finish_reason=length}"] + m["vt_requests_total{finish_reason=stop}"] > 0


def test_the_readme_curl_body_is_served(served_url):
    """The README's first-screen curl: its JSON body (model renamed to this server's) works."""
    import json
    import pathlib
    import re
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    line = next(l for l in readme.splitlines() if l.startswith("curl ") and "/v1/completions" in l)
    body = json.loads(re.search(r"-d '(\{.*\})'", line).group(1))
    assert "localhost:8000/v1/completions" in line
    r = httpx.post(served_url + "/v1/completions", json={**body, "model": "tiny"}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
