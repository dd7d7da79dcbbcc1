"""The speculative step's kernels against hand-worked cases (numpy twins; the CUDA source is
the same algorithm, run by the GPU tests)."""
import numpy as np

from vt.forward.spec_kernels import ACCEPT, COUNT, NGRAM, TOKENS
from vt.sampling.logprobs import RECORD_WORDS


def test_ngram_drafts_follow_the_latest_earlier_match_of_the_longest_tail():
    """History 5 6 7 9 5 6 7 8 1 5 6 7: the tail 5 6 7 last occurred at 4..6, followed by
    8 1 5; a draft past the last token repeats it."""
    hist = np.zeros((2, 16), np.int32)
    hist[0, :12] = [5, 6, 7, 9, 5, 6, 7, 8, 1, 5, 6, 7]
    pos = np.array([11, 0], np.int32)
    drafts = np.full((1, 3), -9, np.int32)
    NGRAM.run_numpy(np.array([0], np.int32), pos, hist, drafts, n_min=1, n_max=3)
    assert drafts.tolist() == [[8, 1, 5]]
    drafts5 = np.full((1, 5), -9, np.int32)
    NGRAM.run_numpy(np.array([0], np.int32), pos, hist, drafts5, n_min=1, n_max=3)
    assert drafts5.tolist() == [[8, 1, 5, 6, 7]]
    hist[0, 12] = 4            # a token never seen before: no match, the last token again
    pos[0] = 12
    NGRAM.run_numpy(np.array([0], np.int32), pos, hist, drafts, n_min=1, n_max=3)
    assert drafts.tolist() == [[4, 4, 4]]


def test_accept_keeps_drafts_up_to_the_first_mismatch_and_emits_the_targets_token():
    """Row 0: drafts 3 4 9, target 3 4 5 6 -> emits 3 4 5; row 1: all right -> 3 drafts and
    the bonus; row 2 (padding, its record unread) leaves every row's state alone."""
    k, V = 3, 10
    target = [[3, 4, 5, 6], [1, 2, 3, 7], [0, 0, 0, 0]]
    logits = np.zeros((3 * (k + 1), V), np.float32)
    for r, toks in enumerate(target):
        for j, t in enumerate(toks):
            logits[r * (k + 1) + j, t] = 1.0
    drafts = np.array([[3, 4, 9], [1, 2, 3], [0, 0, 0]], np.int32)
    rows = np.array([0, 1, 4], np.int32)          # row 4: the pad row
    pos = np.array([2, 5, 0, 0, 0], np.int32)
    hist = np.zeros((5, 16), np.int32)
    table = np.zeros(32, np.int32)
    records = np.zeros((3, RECORD_WORDS), np.int32)
    out = np.zeros((3, V), np.float32)
    targets = np.array(target, np.int32).ravel()   # the sampler's token at each position
    ACCEPT.run_numpy(targets, logits, drafts, rows, pos, hist, table, records, out, k=k, pad_row=4)
    assert records[:2, COUNT].tolist() == [3, 4]
    assert records[0, TOKENS:TOKENS + 3].tolist() == [3, 4, 5]
    assert records[1, TOKENS:TOKENS + 4].tolist() == [1, 2, 3, 7]
    assert pos.tolist() == [5, 9, 0, 0, 0]
    assert hist[0, 3:6].tolist() == [3, 4, 5] and hist[1, 6:10].tolist() == [1, 2, 3, 7]
    assert table[:2].tolist() == [5, 7] and not hist[4].any()
    np.testing.assert_array_equal(out, logits[::k + 1])


def test_the_cuda_kernels_compile_for_sm90():
    """NVRTC builds the speculative step's CUDA source with the options CuPy is given."""
    from vt.backend.nvrtc import nvrtc_options
    from vt.forward import spec_kernels

    from tests.bundled.test_cuda_compile import _assert_holds_kernels, _cubin
    _assert_holds_kernels(_cubin(spec_kernels.CODE, nvrtc_options({})), spec_kernels.CODE)


def test_bad_speculative_configs_and_targets_are_refused_by_name(sim_backend):
    import pytest

    from vt.forward.speculative import SpeculativeConfig, SpeculativeModel
    from vt.forward.toy import ToyForward
    from ._causal import CausalToy
    with pytest.raises(ValueError, match="method must be one of ngram, oracle, draft, got 'eagle'"):
        SpeculativeConfig("eagle")
    with pytest.raises(ValueError, match="k"):
        SpeculativeConfig("ngram", k=0)
    with pytest.raises(ValueError, match="accept must be a fraction in \\[0, 1\\], got 1.5"):
        SpeculativeConfig("oracle", accept=1.5, references={})
    with pytest.raises(ValueError, match="'oracle' needs references"):
        SpeculativeConfig("oracle")
    with pytest.raises(ValueError, match="does not declare verifies_by_decode"):
        SpeculativeModel(sim_backend, ToyForward(sim_backend).step_model(), SpeculativeConfig("ngram"))
    small = CausalToy(sim_backend, max_k=1).step_model()
    with pytest.raises(ValueError, match="token table has 25 entries; k=4 .* need 49"):
        SpeculativeModel(sim_backend, small, SpeculativeConfig("ngram", k=4))
