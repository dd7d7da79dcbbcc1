"""`vt serve --speculative draft --draft-model DIR`: the completion is transformers' greedy one,
the draft's acceptance reaches /metrics, and the flags refuse a draft without its model, a
model without the draft method and a draft of another vocabulary, in one line each."""
import json
import signal

import pytest

for _mod in ("fastapi", "uvicorn", "torch", "transformers", "httpx"):
    pytest.importorskip(_mod, reason=f"vt serve and its reference need {_mod}")

import httpx  # noqa: E402

from tests.serve._live import spawn_server, stop_server  # noqa: E402
from tools import tiny_checkpoint  # noqa: E402
from vt.cli.main import main  # noqa: E402

FLAGS = ["--backend", "sim", "--max-context", "64", "--block-size", "4", "--max-concurrency", "4"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint.build(tmp_path_factory.mktemp("tiny-target"), seed=0)


def _greedy(checkpoint, ids, n):
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                         eos_token_id=None, min_new_tokens=n)
    return out[0, len(ids):].tolist()


def test_draft_serving_gives_the_greedy_completion_and_its_acceptance(checkpoint):
    """The checkpoint drafting for itself (loaded twice: its own KV cache): transformers'
    greedy tokens, and /metrics counts drafts, most of them accepted."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    ids = tok("one two three one two three one two").input_ids
    want = _greedy(checkpoint, ids, 20)
    proc, url = spawn_server(["--model", str(checkpoint), "--speculative", "draft",
                              "--draft-model", str(checkpoint), "--num-spec", "3", *FLAGS])
    try:
        r = httpx.post(f"{url}/v1/completions", timeout=60, json=dict(
            model=str(checkpoint), prompt=ids, max_tokens=20, temperature=0, ignore_eos=True))
        metrics = httpx.get(f"{url}/metrics", timeout=60).text
    finally:
        stop_server(proc, signal.SIGTERM)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tok.decode(want, skip_special_tokens=True)
    value = lambda name: float(next(line.split()[1] for line in metrics.splitlines()   # noqa: E731
                                    if line.startswith(name + " ")))
    assert value("vt_spec_decode_draft_tokens_total") > 0
    assert value("vt_spec_decode_acceptance_rate") > 0.5
    assert "draft model" in proc.stderr.read()


def test_a_draft_of_another_vocabulary_is_refused_before_its_weights(checkpoint, tmp_path, capsys):
    """The draft's config.json alone is read: a vocabulary other than the target's is one line,
    exit 2."""
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["vocab_size"] += 7
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["serve", "--model", str(checkpoint), "--speculative", "draft", "--draft-model",
                 str(tmp_path), *FLAGS, "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    want = f"vocab {cfg['vocab_size']:,} differs from {checkpoint}'s {cfg['vocab_size'] - 7:,}"
    assert want in err[-1] and "share the target's tokenizer" in err[-1], err
