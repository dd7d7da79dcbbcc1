"""min_tokens (vLLM's): until a request has min_tokens tokens its stop tokens cannot be sampled.
The numpy twins ban and count as vt/sampling/penalties.py says; through the engine (sim, every
safe mode) a forward whose EOS dominates gives exactly the tokens of a reference sampler written
here (stop tokens' logits -inf for the first min_tokens tokens), greedy and sampled, with
penalties, beside requests without it (which stop at once), and with a prompt prefilled in
chunks; what the engine refuses."""
import numpy as np
import pytest

from engine_runs import kernel_engine
from vt import SamplingParams
from vt.config import SAFE_MODES
from vt.engine.submit import check_speculative_sampling, make_requests
from vt.forward.user import KVGeometry
from vt.sampling import penalties, reference
from vt.sampling.params import MAX_MIN_TOKENS_STOPS, MIN_TOKENS, PENALIZE

from .test_penalties import _by_definition

VOCAB = 61
EOS, OTHER_STOP = 0, 1     # the forward's two most likely tokens, always


def _state(R, V):
    return dict(counts=np.zeros((R, V), np.uint16), bits=np.zeros((R, -(-V // 32)), np.uint32),
                ids=np.full((R, 1024), -1, np.int32), vals=np.zeros((R, 1024), np.float32),
                min_left=np.zeros(R, np.int32), stops=np.full((R, MAX_MIN_TOKENS_STOPS), -1, np.int32))


def _penalize(x, rows, stages, st, presence=None):
    S = len(rows)
    pres = np.zeros(S, np.float32) if presence is None else presence
    penalties.penalize(x, rows, np.asarray(stages, np.int32), pres, np.zeros(S, np.float32),
                       np.ones(S, np.float32), *st.values())


def test_the_twin_bans_stop_tokens_only_while_min_tokens_are_left():
    rng = np.random.default_rng(1)
    V, R = 300, 6
    st = _state(R, V)
    rows = np.array([4, 1, 2, 5], np.int32)
    for r, stops, left in ((4, [7, 299], 3), (1, [7], 0), (2, [5, 6, 7], 1), (5, [9], 2)):
        st["stops"][r, :len(stops)] = stops
        st["min_left"][r] = left
    x = (rng.standard_normal((4, V)) * 3).astype(np.float32)
    got = x.copy()
    _penalize(got, rows, [MIN_TOKENS, MIN_TOKENS, MIN_TOKENS, 0], st)
    want = x.copy()
    want[0, [7, 299]] = -np.inf       # min_left 3
    want[2, [5, 6, 7]] = -np.inf      # min_left 1; row 1 has none left, row 3 does not ask
    np.testing.assert_array_equal(got, want)
    # with penalties: they apply, then the ban (a stop token's -inf survives them)
    st["counts"][4, [7, 8]] = 2
    got = x.copy()
    _penalize(got, rows[:1], [PENALIZE | MIN_TOKENS], st, presence=np.float32([0.5]))
    want = x[:1].copy()
    want[0, 8] -= np.float32(0.5)
    want[0, [7, 299]] = -np.inf
    np.testing.assert_array_equal(got[:1], want)


def test_count_brings_min_left_to_zero_and_no_further():
    counts, left = np.zeros((4, 10), np.uint16), np.array([2, 1, 0, 5], np.int32)
    toks, rows = np.array([3, 3, 3, -1]), np.array([0, 1, 2, 3])
    penalties.count(toks, rows, np.array([MIN_TOKENS, MIN_TOKENS, MIN_TOKENS, MIN_TOKENS]), counts, left)
    assert left.tolist() == [1, 0, 0, 5]          # an error row (-1) counts nothing
    assert counts.sum() == 0                      # MIN_TOKENS alone counts no token
    penalties.count(toks, rows, np.array([PENALIZE, 0, PENALIZE | MIN_TOKENS, 0]), counts, left)
    assert left.tolist() == [1, 0, 0, 5] and counts[0, 3] == 1 and counts[2, 3] == 1


def _raw_logits(token, position):
    """The forward's logits: EOS far above everything, OTHER_STOP next, the rest wavy."""
    x = (np.sin(token * 1.3 + position * 0.77 + np.arange(VOCAB) * 0.41) * 3).astype(np.float32)
    x[EOS], x[OTHER_STOP] = 9.0, 8.0
    return x


class _EosFirst:
    def run_numpy(self, table, rows, positions, logits):
        for i, (r, p) in enumerate(zip(rows, positions)):
            logits[i] = _raw_logits(int(table[r]), int(p))


def _reference_tokens(prompt, n, sp: SamplingParams, stops):
    """The request's tokens by the definition: penalties, then its stop tokens at -inf while it
    has fewer than min_tokens; it ends at a stop token or after n."""
    out = []
    for j in range(n):
        pos = len(prompt) - 1 + j
        tok_in = prompt[-1] if j == 0 else out[-1]
        x = _by_definition(_raw_logits(tok_in, pos), prompt, out, sp).astype(np.float32)
        if j < sp.min_tokens:
            x[list(stops)] = -np.inf
        t = int(reference.sample_tokens(x[None], np.array([pos]), np.float32([sp.temperature]),
                                        np.int32([sp.top_k or 0]), np.float32([sp.top_p]),
                                        np.float32([sp.min_p]), np.uint64([sp.seed]))[0])
        out.append(t)
        if t in stops:
            break
    return out


@pytest.mark.parametrize("mode", SAFE_MODES)
def test_engine_tokens_equal_the_definition_in_every_mode(sim_backend, mode):
    stops = (EOS, OTHER_STOP)
    asks = [SamplingParams(0.0, min_tokens=5),
            SamplingParams(0.0),                                   # beside them: stops at once
            SamplingParams(1.0, seed=7, min_tokens=7),
            SamplingParams(0.0, min_tokens=4, frequency_penalty=1.5, logit_bias={9: 2.0}),
            SamplingParams(0.0, min_tokens=12)]                    # = max_new_tokens: no stop
    prompts = [[3, 9, 9], [3, 9, 9], [7, 7, 7, 1], [20], [5, 6]]
    with kernel_engine(sim_backend, _EosFirst(), VOCAB, mode) as eng:
        results = eng.generate(prompts, max_new_tokens=12, stop_token=list(stops), sampling=asks)
    for p, sp, res in zip(prompts, asks, results):
        want = _reference_tokens(p, 12, sp, stops)
        assert res.tokens == want, (mode, sp)
        assert res.finish_reason == ("stop" if want[-1] in stops else "length")
        assert not set(res.tokens[:sp.min_tokens]) & set(stops)
    assert results[1].tokens == [EOS]                        # without min_tokens: at once
    assert len(results[0].tokens) == 6 and results[0].tokens[-1] == EOS
    assert len(results[4].tokens) == 12 and results[4].finish_reason == "length"


def test_only_the_requests_stop_tokens_are_banned(sim_backend):
    """stop_token [EOS] alone: OTHER_STOP, the next most likely, fills the first min_tokens."""
    with kernel_engine(sim_backend, _EosFirst(), VOCAB, "ring") as eng:
        (res,) = eng.generate([[4, 2]], max_new_tokens=8, stop_token=EOS,
                              sampling=SamplingParams(0.0, min_tokens=3))
    assert res.tokens == [OTHER_STOP] * 3 + [EOS]


def test_a_prompt_prefilled_in_chunks_still_gets_its_min_tokens(sim_backend):
    """Each chunk samples (a token never returned) and counts it; the last chunk sets the
    count again, so the request still bans its stop tokens for min_tokens tokens."""
    prompt = [int(t) for t in np.arange(2, 13)]                  # 11 tokens, chunks of 4
    sp = SamplingParams(0.0, min_tokens=3)
    with kernel_engine(sim_backend, _EosFirst(), VOCAB, "ring", max_prefill_tokens=4) as eng:
        (res,) = eng.generate([prompt], max_new_tokens=8, stop_token=[EOS, OTHER_STOP], sampling=sp)
    assert res.tokens == _reference_tokens(prompt, 8, sp, (EOS, OTHER_STOP))
    assert len(res.tokens) == 4


def test_the_engine_refuses_min_tokens_it_cannot_honour(sim_backend):
    with pytest.raises(ValueError, match=r"SamplingParams.min_tokens=-1 must be >= 0"):
        SamplingParams(min_tokens=-1)
    with pytest.raises(TypeError, match=r"SamplingParams.min_tokens must be an int"):
        SamplingParams(min_tokens=2.0)
    with kernel_engine(sim_backend, _EosFirst(), VOCAB, "ring") as eng:
        with pytest.raises(ValueError, match=r"prompt 0: min_tokens=5 exceeds max_new_tokens=4"):
            eng.generate([[3]], max_new_tokens=4, stop_token=EOS, sampling=SamplingParams(min_tokens=5))
        # min_tokens equal to max_new_tokens is fine
        assert len(eng.generate([[3]], max_new_tokens=4, stop_token=EOS,
                                sampling=SamplingParams(min_tokens=4))[0].tokens) == 4
    geo = KVGeometry(max_seqs=2, num_kv_blocks=8, block_size=4, max_context=16)
    many = list(range(MAX_MIN_TOKENS_STOPS + 1))     # more stop tokens than a row's ban list holds
    with pytest.raises(ValueError, match=rf"prompt 0: min_tokens=2 with {len(many)} stop tokens; "
                                         rf"at most {MAX_MIN_TOKENS_STOPS} can be banned"):
        make_requests([[3]], 4, many, SamplingParams(min_tokens=2), geo, 1000, 8)
    assert make_requests([[3]], 4, many, SamplingParams(), geo, 1000, 8)[0].stop_tokens == tuple(many)


def test_speculative_decoding_refuses_min_tokens_by_name():
    with pytest.raises(ValueError, match=r"prompt 2: min_tokens=3 with speculative decoding"):
        check_speculative_sampling(2, SamplingParams(min_tokens=3))
