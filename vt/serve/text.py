"""A checkpoint's text side: its tokenizer (transformers' AutoTokenizer), its chat template,
and its end-of-sequence ids (generation_config.json, else config.json)."""
from __future__ import annotations

import json
from pathlib import Path

from vt.serve.detok import TextStream


class TextCodec:
    """Text to prompt ids and generated ids back to text, with one tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def from_dir(cls, path) -> "TextCodec":
        from transformers import AutoTokenizer
        try:
            return cls(AutoTokenizer.from_pretrained(str(path)))
        except (OSError, ValueError) as e:
            raise ValueError(f"checkpoint {str(path)!r}: its tokenizer does not load: {e}") from None

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A completion prompt: the tokenizer's own special tokens added (a BOS, usually)."""
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def use_chat_template(self, template: str) -> None:
        """Serve with `template` (Jinja text, `vt serve --chat-template FILE`) instead of the
        tokenizer's own."""
        self.tokenizer.chat_template = template

    def chat_prompt(self, messages: list[dict], **template_kwargs) -> list[int]:
        """Messages through the chat template, the assistant's turn opened; template_kwargs
        reach the template as its variables (Qwen3's enable_thinking). The template writes the
        special tokens itself, so encoding adds none (as transformers does)."""
        if not self.has_chat_template:
            raise ValueError("this checkpoint's tokenizer has no chat template; use /v1/completions")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True, **template_kwargs)
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream(self, stop: tuple[str, ...] = (), *, include_stop: bool = False,
               skip_special_tokens: bool = True, min_tokens: int = 0) -> TextStream:
        """An incremental decoder of one request's tokens, cutting at the first stop string
        (keeping it with include_stop) that ends after the first min_tokens tokens' text."""
        decode = self.decode if skip_special_tokens else (lambda ids: self.decode(ids, False))
        return TextStream(decode, stop, include_stop, min_tokens)


def eos_token_ids(path) -> tuple[int, ...]:
    """The ids that end generation: generation_config.json's eos_token_id, else config.json's
    (an int or a list; () when neither names one). A value of another kind is a ValueError
    naming the file."""
    for name in ("generation_config.json", "config.json"):
        f = Path(path) / name
        if f.is_file():
            try:
                data = json.loads(f.read_text())
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{f}: not valid JSON ({e})") from None
            if not isinstance(data, dict):
                raise ValueError(f"{f}: expected a JSON object, got {type(data).__name__}")
            value = data.get("eos_token_id")
            if value is not None:
                ids = value if isinstance(value, list) else [value]
                if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ids):
                    raise ValueError(f"{f}: eos_token_id={value!r} must be a token id (an int "
                                     f">= 0) or a list of them")
                return tuple(sorted(set(ids)))
    return ()
