"""A collected step's token records ([n, RECORD_WORDS]: the token, then the logprobs a row asks
for) are copied out of the pinned buffer only while something reads them: a live request that
asks for logprobs, or speculation. The token buffer tells the runner when that starts and
stops (TokenBuffer's records_read, Runner.set_copy_records); a request that asks still gets
the logprobs of every one of its tokens, its first (a prefill step's) included."""
import numpy as np
import pytest

from engine_runs import kernel_engine
from vt import SamplingParams
from vt.engine.requests import Request
from vt.engine.token_buffer import TokenBuffer

VOCAB = 97


def _asking(index, logprobs):
    return Request(index, np.arange(1, 4, dtype=np.int32), 4,
                   sampling=SamplingParams(0.0, logprobs=logprobs))


def test_the_buffer_says_when_records_start_and_stop_being_read():
    """Off from the start; on when the first request that asks is admitted, off once the last
    one finishes; requests that do not ask change nothing."""
    told = []
    buf = TokenBuffer(2, 8, VOCAB, record_logits=False, records_read=told.append)
    plain, first, second = _asking(0, None), _asking(1, 3), _asking(2, 0)
    buf.admit([plain])
    assert told == [False]
    buf.admit([first, second])
    assert told == [False, True]
    buf.finish(first, "length")
    buf.finish(plain, "length")
    assert told == [False, True]
    buf.finish(second, "cancelled")
    assert told == [False, True, False]


def test_speculation_reads_every_steps_records():
    """A verify step's tokens are in its records: on from the start, never turned off."""
    told = []
    buf = TokenBuffer(2, 8, VOCAB, record_logits=False, speculative=2, records_read=told.append)
    req = _asking(0, None)
    buf.admit([req])
    buf.finish(req, "length")
    assert told == [True]


class _Wavy:
    """Logits that depend on the input token and its position: a fresh distribution a step."""

    def run_numpy(self, table, rows, positions, logits):
        tok = table[rows].astype(np.float64)[:, None]
        pos = positions.astype(np.float64)[:, None]
        logits[...] = (np.sin(tok * 1.3 + pos * 0.7 + np.arange(logits.shape[1]) * 0.41) * 4
                       ).astype(np.float32)


def _spy_collects(eng) -> list:
    """Every step handle the engine's runner collects from now on, in order."""
    seen, collect = [], eng.runner.collect

    def spy(handle):
        tokens = collect(handle)
        seen.append(handle)
        return tokens
    eng.runner.collect = spy
    return seen


def _log_softmax(x, t):
    z = x.astype(np.float64) / (t if t > 0 else 1.0)
    z -= z.max()
    return z - np.log(np.exp(z).sum())


@pytest.mark.parametrize("mode", ["ring", "drain", "sync"])
def test_records_are_copied_only_while_a_live_request_asks_for_logprobs(sim_backend, mode):
    with kernel_engine(sim_backend, _Wavy(), VOCAB, mode, record_logits=True) as eng:
        collected = _spy_collects(eng)
        eng.generate([[5, 6], [7]], max_new_tokens=6)
        assert collected and all(h.records is None for h in collected)

        collected.clear()
        plain = eng.submit([11, 3], max_new_tokens=12)
        tokens = plain.stream(timeout=60)
        next(tokens), next(tokens)      # the request that asks joins a running batch
        ask = SamplingParams(0.7, seed=4, logprobs=3)
        asking = eng.submit([8, 2, 9], max_new_tokens=5, sampling=ask)
        res = asking.result(timeout=60)
        plain.result(timeout=60)
        assert plain.logprobs(0) is None
        for i, tok in enumerate(res.tokens):
            want = _log_softmax(res.logits[i], ask.temperature)
            got, top = asking.logprobs(i)
            assert abs(got - want[tok]) < 1e-4, (mode, i)
            assert [t for t, _ in top] == np.argsort(-res.logits[i], kind="stable")[:3].tolist()
        assert any(h.records is not None for h in collected)
        assert collected[0].records is None   # steps before it joined copied none

        collected.clear()
        eng.generate([[4, 4, 4]], max_new_tokens=6)
        assert collected and all(h.records is None for h in collected)
