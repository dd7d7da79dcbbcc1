"""GrammarRows: a serving loop's live constrained requests and the masks their grammars write.

A constrained request's mask for batch step t + 1 is built from its token of step t
(vt/sampling/token_mask.py): once the loop has collected step t, each grammar takes its
token (`accept`) and, if its request samples at step t + 1, writes its next mask
(`fill_mask` into the pinned staging, then one H2D copy per row in the runner's stream),
which the step's sampler reads. When step t + 1's forward was launched already (the loop's
split step, vt/engine/serving.py), a request whose last token it samples has left the batch
and let its row go, so each request's row is the one it was admitted to, kept here.
"""
from __future__ import annotations

from vt.engine.requests import RequestPhase


class GrammarRows:
    """masks: the step model's TokenMaskState; stream: the runner's; after_write(masks, rows):
    the executor hook called once a step's mask copies are queued (vt.hooks)."""

    def __init__(self, masks, stream, after_write):
        self.masks, self._stream, self._after_write = masks, stream, after_write
        self._rows: dict = {}   # live constrained request -> the row it was admitted to

    def __bool__(self) -> bool:
        """Whether a constrained request is live (or finished since the last advance)."""
        return bool(self._rows)

    def admit(self, reqs) -> None:
        """Requests the scheduler just admitted (their rows assigned): the constrained ones
        are live from now."""
        for req in reqs:
            if req.sampling.grammar is not None:
                self._rows.setdefault(req, req.row)

    def advance(self, t: int, tokens) -> None:
        """Each live constrained request's grammar takes its token of batch step t (tokens:
        the token buffer); one that samples at step t + 1 too gets its next mask, queued
        before that step's sampler. Finished requests are dropped."""
        masks, live, rows = self.masks, {}, []
        for req, row in self._rows.items():
            if req.finished:
                continue
            live[req] = row
            first = req.first_step
            if first is None or first > t or req.phase is not RequestPhase.DECODING:
                continue   # no token of its own in step t (prefilling, or a non-final chunk)
            d = req.entry(t)
            if d >= req.span_end or tokens[d] < 0:
                continue   # past its end, or an error token (the request ends with it)
            grammar = req.sampling.grammar
            grammar.accept(int(tokens[d]))
            if d + 1 < req.span_end:   # it samples again
                grammar.fill_mask(masks.staging(row))
                rows.append(row)
        masks.write(self._stream, rows)
        if rows:
            self._after_write(masks, rows)
        self._rows = live
