"""The OpenAI request bodies `vt serve` accepts, validated before anything reaches the engine.

A body is parsed as JSON and checked against a pydantic model that forbids unknown fields and
coerces nothing (strict: "5" is not an int, 1.0 is not an int, 1 is a float). What vt cannot do
is refused by name rather than ignored: n other than 1, logprobs, penalties, echo, suffix,
best_of, logit_bias. Every refusal is a RequestError, which the app answers with HTTP 400 (or
the status it carries) and an OpenAI-style error body.

Every string in a body must be text: a lone UTF-16 surrogate (JSON's "\\ud800" escape) is
refused, as is JSON nested too deep to parse. What a body may hold is bounded before anything
costly runs (RequestLimits): its bytes, and a text prompt's characters, which cannot fit the
context when each of its tokens would need more characters than the tokenizer's longest token.

Beyond OpenAI's fields, as vLLM names them: top_k, min_p, stop_token_ids, ignore_eos.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr
from pydantic import ValidationError

from vt.sampling.params import SamplingParams
from vt.errors import VtError

MAX_STOP_STRINGS = 16
# A body's bytes beyond its text prompt's: the other fields, a chat's message framing.
BODY_BYTES_BESIDES_PROMPT = 1 << 20
# The most bytes one character of a JSON string can take: a \uXXXX escape.
JSON_BYTES_PER_CHAR = 6
# The most bytes one token id of a prompt given as ids can take: ten digits, a comma, a space.
JSON_BYTES_PER_ID = 12
_SURROGATE = re.compile("[\ud800-\udfff]")
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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: StrictBool = False


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

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
    user: StrictStr | None = None


class CompletionBody(_Body):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None


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
    if body.n != 1:
        raise RequestError(f"n={body.n} is not supported; vt serve returns one choice (n=1)",
                           param="n")
    # A completion's logprobs is a count, and 0 asks for the sampled token's own; only a
    # chat's false (or an absent field) asks for none.
    logprobs = getattr(body, "logprobs", None)
    wants_logprobs = logprobs is not None and logprobs is not False
    if wants_logprobs or body.top_logprobs is not None:
        raise RequestError("logprobs are not supported by vt serve (its sampler returns token ids "
                           "only)", param="logprobs" if wants_logprobs else "top_logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) != 0:
            raise RequestError(f"{name} is not supported (only 0)", param=name)
    if body.logit_bias:
        raise RequestError("logit_bias is not supported", param="logit_bias")
    for name, ok in (("echo", not getattr(body, "echo", False)),
                     ("suffix", getattr(body, "suffix", None) is None),
                     ("best_of", getattr(body, "best_of", None) in (None, 1))):
        if not ok:
            raise RequestError(f"{name} is not supported", param=name)
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
    stop = () if body.stop is None else (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise RequestError(f"stop takes 1 to {MAX_STOP_STRINGS} non-empty strings", param="stop")
    stop_ids = tuple(body.stop_token_ids or ())
    if any(not 0 <= t < vocab for t in stop_ids):
        raise RequestError(f"stop_token_ids must be token ids in [0, {vocab})", param="stop_token_ids")
    return GenerationSpec(max_tokens, _sampling(body, vocab), stop, stop_ids, body.ignore_eos,
                          body.stream, bool(body.stream_options and body.stream_options.include_usage))


def _sampling(body: _Body, vocab: int) -> SamplingParams:
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
                          top_p=top_p, min_p=min_p, seed=seed)


def completion_prompt(body: CompletionBody) -> str | list[int]:
    """The one prompt of a completion: a string or token ids (a list of one of either)."""
    p = body.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise RequestError(f"prompt holds {len(p)} prompts; vt serve takes one per request",
                               param="prompt")
        p = p[0]
    if not p:
        raise RequestError("prompt is empty", param="prompt")
    return p
