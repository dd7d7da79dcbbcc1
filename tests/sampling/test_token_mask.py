"""Grammar masks in the sampler (vt/sampling/token_mask.py): the numpy twin sets exactly the
disallowed logits of the flagged rows to -inf; the sampler then draws only allowed tokens from
them, leaves unflagged rows' tokens as they were, and the CUDA kernel compiles for sm_90 (and
equals the twin on a GPU)."""
import numpy as np
import pytest

from vt import SamplingParams
from vt.backend.nvrtc import nvrtc_options
from vt.sampling import token_mask
from vt.sampling.params import row_vectors
from vt.sampling.sampler import Sampler

from tests.bundled.test_cuda_compile import _assert_holds_kernels, _cubin

V = 300


def _bits(allowed_sets, R):
    """[R, ceil(V / 32)] int32 bitmasks of token sets, row r from allowed_sets[r] (None: zeros)."""
    bits = np.zeros((R, token_mask.mask_words(V)), np.uint32)
    for r, allowed in enumerate(allowed_sets):
        if allowed is not None:
            a = np.asarray(sorted(allowed), np.int64)
            np.bitwise_or.at(bits[r], a >> 5, np.uint32(1) << (a & 31).astype(np.uint32))
    return bits.view(np.int32)


def _case(seed=0):
    rng = np.random.default_rng(seed)
    S, R = 6, 9
    rows = np.array([4, 0, 7, 2, 8, 5], np.int32)
    sets = [None] * R
    sets[4] = {0, 31, 32, 299}
    sets[7] = set(rng.choice(V, 40, replace=False).tolist())
    sets[8] = {17}
    sets[2] = {3, 4}             # its flag stays 0: bits present but not applied
    on = np.zeros(R, np.int32)
    on[[4, 7, 8]] = 1
    x = (rng.standard_normal((S, V)) * 3).astype(np.float32)
    return x, rows, on, _bits(sets, R), sets


def test_the_twin_masks_exactly_the_disallowed_tokens_of_flagged_rows():
    x, rows, on, bits, sets = _case()
    got = x.copy()
    token_mask.apply_mask(got, rows, on, bits)
    for i, r in enumerate(rows):
        if on[r]:
            allowed = np.zeros(V, bool)
            allowed[sorted(sets[r])] = True
            np.testing.assert_array_equal(got[i][allowed], x[i][allowed])
            assert np.all(got[i][~allowed] == -np.inf)
        else:
            np.testing.assert_array_equal(got[i], x[i])


@pytest.mark.parametrize("temperature", [0.0, 5.0], ids=["greedy", "hot"])
def test_the_sampler_draws_only_allowed_tokens_and_leaves_other_rows_alone(temperature):
    x, rows, on, bits, sets = _case(1)
    S = len(rows)
    kn = row_vectors([SamplingParams(temperature, seed=3)] * S)
    pos = np.arange(S, dtype=np.int32) * 5
    extra = [kn["logprobs"], np.zeros(S, np.int32), np.zeros(S, np.float32), np.zeros(S, np.float32),
             np.ones(S, np.float32), np.zeros((9, V), np.uint16), np.zeros((9, 10), np.uint32),
             np.full((9, 4), -1, np.int32), np.zeros((9, 4), np.float32), np.zeros(9, np.int32),
             np.full((9, 4), -1, np.int32)]

    def sample(*mask):
        out, table = np.full(S, -7, np.int32), np.full(10, -7, np.int32)
        Sampler().run_numpy(x.copy(), rows, pos, kn["temperature"], kn["top_k"], kn["top_p"],
                            kn["min_p"], kn["seed"], out, table, *extra, *mask)
        return out

    plain, masked = sample(), sample(on, bits)
    for i, r in enumerate(rows):
        if on[r]:
            assert masked[i] in sets[r], (i, masked[i])
        else:
            assert masked[i] == plain[i]
    assert any(plain[i] not in sets[r] for i, r in enumerate(rows) if on[r])   # the mask mattered


def test_the_sampler_refuses_a_wrong_argument_count():
    x, rows, on, bits, _ = _case()
    kn = row_vectors([SamplingParams()] * len(rows))
    with pytest.raises(ValueError, match="3 arguments after logprobs"):
        Sampler().run_numpy(x, rows, rows, kn["temperature"], kn["top_k"], kn["top_p"], kn["min_p"],
                            kn["seed"], np.zeros(len(rows), np.int32), np.zeros(10, np.int32),
                            kn["logprobs"], on, bits, bits)


def test_a_grammar_without_the_protocol_is_refused_by_name():
    with pytest.raises(TypeError, match="SamplingParams.grammar must have fill_mask.*got str"):
        SamplingParams(grammar="{}")


def test_mask_kernel_compiles_for_sm90():
    _assert_holds_kernels(_cubin(token_mask.CODE, nvrtc_options({})), token_mask.CODE)
    assert token_mask.KERNELS == ("mask_logits",)


@pytest.mark.gpu
def test_mask_kernel_equals_the_twin_on_a_gpu():
    cp = pytest.importorskip("cupy", reason="no CuPy: the mask kernel needs it")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA GPU")
    except Exception as exc:  # noqa: BLE001 (no driver)
        pytest.skip(f"no CUDA GPU ({type(exc).__name__})")
    x, rows, on, bits, _ = _case(2)
    want = x.copy()
    token_mask.apply_mask(want, rows, on, bits)
    got = cp.asarray(x)
    token_mask.launch_mask(got, cp.asarray(rows), cp.asarray(on), cp.asarray(bits))
    np.testing.assert_array_equal(got.get(), want)
