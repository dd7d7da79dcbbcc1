"""Structured output through the official openai client against the vt serve app on the sim,
over the tiny random-weight checkpoint (which, left alone, writes noise): response_format
json_schema and json_object, vLLM's guided_choice / guided_regex, tool_choice "required" and
named in the Hermes and Llama 3.1 formats, whole and streamed, each choice of n its own
grammar, the bench's ignore_eos requests, and the refusals (vt/serve/grammar.py)."""
import asyncio
import json

import httpx
import openai
import pytest

pytest.importorskip("xgrammar", reason="structured output needs xgrammar (pip install 'vt-graphs[grammar]')")

from ._live import InProcessServer  # noqa: E402

CONC = 16
COLORS = ["red", "green", "blue"]
# A schema whose valid outputs are short (enums, a bool, a one-digit int): the random model
# ends each within a few tokens.
SCHEMA = {"type": "object",
          "properties": {"color": {"enum": COLORS}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["color", "ok", "n"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
TOOLS = [{"type": "function", "function": {
             "name": "get_weather", "description": "The weather in a city",
             "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}},
                            "required": ["city"], "additionalProperties": False}}},
         {"type": "function", "function": {
             "name": "get_time",
             "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                            "required": ["zone"], "additionalProperties": False}}}]
ARGUMENTS = {"get_weather": ("city", {"Paris", "Tokyo"}), "get_time": ("zone", {"UTC", "CET"})}
# A chat template in the Hermes style (the model writes <tool_call> blocks); the checkpoint's
# own template does not mention <tool_call>, so its calls are Llama 3.1 JSON.
HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>")


def valid(obj) -> bool:
    """obj is valid against SCHEMA."""
    return (isinstance(obj, dict) and set(obj) == {"color", "ok", "n"} and obj["color"] in COLORS
            and isinstance(obj["ok"], bool) and type(obj["n"]) is int and 0 <= obj["n"] <= 9)


@pytest.fixture(scope="module")
def server(checkpoint):
    from vt.backend import get_backend
    from vt.serve.model_source import load_checkpoint
    be = get_backend("sim")
    served = load_checkpoint(be, checkpoint, max_seqs=CONC, max_context=128, block_size=8, name="tiny")
    own_template = served.text.tokenizer.chat_template
    srv = InProcessServer(be, served, conc=CONC, max_queued=128)
    yield srv, served, own_template
    srv.close()


@pytest.fixture
def clients(server):
    srv, served, own_template = server
    served.text.use_chat_template(own_template)
    sync = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=60, max_retries=0)
    yield sync, srv.url, served
    sync.close()


def _gather(url: str, make):
    """make(client, i) for i in 0..99 at once, through one AsyncOpenAI client."""
    async def run():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=120,
                                      max_retries=0) as client:
            return await asyncio.gather(*(make(client, i) for i in range(100)))
    return asyncio.run(run())


def _chat(client, i, max_tokens=40, **kw):
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": f"Pick one, {i}."}], max_tokens=max_tokens,
        temperature=1.0, seed=i, **kw)


def test_json_schema_100_of_100_valid(clients):
    _, url, _ = clients
    out = _gather(url, lambda c, i: _chat(c, i, response_format=RESPONSE_FORMAT))
    texts = [r.choices[0].message.content for r in out]
    assert all(r.choices[0].finish_reason == "stop" for r in out), texts
    assert all(valid(json.loads(t)) for t in texts), texts
    assert len(set(texts)) > 5            # sampled, not one forced string


def test_json_object_100_of_100_parse(clients):
    """Free-form JSON never ends on a random model's own (a string goes on until the budget),
    so `"`, `}` and `]` are biased up: the model then closes what it opens. The grammar makes it
    JSON: the same bias without it writes text that does not parse."""
    sync, url, served = clients
    tok = served.text.tokenizer
    bias = {str(tok.convert_tokens_to_ids(t)): b for t, b in (('"', 12), ("}", 8), ("]", 8))}
    out = _gather(url, lambda c, i: _chat(c, i, response_format={"type": "json_object"}, logit_bias=bias))
    texts = [r.choices[0].message.content for r in out]
    assert all(r.choices[0].finish_reason == "stop" for r in out), [t for r, t in zip(out, texts) if r.choices[0].finish_reason != "stop"]
    assert all(isinstance(json.loads(t), dict) for t in texts), texts
    assert any(json.loads(t) for t in texts)     # not only {}
    free = _chat(sync, 0, logit_bias=bias, max_tokens=8).choices[0].message.content
    with pytest.raises(ValueError):
        json.loads(free)


def test_each_choice_of_n_follows_its_own_grammar(clients):
    sync, _, _ = clients
    whole = _chat(sync, 1, response_format=RESPONSE_FORMAT, n=4)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert all(valid(json.loads(c.message.content)) for c in whole.choices)
    chunks = list(_chat(sync, 1, response_format=RESPONSE_FORMAT, n=4, stream=True))
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(4)]
    assert texts == [c.message.content for c in whole.choices]


def test_guided_choice_and_regex_on_completions(clients):
    sync, _, _ = clients
    for seed in range(6):
        pick = sync.completions.create(model="tiny", prompt="The answer:", max_tokens=10, seed=seed,
                                       extra_body={"guided_choice": ["yes", "no", "maybe not"]})
        assert pick.choices[0].text in ("yes", "no", "maybe not")
        code = sync.completions.create(model="tiny", prompt="A code:", max_tokens=10, seed=seed,
                                       extra_body={"guided_regex": "[A-C][0-9]{3}"})
        assert len(code.choices[0].text) == 4 and code.choices[0].text[0] in "ABC"
        assert code.choices[0].text[1:].isdigit()


def test_ignore_eos_goes_on_unconstrained_after_the_value(clients):
    """The bench's requests (token ids, ignore_eos, exactly max_tokens): the output starts with
    the schema's value, and the request still makes every token it asked for."""
    sync, _, _ = clients
    r = sync.completions.create(model="tiny", prompt=[1, 5, 9], max_tokens=40, temperature=0,
                                extra_body={"ignore_eos": True, "response_format": RESPONSE_FORMAT})
    assert r.usage.completion_tokens == 40 and r.choices[0].finish_reason == "length"
    value, _ = json.JSONDecoder().raw_decode(r.choices[0].text)
    assert valid(value)


def test_the_bench_client_streams_schema_requests(clients):
    """vt bench --workload serve --url ... --request-fields '{"response_format": ...}': its
    client's streamed requests make every token they ask for, the output the schema's value."""
    from vt.bench.serve_http import CompletionClient
    _, url, served = clients
    bench = CompletionClient(url, "tiny", timeout_s=60)
    try:
        out = bench.stream([1, 5, 9], 48, fields={"response_format": RESPONSE_FORMAT})
    finally:
        bench.close()
    assert len(out.token_ids) == 48
    value, _ = json.JSONDecoder().raw_decode(served.text.decode(out.token_ids))
    assert valid(value)


def _call_of(name: str, arguments: str) -> bool:
    key, allowed = ARGUMENTS[name]
    return json.loads(arguments) in ({key: v} for v in allowed)


@pytest.mark.parametrize("template", [None, HERMES_TEMPLATE], ids=["llama3_json", "hermes"])
def test_tool_choice_required_returns_a_call_whole_and_streamed(clients, template):
    sync, _, served = clients
    if template is not None:
        served.text.use_chat_template(template)
    names = set()
    for seed in range(4):
        whole = _chat(sync, seed, tools=TOOLS, tool_choice="required", max_tokens=60)
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        [call] = choice.message.tool_calls
        assert _call_of(call.function.name, call.function.arguments)
        names.add(call.function.name)
        chunks = list(_chat(sync, seed, tools=TOOLS, tool_choice="required", max_tokens=60, stream=True))
        deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == \
            [(0, call.function.name, json.loads(call.function.arguments))]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert names <= {"get_weather", "get_time"}


def test_a_named_tool_choice_calls_that_tool(clients):
    sync, _, served = clients
    served.text.use_chat_template(HERMES_TEMPLATE)
    for seed in range(4):
        whole = _chat(sync, seed, tools=TOOLS, max_tokens=60,
                      tool_choice={"type": "function", "function": {"name": "get_time"}})
        [call] = whole.choices[0].message.tool_calls
        assert call.function.name == "get_time" and _call_of("get_time", call.function.arguments)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
])
def test_what_does_not_compile_or_conflicts_is_refused_by_name(clients, extra, param):
    _, url, _ = clients
    r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "\n" not in err["message"], err
    assert "unknown field" not in err["message"] and "not supported" not in err["message"], err


def test_a_token_outside_the_grammar_ends_the_request_in_an_error():
    """TokenGrammar: a refused token leaves an error and a mask that allows nothing (the
    request fails naming it instead of going on outside its grammar); a grammar that has
    ended allows every token (a request that ignores EOS goes on unconstrained)."""
    import numpy as np
    import xgrammar as xgr
    from vt.serve.grammar import TokenGrammar
    info = xgr.TokenizerInfo(["a", "b", "</s>"], stop_token_ids=[2])
    compiled = xgr.GrammarCompiler(info).compile_regex("a")
    g, bits = TokenGrammar(xgr.GrammarMatcher(compiled)), np.zeros(1, np.int32)
    g.fill_mask(bits)
    assert bits[0] & 0b111 == 0b001         # "a" only (the bits past the vocabulary are not read)
    g.accept(1)
    assert g.error == "token 1 does not follow the request's grammar"
    g.fill_mask(bits)
    assert bits[0] == 0
    g = TokenGrammar(xgr.GrammarMatcher(compiled))
    g.accept(0)
    g.accept(2)
    g.fill_mask(bits)
    assert g.ended and g.error is None and bits[0] == -1
