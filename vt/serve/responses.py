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


class ResponseShape:
    """The ids, timestamps and object names one response's bodies share."""

    def __init__(self, model: str, chat: bool):
        self.model, self.chat = model, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, token_ids: list[int], finish_reason: str, use: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish_reason, "token_ids": token_ids}
            return {**self._head("chat.completion"), "choices": [choice], "usage": use}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                  "token_ids": token_ids}
        return {**self._head("text_completion"), "choices": [choice], "usage": use}

    def chunk(self, text: str | None, token_ids: list[int], finish_reason: str | None = None,
              *, role: bool = False) -> dict:
        """One streamed choice delta (the chat's first one carries the role)."""
        if self.chat:
            delta = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason,
                      "token_ids": token_ids}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason,
                  "token_ids": token_ids}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, use: dict) -> dict:
        """stream_options.include_usage: the last chunk, with no choices."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": use}
