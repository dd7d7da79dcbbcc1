"""Fixtures of the vt serve tests: a tiny Llama checkpoint built offline (tools/tiny_checkpoint.py),
transformers' greedy reference over it, and `vt serve` running on it on the sim backend."""
import signal

import pytest

for _mod, _why in (("fastapi", "vt serve needs FastAPI (pip install 'vt-graphs[serve]')"),
                   ("uvicorn", "vt serve needs uvicorn (pip install 'vt-graphs[serve]')"),
                   ("torch", "a checkpoint needs PyTorch"),
                   ("transformers", "the tokenizer and the reference need transformers"),
                   ("openai", "the client tests use the openai package (pip install 'vt-graphs[serve-test]')"),
                   ("prometheus_client", "/metrics is parsed with prometheus_client")):
    pytest.importorskip(_mod, reason=_why)

from tools import tiny_checkpoint  # noqa: E402

from ._live import spawn_server, stop_server  # noqa: E402

CONTEXT, BLOCK, CONC = 64, 4, 4
SERVER_FLAGS = ["--backend", "sim", "--max-context", str(CONTEXT), "--block-size", str(BLOCK),
                "--max-concurrency", str(CONC)]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint.build(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="session")
def hf_model(checkpoint):
    """transformers' own model of the checkpoint, fp32, in eval mode (the tests' reference)."""
    import torch
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint),
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def reference(checkpoint, hf_model):
    """(tokenizer, greedy(prompt_ids, n) -> generated ids) of transformers itself."""
    import torch
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    model = hf_model

    def greedy(ids, n, ignore_eos=False):
        x = torch.tensor([ids])
        extra = dict(eos_token_id=None, min_new_tokens=n) if ignore_eos else {}
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=n, **extra)
        return out[0, len(ids):].tolist()
    return tok, greedy


@pytest.fixture(scope="session")
def served_url(checkpoint):
    """`vt serve --model DIR` on the sim, for the whole session; stopped with SIGTERM."""
    proc, url = spawn_server(["--model", str(checkpoint), "--served-model-name", "tiny",
                              "--max-queued", "8", *SERVER_FLAGS])
    yield url
    if proc.poll() is None:
        stop_server(proc, signal.SIGTERM)


@pytest.fixture(scope="module")
def client(served_url):
    """The openai client of served_url (a module's own served_url where it has one)."""
    import openai
    with openai.OpenAI(base_url=served_url + "/v1", api_key="none", timeout=60, max_retries=0) as c:
        yield c
