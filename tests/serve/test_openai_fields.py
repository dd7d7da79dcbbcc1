"""The fields OpenAI clients send by default are accepted (and change nothing where vt ignores
them), the ones vt cannot honour are refused by name; vLLM's extras; and the server features a
vLLM user reaches for: --api-key, --chat-template FILE, --max-model-len, /tokenize,
/detokenize, /version. Through the official openai client and plain HTTP, on the sim."""
import signal

import httpx
import openai
import pytest

from ._live import spawn_server, stop_server
from .conftest import SERVER_FLAGS

KEY = "sk-vt-test"
# A template that shows a variable of its own (chat_template_kwargs) in the prompt.
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
            "{% if shout %}!!!{% endif %}<assistant>")
CHAT = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def keyed(checkpoint, tmp_path_factory):
    """A second server: --api-key, --chat-template FILE and --max-model-len (vLLM's spelling)."""
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    flags = [f for f in SERVER_FLAGS]
    i = flags.index("--max-context")
    flags[i:i + 2] = ["--max-model-len", "48"]
    proc, url = spawn_server(["--model", str(checkpoint), "--served-model-name", "tiny",
                              "--api-key", KEY, "--chat-template", str(template), *flags])
    yield url
    if proc.poll() is None:
        stop_server(proc, signal.SIGTERM)


def test_fields_clients_send_by_default_are_accepted_and_change_nothing(client):
    plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0)
    sent = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=8, temperature=0, store=False, user="u-1",
        metadata={"app": "x"}, service_tier="auto", parallel_tool_calls=True,
        prompt_cache_key="k", safety_identifier="s", verbosity="low", modalities=["text"],
        response_format={"type": "text"})
    assert sent.choices[0].message.content == plain.choices[0].message.content
    assert sent.choices[0].token_ids == plain.choices[0].token_ids


@pytest.mark.parametrize("field, value", [
    ("tool_choice", "required"), ("response_format", {"type": "json_schema"}),
    ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy", "format": "wav"}),
    ("functions", [{"name": "f"}]), ("prediction", {"type": "content", "content": "x"}),
    ("web_search_options", {}),
])
def test_what_vt_cannot_honour_is_refused_by_name(served_url, field, value):
    r = httpx.post(served_url + "/v1/chat/completions", timeout=30,
                   json={"model": "tiny", "messages": CHAT, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and "\n" not in r.json()["error"]["message"]


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client):
    chunks = list(client.completions.create(
        model="tiny", prompt="The quick brown fox", max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].token_ids]
    assert counts == sorted(counts) and counts[-1] == 6
    assert chunks[-1].usage.completion_tokens == 6


def test_include_stop_str_in_output_keeps_the_stop_string(client):
    whole = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=30,
                                      temperature=0, extra_body={"ignore_eos": True})
    text = whole.choices[0].text
    stop = text[5:8]
    cut = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=30,
                                    temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert cut.choices[0].text == text[:text.index(stop) + len(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_skip_special_tokens_false_keeps_them_in_the_text(checkpoint):
    from vt.serve.text import TextCodec
    codec = TextCodec.from_dir(checkpoint)
    eos = codec.tokenizer.eos_token_id
    ids = codec.encode("Hello", add_special_tokens=False) + [eos]
    kept, dropped = (codec.stream(skip_special_tokens=skip) for skip in (False, True))
    assert kept.push(ids) + kept.finish() == "Hello" + codec.tokenizer.eos_token
    assert dropped.push(ids) + dropped.finish() == "Hello"


def test_an_api_key_guards_every_endpoint_but_health(keyed):
    for path in ("/v1/models", "/metrics", "/version"):
        r = httpx.get(keyed + path, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        assert httpx.get(keyed + path, headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
    assert httpx.get(keyed + "/health", timeout=30).status_code == 200
    with openai.OpenAI(base_url=keyed + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="tiny", prompt="Hi", max_tokens=2)
    with openai.OpenAI(base_url=keyed + "/v1", api_key=KEY, max_retries=0, timeout=60) as good:
        assert good.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices[0].finish_reason
        assert good.models.list().data[0].model_extra["max_model_len"] == 48   # --max-model-len


def test_tokenize_detokenize_version_and_the_chat_template_file(keyed, checkpoint):
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(keyed + "/tokenize", headers=auth, timeout=30,
                   json={"model": "tiny", "prompt": "Hello there"}).json()
    assert r["tokens"] == tok("Hello there").input_ids and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 48
    for shout, tail in ((False, ""), (True, "!!!")):
        r = httpx.post(keyed + "/tokenize", headers=auth, timeout=30,
                       json={"model": "tiny", "messages": CHAT,
                             "chat_template_kwargs": {"shout": shout}}).json()
        assert r["tokens"] == tok(f"<user>Hello there{tail}<assistant>", add_special_tokens=False).input_ids
    back = httpx.post(keyed + "/detokenize", headers=auth, timeout=30,
                      json={"model": "tiny", "tokens": tok("Hello there").input_ids}).json()
    assert back["prompt"] == tok.decode(tok("Hello there").input_ids)
    from vt import __version__
    assert httpx.get(keyed + "/version", headers=auth, timeout=30).json() == {"version": __version__}
    bad = httpx.post(keyed + "/tokenize", headers=auth, timeout=30,
                     json={"model": "tiny", "messages": CHAT, "chat_template_kwargs": {"tokenize": True}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs.tokenize"


def test_a_list_of_prompts_gives_one_choice_each(client):
    prompts = ["Hello, world", "The quick brown fox"]
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0,
                                       logprobs=1) for p in prompts]
    both = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0,
                                     logprobs=1)
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone]
    assert [c.logprobs.text_offset for c in both.choices] == [a.choices[0].logprobs.text_offset for a in alone]
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    streamed = {0: "", 1: ""}
    for c in client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0,
                                       stream=True):
        for ch in c.choices:
            streamed[ch.index] += ch.text
    assert [streamed[0], streamed[1]] == [a.choices[0].text for a in alone]


def test_the_http_bench_puts_its_request_fields_on_the_share_asked(served_url):
    """vt bench --url --request-fields JSON --request-fields-share F: the fields go on an even
    share of the requests, and the server takes them (logprobs here)."""
    from vt.bench.serve_http import ClientPool
    pool = ClientPool(served_url, "tiny", fields={"logprobs": 2}, share=0.5)
    try:
        assert [pool.fields_for(i) for i in range(4)] == [None, {"logprobs": 2}, None, {"logprobs": 2}]
        assert ClientPool(served_url, "tiny").fields_for(1) is None
        out = pool.get(0).stream([5, 6, 7], 3, fields=pool.fields_for(1))
        assert len(out.token_ids) == 3
    finally:
        pool.close()
