"""Speculative decoding over vt.torch's LlamaDecoder: its decode is the verify step (a row's
k + 1 tokens as decode rows over its cached prefix). The sim twin of the GPU test below."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from vt.backend.zeros import zeros  # noqa: E402
from vt.engine.speculative import generate_speculative  # noqa: E402
from vt.forward.speculative import SpeculativeConfig, SpeculativeModel, verify_table_rows  # noqa: E402
from vt.config import ExecutorConfig  # noqa: E402
from vt.torch import TorchForwardModel  # noqa: E402
from vt.engine import Engine  # noqa: E402
from vt.backend import available_backends  # noqa: E402

from vt_torch._torch_util import GEO, prompts as make_prompts, tiny_llama  # noqa: E402

K = 4


def _run(be, mode, method, accept=1.0):
    ps = make_prompts(4, seed=3)
    budgets = [10, 14, 12, 9]
    with Engine(be, TorchForwardModel(be, tiny_llama(be), geometry=GEO),
                ExecutorConfig(mode="drain", capture_sizes=(1, 2, 4))) as eng:
        want = [r.tokens for r in eng.generate(ps, max_new_tokens=budgets)]
    table = zeros(be, (verify_table_rows(GEO.max_seqs, GEO.max_seqs, K),), np.int32)
    target = TorchForwardModel(be, tiny_llama(be), geometry=GEO, token_table=table)
    refs = {tuple(p): w for p, w in zip(ps, want)}
    model = SpeculativeModel(be, target, SpeculativeConfig(method, k=K, accept=accept, references=refs))
    got, st = generate_speculative(be, model, ExecutorConfig(mode=mode, capture_sizes=(1, 2, 4)),
                                   ps, budgets)
    return got, want, st


@pytest.mark.parametrize("method,accept", [("oracle", 1.0), ("oracle", 0.5), ("ngram", 1.0)])
def test_llama_speculative_tokens_equal_its_own_on_the_sim(sim_backend, method, accept):
    got, want, st = _run(sim_backend, "ring", method, accept)
    assert all(np.array_equal(a, b) for a, b in zip(got, want)), (got, want)
    if method == "oracle":
        assert st.acceptance_rate == pytest.approx(accept, abs=0.15)


@pytest.mark.gpu
@pytest.mark.skipif("cuda" not in available_backends(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["drain", "ring", "staged"])
@pytest.mark.parametrize("method", ["oracle", "ngram"])
def test_llama_speculative_tokens_equal_its_own_on_the_gpu(mode, method):
    from vt.backend import get_backend
    be = get_backend("cuda")
    try:
        got, want, _ = _run(be, mode, method)
    finally:
        be.close()
    assert all(np.array_equal(a, b) for a, b in zip(got, want)), (got, want)


def _engine_run(be, method, accept=1.0):
    """vt.torch's decoder through the Engine (prefix caching on, its default), a second turn
    hitting the first's cached blocks: speculation's tokens and the decoder's own."""
    ps = make_prompts(4, seed=5)
    budgets = [11, 7, 13, 9]
    cfg = ExecutorConfig(mode="ring", capture_sizes=(1, 2, 4))
    table = zeros(be, (verify_table_rows(GEO.max_seqs, GEO.max_seqs, K),), np.int32)
    module = tiny_llama(be)
    with Engine(be, TorchForwardModel(be, module, geometry=GEO, token_table=table), cfg) as eng:
        want = [r.tokens for r in eng.generate(ps, max_new_tokens=budgets)]
        turn2 = [list(p) + w + [3, 4] for p, w in zip(ps, want)]
        want2 = [r.tokens for r in eng.generate(turn2, max_new_tokens=6)]
    refs = {tuple(p): w for p, w in zip(ps + turn2, want + want2)}
    spec = SpeculativeConfig(method, k=K, accept=accept, references=refs)
    with Engine(be, TorchForwardModel(be, module, geometry=GEO, token_table=table), cfg,
                speculative=spec) as eng:
        assert eng.prefix_caching
        got = [r.tokens for r in eng.generate(ps, max_new_tokens=budgets)]
        got2 = [r.tokens for r in eng.generate(turn2, max_new_tokens=6)]
        st = eng.stats()
    return got + got2, want + want2, st


@pytest.mark.parametrize("method", ["oracle", "ngram"])
def test_llama_through_the_engine_with_prefix_caching_on_the_sim(sim_backend, method):
    got, want, st = _engine_run(sim_backend, method)
    assert got == want
    assert st["prefix_cache"]["cached_tokens"] > 0
    if method == "oracle":
        assert st["speculative"]["acceptance_rate"] > 0.6


@pytest.mark.gpu
@pytest.mark.skipif("cuda" not in available_backends(), reason="needs a CUDA GPU")
def test_llama_through_the_engine_with_prefix_caching_on_the_gpu():
    from vt.backend import get_backend
    be = get_backend("cuda")
    try:
        got, want, _ = _engine_run(be, "oracle")
    finally:
        be.close()
    assert got == want
