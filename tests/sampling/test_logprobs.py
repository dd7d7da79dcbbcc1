"""Token records (vt/sampling/logprobs.py): the sampler's logprobs equal log_softmax(logits /
temperature) computed here in float64, the top tokens are the true most likely ones, rows that
do not ask get nothing past their token, and the CUDA kernel compiles for sm_90."""
import numpy as np
import pytest

from vt.backend.nvrtc import nvrtc_options
from vt.sampling import logprobs as lp
from vt.sampling import reference
from vt.sampling.params import MAX_LOGPROBS, NO_LOGPROBS
from vt.sampling.sampler import Sampler

from tests.bundled.test_cuda_compile import _assert_holds_kernels, _cubin
from ._cases import MODES, knobs, random_logits


def _log_softmax(x: np.ndarray, t: float) -> np.ndarray:
    z = x.astype(np.float64) / (t if t > 0 else 1.0)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def _sample_records(x, modes, counts):
    S = x.shape[0]
    kn = knobs(modes)
    pos = np.arange(S, dtype=np.int32) * 5 + 1
    rec = np.full((S, lp.RECORD_WORDS), -999, np.int32)   # poison: what is not written stays
    table = np.zeros(S + 1, np.int32)
    Sampler().run_numpy(x, np.arange(S, dtype=np.int32), pos, kn["temperature"], kn["top_k"],
                        kn["top_p"], kn["min_p"], kn["seed"], rec, table, np.array(counts, np.int32))
    return rec, reference.sample_tokens(x, pos, **kn), kn


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_records_hold_the_sampled_tokens_logprob_and_the_true_top_n(ties):
    rng = np.random.default_rng(7 + ties)
    modes = list(MODES)
    S, V = len(modes), 3000
    x = random_logits(rng, S, V, ties)
    counts = [MAX_LOGPROBS, 0, 5, 1, 20, 3, 7][:S]
    rec, want_tokens, kn = _sample_records(x, modes, counts)
    np.testing.assert_array_equal(rec[:, 0], want_tokens)
    for r in range(S):
        want = _log_softmax(x[r], float(kn["temperature"][r]))
        got, top = lp.read_record(rec[r], counts[r])
        assert abs(got - want[want_tokens[r]]) < 1e-4, (modes[r], got, want[want_tokens[r]])
        order = np.lexsort((np.arange(V), -x[r]))[:counts[r]]     # logit desc, id asc
        assert [i for i, _ in top] == order.tolist(), modes[r]
        np.testing.assert_allclose([v for _, v in top], want[order], atol=1e-4)
        assert (rec[r, lp.TOP_IDS][counts[r]:] == -999).all()  # only the n asked are written


def test_rows_that_do_not_ask_get_only_their_token_and_the_unasked_mark():
    rng = np.random.default_rng(3)
    x = random_logits(rng, 3, 500)
    rec, want_tokens, _ = _sample_records(x, ["temperature", "greedy", "top_p"], [NO_LOGPROBS, 2, NO_LOGPROBS])
    np.testing.assert_array_equal(rec[:, 0], want_tokens)
    assert (rec[[0, 2], 1] == lp.UNASKED).all() and (rec[[0, 2], 2:] == -999).all()
    assert (rec[1, 1:4] != -999).all() and rec[1, 1] != lp.UNASKED


def test_an_error_row_gets_no_logprobs():
    x = np.zeros((1, 64), np.float32)
    x[0, 3] = np.nan
    rec, want_tokens, _ = _sample_records(x, ["temperature"], [4])
    assert rec[0, 0] == -1 and rec[0, 1] == lp.UNASKED and (rec[0, 2:] == -999).all()


def test_a_records_call_without_the_counts_is_refused():
    x = np.zeros((2, 8), np.float32)
    z = np.zeros(2, np.int32)
    with pytest.raises(ValueError, match=r"records \[S, 42\] with the rows' logprobs counts"):
        Sampler().run_numpy(x, z, z, np.zeros(2, np.float32), z, np.ones(2, np.float32),
                            np.zeros(2, np.float32), np.zeros(2, np.uint64),
                            np.zeros((2, lp.RECORD_WORDS), np.int32), np.zeros(3, np.int32))


def test_records_kernel_compiles_for_sm90():
    _assert_holds_kernels(_cubin(lp.CODE, nvrtc_options({})), lp.CODE)
    assert "token_records" in lp.KERNELS
