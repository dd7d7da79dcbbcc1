"""Generated ids to text as they arrive: never a broken UTF-8 character, stop strings found
across token boundaries.

IncrementalDetokenizer is the prefix-window method of Hugging Face's text-generation-inference
and vLLM: decode the tokens from `prefix` on, subtract the text of the ones already emitted
(`prefix`..`read`), and emit the rest only when it does not end in U+FFFD (a character whose
bytes have not all arrived). Decoding a window rather than one token at a time keeps the
tokenizer's context (spaces merged across tokens) and costs a few tokens per step, not the
whole output. What is emitted is always a prefix of decoding every token at once. Tokens that
add no text at all after their context leave the window at once, so a run of them (ids the
tokenizer has no text for) costs the same per token as any other.

StopStrings holds back the longest tail that could still begin a stop string, and cuts the
text before the first stop string found, as OpenAI does (the stop string is not returned).
With min_tokens (vLLM's), a stop string that ends in the text of the request's first
min_tokens tokens does not count; one that ends after it does, even if it begins inside.
"""
from __future__ import annotations

from typing import Callable

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self.tokens: list[int] = []      # the decode window's ids (emitted context + pending)
        self._prefix = self._read = 0

    def push(self, ids) -> str:
        """Add tokens; the new complete text (possibly "")."""
        start = len(self.tokens)
        self.tokens.extend(ids)
        done = self._decode(self.tokens[self._prefix:self._read])
        text = self._decode(self.tokens[self._prefix:])
        if len(text) > len(done) and not text.endswith(_REPLACEMENT):
            self._prefix, self._read = self._read, len(self.tokens)
            return text[len(done):]
        if text == done and self._read == start:
            # The new tokens add nothing after their context and no character waits for
            # bytes (ids with no text: special tokens, ids past the tokenizer's vocabulary):
            # drop them from the window, which would otherwise grow, and every push with it,
            # for as long as such ids come. (While a character waits, an unchanged text
            # proves nothing: its replacement character looks the same with more bytes.)
            del self.tokens[start:]
        return ""

    @property
    def held(self) -> int:
        """How many of the last ids pushed have text not returned yet (a character waiting
        for its bytes)."""
        return len(self.tokens) - self._read

    def held_text(self, count: int) -> str:
        """What flush() would return had the request ended `count` held ids in (nothing
        changes)."""
        done = self._decode(self.tokens[self._prefix:self._read])
        return self._decode(self.tokens[self._prefix:self._read + count])[len(done):]

    def flush(self) -> str:
        """The text held back at the end of the request (its replacement characters included,
        as a whole-sequence decode has them)."""
        text = self.held_text(self.held)
        self._prefix = self._read = len(self.tokens)
        return text


class StopStrings:
    """include: the stop string found stays in the text (vLLM's include_stop_str_in_output)."""

    def __init__(self, stops: tuple[str, ...], include: bool = False):
        self.stops, self.include = tuple(stops), include
        self._pending = ""
        self._unchecked = 0     # leading chars of _pending no stop string may end in
        self.stopped = False

    def push(self, text: str, *, checked: bool = True, unchecked: int = 0) -> str:
        """The text that can be emitted now; sets `stopped` at the first stop string.
        checked=False: no stop string may end in this text (a min_tokens request's first
        tokens), though one may begin in it; unchecked: none may end in its first chars."""
        if self.stopped or not text:
            return ""
        if not self.stops:
            return text
        buf = self._pending + text
        head = self._head(buf, checked, unchecked)
        cut, found = self._first(buf, head)
        if cut >= 0:
            self.stopped, self._pending, self._unchecked = True, "", 0
            return buf[:cut + len(found)] if self.include else buf[:cut]
        emitted = len(buf) - self._held_tail(buf)
        self._unchecked = max(0, head - emitted)
        self._pending = buf[emitted:]
        return buf[:emitted]

    def flush(self) -> str:
        out, self._pending, self._unchecked = ("" if self.stopped else self._pending), "", 0
        return out

    def would_stop(self, text: str, *, checked: bool = True, unchecked: int = 0) -> bool:
        """Whether push(text, ...) with the same arguments would find a stop string (nothing
        changes)."""
        buf = self._pending + text
        return not self.stopped and self._first(buf, self._head(buf, checked, unchecked))[0] >= 0

    def _head(self, buf: str, checked: bool, unchecked: int) -> int:
        """How many of buf's first chars no stop string may end in: all of them unless checked;
        else the pending ones up to the end of text's unchecked chars, or pending's own
        unchecked head."""
        if not checked:
            return len(buf)
        return len(self._pending) + unchecked if unchecked else self._unchecked

    def _first(self, buf: str, head: int) -> tuple[int, str]:
        """(where, which) of the first stop string in buf that ends past its first `head`
        chars; (-1, "") if none."""
        return min(((i, s) for s in self.stops if (i := buf.find(s, max(0, head - len(s) + 1))) >= 0),
                   default=(-1, ""))

    def _held_tail(self, buf: str) -> int:
        """The length of the longest tail of buf that is the start of a stop string."""
        for k in range(min(len(buf), max(len(s) for s in self.stops) - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0


class TextStream:
    """One request's text: tokens in, text deltas out, until a stop string (`stopped`).
    `tokens` counts the tokens consumed up to and including the one that completed it.
    min_tokens: no stop string ends in the text that arrives with the first min_tokens
    tokens (vLLM's min_tokens)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = (),
                 include_stop: bool = False, min_tokens: int = 0):
        self._detok = IncrementalDetokenizer(decode)
        self._stops = StopStrings(stop, include_stop)
        self.tokens = 0
        self.min_tokens = min_tokens

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    def push(self, ids) -> str:
        if self.stopped:
            return ""
        out = []
        for tok in ids:            # one at a time: the stop is known at the token that made it
            self.tokens += 1
            checked = self.tokens > self.min_tokens
            out.append(self._stops.push(self._detok.push([tok]), checked=checked))
            if self.stopped:
                break
        return "".join(out)

    def finish(self) -> str:
        """The rest, when the request has ended by itself (length, a stop token). A stop string
        can lie in the text the detokenizer held back (replacement characters of bytes that
        never completed a character); then the stream stops at the held token that completes
        it, as push() would have stopped had the request ended right after that token, and
        `tokens` no longer counts the held tokens after it."""
        if self.stopped:
            return ""
        held = self._detok.held
        # the held tokens among the first min_tokens: no stop string may end in their text
        head = max(0, min(held, self.min_tokens - (self.tokens - held)))
        unchecked = len(self._detok.held_text(head)) if head else 0
        for count in range(head + 1, held + 1) if self._stops.stops else ():
            text = self._detok.held_text(count)
            if self._stops.would_stop(text, unchecked=unchecked):
                self.tokens -= held - count
                return self._stops.push(text, unchecked=unchecked)
        return (self._stops.push(self._detok.flush(), checked=self.tokens > self.min_tokens,
                                 unchecked=unchecked) + self._stops.flush())

    @property
    def settled(self) -> int:
        """How many of the tokens consumed finish() can no longer cut: with stop strings, those
        before the ones the detokenizer holds back; without, all of them."""
        if self._stops.stops and not self.stopped:
            return self.tokens - self._detok.held
        return self.tokens
