"""Logprobs through the official openai client against `vt serve` on the tiny checkpoint (sim):
each sampled token's logprob equals log_softmax(logits / temperature) of transformers' own fp32
logits for that position, computed here, within 1e-4, and the top tokens are the true top N;
completions (logprobs: int, 0 included) and chat (logprobs, top_logprobs), whole and streamed."""
import numpy as np
import openai
import pytest


@pytest.fixture(scope="module")
def log_softmax(hf_model):
    """(ids, n, temperature) -> [n, V] float64 log_softmax of the logits that sample the last n
    of ids, from transformers' fp32 forward of the whole sequence."""
    import torch
    model = hf_model

    def fn(ids, n, temperature):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, len(ids) - 1 - n:len(ids) - 1].double().numpy()
        z = logits / (temperature if temperature > 0 else 1.0)
        z -= z.max(axis=1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return fn


def _chat_ids(reference, messages):
    tok, _ = reference
    return tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False).input_ids


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_chat_logprobs_equal_log_softmax_of_the_models_logits(client, reference, log_softmax, temperature):
    tok, _ = reference
    messages = [{"role": "user", "content": "Tell me about the fox."}]
    kw = dict(model="tiny", messages=messages, max_tokens=12, temperature=temperature, seed=11,
              logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    ids = whole.choices[0].token_ids
    want = log_softmax(_chat_ids(reference, messages) + ids, len(ids), temperature)
    content = whole.choices[0].logprobs.content
    assert len(content) == len(ids) == 12
    for i, (t, entry) in enumerate(zip(ids, content)):
        assert abs(entry.logprob - want[i, t]) < 1e-4, i
        assert entry.token == tok.decode([t]) and entry.bytes == list(entry.token.encode())
        true_top = np.lexsort((np.arange(want.shape[1]), -want[i]))[:5]
        assert [e.token for e in entry.top_logprobs] == [tok.decode([j]) for j in true_top]
        np.testing.assert_allclose([e.logprob for e in entry.top_logprobs], want[i, true_top], atol=1e-4)
    streamed = [c.choices[0].logprobs for c in client.chat.completions.create(**kw, stream=True)
                if c.choices and c.choices[0].logprobs is not None]
    got = [e for lp in streamed for e in lp.content]
    assert [e.token for e in got] == [e.token for e in content]
    # the same tokens; their logits come from other batch shapes, equal to float32 rounding
    np.testing.assert_allclose([e.logprob for e in got], [e.logprob for e in content], atol=1e-5)


@pytest.mark.parametrize("n", [0, 3])
def test_completion_logprobs_count_includes_zero(client, reference, log_softmax, n):
    tok, _ = reference
    prompt = "The quick brown fox"
    kw = dict(model="tiny", prompt=prompt, max_tokens=10, temperature=0.9, seed=5, logprobs=n,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    choice = whole.choices[0]
    ids = choice.token_ids
    want = log_softmax(tok(prompt).input_ids + ids, len(ids), 0.9)
    lp = choice.logprobs
    assert lp.tokens == [tok.decode([t]) for t in ids]
    np.testing.assert_allclose(lp.token_logprobs, want[np.arange(len(ids)), ids], atol=1e-4)
    for i, (t, top) in enumerate(zip(ids, lp.top_logprobs)):
        true_top = np.lexsort((np.arange(want.shape[1]), -want[i]))[:n]
        expect = {tok.decode([j]): want[i, j] for j in [*true_top, t]}
        assert top.keys() == expect.keys()
        assert all(abs(top[k] - expect[k]) < 1e-4 for k in expect)
    assert lp.text_offset == np.cumsum([0] + [len(s) for s in lp.tokens[:-1]]).tolist()
    chunks = [c.choices[0].logprobs for c in client.completions.create(**kw, stream=True)
              if c.choices and c.choices[0].logprobs is not None]
    np.testing.assert_allclose(sum((c.token_logprobs for c in chunks), []), lp.token_logprobs, atol=1e-5)
    assert sum((c.text_offset for c in chunks), []) == lp.text_offset


def test_a_request_without_logprobs_gets_none(client):
    whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=4)
    assert whole.choices[0].logprobs is None


@pytest.mark.parametrize("body, param", [
    ({"logprobs": 21}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
def test_out_of_range_logprobs_are_refused_by_name(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2, extra_body=body)
    assert e.value.body["param"] == param


def test_chat_top_logprobs_without_logprobs_is_refused(client):
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs: true"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=2, top_logprobs=3)
