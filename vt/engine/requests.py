"""Request, one request as the engine serves it, and RequestResult, what its caller gets back.

A request is finished once `final` is set (the buffer's finish sets it last, after the
tokens, logits, times and error it describes): readers in other threads take `final` being
set as the sign that everything else about the request is settled."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from vt.step.contract import GREEDY, SamplingParams


@dataclass
class RequestResult:
    """One request's outcome.

    tokens: the generated ids. finish_reason: "stop" (a stop token was sampled; it is the
    last token), "length" (max_new_tokens were generated), "cancelled" (RequestHandle.cancel
    or Engine.close: the tokens collected until then) or "error" (the model gave NaN or +inf
    logits, or only -inf, for the next token: `tokens` holds the ones before it and `error`
    says what happened). logits: [len(tokens), vocab] float32 when the Engine records
    logits (no rows when there are no tokens), else None. token_times: [len(tokens)], per
    token the perf_counter() time its step's tokens reached the host. index: the prompt's
    index in generate(), the engine's request number for submit().
    """
    index: int
    prompt_len: int
    tokens: list[int]
    finish_reason: str
    logits: np.ndarray | None = None
    token_times: np.ndarray | None = None
    error: str | None = None


@dataclass(eq=False)
class Request:
    """One request from submit() to its result. While it runs, its tokens land in the
    engine's token buffer (vt/engine/outputs.py) at [base, base + max_new_tokens); `end` is
    where they stop (moved up by a stop token). The token of the step at batch step t is at
    base + t - t0. Once finished, `final` holds its tokens and the buffer span is reused."""
    index: int
    prompt: np.ndarray        # [L] int32
    max_new_tokens: int
    stop_tokens: tuple[int, ...] = ()
    sampling: SamplingParams = GREEDY
    base: int = 0
    end: int = 0
    t0: int = -1              # the batch step of its (last) prefill chunk (-1: not yet)
    prefilled: int = 0        # prompt tokens prefilled so far
    row: int = -1
    blocks: list[int] = field(default_factory=list)
    batch_index: int = -1     # its entry in the DecodeBatch, -1 when not decoding
    finish_reason: str | None = None
    final: np.ndarray | None = None          # its tokens, once finished
    final_logits: np.ndarray | None = None
    token_times: np.ndarray | None = None
    error: BaseException | None = None       # the failure of a step it was in
    error_message: str | None = None         # an error row (finish_reason "error")
    cancel_requested: bool = False
    submitted_at: float = 0.0
    done_event: threading.Event = field(default_factory=threading.Event)
    on_done: list = field(default_factory=list)   # callables(request), run by the loop

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    def result(self) -> RequestResult:
        """The caller's view of a finished request."""
        return RequestResult(self.index, self.prompt_len, self.final.tolist(), self.finish_reason,
                             self.final_logits, self.token_times, self.error_message)
