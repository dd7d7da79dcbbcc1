"""TokenBuffer (vt/engine/token_buffer.py) alone, on bare Requests and hand-made step tags (what
the Scheduler fixes at plan time): where a step's tokens land, who finishes and why (budget,
stop token, an error row), which request an error row belongs to when its row already serves
the next request, and how much of a request's span counts as its tokens."""
import numpy as np

from vt.engine.token_buffer import TokenBuffer
from vt.engine.requests import Request, RequestPhase
from vt.engine.scheduler import StepTag

ROWS, SPAN, VOCAB = 2, 8, 4
SCRATCH = ROWS * SPAN        # where a non-final prefill chunk's token goes


def _running(index, row, max_new_tokens, t0, stop_tokens=()):
    """A request as the scheduler leaves it once admitted into `row`, its first token that
    of batch step t0 (None: its prompt is still being prefilled)."""
    req = Request(index, np.arange(1, 4, dtype=np.int32), max_new_tokens,
                  stop_tokens=tuple(stop_tokens))
    req.row, req.first_step = row, t0
    req.phase = RequestPhase.PREFILLING if t0 is None else RequestPhase.DECODING
    req.span_start = row * SPAN
    req.span_end = req.span_start + max_new_tokens
    return req


def _buffer(*live):
    buf = TokenBuffer(ROWS, SPAN, VOCAB, record_logits=True)
    buf.live.update(live)
    return buf


def _tag(t, dest, reqs=None, leaving=()):
    """A step's tag; with `reqs` (a step with stop tokens) each row's stop set from its request."""
    stops = None
    if reqs is not None:
        width = max(1, *(len(r.stop_tokens) for r in reqs))
        stops = np.full((len(reqs), width), -1, np.int32)
        for i, r in enumerate(reqs):
            stops[i, :len(r.stop_tokens)] = r.stop_tokens
    tag = StepTag(t, np.asarray(dest, np.int64), reqs, stops)
    tag.leaving = list(leaving)
    return tag


def _logits(tokens):
    """Per row, logits that name the row's token (so a row's logits can be told apart)."""
    return np.array([[tok + k / 10 for k in range(VOCAB)] for tok in tokens], np.float32)


def _store(buf, tag, tokens, now):
    tokens = np.asarray(tokens, np.int32)
    return buf.store(tag, tokens, _logits(tokens), now)


def test_tokens_land_in_each_requests_span_and_budgets_finish_with_length():
    a, b = _running(0, 0, 3, t0=0), _running(1, 1, 2, t0=0)
    called = []
    b.on_done.append(called.append)
    buf = _buffer(a, b)
    assert _store(buf, _tag(0, [a.span_start, b.span_start]), [5, 6], now=10.0) == []
    assert buf.available(a) == buf.available(b) == 1 and a.final is None
    _store(buf, _tag(1, [a.span_start + 1, b.span_start + 1], leaving=[b]), [7, 8], now=11.0)
    assert b.finish_reason == "length" and b.final.tolist() == [6, 8]
    assert b.done_event.is_set() and called == [b] and b not in buf.live
    np.testing.assert_array_equal(b.final_logits, _logits([6, 8]))
    assert b.token_times.tolist() == [10.0, 11.0]
    assert a.final is None and buf.available(a) == 2
    _store(buf, _tag(2, [a.span_start + 2], leaving=[a]), [9], now=12.0)
    assert a.finish_reason == "length" and a.final.tolist() == [5, 7, 9]
    assert a.token_times.tolist() == [10.0, 11.0, 12.0]
    assert buf.tokens_out == 5 and buf.finished == 2 and not buf.live


def test_a_stop_token_ends_its_request_with_it_and_later_rows_of_it_are_ignored():
    """The row that samples a stop token ends its request there (the stop token is its last
    token) and is returned, so the scheduler frees it; the step launched before the host saw
    it still has a row of that request, past its new end: that token is not the request's,
    even when it is a stop token again."""
    a, b = _running(0, 0, 6, t0=0, stop_tokens=(3,)), _running(1, 1, 6, t0=0)
    buf = _buffer(a, b)
    assert _store(buf, _tag(0, [a.span_start, b.span_start], reqs=[a, b]), [1, 3], now=0.0) == []
    stopped = _store(buf, _tag(1, [a.span_start + 1, b.span_start + 1], reqs=[a, b]), [3, 3], now=1.0)
    assert stopped == [a]      # b has no stop set: its 3 is a token like any other
    assert a.finish_reason == "stop" and a.final.tolist() == [1, 3]
    assert _store(buf, _tag(2, [a.span_start + 2, b.span_start + 2], reqs=[a, b]), [3, 2], now=2.0) == []
    assert a.final.tolist() == [1, 3] and b.final is None and buf.available(b) == 3


def test_a_stop_token_past_a_cancelled_requests_end_is_not_its_stop():
    """A cancel moves a running request's end to the steps launched so far; the step in
    flight still samples its row. A stop token there is past the end: the request is not
    "stop"ped (the loop finishes it "cancelled" once that step is collected)."""
    a = _running(0, 0, 6, t0=0, stop_tokens=(3,))
    buf = _buffer(a)
    _store(buf, _tag(0, [a.span_start], reqs=[a]), [1], now=0.0)
    a.span_end = a.span_start + 1                 # cancelled after step 0; step 1 is in flight
    assert _store(buf, _tag(1, [a.span_start + 1], reqs=[a]), [3], now=1.0) == []
    assert a.final is None and a.span_end == a.span_start + 1
    buf.finish(a, "cancelled")
    assert a.final.tolist() == [1] and a.finish_reason == "cancelled"


def test_an_error_row_ends_its_own_request_before_that_token():
    """The sampler's -1 (NaN or +inf logits, or all -inf) in a step whose tag names each
    row's request: that request ends "error" with the tokens before it and a message naming
    the token; the request beside it goes on."""
    a, b = _running(0, 0, 5, t0=0, stop_tokens=(9,)), _running(1, 1, 5, t0=0)
    buf = _buffer(a, b)
    _store(buf, _tag(0, [a.span_start, b.span_start], reqs=[a, b]), [1, 2], now=0.0)
    stopped = _store(buf, _tag(1, [a.span_start + 1, b.span_start + 1], reqs=[a, b]), [4, -1], now=1.0)
    assert stopped == [b] and b.finish_reason == "error" and b.final.tolist() == [2]
    assert "token 1" in b.error_message and "NaN" in b.error_message
    assert a.final is None and a.error_message is None and buf.available(a) == 2


def test_an_error_on_a_last_token_is_its_requests_even_when_its_row_serves_the_next_one():
    """At depth 2 the next request is admitted into a row (same span) before the previous
    request's last token is stored. A step without stop tokens names no requests, so the
    buffer finds the row's owner at that step: the previous request, never the next."""
    prev = _running(0, 0, 3, t0=0)
    buf = _buffer(prev)
    _store(buf, _tag(0, [0]), [5], now=0.0)
    _store(buf, _tag(1, [1]), [6], now=1.0)
    nxt = _running(1, 0, 4, t0=3)     # admitted by the plan of step 3, row 0 again
    buf.live.add(nxt)
    assert buf.available(nxt) == 0    # the span holds prev's tokens, none of them nxt's
    _store(buf, _tag(2, [2], leaving=[prev]), [-1], now=2.0)
    assert prev.finish_reason == "error" and prev.final.tolist() == [5, 6]
    assert "token 2" in prev.error_message
    assert nxt.final is None and nxt.error_message is None and nxt.span_end == nxt.span_start + 4
    _store(buf, _tag(3, [nxt.span_start]), [7], now=3.0)
    assert buf.available(nxt) == 1 and buf.tokens[nxt.span_start] == 7


def test_an_error_in_a_non_final_chunks_row_fails_nobody():
    """A prompt's non-final chunk samples into the scratch entry: not a token of anyone."""
    a = _running(0, 0, 3, t0=0)
    buf = _buffer(a)
    _store(buf, _tag(0, [a.span_start]), [5], now=0.0)
    assert _store(buf, _tag(1, [a.span_start + 1, SCRATCH]), [6, -1], now=1.0) == []
    assert a.final is None and a.error_message is None and buf.available(a) == 2


def test_a_request_not_yet_prefilled_has_no_tokens():
    a = _running(0, 0, 3, t0=None)
    buf = _buffer(a)
    _store(buf, _tag(0, [SCRATCH]), [5], now=0.0)
    assert buf.available(a) == 0


def test_a_request_finished_without_tokens_has_empty_logits_and_times():
    """Cancelled before its prompt ran, or failed at its first token: [0, vocab] logits and no
    token times, the shapes of every other result (not None)."""
    queued, failing = _running(0, 0, 3, t0=None), _running(1, 1, 3, t0=0)
    buf = _buffer(queued, failing)
    buf.finish(queued, "cancelled")
    _store(buf, _tag(0, [failing.span_start]), [-1], now=0.0)
    for req in (queued, failing):
        assert req.final.tolist() == [] and req.final_logits.shape == (0, VOCAB)
        assert req.token_times.shape == (0,)
    assert failing.finish_reason == "error"
