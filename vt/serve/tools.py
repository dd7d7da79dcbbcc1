"""Tool calls in a chat's output: the model writes them as text in its chat template's format,
and vt returns them as OpenAI's `tool_calls`.

Two formats, as vLLM's parsers of the same names read them:
- "hermes" (the Qwen families, Hermes): each call is `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`; text outside the blocks is the message's content.
- "llama3_json" (Llama 3.1 and 3.2): the whole output is one JSON object `{"name": ...,
  "parameters": {...}}` (or `"arguments"`), or several separated by `;`, optionally after
  `<|python_tag|>`; then there is no content.
A call whose JSON does not parse, or names no string `name`, is not a call: the text stays
content (a model that meant to call and wrote broken JSON gets its text back, not an error).

Streaming (ToolCallStream): text is sent as content until it may be the start of a call; from
there it is held, and the calls go out at the end, each in one chunk with its whole arguments
(OpenAI's clients concatenate the argument pieces of a call, so one piece is a valid stream).
"""
from __future__ import annotations

import json
import re
import uuid

FORMATS = ("hermes", "llama3_json")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def format_of(chat_template: str | None) -> str:
    """The format a chat template's model writes calls in: hermes when its template mentions
    <tool_call>, else llama3_json."""
    return "hermes" if chat_template and "<tool_call>" in chat_template else "llama3_json"


def parse_tool_calls(text: str, fmt: str) -> tuple[str | None, list[dict]]:
    """(content, calls) of a whole output; calls as OpenAI's message.tool_calls entries."""
    if fmt == "hermes":
        calls, kept, at = [], [], 0
        for m in _HERMES.finditer(text):
            call = _call(m.group(1))
            if call is None:
                continue
            kept.append(text[at:m.start()])
            at = m.end()
            calls.append(call)
        if not calls:
            return text, []
        kept.append(text[at:])
        content = "".join(kept).strip()
        return content or None, calls
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return text, []
    calls = [_call(part) for part in _split_json_objects(body)]
    if not calls or any(c is None for c in calls):
        return text, []
    return None, calls


def _split_json_objects(body: str) -> list[str]:
    """`{...}; {...}` into its objects (a `;` inside a JSON string does not split)."""
    decoder, parts, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            _, end = decoder.raw_decode(body, at)
        except ValueError:
            return [body]          # not a sequence of objects: one part, which fails to parse
        parts.append(body[at:end])
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return parts


def _call(raw: str) -> dict | None:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):        # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


class ToolCallStream:
    """A streamed output with tools: push(text) gives the content that can go out now; once
    the text may begin a call it is held, and finish() gives (the held content, calls)."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self._text = ""        # everything so far
        self._sent = 0         # characters of it sent as content
        self._holding = False

    def push(self, piece: str) -> str:
        self._text += piece
        if self._holding:
            return ""
        start = self._call_start()
        if start is None:
            out, self._sent = self._text[self._sent:], len(self._text)
            return out
        self._holding = True
        out, self._sent = self._text[self._sent:start], start
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(content not yet sent, calls): the held text parsed; no calls: it was content."""
        if not self._holding:
            return "", []
        held = self._text[self._sent:]
        content, calls = parse_tool_calls(held, self.fmt)
        return (held, []) if not calls else (content or "", calls)

    def _call_start(self) -> int | None:
        """Where a call may begin in the text so far (a partial marker at the end counts), or
        None."""
        t = self._text
        if self.fmt == "hermes":
            marker = "<tool_call>"
            at = t.find(marker)
            if at >= 0:
                return at
            for k in range(min(len(marker) - 1, len(t)), 0, -1):
                if marker.startswith(t[-k:]):
                    return len(t) - k
            return None
        stripped = t.lstrip()
        if not stripped or self._sent:      # only a whole output can be a call
            return None
        head = stripped[:len(_PYTHON_TAG)]
        return 0 if stripped.startswith("{") or _PYTHON_TAG.startswith(head) or \
            stripped.startswith(_PYTHON_TAG) else None
