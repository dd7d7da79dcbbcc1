"""`vt serve --speculative ngram --num-spec K`: the completion is transformers' greedy one, a
sampled request is served, and /metrics carries the acceptance; logprobs and min_tokens are
refused; the flags refuse what speculation cannot serve, in one line."""
import signal

import httpx
import pytest

from vt.cli.main import main

from ._live import spawn_server, stop_server
from .conftest import SERVER_FLAGS


def test_speculative_serving_gives_the_greedy_completion_and_its_acceptance(checkpoint, reference):
    tok, greedy = reference
    ids = tok("one two three one two three one two").input_ids
    want = greedy(ids, 20, ignore_eos=True)
    proc, url = spawn_server(["--model", str(checkpoint), "--speculative", "ngram",
                              "--num-spec", "2", *SERVER_FLAGS])
    try:
        r = httpx.post(f"{url}/v1/completions", timeout=60, json=dict(
            model=str(checkpoint), prompt=ids, max_tokens=20, temperature=0, ignore_eos=True))
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        sampled = httpx.post(f"{url}/v1/completions", timeout=60, json=dict(
            model=str(checkpoint), prompt=ids, max_tokens=4, temperature=0.8, seed=3,
            ignore_eos=True))
        with_logprobs = httpx.post(f"{url}/v1/completions", timeout=60, json=dict(
            model=str(checkpoint), prompt=ids, max_tokens=4, temperature=0.8, logprobs=2))
        with_min_tokens = httpx.post(f"{url}/v1/completions", timeout=60, json=dict(
            model=str(checkpoint), prompt=ids, max_tokens=4, min_tokens=2))
        metrics = httpx.get(f"{url}/metrics", timeout=60).text
    finally:
        stop_server(proc, signal.SIGTERM)
    assert text == tok.decode(want, skip_special_tokens=True)
    assert sampled.status_code == 200, sampled.text
    assert sampled.json()["usage"]["completion_tokens"] == 4, sampled.text
    assert with_logprobs.status_code == 400 and "logprobs" in with_logprobs.text, with_logprobs.text
    assert with_min_tokens.status_code == 400, with_min_tokens.text
    assert "min_tokens=2 with speculative decoding" in with_min_tokens.text, with_min_tokens.text
    assert "vt_spec_decode_acceptance_rate " in metrics
    drafts = [l for l in metrics.splitlines() if l.startswith("vt_spec_decode_draft_tokens_total")]
    assert drafts and int(drafts[0].split()[1]) > 0, drafts


@pytest.mark.parametrize("argv,words", [
    (["--preset", "tiny-dense", "--speculative", "ngram"], "--speculative needs --model"),
    (["--model", "x", "--num-spec", "2"], "--num-spec needs --speculative"),
    (["--model", "x", "--speculative", "ngram", "--num-spec", "0"], "--num-spec must be in"),
    (["--model", "x", "--speculative", "ngram", "--tensor-parallel", "2"],
     "not with --tensor-parallel 2"),
    (["--model", "x", "--speculative", "draft"], "--speculative draft needs --draft-model DIR"),
    (["--model", "x", "--draft-model", "y"], "--draft-model needs --speculative draft"),
    (["--model", "x", "--speculative", "ngram", "--draft-model", "y"],
     "--draft-model needs --speculative draft"),
])
def test_bad_speculative_flags_are_one_line_and_exit_2(argv, words, capsys):
    assert main(["serve", *argv, "--backend", "sim", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert words in err[-1] and err[-1].startswith("vt serve"), err
