"""A torch forward through vt: every safe mode gives eager torch's greedy tokens, with POISON
too, and the same sampled tokens as sync with sampling and seeds; on every backend (the sim
runs the adapter on CPU tensors)."""
import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install \".[torch]\")")

from vt.config import SAFE_MODES  # noqa: E402
from vt.step import SamplingParams  # noqa: E402

from _torch_util import eager_greedy, generate, prompts, step_model, tiny_llama  # noqa: E402

pytestmark = pytest.mark.torch_allocator

MODES = ("sync", "drain", "ring", "staged") + tuple(m for m in SAFE_MODES
                                                   if m not in ("sync", "drain", "ring", "staged"))


def test_every_safe_mode_gives_eager_torchs_greedy_tokens(backend):
    """sync, drain, ring, staged (and the other safe modes), with and without POISON, equal the
    module called eagerly by torch, token for token."""
    module = tiny_llama(backend)
    ps = prompts(6, seed=1)
    expect = [eager_greedy(module, p, 6) for p in ps]
    model = step_model(backend, module)
    for mode in MODES:
        for poison in (False, True):
            got = generate(backend, model, mode, ps, 6, poison=poison)
            assert got == expect, f"{mode}{' +poison' if poison else ''}"


def test_every_safe_mode_samples_the_tokens_sync_samples(backend):
    """Temperature and top-k sampling with per-request seeds: every mode equals sync, and the
    samples are not greedy's (the test would not see a sampler that ignores the seed)."""
    module = tiny_llama(backend, seed=3)
    model = step_model(backend, module)
    ps = prompts(5, seed=2)
    sampling = [SamplingParams(temperature=1.5, top_k=20, seed=100 + i) for i in range(len(ps))]
    ref = generate(backend, model, "sync", ps, 8, sampling=sampling)
    assert ref != generate(backend, model, "sync", ps, 8)
    for mode in ("drain", "ring", "staged"):
        assert generate(backend, model, mode, ps, 8, sampling=sampling, poison=True) == ref, mode
