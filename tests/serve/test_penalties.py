"""Penalties and logit_bias through the official openai client against `vt serve` on the tiny
checkpoint (sim): greedy tokens equal a reference sampler written here from the definitions
(OpenAI's presence/frequency, transformers' repetition over prompt and output, logit_bias,
vLLM's order) over transformers' own fp32 logits, whole and streamed; a bias of 100 forces a
token whatever the temperature."""
import numpy as np
import pytest


@pytest.fixture(scope="module")
def penalized_greedy(hf_model):
    """(prompt ids, n, presence, frequency, repetition, bias) -> greedy ids by the definitions."""
    import torch
    model = hf_model

    def fn(ids, n, presence=0.0, frequency=0.0, repetition=1.0, bias=None):
        out = []
        for _ in range(n):
            with torch.no_grad():
                x = model(torch.tensor([ids + out])).logits[0, -1].double().numpy()
            for t, b in (bias or {}).items():
                x[t] += b
            counts = np.bincount(np.array(out, np.int64), minlength=x.size)
            seen = (counts > 0) | np.isin(np.arange(x.size), ids)
            x[seen] = np.where(x[seen] > 0, x[seen] / repetition, x[seen] * repetition)
            x -= frequency * counts + presence * (counts > 0)
            out.append(int(np.argmax(x)))
        return out
    return fn


@pytest.mark.parametrize("knobs", [
    dict(frequency_penalty=1.5),
    dict(presence_penalty=1.2, extra_body={"repetition_penalty": 1.5}),
    dict(frequency_penalty=0.6, logit_bias={"5": 4, "7": -100}),
], ids=["frequency", "presence+repetition", "frequency+bias"])
def test_greedy_tokens_equal_the_definitions(client, reference, penalized_greedy, knobs):
    tok, _ = reference
    prompt = "The quick brown fox jumps"
    ids = tok(prompt).input_ids
    extra = dict(knobs.pop("extra_body", {}), ignore_eos=True)
    want = penalized_greedy(ids, 16, knobs.get("presence_penalty", 0.0), knobs.get("frequency_penalty", 0.0),
                            extra.get("repetition_penalty", 1.0),
                            {int(k): v for k, v in knobs.get("logit_bias", {}).items()})
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].token_ids
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                      extra_body=extra, **knobs).choices[0].token_ids
    assert whole == want and whole != plain
    streamed = [t for c in client.completions.create(model="tiny", prompt=prompt, max_tokens=16,
                                                     temperature=0, stream=True, extra_body=extra, **knobs)
                for t in (c.choices[0].token_ids if c.choices else [])]
    assert streamed == want


def test_a_bias_of_100_forces_its_token_at_any_temperature(client):
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=8, temperature=1.5, seed=3, logit_bias={"42": 100},
                                         extra_body={"ignore_eos": True})
    assert out.choices[0].token_ids == [42] * 8
