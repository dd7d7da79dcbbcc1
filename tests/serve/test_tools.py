"""Tool calls: the Hermes <tool_call> and Llama 3.1 JSON formats parsed from a chat's output
(vt/serve/tools.py), and through the official openai client against the vt serve app over a
model whose forward writes a scripted answer: `tool_calls` returned whole and streamed as
OpenAI streams them, finish_reason "tool_calls"; tools reach the chat template; role "tool"
messages are taken; tool_choice "none" returns the text. tool_choice "required" and named
(grammar-constrained): tests/serve/test_structured_output.py."""
import json

import openai
import pytest

from vt.serve.tools import ToolCallStream, format_of, parse_tool_calls

from ._live import InProcessServer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
# A template in the Hermes style: it lists the tools and shows calls as <tool_call> blocks.
HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}{% endif %}{% endfor %}<|assistant|>")
LLAMA_TEMPLATE = HERMES_TEMPLATE.replace("<tool_call>", "[").replace("</tool_call>", "]")


@pytest.mark.parametrize("text, fmt, content, calls", [
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "hermes", None, [("f", {"a": 1})]),
    ('Let me look.<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", '
     '"arguments": "{\\"b\\": 2}"}</tool_call>', "hermes", "Let me look.", [("f", {}), ("g", {"b": 2})]),
    ('<tool_call>{"name": broken</tool_call>', "hermes", '<tool_call>{"name": broken</tool_call>', []),
    ('{"name": "f", "parameters": {"x": "a;b"}}', "llama3_json", None, [("f", {"x": "a;b"})]),
    ('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"k": [1]}}', "llama3_json",
     None, [("f", {}), ("g", {"k": [1]})]),
    ('The answer is 4.', "llama3_json", "The answer is 4.", []),
    ('{"city": "Paris"}', "llama3_json", '{"city": "Paris"}', []),
])
def test_calls_are_parsed_in_both_formats(text, fmt, content, calls):
    got_content, got = parse_tool_calls(text, fmt)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got)


def test_a_stream_sends_content_until_a_call_may_begin():
    s = ToolCallStream("hermes")
    sent = [s.push(p) for p in ["Sure", ", one moment. <tool", "_call>{\"name\": \"f\",", " \"arguments\": {}}",
                                "</tool_call>"]]
    assert "".join(sent) == "Sure, one moment. "
    rest, calls = s.finish()
    assert rest == "" and [c["function"]["name"] for c in calls] == ["f"]
    s = ToolCallStream("hermes")
    assert s.push("a <tool") == "a " and s.push("box> b") == "" and s.finish() == ("<toolbox> b", [])


def test_the_format_follows_the_chat_template():
    assert format_of(HERMES_TEMPLATE) == "hermes" and format_of(LLAMA_TEMPLATE) == "llama3_json"


class _Script:
    """A forward that writes `ids` from the first sampled token on (then EOS): logits one-hot
    at ids[seq_len - prompt_len], in torch ops only (the sim replays a captured forward)."""

    def __init__(self, eos: int):
        import torch
        self.eos = eos
        self.prompt_len = torch.zeros(1, dtype=torch.int64)
        self.ids = torch.full((160,), eos, dtype=torch.int64)

    def set(self, prompt_len: int, ids: list[int]) -> None:
        import torch
        self.prompt_len.fill_(prompt_len)
        self.ids.fill_(self.eos)
        self.ids[:len(ids)] = torch.tensor(ids)

    def wrap(self, module):
        def forward(inputs, logits_out):
            module(inputs, logits_out)
            k = (inputs.seq_lens.long() - self.prompt_len).clamp(0, 159)
            logits_out.fill_(-30.0)
            logits_out.scatter_(1, self.ids[k][:, None], 30.0)
        return forward


@pytest.fixture(scope="module")
def scripted(checkpoint):
    from vt.backend import get_backend
    from vt.serve.model_source import load_checkpoint
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    script = _Script(tok.eos_token_id)
    be = get_backend("sim")
    served = load_checkpoint(be, checkpoint, max_seqs=2, max_context=256, block_size=8, name="tiny",
                             wrap_forward=script.wrap)
    server = InProcessServer(be, served, conc=2, max_queued=2)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0)
    yield served, script, tok, client, server.url
    client.close()
    server.close()


def _as_templates_read(m: dict) -> dict:
    """A message as the server hands it to the template: content "" for none, a call's
    arguments as an object."""
    out = dict(m, content=m.get("content") or "")
    if "tool_calls" in m:
        out["tool_calls"] = [dict(c, function=dict(c["function"], arguments=json.loads(c["function"]["arguments"])))
                             for c in m["tool_calls"]]
    return out


def _ask(scripted, template, messages, answer, **kw):
    served, script, tok, client, _ = scripted
    served.text.use_chat_template(template)
    prompt = tok.apply_chat_template([_as_templates_read(m) for m in messages], tools=TOOLS,
                                     chat_template=template, tokenize=False,
                                     add_generation_prompt=True)
    script.set(len(tok(prompt, add_special_tokens=False).input_ids), tok(answer, add_special_tokens=False).input_ids)
    return client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=100,
                                          temperature=0, **kw)


@pytest.mark.parametrize("template, answer", [
    (HERMES_TEMPLATE, 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'),
    (LLAMA_TEMPLATE, '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
], ids=["hermes", "llama3_json"])
def test_a_call_comes_back_as_tool_calls_whole_and_streamed(scripted, template, answer):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    whole = _ask(scripted, template, messages, answer)
    msg = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    assert msg.content == ("Checking." if template is HERMES_TEMPLATE else None)
    chunks = list(_ask(scripted, template, messages, answer, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert content == (msg.content or "")
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == \
        [(0, "get_weather", {"city": "Paris"})]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tool_results_go_back_through_the_template(scripted):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    whole = _ask(scripted, HERMES_TEMPLATE, messages, "It is 18 C and sunny.")
    assert whole.choices[0].message.content == "It is 18 C and sunny."
    assert whole.choices[0].finish_reason == "stop" and not whole.choices[0].message.tool_calls


def test_tool_choice_none_returns_the_text(scripted):
    answer = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    whole = _ask(scripted, LLAMA_TEMPLATE, [{"role": "user", "content": "Hi"}], answer, tool_choice="none")
    assert whole.choices[0].message.content == answer and not whole.choices[0].message.tool_calls
