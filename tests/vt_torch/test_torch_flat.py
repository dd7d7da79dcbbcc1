"""The flattened batch through vt.torch (TorchForwardModel(prefill="flat")): a prompt chunk, or
a whole mixed step, is one forward call, and its tokens and logits are those of the
token-by-token path; on every backend (the sim runs the module on CPU tensors, fp32)."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install vt-graphs[torch])")

from vt.engine import Engine  # noqa: E402
from vt.config import SAFE_MODES, ExecutorConfig  # noqa: E402
from vt.step import KVGeometry  # noqa: E402
from vt.hooks import Poison  # noqa: E402
from vt.torch import TorchForwardModel  # noqa: E402

from _torch_util import GEO, eager_greedy, prompts, tiny_llama  # noqa: E402

pytestmark = pytest.mark.torch_allocator

SIZES = (1, 2, 4, 8)


def _sizes(conc):
    """Graphs up to the concurrency: no decode batch is larger (a bigger one is never replayed)."""
    return tuple(s for s in SIZES if s <= conc)


def _model(be, module, prefill="flat", forward=None, geometry=GEO):
    return TorchForwardModel(be, forward or module, vocab=module.cfg.vocab, geometry=geometry,
                             prefill=prefill)


def _run(be, model, mode, ps, new, *, max_prefill_tokens=None, conc=4, record=False,
         poison=False):
    cfg = ExecutorConfig(mode=mode, serving_conc=conc, capture_sizes=_sizes(conc))
    with Engine(be, model, cfg, max_prefill_tokens=max_prefill_tokens, record_logits=record,
                hooks=Poison() if poison else None) as eng:
        res = eng.generate(ps, max_new_tokens=new)
        stats = eng.stats()
    return res, stats


def _tokens(res):
    return [list(map(int, r.tokens)) for r in res]


class _Counting:
    """The module as a forward, recording (is_decode, tokens, sequences) of every call."""

    def __init__(self, module):
        self.module, self.calls = module, []

    def __call__(self, inputs, logits_out):
        self.calls.append((inputs.is_decode, inputs.num_tokens, inputs.batch))
        self.module(inputs, logits_out)

    def prompt_calls(self):
        return [c for c in self.calls if not c[0]]


@pytest.mark.parametrize("max_prefill_tokens", [None, 5])
def test_flat_prefill_gives_the_token_by_token_greedy_tokens_in_every_mode(backend,
                                                                              max_prefill_tokens):
    """Prompts of 1 to 20 tokens, more than the batch holds (so later ones join running
    sequences: mixed steps), chunked (5: chunks split prompts) and not: every safe mode, with
    POISON, gives the tokens of the module called one position at a time."""
    module = tiny_llama(backend)
    ps = prompts(7, seed=11, max_len=20)
    ps[0] = ps[0][:1]
    expect = [eager_greedy(module, p, 6) for p in ps]
    model = _model(backend, module)
    for mode in SAFE_MODES:
        for poison in (False, True):
            res, stats = _run(backend, model, mode, ps, 6, max_prefill_tokens=max_prefill_tokens,
                              poison=poison)
            assert _tokens(res) == expect, f"{mode}{' +poison' if poison else ''}"
            assert stats["mixed_steps"] > 0 and stats["graph_steps"] > 0, mode


def test_flat_first_token_logits_are_the_token_by_token_ones_within_1e_4(sim_backend):
    """fp32 on the sim: each request's first-token logits from the flat prefill (whole
    prompts, and chunks of 3) are within 1e-4 of the per-position path's."""
    module = tiny_llama(sim_backend, seed=5)
    ps = prompts(6, seed=4, max_len=25)
    ref, _ = _run(sim_backend, _model(sim_backend, module, "positions"), "sync", ps, 3, record=True)
    for mpt in (None, 3):
        got, _ = _run(sim_backend, _model(sim_backend, module), "ring", ps, 3,
                      max_prefill_tokens=mpt, record=True)
        for r, g in zip(ref, got):
            np.testing.assert_allclose(g.logits, r.logits, atol=1e-4, rtol=0)
            assert np.ptp(r.logits[0]) > 1.0   # logits that say something


@pytest.mark.parametrize("max_prefill_tokens", [4, 7, 32])
def test_a_prompt_costs_one_forward_call_per_chunk(sim_backend, max_prefill_tokens):
    """A prompt of P tokens costs ceil(P / max_prefill_tokens) forward calls, not P, each
    running its chunk's tokens."""
    module = tiny_llama(sim_backend)
    forward = _Counting(module)
    model = _model(sim_backend, module, forward=forward)
    cfg = ExecutorConfig(mode="ring", serving_conc=2, capture_sizes=_sizes(2))
    P = 27
    prompt = prompts(1, seed=3, max_len=1)[0] * P
    with Engine(sim_backend, model, cfg, max_prefill_tokens=max_prefill_tokens) as eng:
        forward.calls.clear()   # construction warmed the shapes up
        res = eng.generate([prompt], max_new_tokens=3)
    calls = forward.prompt_calls()
    assert len(calls) == math.ceil(P / max_prefill_tokens)
    assert sum(t for _, t, _ in calls) == P
    assert _tokens(res) == [eager_greedy(module, prompt, 3)]


def test_a_mixed_step_is_one_forward_call_over_decode_rows_and_chunks(sim_backend):
    """A request arriving while others decode: its prefill step runs the decode rows and its
    prompt in one call (B = rows + 1, T = rows + its prompt), and no decode call of its own."""
    module = tiny_llama(sim_backend)
    forward = _Counting(module)
    model = _model(sim_backend, module, forward=forward)
    first, late = prompts(2, seed=8, max_len=6), [5, 9, 17, 3, 3, 40, 2]
    cfg = ExecutorConfig(mode="sync", serving_conc=4, capture_sizes=_sizes(4))
    with Engine(sim_backend, model, cfg) as eng:
        forward.calls.clear()
        handles = [eng.submit(p, max_new_tokens=12) for p in first]
        for h in handles:   # both are decoding once a token of each arrived
            next(iter(h.stream()))
        res = eng.generate([late], max_new_tokens=4)
        for h in handles:
            h.result()
        stats = eng.stats()
    assert stats["mixed_steps"] >= 1
    mixed = [c for c in forward.prompt_calls() if c[2] > 1 and c[1] > c[2]]
    assert (False, 2 + len(late), 3) in mixed
    assert _tokens(res) == [eager_greedy(module, late, 4)]


def test_long_prompts_of_1_to_300_tokens_chunked_and_not(sim_backend):
    """A bigger context: prompts of 1 to 300 tokens, whole (max_prefill_tokens = max_context)
    and in chunks of 64, give the module's token-by-token tokens."""
    geo = KVGeometry(max_seqs=4, num_kv_blocks=4 * 20 + 1, block_size=16, max_context=320)
    module = tiny_llama(sim_backend, geometry=geo)
    rng = np.random.default_rng(2)
    ps = [rng.integers(0, module.cfg.vocab, size=n).tolist() for n in (1, 300, 37, 129)]
    expect = [eager_greedy(module, p, 4) for p in ps]
    model = _model(sim_backend, module, geometry=geo)
    for mpt in (None, 64):
        res, _ = _run(sim_backend, model, "ring", ps, 4, max_prefill_tokens=mpt)
        assert _tokens(res) == expect, mpt


def test_prefill_mode_is_checked():
    with pytest.raises(ValueError, match="prefill='tokens'"):
        from vt.backend import get_backend
        be = get_backend("sim")
        TorchForwardModel(be, lambda i, o: None, vocab=8, geometry=GEO, prefill="tokens")


def test_the_flat_warm_up_runs_the_largest_step_a_prompt_can_make(sim_backend):
    """warm_up_prefill runs every power of two tokens up to max_prefill_tokens and
    max_prefill_tokens itself: no serving step is larger than one the forward (and on cuda
    torch's caching allocator) has already run."""
    module = tiny_llama(sim_backend)
    counting = _Counting(module)
    model = _model(sim_backend, module, forward=counting)
    stream = sim_backend.stream()
    logits = sim_backend.empty((GEO.max_seqs, module.cfg.vocab), np.float32)
    model.warm_up_prefill(stream, 6, logits)
    stream.synchronize()
    assert [tokens for _, tokens, _ in counting.prompt_calls()] == [1, 2, 4, 6]
