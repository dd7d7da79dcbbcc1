"""TokenBuffer: where every running request's tokens go, and how a request finishes.

One flat buffer with a span of max_context entries per sequence row: a step's tokens are put
in place with ONE fancy assignment through the step's `dest` indices, whatever the number of
rows, and nothing per request happens per step. A request's tokens become its own array only
when it finishes (`finish`: the copy, its finish reason, its done event and callbacks).

A reader (a RequestHandle, in any thread) finds how many tokens a running request has from
the last stored batch step (`stored_t`) alone: Request.tokens_by(stored_t), its token of
batch step t being at Request.entry(t). A row's next request writes its span one step after
the last write of the previous one, and the previous one is finished (copied out) by then; a
reader that raced the finish sees `final` set after its copy and uses it instead
(RequestHandle.snapshot).
"""
from __future__ import annotations

import traceback
from typing import Callable

import numpy as np

from vt.engine.requests import Request, RequestPhase
from vt.forward.spec_kernels import COUNT, TOKENS
from vt.sampling.logprobs import RECORD_WORDS, UNASKED

# Step times kept for the token times of the requests running: more than any request lives.
_TIME_RING_MIN = 1024
# ndarray.min() goes through a Python wrapper (numpy's _methods._amin); the ufunc's reduce is
# the same C loop without it, once per step on the host's critical path.
_smallest = np.minimum.reduce
_NO_RECORD = np.array([-1, UNASKED] + [0] * (RECORD_WORDS - 2), np.int32)


class TokenBuffer:
    """speculative: k, the drafts of a verify step (0: none). Then a step's rows emit a number
    of tokens each, known when it is collected (`store_verified`): each request counts its
    own (Request.emitted) and every entry has its time.

    records_read(on): told whether the token records of the steps collected from now on are
    read (on: with speculation, or while a live request asks for logprobs), when that
    changes; the engine passes Runner.set_copy_records, so that no step's records are copied
    for nothing."""

    def __init__(self, rows: int, span: int, vocab: int, record_logits: bool, *,
                 speculative: int = 0, records_read: Callable[[bool], None] | None = None):
        # + 1: the scratch entry where the token of a non-final prefill chunk goes
        self.tokens = np.zeros(rows * span + 1, np.int32)
        self.logits = np.zeros((rows * span + 1, vocab), np.float32) if record_logits else None
        self.stored_t = 0            # batch steps [0, stored_t) have their tokens here
        ring = max(_TIME_RING_MIN, 1 << (2 * span + 8).bit_length())
        self._times, self._mask = np.zeros(ring), ring - 1
        self.tokens_out = 0          # tokens of every finished request
        self.finished = 0
        self.live: set[Request] = set()   # admitted and not finished (the loop adds them)
        # entry -> token record [RECORD_WORDS] of the tokens whose request asks for logprobs
        # (vt/sampling/logprobs.py): few requests ask, so a dict, not a [rows * span] array
        self.records: dict[int, np.ndarray] = {}
        self._asking = 0             # live requests that ask for logprobs: 0 skips the records
        self.k = speculative
        self._records_read = records_read if records_read is not None else _ignore
        self._records_read(bool(speculative))
        self._entry_times = np.zeros(rows * span + 1) if speculative else None
        self.spec = SpeculativeCounts()

    def admit(self, reqs) -> None:
        """Requests admitted by a step's plan: live from now (called before that step is
        launched, so the records of their first tokens are copied)."""
        self.live.update(reqs)
        self._count_asking(sum(r.sampling.logprobs is not None for r in reqs))

    def store(self, tag, tokens: np.ndarray, host_logits, now: float, records=None) -> list[Request]:
        """Put a step's tokens (and the records [n, RECORD_WORDS] of the rows that asked for
        logprobs) where they belong (tag: Scheduler's StepTag) and finish the requests it
        completes; returns those that just sampled a stop token."""
        self.tokens[tag.dest] = tokens
        if records is not None and self._asking:
            for i in np.flatnonzero(records[:, 1] != UNASKED):
                self.records[int(tag.dest[i])] = records[i]
        if self.logits is not None:
            self.logits[tag.dest] = host_logits
        self._times[tag.t & self._mask] = now
        stopped = []
        if _smallest(tokens) < 0:  # an error row: the sampler's -1 for NaN/inf logits
            stopped += self._error_rows(tag, tokens)
        if tag.stops is not None:
            for i in np.flatnonzero((tokens[:, None] == tag.stops).any(1)):
                req, d = tag.reqs[i], int(tag.dest[i])
                if not req.finished and d < req.span_end:   # else: a token past its end
                    req.span_end = d + 1
                    stopped.append(req)
        self.stored_t = tag.t + 1
        for req in stopped:
            if not req.finished:
                self.finish(req, "error" if req.error_message else "stop")
        for req in tag.leaving:
            if not req.finished:
                self.finish(req, "length")
        return stopped

    def store_verified(self, tag, records: np.ndarray, now: float) -> list[Request]:
        """A speculative step's tokens (tag: Scheduler's StepTag, with every row's request;
        records [n, RECORD_WORDS]): a verify row's tokens are its record's [TOKENS, TOKENS +
        count) (vt/forward/spec_kernels.py), a prefill row's its first word. Each request's
        tokens go after the ones it has, up to its budget, a stop token (kept, the last) or
        an error token (-1, not kept); returns the requests this step completed (stop,
        length or error), which leave the batch as stopped ones do, and finishes them."""
        ended, spec, k, times = [], self.spec, self.k, self._entry_times
        for i, req in enumerate(tag.reqs):
            if req is None or req.finished or req.emitted is None:
                continue   # a non-final prefill chunk, or a request already ended
            have, room = req.emitted, req.span_end - req.span_start - req.emitted
            if room <= 0:
                continue   # its end is known (a cancel): this step's tokens are past it
            if i < tag.n_decode:
                count = int(records[i, COUNT])
                toks = records[i, TOKENS:TOKENS + count]
                spec.verify_rows += 1
                spec.drafts += k
                spec.accepted += count - 1
            else:
                toks = records[i, :1]
            end, reason = min(len(toks), room), None
            if toks.min() < 0:
                bad = int(np.argmax(toks < 0))
                if bad < end:
                    end, reason = bad, "error"
                    req.error_message = (f"the logits of token {have + bad} were NaN or +inf, "
                                         f"or all -inf: nothing to sample")
            if req.stop_tokens and reason is None:
                hit = np.flatnonzero(np.isin(toks[:end], req.stop_tokens))
                if hit.size:
                    end, reason = int(hit[0]) + 1, "stop"
            at = req.span_start + have
            self.tokens[at:at + end] = toks[:end]
            times[at:at + end] = now
            req.emitted = have + end   # after the tokens: a reader counts on them
            if reason is None and end == room:
                reason = "length"
            if reason is not None:
                req.span_end = at + end
                ended.append((req, reason))
        self.stored_t = tag.t + 1
        for req, reason in ended:
            self.finish(req, reason)
        for req in tag.leaving:   # the batch's length schedule, an upper bound: ended already
            if not req.finished:
                self.finish(req, "length")
        return [req for req, _ in ended]

    def _error_rows(self, tag, tokens) -> list[Request]:
        """The requests whose row sampled -1 (vt/sampling/sampler.py: NaN or +inf logits, or
        only -inf): each ends before that token, with finish_reason "error" and a message."""
        ended = []
        for i in np.flatnonzero(tokens < 0):
            d = int(tag.dest[i])
            req = tag.reqs[i] if tag.reqs is not None else self._owner(d, tag.t)
            if req is None or req.finished or d >= req.span_end:
                continue            # a scratch row, or a token past the request's end
            req.span_end = d
            req.error_message = (f"the logits of token {d - req.span_start} were NaN or +inf, or all "
                                 f"-inf: nothing to sample")
            ended.append(req)
        return ended

    def _owner(self, d: int, t: int) -> Request | None:
        """The request whose token of batch step t goes to entry d: the one that held the
        row at that step. Not whichever live request's span holds d: a row's next request
        may already be admitted (its span is the same) before the last token of the
        previous one is stored, and it joined at a later step."""
        for r in self.live:
            if r.first_step is not None and r.first_step <= t and r.entry(t) == d:
                return r
        return None

    def available(self, req: Request) -> int:
        """How many of a running request's tokens are stored."""
        emitted = req.emitted
        return req.tokens_by(self.stored_t) if emitted is None else emitted

    def finish(self, req: Request, reason: str, error: BaseException | None = None) -> None:
        """Copy the request's tokens out of the buffer (its span is reused after) and wake
        whoever waits for it."""
        n = self.available(req)
        span = slice(req.span_start, req.span_start + n)
        # [n, vocab] and [n] whatever n, 0 included (a request cancelled or failed before its
        # first token): every result of one engine has the same shapes.
        req.final_logits = self.logits[span].copy() if self.logits is not None else None
        if req.emitted is None:
            first = req.first_step if req.first_step is not None else 0
            req.token_times = self._times[np.arange(first, first + n) & self._mask]
        else:
            req.token_times = self._entry_times[span].copy()
        req.error = error
        req.finish_reason = reason
        if req.sampling.logprobs is not None:
            req.final_records = np.array([self.records.pop(d, _NO_RECORD) for d in range(span.start, span.stop)],
                                         np.int32).reshape(n, RECORD_WORDS)
        req.final = self.tokens[span].copy()
        req.phase = RequestPhase.FINISHED   # last: readers take it as "everything is settled"
        self.tokens_out += n
        self.finished += 1
        if req in self.live:
            self.live.discard(req)
            if req.sampling.logprobs is not None:
                self._count_asking(-1)
        req.done_event.set()
        for fn in req.on_done:
            try:
                fn(req)
            except Exception:   # noqa: BLE001 (a caller's callback must not fail the step's others)
                traceback.print_exc()

    def _count_asking(self, change: int) -> None:
        """Live requests asking for logprobs: `change` more; records_read when that count
        leaves or reaches 0 (speculation reads every step's records anyway)."""
        was = self._asking
        self._asking = was + change
        if not self.k and (was == 0) != (self._asking == 0):
            self._records_read(self._asking > 0)


def _ignore(on: bool) -> None:
    """records_read of a TokenBuffer nobody tells."""


class SpeculativeCounts:
    """Verify rows of live requests counted (verify_rows), the drafts they verified (k each)
    and how many were accepted."""

    __slots__ = ("verify_rows", "drafts", "accepted")

    def __init__(self):
        self.verify_rows = self.drafts = self.accepted = 0

    def as_dict(self) -> dict:
        """The counts, acceptance_rate (accepted / drafts) and mean_accepted_length (tokens a
        verify row emits, 1 .. k + 1)."""
        rows = self.verify_rows
        return dict(verify_rows=rows, drafts=self.drafts, accepted=self.accepted,
                    acceptance_rate=self.accepted / self.drafts if self.drafts else 0.0,
                    mean_accepted_length=(self.accepted + rows) / rows if rows else 0.0)
