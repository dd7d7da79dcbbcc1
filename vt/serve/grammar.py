"""Structured output through xgrammar: a request's Constraint (vt/serve/protocol.py) compiled
against the served tokenizer, and one matcher per choice that the engine drives as
SamplingParams.grammar (fill_mask(bits) before each step it samples in, accept(token) after).

xgrammar (the grammar engine vLLM and SGLang use) is imported on the first constrained
request, not at start-up: a server that never sees one does not pay its import. Its
TokenizerInfo is built once per served tokenizer, over the model's padded vocabulary (the ids
past the tokenizer's are never allowed), with the model's end-of-sequence ids as the ids that
end a grammar. Its GrammarCompiler caches what it compiled (a schema sent again compiles
once), within COMPILE_CACHE_BYTES.

JSON is compiled compact (any_whitespace=False: one space after `:` and `,`, no newlines): a
grammar that admits any whitespace lets a model fill its budget with blanks, the invalid JSON
vLLM's users report. A tool call is one call of one of the request's tools in the chat
template's format (vt/serve/tools.py): Hermes `<tool_call>\\n{"name": ..., "arguments": {...}}
\\n</tool_call>`, Llama 3.1 `{"name": ..., "parameters": {...}}`, its arguments by the tool's
parameters schema.
"""
from __future__ import annotations

import json
import re
import threading

import numpy as np

from vt.serve.protocol import Constraint, RequestError

# What xgrammar's compiler keeps of compiled grammars (its own cache, least recently used out).
COMPILE_CACHE_BYTES = 256 << 20
_XGRAMMAR_HINT = "install xgrammar on the server: pip install 'vt-graphs[grammar]'"
# xgrammar's C++ errors start with a time stamp and a source position: the reason follows.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


class GrammarEngine:
    """The served model's grammar compiler. `compile(constraint, tool_format)` gives a
    compiled grammar (shareable, cached); `grammar(compiled)` one request's TokenGrammar."""

    def __init__(self, tokenizer, vocab: int, stop_ids: tuple[int, ...]):
        self._tokenizer, self._vocab, self._stop_ids = tokenizer, vocab, list(stop_ids)
        self._compiler = None
        self._lock = threading.Lock()

    def _xgrammar(self, constraint: Constraint):
        try:
            import xgrammar
        except ImportError:
            raise RequestError(f"{constraint.param} needs a grammar engine, which this server "
                               f"lacks ({_XGRAMMAR_HINT})", param=constraint.param) from None
        with self._lock:
            if self._compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab, stop_token_ids=self._stop_ids)
                self._compiler = xgrammar.GrammarCompiler(info, cache_limit_bytes=COMPILE_CACHE_BYTES)
        return xgrammar, self._compiler

    def compile(self, constraint: Constraint, tool_format: str | None = None):
        """The constraint compiled (call it off the event loop: a large schema takes a while);
        a RequestError naming constraint.param when it does not compile."""
        xgr, compiler = self._xgrammar(constraint)
        kind, value = constraint.kind, constraint.value
        try:
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                    strict_mode=False)
            if kind == "json_schema":
                return compiler.compile_json_schema(json.dumps(value), any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(value)
            if kind == "choice":
                return compiler.compile_regex("|".join(re.escape(c) for c in value))
            if kind == "tool_call":
                return compiler.compile_grammar(_tool_call_grammar(xgr, value, tool_format))
        except (RuntimeError, ValueError, TypeError) as e:
            reason = _CPP_PREFIX.sub("", str(e).strip().splitlines()[-1] if str(e).strip() else "")
            raise RequestError(f"{constraint.param}: does not compile to a grammar: "
                               f"{reason or type(e).__name__}", param=constraint.param) from None
        raise ValueError(f"unknown constraint kind {kind!r}")

    def grammar(self, compiled) -> "TokenGrammar":
        """A fresh matcher over `compiled`: one per choice (a matcher holds its request's state)."""
        import xgrammar
        return TokenGrammar(xgrammar.GrammarMatcher(compiled))


def _tool_call_grammar(xgr, tools: tuple[tuple[str, dict | None], ...], fmt: str):
    """One call of one of `tools` ((name, parameters schema or None), ...) in format `fmt`."""
    key = "arguments" if fmt == "hermes" else "parameters"
    calls = [{"type": "object",
              "properties": {"name": {"enum": [name]}, key: params or {"type": "object"}},
              "required": ["name", key], "additionalProperties": False}
             for name, params in tools]
    schema = json.dumps(calls[0] if len(calls) == 1 else {"anyOf": calls})
    call = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    if fmt != "hermes":
        return call
    return xgr.Grammar.concat(xgr.Grammar.from_ebnf('root ::= "<tool_call>\\n"'), call,
                              xgr.Grammar.from_ebnf('root ::= "\\n</tool_call>"'))


class TokenGrammar:
    """One request's grammar state, as SamplingParams.grammar: fill_mask(bits) writes the next
    token's allowed set (an int32 bitmask, xgrammar's layout), accept(token) advances.

    Once the grammar has ended (it accepted an end-of-sequence id, which ends the request
    unless it ignores EOS), every token is allowed: a request that ignores EOS goes on
    unconstrained. A token the grammar refuses (the mask was not applied) leaves `error` set
    and allows no token from then on, so the request ends in an error that names it rather
    than going on outside its grammar."""

    def __init__(self, matcher):
        self._matcher = matcher
        self.error: str | None = None

    def fill_mask(self, bits: np.ndarray) -> None:
        if self.error is not None:
            bits[:] = 0
        elif self._matcher.is_terminated():
            bits[:] = -1
        else:
            self._matcher.fill_next_token_bitmask(bits)

    def accept(self, token: int) -> None:
        if self.error is not None or self._matcher.is_terminated():
            return
        if not self._matcher.accept_token(int(token)):
            self.error = f"token {int(token)} does not follow the request's grammar"

    @property
    def ended(self) -> bool:
        """The grammar reached its end (a whole JSON value, call, match)."""
        return self._matcher.is_terminated()
