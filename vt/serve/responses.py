"""OpenAI's response bodies: completions and chat completions whole and as server-sent-event
chunks (`data: {...}` lines, `data: [DONE]` at the end), and the error body
{"error": {"message", "type", "param", "code"}} of every refusal.

Each choice also carries `token_ids` (the generated ids; the only output of a preset model,
which has no tokenizer), as vLLM's `return_token_ids` does."""
from __future__ import annotations

import json
import time
import uuid

DONE = b"data: [DONE]\n\n"


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code=None) -> dict:
    """The body of an error. A lone surrogate in the message (one quoted from a request) is
    written as its escape: a JSON response must encode as UTF-8."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# The logprob OpenAI's bodies give a token of probability 0 (JSON has no -Infinity), as vLLM's.
LOWEST_LOGPROB = -9999.0


def _lp(v: float) -> float:
    return max(v, LOWEST_LOGPROB)


class ResponseShape:
    """The ids, timestamps and object names one response's bodies share. `token_text(id)`
    names a token in logprobs (its decoded text)."""

    def __init__(self, model: str, chat: bool, token_text=None):
        self.model, self.chat = model, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._text = token_text or (lambda t: f"token_id:{t}")
        self._offsets: dict[int, int] = {}   # choice -> a completion's text_offset so far
        self.tool_format: str | None = None  # a chat with tools: the format calls are parsed in

    def logprobs(self, entries, index: int = 0) -> dict | None:
        """OpenAI's logprobs object of some tokens ((id, logprob, top) each; None: not asked).
        Chat: {"content": [{token, logprob, bytes, top_logprobs}], "refusal"}. Completion:
        {tokens, token_logprobs, top_logprobs, text_offset}; as vLLM's, each top_logprobs dict
        also holds the sampled token, so logprobs=0 gives its logprob there too."""
        if entries is None:
            return None
        name = self._text
        if self.chat:
            def item(t, v):
                text = name(t)
                return {"token": text, "logprob": _lp(v), "bytes": list(text.encode())}
            return {"content": [{**item(t, v), "top_logprobs": [item(i, w) for i, w in top]}
                                for t, v, top in entries], "refusal": None}
        tokens, offsets, at = [], [], self._offsets.get(index, 0)
        for t, _, _ in entries:
            tokens.append(name(t))
            offsets.append(at)
            at += len(tokens[-1])
        self._offsets[index] = at
        return {"tokens": tokens, "token_logprobs": [_lp(v) for _, v, _ in entries],
                "top_logprobs": [{**{name(i): _lp(w) for i, w in top}, name(t): _lp(v)}
                                 for t, v, top in entries],
                "text_offset": offsets}

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str | None, token_ids: list[int], finish_reason: str, use: dict,
              logprobs=None, index: int = 0, tool_calls: list | None = None) -> dict:
        """logprobs: the tokens' (id, logprob, top) or None (not asked); index: the choice's;
        tool_calls: the calls parsed from a chat's output (vt/serve/tools.py), if any."""
        lp = self.logprobs(logprobs, index)
        if self.chat:
            message = {"role": "assistant", "content": text}
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice = {"index": index, "message": message,
                      "logprobs": lp, "finish_reason": finish_reason, "token_ids": token_ids}
            return {**self._head("chat.completion"), "choices": [choice], "usage": use}
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason,
                  "token_ids": token_ids}
        return {**self._head("text_completion"), "choices": [choice], "usage": use}

    def chunk(self, text: str | None, token_ids: list[int], finish_reason: str | None = None,
              *, role: bool = False, logprobs=None, index: int = 0,
              tool_calls: list | None = None) -> dict:
        """One streamed choice delta (the chat's first one carries the role); logprobs: its
        tokens' (id, logprob, top), or None; index: the choice's; tool_calls: whole calls,
        each as a delta with its index in the message's list."""
        lp = self.logprobs(logprobs, index)
        if self.chat:
            delta = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason,
                      "token_ids": token_ids}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish_reason,
                  "token_ids": token_ids}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, use: dict) -> dict:
        """stream_options.include_usage: the last chunk, with no choices."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": use}
