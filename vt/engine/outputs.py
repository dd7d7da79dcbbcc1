"""CallOutputs: where one generate() call's tokens go. Every request's tokens live in one flat
buffer at [base, end) (end moves up when a stop token is seen), filled step by step through
each step's `dest` indices, and become per-request lists only in the results."""
from __future__ import annotations

import numpy as np

from vt.engine.requests import Request, RequestResult


class CallOutputs:
    def __init__(self, reqs: list[Request], vocab: int, record_logits: bool):
        total = reqs[-1].end if reqs else 0
        self.reqs = reqs
        self.tokens = np.zeros(total, np.int32)                  # every request's tokens
        self.limit = np.array([r.end for r in reqs], np.int64)   # per request: where they stop
        self.logits = np.zeros((total, vocab), np.float32) if record_logits else None
        self.finished = 0   # requests of this call whose last token arrived
        self.count = 0      # tokens of this call that arrived
        self._bases = np.array([r.base for r in reqs], np.int64)   # a dest's request, by search
        self._cut = False   # an error ended a request early: later tokens are checked

    def store(self, tag, tokens: np.ndarray, host_logits=None) -> list[Request]:
        """Put a step's tokens where they belong (tag: Scheduler.plan's); returns the
        requests that just ended: a stop token, or an error row (the sampler's -1 for NaN/inf
        logits: vt/sampling/sampler.py), whose token is not kept."""
        dest, rid, stop, n_last = tag
        self.tokens[dest] = tokens
        if self.logits is not None:
            self.logits[dest] = host_logits
        if rid is None and not self._cut and tokens.min() >= 0:
            self.count += len(tokens)   # no stop tokens, no error so far: every token counts
            self.finished += n_last
            return []
        if rid is None:                 # an error ended a request of a call without stops
            rid = np.searchsorted(self._bases, dest, side="right") - 1
        limit = self.limit[rid]
        valid = dest < limit            # False: past an end learned earlier
        error = tokens < 0
        ended = []
        hits = error if stop is None else error | (tokens == stop)
        for i in np.flatnonzero(hits & valid):
            req = self.reqs[rid[i]]
            if error[i]:
                req.end, req.finish_reason = int(dest[i]), "error"
                req.error = (f"the logits of token {int(dest[i]) - req.base} were NaN or +inf, or "
                             f"all -inf: nothing to sample")
            else:
                req.end, req.finish_reason = int(dest[i]) + 1, "stop"
            self.limit[req.index] = limit[i] = req.end
            ended.append(req)
        self._cut = self._cut or bool(ended)
        kept = valid & ~error
        self.count += int(np.count_nonzero(kept))
        self.finished += int(np.count_nonzero(kept & (dest + 1 == limit)))
        self.finished += sum(r.finish_reason == "error" for r in ended)
        return ended

    def result(self, req: Request) -> RequestResult:
        span = slice(req.base, req.end)
        logits = self.logits[span].copy() if self.logits is not None else None
        return RequestResult(req.index, req.prompt_len, self.tokens[span].tolist(),
                             req.finish_reason or "length", logits, req.error)
