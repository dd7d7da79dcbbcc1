"""Request, one request as the engine serves it, its RequestPhase, and RequestResult, what
its caller gets back.

A request's whole serving state is here: its phase, the row and KV blocks it holds, how much
of its prompt is prefilled, and where its tokens go (its span of the token buffer, and the
batch step of its first token). The scheduler and the token buffer change it; the
DecodeBatch keeps a vectorised copy of the decoding requests' positions for the per-step
add (vt/engine/batch.py), derived from these fields when a request joins.

A request is finished once its phase is FINISHED (the buffer's finish sets it last, after
the tokens, logits, times and error it describes): readers in other threads take that as the
sign that everything else about the request is settled."""
from __future__ import annotations

import enum
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


class RequestPhase(enum.Enum):
    """Where a request is in its life. It only moves forward: WAITING -> PREFILLING (a long
    prompt prefilled in chunks) -> DECODING -> FINISHED, skipping PREFILLING when the whole
    prompt is prefilled at once, and to FINISHED from any phase (a cancel, a failed step)."""
    WAITING = "waiting"          # queued: no row, no KV blocks
    PREFILLING = "prefilling"    # holds a row and its KV blocks; prompt chunks still to run
    DECODING = "decoding"        # its last prefill chunk is planned: its tokens are coming
    FINISHED = "finished"        # `final` holds its tokens; the row, blocks and span are free


@dataclass(eq=False)
class Request:
    """One request from submit() to its result. From the step that plans its last prefill
    chunk (`first_step`, the batch step that samples its first token) its tokens land in
    the engine's token buffer (vt/engine/token_buffer.py), one per batch step, in its span
    [span_start, span_start + max_new_tokens); `span_end` is where they stop (moved up by a
    stop token, an error row or a cancel). Once finished, `final` holds its tokens and the
    span is reused."""
    index: int
    prompt: np.ndarray        # [L] int32
    max_new_tokens: int
    stop_tokens: tuple[int, ...] = ()
    sampling: SamplingParams = GREEDY
    phase: RequestPhase = RequestPhase.WAITING
    prefilled: int = 0        # prompt tokens prefilled (planned) so far
    row: int | None = None    # its sequence row while it holds one (vt/engine/rows.py)
    blocks: list[int] = field(default_factory=list)   # its KV blocks while it holds a row
    span_start: int = 0       # where its first token goes in the token buffer
    span_end: int = 0         # where its tokens stop: span_start + the most it will have
    first_step: int | None = None   # the batch step of its first token, once DECODING
    # speculative decoding: how many of its tokens are stored (a verify step emits a number
    # per row known only when it is collected); None: one a batch step, tokens_by counts them
    emitted: int | None = None
    # prefix caching (vt/engine/kv_blocks.py): its full prompt blocks' chained hashes (made at
    # its first admission attempt), how many of its first blocks are cached (taken or
    # computed and named), and how many prompt tokens came from the cache, not computed
    block_hashes: list | None = None
    cached_blocks: int = 0
    cached_tokens: int = 0
    # its KV blocks after it let them go and before it finishes (the full ones its decoding
    # wrote are named then, when its tokens are known)
    released_blocks: list | None = None
    batch_index: int = -1     # the DecodeBatch's entry for it (the batch's, -1: not in it)
    finish_reason: str | None = None
    final: np.ndarray | None = None          # its tokens, once finished
    final_logits: np.ndarray | None = None
    # its tokens' records [n, RECORD_WORDS] once finished, when its sampling asks for logprobs
    final_records: np.ndarray | None = None
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

    @property
    def finished(self) -> bool:
        return self.phase is RequestPhase.FINISHED

    def entry(self, t: int) -> int:
        """The token-buffer entry of its token of batch step t (DECODING or after)."""
        return self.span_start + t - self.first_step

    def tokens_by(self, t: int) -> int:
        """How many of its tokens the batch steps before t sample (0 before DECODING)."""
        first = self.first_step
        if first is None:
            return 0
        return max(0, min(t - first, self.span_end - self.span_start))

    def result(self) -> RequestResult:
        """The caller's view of a finished request."""
        return RequestResult(self.index, self.prompt_len, self.final.tolist(), self.finish_reason,
                             self.final_logits, self.token_times, self.error_message)
