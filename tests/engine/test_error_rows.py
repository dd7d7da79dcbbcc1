"""A request whose logits turn NaN (or +inf, or all -inf) finishes with finish_reason "error"
and the tokens before it; the requests beside it are served as if it were not there, in
every mode, with and without stop tokens (the sampler marks such a row -1:
vt/sampling/sampler.py)."""
import numpy as np
import pytest

from vt import Engine, ExecutorConfig, ForwardModel, KVGeometry
from vt.config import SAFE_MODES

VOCAB = 32
BAD = {5: np.nan, 20: np.inf}   # the input token whose logits go bad -> the bad value


class _CountUp:
    """logits[r] = one-hot at (token + 1) % V, except after a token of BAD: that value."""

    def run_numpy(self, table, rows, logits):
        tok = table[rows]
        logits[...] = 0
        logits[np.arange(len(rows)), (tok + 1) % logits.shape[1]] = 1
        for t, v in BAD.items():
            logits[tok == t] = v
        logits[tok == 27] = -np.inf          # all -inf: nothing to sample

    def run_cupy(self, stream_handle, table, rows, logits):
        import cupy as cp   # elementwise only: a boolean-mask assignment would sync (no capture)
        tok = table[rows][:, None]
        onehot = cp.arange(logits.shape[1])[None, :] == (tok + 1) % logits.shape[1]
        out = cp.where(onehot, cp.float32(1), cp.float32(0))
        for t, v in BAD.items():
            out = cp.where(tok == t, cp.float32(v), out)
        logits[...] = cp.where(tok == 27, cp.float32(-cp.inf), out)


def _engine(be, mode, record_logits=False):
    geo = KVGeometry(max_seqs=8, num_kv_blocks=64, block_size=4, max_context=64)
    table = be.empty((geo.max_seqs + 1,), np.int32)
    kernel = _CountUp()

    def forward(stream, inputs, logits_out):
        be.launch(stream, kernel, table, inputs.token_rows, logits_out)

    model = ForwardModel(be, forward, vocab=VOCAB, token_table=table, geometry=geo)
    return Engine(be, model, ExecutorConfig(mode=mode, serving_conc=4, capture_sizes=(1, 2, 4)),
                  record_logits=record_logits)


@pytest.mark.parametrize("stop", [None, 31])
@pytest.mark.parametrize("mode", SAFE_MODES)
def test_a_bad_row_ends_its_request_alone(backend, mode, stop):
    with _engine(backend, mode) as eng:
        res = eng.generate([[3], [10], [17], [24], [8]], max_new_tokens=6, stop_token=stop)
    assert [r.finish_reason for r in res] == ["error", "length", "error", "error", "length"]
    assert res[0].tokens == [4, 5] and "NaN" in res[0].error     # 5's logits are NaN
    assert res[1].tokens == [11, 12, 13, 14, 15, 16] and res[1].error is None
    assert res[2].tokens == [18, 19, 20]                          # 20's are +inf
    assert res[3].tokens == [25, 26, 27]                          # 27's are all -inf
    assert res[4].tokens == [9, 10, 11, 12, 13, 14]


def test_the_engine_serves_on_after_an_error_row(sim_backend):
    with _engine(sim_backend, "ring") as eng:
        assert eng.generate([[4]], max_new_tokens=3)[0].finish_reason == "error"
        again = eng.generate([[10], [11]], max_new_tokens=4)
        assert [r.tokens for r in again] == [[11, 12, 13, 14], [12, 13, 14, 15]]
        assert eng.stats()["driver_mallocs_since_warm_up"] == 0


def test_a_request_without_tokens_records_logits_and_times_of_its_shape(sim_backend):
    """record_logits: a request whose first token fails has logits [0, vocab] and token_times
    [0], as every result has [len(tokens), vocab] and [len(tokens)]."""
    with _engine(sim_backend, "ring", record_logits=True) as eng:
        bad, other = eng.generate([[5], [3]], max_new_tokens=3)
    assert (bad.finish_reason, bad.tokens) == ("error", [])
    assert bad.logits.shape == (0, VOCAB) and bad.logits.dtype == np.float32
    assert bad.token_times.shape == (0,)
    assert other.tokens == [4, 5] and other.logits.shape == (2, VOCAB)
    assert other.token_times.shape == (2,)
