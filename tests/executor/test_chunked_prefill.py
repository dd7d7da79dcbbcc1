"""Chunked prefill on the bundled model (HybridStepModel, chunked_prefill = True).

An engine whose max_prefill_tokens splits prompts into several chunks serves exactly the
tokens (and logits bytes) of one whose budget takes every prompt whole, in sync, drain and
ring; and one step-level schedule of chunks (first and continuing chunks mixed in a launch)
leaves the KV cache, the GDN states and the last-token logits bit-equal to whole prompts.
Bit-equality is the expected result, not a tolerance: the sim's kernels are row- and
batch-invariant (a token's values do not depend on the segment or step it runs in, and the
GDN state crosses a chunk boundary as the same fp32 values), and the GPU variant runs the
model with batch_invariant=True for the same reason.
"""
import numpy as np
import pytest

from vt.backend import get_backend
from vt.engine import Engine
from vt.forward.hybrid import HybridStepModel
from vt.config import ExecutorConfig
from vt.bundled import PRESETS, HybridModel
from vt.step import GREEDY, PrefillSeq, SamplingParams

from engine_runs import mismatches, preset_weights

PRESET_IDS = ["tiny-dense", "tiny-moe"]
BUDGET = 7    # prompt tokens per step: every prompt longer than that comes in chunks


def _requests(preset, seed=3):
    """Prompts of 1..40 tokens, greedy and seeded sampling, 2..6 new tokens each."""
    rng = np.random.default_rng(seed)
    vocab = PRESETS[preset].vocab
    lens = [23, 1, 40, 7, 15, 2, 31, 9, 18, 5]
    samplings = [GREEDY if i % 2 else SamplingParams(temperature=0.8, top_k=20, seed=100 + i)
                 for i in range(len(lens))]
    return ([rng.integers(0, vocab, n).tolist() for n in lens],
            [int(b) for b in rng.integers(2, 7, len(lens))], samplings)


def _serve(be, preset, mode, max_prefill_tokens, batch_invariant=None):
    """generate() on a fresh model; returns the results and, per prefill step, each
    sequence's (start, end) of the prompt."""
    prompts, budgets, samplings = _requests(preset)
    model = HybridModel(be, PRESETS[preset], preset_weights(preset), max_seqs=8, num_kv_blocks=256,
                        batch_invariant=batch_invariant)
    step = HybridStepModel(be, model)
    calls, real = [], step.prepare_prefill   # what the runner calls for every prefill

    def recording(seqs):
        calls.append([(s.start, len(s.tokens)) for s in seqs])
        return real(seqs)
    step.prepare_prefill = recording
    config = ExecutorConfig(mode=mode, serving_conc=6, capture_sizes=(1, 2, 4, 8))
    try:
        with Engine(be, step, config, record_logits=True,
                    max_prefill_tokens=max_prefill_tokens) as eng:
            results = eng.generate(prompts, max_new_tokens=budgets, sampling=samplings)
    finally:
        model.close()
    assert [len(r.tokens) for r in results] == budgets
    return results, calls


def _check_chunked_equals_whole(be, preset, mode, batch_invariant=None):
    whole, whole_calls = _serve(be, preset, mode, None, batch_invariant)
    chunked, calls = _serve(be, preset, mode, BUDGET, batch_invariant)
    assert all(start == 0 for call in whole_calls for start, _ in call)
    assert max(sum(end - start for start, end in call) for call in calls) <= BUDGET
    # Some step mixes a first chunk with a continuing one (the GDN kernel's per-segment start).
    assert any({start > 0 for start, _ in call} == {True, False} for call in calls)
    assert mismatches(whole, chunked) == 0


@pytest.mark.parametrize("preset", PRESET_IDS)
@pytest.mark.parametrize("mode", ["sync", "drain", "ring"])
def test_chunked_prefill_serves_the_tokens_of_whole_prompts(sim_backend, preset, mode):
    """max_prefill_tokens=7 (prompts of up to 40 tokens in chunks) == a budget that takes
    every prompt whole: tokens and logits bytes, greedy and seeded."""
    _check_chunked_equals_whole(sim_backend, preset, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", PRESET_IDS)
@pytest.mark.parametrize("mode", ["sync", "drain", "ring"])
def test_chunked_prefill_serves_the_tokens_of_whole_prompts_on_cuda(preset, mode):
    """The same on cuda, with batch_invariant=True: the default cuda model's GEMMs and
    attention splits change with the token count, so only the invariant one must match."""
    be = get_backend("cuda")
    try:
        _check_chunked_equals_whole(be, preset, mode, batch_invariant=True)
    finally:
        be.close()


# -- one step model, chunk by chunk ------------------------------------------------------
LENS = (13, 5, 20)
ROWS, STATES = (2, 0, 3), (1, 3, 0)     # rows and state slots differ: a mix-up shows
# Per prefill call: (sequence, start, end). The second and third mix first and continuing chunks.
SCHEDULE = [[(0, 0, 4), (2, 0, 7)], [(0, 4, 9), (1, 0, 5), (2, 7, 8)], [(0, 9, 13), (2, 8, 20)]]


def _host(be, stream, d):
    h = be.pinned_empty(d.shape, d.dtype)
    be.copy_d2h(h, d, stream)
    stream.synchronize()
    return np.array(h)


class _Prefiller:
    """A HybridStepModel with 3 sequences in shuffled rows, state slots and KV blocks."""

    def __init__(self, be, preset):
        self.be, self.s = be, be.stream(name="test")
        self.m = HybridModel(be, PRESETS[preset], preset_weights(preset), max_seqs=4, num_kv_blocks=64)
        self.step = HybridStepModel(be, self.m)
        g = self.step.geometry
        self.bt = np.full((3, g.max_blocks), g.scratch_block, np.int32)
        self.bt[:, :3] = np.random.default_rng(0).permutation(self.m.num_kv_blocks)[:9].reshape(3, 3)

    def prefill(self, prompts, calls):
        """Each call [(i, start, end)]: the chunk [start, end) of prompts[i]. Returns the
        last-token logits of every sequence whose prompt ends in a call."""
        last = {}
        for call in calls:
            seqs = [PrefillSeq(ROWS[i], np.asarray(prompts[i][:end], np.int32), self.bt[i],
                               STATES[i], start=start) for i, start, end in call]
            logits = self.be.empty((len(seqs), self.m.cfg.vocab), np.float32)
            self.step.prefill(self.s, seqs, logits)
            host = _host(self.be, self.s, logits)
            last.update({i: host[j] for j, (i, _, end) in enumerate(call) if end == len(prompts[i])})
        return last

    def snapshot(self):
        """Each sequence's GDN states and the K/V of its prompt's positions, by layer."""
        bs, out = self.m.cfg.kv_block_size, []
        for i, n in enumerate(LENS):
            out += [_host(self.be, self.s, self.m.states[L])[STATES[i]] for L in self.m.cfg.gdn_layers]
            slots = self.bt[i][np.arange(n) // bs] * bs + np.arange(n) % bs
            for L in self.m.cfg.attn_layers:
                for c in (self.m.k_cache[L], self.m.v_cache[L]):
                    out.append(_host(self.be, self.s, c).reshape(-1, *c.shape[2:])[slots])
        return out


@pytest.mark.parametrize("preset", PRESET_IDS)
def test_chunks_leave_the_kv_cache_and_states_of_whole_prompts(sim_backend, preset):
    """The chunk schedule above == whole prompts in one call: every K/V byte of the prompts'
    positions, every GDN state byte and the last-token logits. The chunked model first
    prefills other prompts into the same rows, so a first chunk must start from a zero
    state, not from what its slot held."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, PRESETS[preset].vocab, n).tolist() for n in LENS]
    whole, chunked = _Prefiller(sim_backend, preset), _Prefiller(sim_backend, preset)
    try:
        want = whole.prefill(prompts, [[(i, 0, n) for i, n in enumerate(LENS)]])
        other = [rng.integers(0, PRESETS[preset].vocab, 20).tolist() for _ in LENS]
        chunked.prefill(other, [[(i, 0, 20) for i in range(3)]])
        got = chunked.prefill(prompts, SCHEDULE)
        assert sorted(got) == [0, 1, 2]
        for i in range(3):
            assert got[i].tobytes() == want[i].tobytes(), f"sequence {i}: last-token logits differ"
        for k, (a, b) in enumerate(zip(whole.snapshot(), chunked.snapshot())):
            assert a.tobytes() == b.tobytes(), f"snapshot entry {k} differs"
    finally:
        whole.m.close()
        chunked.m.close()
