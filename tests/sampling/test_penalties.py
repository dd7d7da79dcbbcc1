"""Penalties and logit bias (vt/sampling/penalties.py): the numpy twin equals the definitions
written here (OpenAI's presence/frequency, transformers' repetition, logit_bias, vLLM's order);
through the engine (sim, every safe mode), each request's tokens equal a reference sampler
written here from the definitions over the forward's own logits, requests without penalties
beside them unchanged; the CUDA kernels compile for sm_90."""
import numpy as np
import pytest

from engine_runs import kernel_engine
from vt import SamplingParams
from vt.backend.nvrtc import nvrtc_options
from vt.config import SAFE_MODES
from vt.sampling import penalties, reference

from tests.bundled.test_cuda_compile import _assert_holds_kernels, _cubin

VOCAB = 61


def _by_definition(x, prompt, output, sp: SamplingParams):
    """The logits a request samples from, by the definitions, in float64."""
    x = np.asarray(x, np.float64).copy()
    for t, b in sp.logit_bias:
        x[t] += b
    counts = np.bincount(np.asarray(output, np.int64), minlength=x.size)
    seen = (counts > 0) | np.isin(np.arange(x.size), prompt)
    r = sp.repetition_penalty
    x[seen] = np.where(x[seen] > 0, x[seen] / r, x[seen] * r)
    x -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0)
    return x


def test_the_twin_equals_the_definitions():
    rng = np.random.default_rng(0)
    S, V, R = 5, 300, 8
    sps = [SamplingParams(presence_penalty=0.7), SamplingParams(frequency_penalty=-1.1),
           SamplingParams(repetition_penalty=1.4), SamplingParams(logit_bias={3: 5.0, 299: -100.0}),
           SamplingParams(presence_penalty=0.3, frequency_penalty=0.9, repetition_penalty=0.8,
                          logit_bias={7: 2.5})]
    rows = np.array([2, 5, 0, 7, 3], np.int32)
    x = (rng.standard_normal((S, V)) * 3).astype(np.float32)
    x[0, 11] = -np.inf
    state = dict(counts=np.zeros((R, V), np.uint16), bits=np.zeros((R, -(-V // 32)), np.uint32),
                 ids=np.full((R, 1024), -1, np.int32), vals=np.zeros((R, 1024), np.float32),
                 min_left=np.zeros(R, np.int32), stops=np.full((R, 256), -1, np.int32))
    prompts, outputs = {}, {}
    for i, (r, sp) in enumerate(zip(rows, sps)):
        prompts[i] = rng.integers(0, V, 20)
        outputs[i] = rng.integers(0, V, 30)
        np.bitwise_or.at(state["bits"][r], prompts[i] >> 5, np.uint32(1) << (prompts[i] & 31).astype(np.uint32))
        np.add.at(state["counts"][r], outputs[i], 1)
        for j, (t, b) in enumerate(sp.logit_bias):
            state["ids"][r, j], state["vals"][r, j] = t, b
    got = x.copy()
    vec = {k: np.array([getattr(sp, k) for sp in sps], np.float32)
           for k in ("presence_penalty", "frequency_penalty", "repetition_penalty")}
    penalties.penalize(got, rows, np.ones(S, np.int32), vec["presence_penalty"], vec["frequency_penalty"],
                       vec["repetition_penalty"], *state.values())
    for i, sp in enumerate(sps):
        np.testing.assert_allclose(got[i], _by_definition(x[i], prompts[i], outputs[i], sp), rtol=1e-5, atol=1e-5)
    untouched = x.copy()
    penalties.penalize(untouched, rows, np.zeros(S, np.int32), *vec.values(), *state.values())
    np.testing.assert_array_equal(untouched, x)   # penalized 0: nothing changes


def test_counts_saturate_and_skip_error_rows_and_unpenalized_rows():
    counts = np.zeros((4, 10), np.uint16)
    counts[1, 3] = penalties.COUNT_MAX
    penalties.count(np.array([3, 3, -1, 5]), np.array([1, 2, 0, 3]), np.array([1, 0, 1, 1]), counts,
                    np.zeros(4, np.int32))
    assert counts[1, 3] == penalties.COUNT_MAX and counts[2].sum() == 0 and counts[0].sum() == 0
    assert counts[3, 5] == 1


def test_penalty_kernels_compile_for_sm90():
    _assert_holds_kernels(_cubin(penalties.CODE, nvrtc_options({})), penalties.CODE)
    assert set(penalties.KERNELS) == {"penalize", "count_tokens", "zero_u16"}


def _raw_logits(token, position):
    """The forward's logits for an input token at a position (the test's own copy)."""
    return (np.sin(token * 1.7 + position * 0.61 + np.arange(VOCAB) * 0.37) * 4).astype(np.float32)


class _Wavy:
    def run_numpy(self, table, rows, positions, logits):
        for i, (r, p) in enumerate(zip(rows, positions)):
            logits[i] = _raw_logits(int(table[r]), int(p))


def _engine(be, mode):
    return kernel_engine(be, _Wavy(), VOCAB, mode)


def _reference_tokens(prompt, n, sp: SamplingParams):
    out = []
    for j in range(n):
        pos = len(prompt) - 1 + j
        tok_in = prompt[-1] if j == 0 else out[-1]
        x = _by_definition(_raw_logits(tok_in, pos), prompt, out, sp).astype(np.float32)
        t = reference.sample_tokens(x[None], np.array([pos]), np.float32([sp.temperature]),
                                    np.int32([sp.top_k or 0]), np.float32([sp.top_p]),
                                    np.float32([sp.min_p]), np.uint64([sp.seed]))
        out.append(int(t[0]))
    return out


@pytest.mark.parametrize("mode", SAFE_MODES)
def test_engine_tokens_equal_a_reference_sampler_from_the_definitions(sim_backend, mode):
    asks = [SamplingParams(0.0, frequency_penalty=1.5),
            SamplingParams(0.0, presence_penalty=1.0, repetition_penalty=1.6),
            SamplingParams(0.9, seed=4, frequency_penalty=0.8, logit_bias={5: 3.0, 9: -100.0}),
            SamplingParams(0.0),                       # beside them, untouched
            SamplingParams(0.0, repetition_penalty=0.7, logit_bias={17: 1.5})]
    prompts = [[3, 9, 9], [12, 4], [7, 7, 7, 1], [3, 9, 9], [20]]
    with _engine(sim_backend, mode) as eng:
        results = eng.generate(prompts, max_new_tokens=10, sampling=asks)
    for p, sp, res in zip(prompts, asks, results):
        assert res.tokens == _reference_tokens(p, 10, sp), (mode, sp)
    assert results[0].tokens != results[3].tokens   # the penalty changed something
