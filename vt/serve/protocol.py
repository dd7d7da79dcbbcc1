"""The OpenAI request bodies `vt serve` accepts, validated before anything reaches the engine.

A body is parsed as JSON and checked against a pydantic model that forbids unknown fields and
coerces nothing (strict: "5" is not an int, 1.0 is not an int, 1 is a float). What vt cannot do
is refused by name rather than ignored: n above MAX_CHOICES, echo, suffix, best_of,
and the chat fields of _refuse_chat_fields. Every refusal is a RequestError, which the app answers with HTTP 400 (or
the status it carries) and an OpenAI-style error body.

Every string in a body must be text: a lone UTF-16 surrogate (JSON's "\\ud800" escape) is
refused, as is JSON nested too deep to parse. What a body may hold is bounded before anything
costly runs (RequestLimits): its bytes, and a text prompt's characters, which cannot fit the
context when each of its tokens would need more characters than the tokenizer's longest token.

Beyond OpenAI's fields, as vLLM names them: top_k, min_p, stop_token_ids, ignore_eos,
min_tokens, and guided_json / guided_regex / guided_choice.

Structured output (response_format json_object or json_schema, guided_*, tool_choice
"required" or a named function) becomes the request's Constraint, at most one per request;
vt/serve/grammar.py compiles it.
"""
from __future__ import annotations

import dataclasses

import json
import re
import secrets
from dataclasses import dataclass
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr
from pydantic import ValidationError, model_validator

from vt.sampling.params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from vt.errors import VtError

MAX_STOP_STRINGS = 16
# A body's bytes beyond its text prompt's: the other fields, a chat's message framing.
BODY_BYTES_BESIDES_PROMPT = 1 << 20
# The most bytes one character of a JSON string can take: a \uXXXX escape.
JSON_BYTES_PER_CHAR = 6
# The most bytes one token id of a prompt given as ids can take: ten digits, a comma, a space.
JSON_BYTES_PER_ID = 12
_SURROGATE = re.compile("[\ud800-\udfff]")
# The most choices one request may ask for (n): each holds a row of the batch.
MAX_CHOICES = 16

# A seed drawn for a sampled request that gave none (the sampler keys on it: two requests
# without seeds must not draw the same tokens).
_SEED_BOUND = 2**63


class RequestError(VtError):
    """A request refused before it runs: `status` (400 unless said), the offending `param`,
    OpenAI's error `type` and `code`."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code


Real = Union[StrictInt, StrictFloat]


@dataclass(frozen=True)
class RequestLimits:
    """How much a request may send: `prompt_chars`, a text prompt's characters (all of a
    chat's contents together; 0 without a tokenizer), and `body_bytes`, the request body's."""
    max_context: int
    chars_per_token: int
    prompt_chars: int
    body_bytes: int

    @classmethod
    def for_model(cls, max_context: int, text) -> "RequestLimits":
        """`text`: the model's TextCodec, or None (token ids only). No token of its tokenizer
        spells more characters than its longest entry does (a byte-level entry has one character
        per byte), so a prompt longer than max_context times that cannot fit."""
        per_token = max(map(len, text.tokenizer.get_vocab())) if text is not None else 0
        chars = max_context * per_token
        prompt_bytes = max(JSON_BYTES_PER_CHAR * chars, JSON_BYTES_PER_ID * max_context)
        return cls(max_context, per_token, chars, BODY_BYTES_BESIDES_PROMPT + prompt_bytes)

    def check_body_size(self, size: int) -> None:
        if size > self.body_bytes:
            raise RequestError(f"the request body has more than {self.body_bytes} bytes, the most "
                               f"this server reads (a prompt that fits the model's context takes "
                               f"fewer)", status=413, code="request_too_large")

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """Before tokenizing: a text that cannot fit the context is refused at once."""
        if chars > self.prompt_chars:
            raise RequestError(f"the prompt has {chars} characters; the model's context of "
                               f"{self.max_context} tokens holds at most {self.prompt_chars} "
                               f"(its tokenizer's longest token has {self.chars_per_token})",
                               param=param)


class _Strict(BaseModel):
    """A request's object: an unknown field is refused, and no value is coerced to a type
    (OpenAI's types, as sent)."""
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False     # vLLM's: usage in every chunk
    include_obfuscation: StrictBool | None = None   # ignored: vt pads no chunk


class JsonSchemaFormat(_Strict):
    """response_format's json_schema: the output is one JSON value valid against `schema`.
    strict is accepted either way: the grammar holds the output to the schema always."""
    model_config = ConfigDict(populate_by_name=True)
    name: StrictStr
    description: StrictStr | None = None
    schema_: dict | StrictBool = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only then")
        return self


@dataclass(frozen=True)
class Constraint:
    """What a request's output must follow, from the field `param` that asked: kind
    "json_object" (any JSON object), "json_schema" (value: the schema), "regex" (value: the
    pattern), "choice" (value: the strings, one of them exactly) or "tool_call" (value:
    ((name, parameters schema or None), ...), one call of one of them)."""
    kind: str
    value: object
    param: str


class _Body(_Strict):

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Real | None = None
    top_p: Real | None = None
    top_k: StrictInt | None = None
    min_p: Real | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    presence_penalty: Real = 0
    frequency_penalty: Real = 0
    logit_bias: dict[StrictStr, Real] | None = None
    top_logprobs: StrictInt | None = None
    user: StrictStr | None = None          # accepted, ignored (docs/serve.md's field table)
    # vLLM's extras
    min_tokens: StrictInt = 0
    repetition_penalty: Real = 1
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    # structured output (Constraint)
    response_format: ResponseFormat | None = None
    guided_json: dict | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None


class CompletionBody(_Body):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(_Strict):
    name: StrictStr
    arguments: StrictStr          # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: StrictStr
    type: Literal["function"]
    function: FunctionCall


class Message(_Strict):
    """A chat message. An assistant's may carry the tool_calls it made (its content then
    optional); a "tool" message is a call's result, naming it by tool_call_id."""
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None

    @model_validator(mode="after")
    def _check_roles(self) -> "Message":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a message of role {self.role!r} needs content")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message, and only one, names its tool_call_id")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def dict_for_template(self) -> dict:
        """The message as chat templates read it: a call's arguments as an object (the
        templates of Qwen and Llama write them with tojson)."""
        out = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name,
                                               "arguments": _arguments(c.function.arguments)}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDef(_Strict):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef

    def for_template(self) -> dict:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class _Templated(_Strict):
    """A body whose messages go through the chat template, with variables of its own."""
    chat_template_kwargs: dict[StrictStr, object] | None = None   # vLLM's (Qwen3's enable_thinking)
    reasoning_effort: StrictStr | None = None

    def template_variables(self) -> dict:
        """What the chat template sees beyond the messages: chat_template_kwargs, and
        reasoning_effort as the variable of that name (gpt-oss's templates read it)."""
        out = dict(self.chat_template_kwargs or {})
        for key in ("tokenize", "conversation", "messages", "chat_template", "add_generation_prompt",
                    "tools"):
            if key in out:
                raise RequestError(f"chat_template_kwargs.{key} is vt's to set, not the request's",
                                   param=f"chat_template_kwargs.{key}")
        if self.reasoning_effort is not None:
            out.setdefault("reasoning_effort", self.reasoning_effort)
        return out


class ChatBody(_Templated, _Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    # Accepted and ignored: they ask nothing of the generation (docs/serve.md's field table).
    store: StrictBool | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    service_tier: StrictStr | None = None
    parallel_tool_calls: StrictBool | None = None
    prompt_cache_key: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    verbosity: StrictStr | None = None
    # Honoured where vt can, refused by name where not (_refuse_chat_fields).
    modalities: list[StrictStr] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    functions: list[dict] | None = None
    function_call: StrictStr | dict | None = None
    audio: dict | None = None
    prediction: dict | None = None
    web_search_options: dict | None = None


class TokenizeBody(_Templated):
    """/tokenize, as vLLM's: a completion's prompt, or a chat's messages through the template."""
    model: StrictStr
    prompt: StrictStr | None = None
    messages: list[Message] | None = None
    add_special_tokens: StrictBool = True

    def model_post_init(self, _) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("give one of prompt and messages", param="prompt")


class DetokenizeBody(_Strict):
    model: StrictStr
    tokens: list[StrictInt]


@dataclass(frozen=True)
class GenerationSpec:
    """What one request asks of the engine and of the text stream, validated."""
    max_tokens: int | None          # None: the rest of the context
    sampling: SamplingParams
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    n: int = 1                      # choices; choice i samples with seed + i (choice_spec)
    continuous_usage: bool = False  # usage in every chunk (stream_options.continuous_usage_stats)
    include_stop: bool = False      # the stop string stays in the text
    skip_special_tokens: bool = True
    constraint: Constraint | None = None   # structured output (vt/serve/grammar.py compiles it)
    compiled_grammar: object = None        # the constraint compiled; each choice matches its own

    def choice_spec(self, i: int) -> "GenerationSpec":
        """Choice i of n: one choice whose seed is the request's seed + i (mod 2**63), so that
        the same request with that seed and n=1 gives the same choice."""
        sampling = dataclasses.replace(self.sampling, seed=(self.sampling.seed + i) % _SEED_BOUND)
        return dataclasses.replace(self, sampling=sampling, n=1)


def parse_body(raw: bytes, kind: type[_Body]) -> _Body:
    """The body as `kind` (CompletionBody or ChatBody), or a RequestError naming what is wrong."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise RequestError("the request body nests JSON arrays or objects too deeply to "
                           "parse") from None
    if not isinstance(data, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(data).__name__}")
    _refuse_lone_surrogates(data)
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"] if not _is_union_branch(p))
        what = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise RequestError(f"{loc}: {what}{more}", param=loc or None) from None


def _refuse_lone_surrogates(data: dict) -> None:
    """A RequestError naming the first string (or key) that holds half of a UTF-16 surrogate
    pair: no tokenizer, detokenizer or JSON response can encode one. Walked without recursion
    (the body may nest as deep as the parser allows)."""
    stack = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            found = _SURROGATE.search(value)
            if found:
                raise RequestError(f"{path}: holds a lone surrogate (U+{ord(found.group()):04X}), "
                                   f"which is not a character", param=path)
        elif isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{key}" if path else key
                if _SURROGATE.search(key):
                    where = f"{path}.{ascii(key)}" if path else ascii(key)
                    raise RequestError(f"{where}: a key holds a lone surrogate, which is not a "
                                       f"character", param=path or None)
                stack.append((where, item))
        elif isinstance(value, list):   # a prompt's ids: no string to see, no path to build
            stack.extend((f"{path}.{i}", item) for i, item in enumerate(value)
                         if isinstance(item, (str, dict, list)))


def _is_union_branch(part) -> bool:
    """pydantic names the member of a union it tried ('str', 'list[int]') inside the location."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


def generation_spec(body: _Body, vocab: int) -> GenerationSpec:
    """Refuse what vt cannot honour, by name; map the rest onto the engine's terms."""
    if not 1 <= body.n <= MAX_CHOICES:
        raise RequestError(f"n must be in [1, {MAX_CHOICES}], got {body.n}", param="n")
    logprobs = _logprobs(body)
    for name, ok in (("echo", not getattr(body, "echo", False)),
                     ("suffix", getattr(body, "suffix", None) is None),
                     ("best_of", getattr(body, "best_of", None) in (None, 1))):
        if not ok:
            raise RequestError(f"{name} is not supported", param=name)
    if isinstance(body, ChatBody):
        _refuse_chat_fields(body)
        body.template_variables()
    if body.stream_options is not None and not body.stream:
        raise RequestError("stream_options needs stream: true", param="stream_options")
    max_tokens = body.max_tokens
    if isinstance(body, ChatBody) and body.max_completion_tokens is not None:
        if max_tokens is not None and max_tokens != body.max_completion_tokens:
            raise RequestError("max_tokens and max_completion_tokens disagree; give one",
                               param="max_completion_tokens")
        max_tokens = body.max_completion_tokens
    if isinstance(body, CompletionBody) and max_tokens is None:
        max_tokens = 16                      # OpenAI's default for completions
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if body.min_tokens < 0 or (max_tokens is not None and body.min_tokens > max_tokens):
        bound = "" if max_tokens is None else f" and at most max_tokens={max_tokens}"
        raise RequestError(f"min_tokens must be >= 0{bound}, got {body.min_tokens}",
                           param="min_tokens")
    stop = () if body.stop is None else (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise RequestError(f"stop takes 1 to {MAX_STOP_STRINGS} non-empty strings", param="stop")
    stop_ids = tuple(body.stop_token_ids or ())
    if any(not 0 <= t < vocab for t in stop_ids):
        raise RequestError(f"stop_token_ids must be token ids in [0, {vocab})", param="stop_token_ids")
    opts = body.stream_options or StreamOptions()
    return GenerationSpec(max_tokens, _sampling(body, vocab, logprobs), stop, stop_ids,
                          body.ignore_eos, body.stream, opts.include_usage, n=body.n,
                          continuous_usage=opts.continuous_usage_stats,
                          include_stop=body.include_stop_str_in_output,
                          skip_special_tokens=body.skip_special_tokens,
                          constraint=constraint_of(body))


def constraint_of(body: _Body) -> Constraint | None:
    """The request's structured output, or None. At most one field may ask for one."""
    asked = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(Constraint("json_object", None, "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.schema_
        if schema is False:
            raise RequestError("response_format.json_schema.schema is false: no output is valid",
                               param="response_format.json_schema.schema")
        asked.append(Constraint("json_schema", {} if schema is True else schema,
                                "response_format.json_schema.schema"))
    if body.guided_json is not None:
        schema = body.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise RequestError(f"guided_json is a string that is not JSON: {e}",
                                   param="guided_json") from None
            if not isinstance(schema, dict):
                raise RequestError("guided_json must be a JSON schema (an object)", param="guided_json")
        asked.append(Constraint("json_schema", schema, "guided_json"))
    if body.guided_regex is not None:
        asked.append(Constraint("regex", body.guided_regex, "guided_regex"))
    if body.guided_choice is not None:
        if not body.guided_choice or any(not c for c in body.guided_choice):
            raise RequestError("guided_choice takes one or more non-empty strings",
                               param="guided_choice")
        asked.append(Constraint("choice", tuple(body.guided_choice), "guided_choice"))
    if isinstance(body, ChatBody):
        call = _tool_call_constraint(body)
        if call is not None:
            asked.append(call)
    if len(asked) > 1:
        raise RequestError(f"{asked[0].param} and {asked[1].param} both constrain the output; "
                           f"give one", param=asked[1].param)
    return asked[0] if asked else None


def _tool_call_constraint(body: ChatBody) -> Constraint | None:
    """tool_choice "required" (a call of one of the tools) or {"type": "function",
    "function": {"name": N}} (a call of N), as a Constraint; None for "auto" and "none"."""
    choice = body.tool_choice
    if choice in (None, "none", "auto"):
        return None
    if not body.tools:
        raise RequestError("tool_choice 'required' or a named function needs tools",
                           param="tool_choice")
    tools = tuple((t.function.name, t.function.parameters) for t in body.tools)
    if choice == "required":
        return Constraint("tool_call", tools, "tool_choice")
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise RequestError("tool_choice must be 'none', 'auto', 'required' or {\"type\": "
                           "\"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    named = tuple(t for t in tools if t[0] == name)
    if not named:
        raise RequestError(f"tool_choice names the function {name!r}, which is not among the "
                           f"tools ({', '.join(t[0] for t in tools)})", param="tool_choice")
    return Constraint("tool_call", named[:1], "tool_choice")


def _refuse_chat_fields(body: ChatBody) -> None:
    """A chat's fields that ask for what vt cannot do, refused by name."""
    if body.modalities is not None and body.modalities != ["text"]:
        raise RequestError(f"modalities {body.modalities} is not supported; vt generates text "
                           f"only", param="modalities")
    if body.tools and body.n != 1:
        raise RequestError("tools with n > 1 is not supported", param="n")
    for name in ("functions", "function_call", "audio", "prediction",
                 "web_search_options"):
        if getattr(body, name) is not None:
            raise RequestError(f"{name} is not supported", param=name)


def _logprobs(body: _Body) -> int | None:
    """How many top tokens each token's logprobs list, or None for no logprobs. A completion's
    logprobs is that count (0: the sampled token's own only); a chat asks with logprobs: true
    and counts with top_logprobs (0 when absent), which needs logprobs: true."""
    if isinstance(body, ChatBody):
        if body.top_logprobs is not None and not body.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        n, param = (body.top_logprobs or 0) if body.logprobs else None, "top_logprobs"
    else:
        if body.top_logprobs is not None:
            raise RequestError("top_logprobs is a chat field; a completion counts its top tokens "
                               "with logprobs", param="top_logprobs")
        n, param = body.logprobs, "logprobs"
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise RequestError(f"{param} must be in [0, {MAX_LOGPROBS}], got {n}", param=param)
    return n


def _sampling(body: _Body, vocab: int, logprobs: int | None) -> SamplingParams:
    temperature = 1.0 if body.temperature is None else float(body.temperature)
    if not 0 <= temperature <= 2:
        raise RequestError(f"temperature must be in [0, 2], got {temperature}", param="temperature")
    top_p = 1.0 if body.top_p is None else float(body.top_p)
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    min_p = 0.0 if body.min_p is None else float(body.min_p)
    if not 0 <= min_p < 1:
        raise RequestError(f"min_p must be in [0, 1), got {min_p}", param="min_p")
    top_k = body.top_k
    if top_k is not None and not (top_k in (-1, 0) or 1 <= top_k <= vocab):
        raise RequestError(f"top_k must be -1 or 0 (all tokens) or in [1, {vocab}], got {top_k}",
                           param="top_k")
    seed = body.seed
    if seed is not None and not 0 <= seed < _SEED_BOUND:
        raise RequestError(f"seed must be in [0, 2**63), got {seed}", param="seed")
    if seed is None:
        seed = secrets.randbelow(_SEED_BOUND) if temperature > 0 else 0
    return SamplingParams(temperature, top_k=None if top_k in (None, -1, 0) else top_k,
                          top_p=top_p, min_p=min_p, seed=seed, logprobs=logprobs,
                          min_tokens=body.min_tokens, **_penalties(body, vocab))


def _penalties(body: _Body, vocab: int) -> dict:
    """presence_penalty and frequency_penalty in [-2, 2] (OpenAI's range), repetition_penalty
    > 0 (vLLM's), logit_bias: token ids (as strings) in the vocabulary to biases in [-100, 100]."""
    out = {}
    for name in ("presence_penalty", "frequency_penalty"):
        v = float(getattr(body, name))
        if not -2 <= v <= 2:
            raise RequestError(f"{name} must be in [-2, 2], got {v}", param=name)
        out[name] = v
    rep = float(body.repetition_penalty)
    if not 0 < rep <= 100:
        raise RequestError(f"repetition_penalty must be in (0, 100], got {rep}", param="repetition_penalty")
    out["repetition_penalty"] = rep
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.isdigit() or not 0 <= int(key) < vocab:
            raise RequestError(f"logit_bias keys must be token ids in [0, {vocab}), got {key!r}",
                               param="logit_bias")
        if not -100 <= value <= 100:
            raise RequestError(f"logit_bias values must be in [-100, 100], got {value} for token "
                               f"{key}", param="logit_bias")
        if int(key) in bias:
            raise RequestError(f"logit_bias names token {int(key)} twice", param="logit_bias")
        bias[int(key)] = float(value)
    if len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS}",
                           param="logit_bias")
    out["logit_bias"] = bias
    return out


MAX_PROMPTS = 64     # prompts of one completion request (each gives n choices)


def completion_prompts(body: CompletionBody) -> list[str | list[int]]:
    """A completion's prompts, each a string or token ids: one, or a list of either (each
    prompt its own choices, as vLLM and OpenAI's legacy API answer it)."""
    p = body.prompt
    prompts = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
    if len(prompts) * body.n > MAX_PROMPTS:
        raise RequestError(f"prompt holds {len(prompts)} prompts of n={body.n} choices each; one "
                           f"request takes at most {MAX_PROMPTS} choices", param="prompt")
    for i, one in enumerate(prompts):
        if not one:
            raise RequestError("prompt is empty" if len(prompts) == 1 else f"prompt {i} is empty",
                               param="prompt")
    return prompts
