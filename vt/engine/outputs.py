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

    def store(self, tag, tokens: np.ndarray, host_logits=None) -> list[Request]:
        """Put a step's tokens where they belong (tag: Scheduler.plan's); returns the
        requests that just stopped."""
        dest, rid, stop, n_last = tag
        self.tokens[dest] = tokens
        if self.logits is not None:
            self.logits[dest] = host_logits
        if rid is None:                 # no stop tokens in this call: every token counts
            self.count += len(tokens)
            self.finished += n_last
            return []
        limit = self.limit[rid]
        valid = dest < limit            # False: past a stop learned earlier
        stopped = []
        for i in np.flatnonzero((tokens == stop) & valid):
            req = self.reqs[rid[i]]
            req.end = int(dest[i]) + 1
            req.finish_reason = "stop"
            self.limit[req.index] = limit[i] = req.end
            stopped.append(req)
        self.count += int(np.count_nonzero(valid))
        self.finished += int(np.count_nonzero(dest + 1 == limit))
        return stopped

    def result(self, req: Request) -> RequestResult:
        span = slice(req.base, req.end)
        logits = self.logits[span].copy() if self.logits is not None else None
        return RequestResult(req.index, req.prompt_len, self.tokens[span].tolist(),
                             req.finish_reason or "length", logits)
