"""TorchForwardModel's defaults are the fast path: a module that takes the flattened batch
(LlamaDecoder) prefills a prompt chunk in one call without being told, and the sim's warm-up
of the prompt path runs short steps, not a prefill of the whole context."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install vt-graphs[torch])")

from vt.engine import Engine  # noqa: E402
from vt.config import ExecutorConfig  # noqa: E402
from vt.step import KVGeometry  # noqa: E402
from vt.torch import TorchForwardModel  # noqa: E402
from vt.torch.forward import SIM_PREFILL_WARM_UP_TOKENS  # noqa: E402

from _torch_util import GEO, eager_greedy, tiny_llama  # noqa: E402

pytestmark = pytest.mark.torch_allocator


class _Counting:
    """A forward that calls the module and records (is_decode, tokens) of every call; its
    `prefill` is the module's, as a wrapper that forwards attributes would have it."""

    def __init__(self, module):
        self.module, self.calls = module, []
        self.vocab, self.geometry = module.vocab, module.geometry
        self.prefill = getattr(module, "prefill", None)

    def __call__(self, inputs, logits_out):
        self.calls.append((inputs.is_decode, inputs.num_tokens))
        self.module(inputs, logits_out)

    def prompt_tokens(self):
        return [t for decode, t in self.calls if not decode]


def test_a_llama_decoder_prefills_flat_by_default(sim_backend):
    """TorchForwardModel(be, module) with no prefill argument: a 24-token prompt is one
    forward call of 24 tokens (the module declares prefill = "flat"), and its tokens are the
    module's token by token."""
    module = tiny_llama(sim_backend)
    forward = _Counting(module)
    model = TorchForwardModel(sim_backend, forward)
    assert model.prefill_mode == "flat"
    prompt = list(np.random.default_rng(4).integers(0, module.cfg.vocab, size=24))
    cfg = ExecutorConfig(mode="ring", serving_conc=2, capture_sizes=(1, 2))
    with Engine(sim_backend, model, cfg) as eng:
        forward.calls.clear()   # construction's warm-up
        res = eng.generate([prompt], max_new_tokens=3)
    assert forward.prompt_tokens() == [24]
    assert list(map(int, res[0].tokens)) == eager_greedy(module, prompt, 3)


def test_a_forward_without_a_prefill_string_keeps_the_per_position_path(sim_backend):
    """A plain function (no attribute) and a forward whose `prefill` is a method both get
    "positions", correct for any causal forward; an explicit prefill wins over the module's."""
    module = tiny_llama(sim_backend)

    class WithMethod:
        def __call__(self, inputs, logits_out):
            module(inputs, logits_out)

        def prefill(self, tokens):   # a method of that name declares nothing
            raise AssertionError("never called")

    for forward in (lambda i, o: module(i, o), WithMethod()):
        model = TorchForwardModel(sim_backend, forward, vocab=module.vocab, geometry=GEO)
        assert model.prefill_mode == "positions"
    assert TorchForwardModel(sim_backend, module, prefill="positions").prefill_mode == "positions"


def test_a_declared_prefill_that_is_no_mode_is_refused(sim_backend):
    module = tiny_llama(sim_backend)
    module.prefill = "tokens"
    with pytest.raises(ValueError, match="prefill='tokens'"):
        TorchForwardModel(sim_backend, module)


def test_the_prompt_path_warms_up_to_the_budget_on_cuda_and_with_short_steps_on_the_sim(backend):
    """A budget of max_context (320) tokens: cuda warms up to it (torch's allocator grows to the
    largest step); the sim with steps of at most SIM_PREFILL_WARM_UP_TOKENS, no full-context
    prefill. Either way a longer prompt is served afterwards."""
    geo = KVGeometry(max_seqs=2, num_kv_blocks=2 * 20 + 1, block_size=16, max_context=320)
    module = tiny_llama(backend, geometry=geo)
    forward = _Counting(module)
    cfg = ExecutorConfig(mode="ring", serving_conc=2, capture_sizes=(1, 2))
    with Engine(backend, TorchForwardModel(backend, forward, prefill="flat"), cfg) as eng:
        assert eng.max_prefill_tokens == 320
        warmed = forward.prompt_tokens()
        top = 320 if backend.name == "cuda" else SIM_PREFILL_WARM_UP_TOKENS
        assert warmed == [1 << k for k in range(top.bit_length()) if 1 << k < top] + [top]
        forward.calls.clear()
        prompt = [int(t) % 96 for t in range(1, 300)]
        res = eng.generate([prompt], max_new_tokens=2)
    assert forward.prompt_tokens() == [299]
    assert list(map(int, res[0].tokens)) == eager_greedy(module, prompt, 2)
