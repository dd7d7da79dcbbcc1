"""min_tokens (vLLM's) through the official openai client against `vt serve` on the tiny
checkpoint (sim): with EOS made dominant by logit_bias a request ends at once, and with
min_tokens it gives exactly min_tokens tokens (transformers' greedy ones with EOS banned) and
then EOS, whole and streamed, completions and chat; stop_token_ids are banned likewise;
ignore_eos composes; a stop string in the first min_tokens tokens' text does not stop it; the
400s name min_tokens."""
import httpx
import numpy as np
import pytest

from vt.serve.text import eos_token_ids

PROMPT = "The quick brown fox"
F = 42            # the tiny tokenizer's "F"


@pytest.fixture(scope="module")
def eos(checkpoint):
    (eos,) = eos_token_ids(checkpoint)
    return eos


@pytest.fixture(scope="module")
def banned_greedy(hf_model):
    """(prompt ids, n, bias, banned, min_tokens) -> greedy ids: bias added, `banned` at -inf
    while fewer than min_tokens were generated, ending at a banned id."""
    import torch

    def fn(ids, n, bias, banned, min_tokens):
        out = []
        for _ in range(n):
            with torch.no_grad():
                x = hf_model(torch.tensor([ids + out])).logits[0, -1].double().numpy()
            for t, b in bias.items():
                x[t] += b
            if len(out) < min_tokens:
                x[list(banned)] = -np.inf
            out.append(int(np.argmax(x)))
            if out[-1] in banned:
                break
        return out
    return fn


def _streamed_ids(chunks):
    return [t for c in chunks for t in (c.choices[0].token_ids if c.choices else [])]


def test_eos_cannot_end_a_request_before_min_tokens(client, reference, banned_greedy, eos):
    tok, _ = reference
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, logit_bias={str(eos): 100})
    plain = client.completions.create(**kw).choices[0]
    assert plain.token_ids == [eos] and plain.finish_reason == "stop"
    want = banned_greedy(tok(PROMPT).input_ids, 12, {eos: 100}, {eos}, 5)
    assert len(want) == 6 and want[-1] == eos
    held = client.completions.create(**kw, extra_body={"min_tokens": 5}).choices[0]
    assert held.token_ids == want and held.finish_reason == "stop"
    streamed = client.completions.create(**kw, stream=True, extra_body={"min_tokens": 5})
    assert _streamed_ids(streamed) == want


def test_chat_min_tokens_holds_eos_back_too(client, eos):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=10,
              temperature=0.8, seed=4, logit_bias={str(eos): 100})
    assert client.chat.completions.create(**kw).choices[0].token_ids == [eos]
    held = client.chat.completions.create(**kw, extra_body={"min_tokens": 7}).choices[0]
    assert len(held.token_ids) == 8 and held.token_ids[-1] == eos and eos not in held.token_ids[:7]
    assert held.finish_reason == "stop"


def test_stop_token_ids_are_banned_until_min_tokens(client, reference, banned_greedy):
    tok, _ = reference
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, logit_bias={str(F): 100})
    extra = {"stop_token_ids": [F], "ignore_eos": True}
    assert client.completions.create(**kw, extra_body=extra).choices[0].token_ids == [F]
    got = client.completions.create(**kw, extra_body=dict(extra, min_tokens=4)).choices[0]
    assert got.token_ids == banned_greedy(tok(PROMPT).input_ids, 12, {F: 100}, {F}, 4)
    assert len(got.token_ids) == 5 and got.token_ids[-1] == F and got.finish_reason == "stop"


def test_ignore_eos_composes_eos_neither_banned_nor_stopping(client, eos):
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                    logit_bias={str(eos): 100},
                                    extra_body={"ignore_eos": True, "min_tokens": 3}).choices[0]
    assert got.token_ids == [eos] * 6 and got.finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_string_in_the_first_min_tokens_does_not_stop_it(client, stream):
    """Every token is "F" and "F" is the stop string: at once without min_tokens; with 3, the
    first "F" that counts is the fourth token's (vLLM's rule)."""
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logit_bias={str(F): 100},
              stop=["F"], stream=stream)

    def run(extra):
        out = client.completions.create(**kw, extra_body=dict(extra, ignore_eos=True))
        if not stream:
            c = out.choices[0]
            return c.text, c.token_ids, c.finish_reason
        chunks = list(out)
        return ("".join(c.choices[0].text for c in chunks if c.choices), _streamed_ids(chunks),
                [c.choices[0].finish_reason for c in chunks if c.choices][-1])

    assert run({}) == ("", [F], "stop")
    assert run({"min_tokens": 3}) == ("FFF", [F] * 4, "stop")


@pytest.mark.parametrize("body, message", [
    ({"min_tokens": -1, "max_tokens": 4}, "min_tokens must be >= 0 and at most max_tokens=4, got -1"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be >= 0 and at most max_tokens=4, got 5"),
    ({"min_tokens": 1000}, "min_tokens=1000 exceeds the"),       # no max_tokens: the context's rest
], ids=["negative", "above-max_tokens", "above-the-context"])
def test_min_tokens_it_cannot_honour_is_a_400_naming_it(served_url, body, message):
    r = httpx.post(served_url + "/v1/chat/completions", timeout=30,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "min_tokens" and message in err["message"] and "\n" not in err["message"]
