"""Logprobs through the engine (sim): every token of a request that asks has its logprob and
top tokens, equal to log_softmax(logits / temperature) of the logits the engine recorded for
that token, computed here; a request beside it that does not ask gets None. In every safe mode
(graph steps, the ring, eager and mixed steps alike)."""
import numpy as np
import pytest

from engine_runs import kernel_engine
from vt import SamplingParams
from vt.config import SAFE_MODES

VOCAB = 97


class _Wavy:
    """Logits that depend on the input token and its position: every step a fresh distribution."""

    def run_numpy(self, table, rows, positions, logits):
        tok = table[rows].astype(np.float64)[:, None]
        pos = positions.astype(np.float64)[:, None]
        logits[...] = (np.sin(tok * 1.7 + pos * 0.61 + np.arange(logits.shape[1]) * 0.37) * 4).astype(np.float32)


def _engine(be, mode):
    return kernel_engine(be, _Wavy(), VOCAB, mode, record_logits=True)


def _log_softmax(x, t):
    z = x.astype(np.float64) / (t if t > 0 else 1.0)
    z -= z.max()
    return z - np.log(np.exp(z).sum())


@pytest.mark.parametrize("mode", SAFE_MODES)
def test_each_token_carries_the_logprobs_of_its_own_logits(sim_backend, mode):
    asks = [SamplingParams(0.8, seed=5, logprobs=4), SamplingParams(0.0, logprobs=0),
            SamplingParams(1.3, top_k=7, seed=9, logprobs=20)]
    with _engine(sim_backend, mode) as eng:
        handles = [eng.submit([3 + i, 9], max_new_tokens=7, sampling=s) for i, s in enumerate(asks)]
        plain = eng.submit([40], max_new_tokens=5, sampling=SamplingParams(0.9, seed=1))
        results = [h.result(timeout=60) for h in handles]
        assert plain.result(timeout=60).tokens and plain.logprobs(0) is None
        for h, s, res in zip(handles, asks, results):
            assert len(res.tokens) == 7
            for i, tok in enumerate(res.tokens):
                want = _log_softmax(res.logits[i], s.temperature)
                got, top = h.logprobs(i)
                assert abs(got - want[tok]) < 1e-4, (mode, i)
                order = np.lexsort((np.arange(VOCAB), -res.logits[i]))[:s.logprobs]
                assert [t for t, _ in top] == order.tolist()
                np.testing.assert_allclose([v for _, v in top], want[order], atol=1e-4)
