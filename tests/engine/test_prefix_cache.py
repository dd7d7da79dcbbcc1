"""Prefix caching in the engine (vt/engine/kv_blocks.py, the scheduler's admission): tokens
with caching on equal tokens with it off in every mode, greedy and seeded, also when the KV
pool is so small that cached blocks are evicted and reused every few steps; the switch, the
default per model, and what stats() reports."""
import numpy as np
import pytest

from vt.backend import get_backend
from vt.engine.engine import Engine
from vt.forward.toy import ToyForward
from vt.forward.user import KVGeometry
from vt.sampling import SamplingParams

from ._prefix import run, shared_prefix_workload, tokens

MODES = ("sync", "drain", "ring", "staged")
TINY_POOL = KVGeometry(max_seqs=8, num_kv_blocks=14, block_size=4, max_context=32)


@pytest.fixture(scope="module")
def be():
    b = get_backend("sim")
    yield b
    b.close()


@pytest.fixture(scope="module")
def reference(be):
    """Caching off, sync: greedy and seeded tokens of the shared-prefix workload."""
    p, b = shared_prefix_workload(14, seed=1)
    seeded = [SamplingParams(temperature=0.9, top_k=20, seed=100 + i) for i in range(len(p))]
    return p, b, seeded, {
        "greedy": tokens(run(be, p, b, prefix_caching=False)[0]),
        "seeded": tokens(run(be, p, b, prefix_caching=False, sampling=seeded)[0]),
    }


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ("greedy", "seeded"))
def test_tokens_with_caching_equal_tokens_without(be, reference, mode, kind):
    p, b, seeded, ref = reference
    res, st, _ = run(be, p, b, mode=mode, sampling=seeded if kind == "seeded" else None)
    assert tokens(res) == ref[kind]
    pc = st["prefix_cache"]
    assert pc["enabled"] and pc["cached_tokens"] > 0 and 0 < pc["hit_rate"] < 1


@pytest.mark.parametrize("mode", MODES)
def test_tokens_equal_under_eviction_pressure(be, reference, mode):
    """13 usable blocks, 4 requests of 3-4 blocks each at a time: cached blocks are evicted
    and rewritten every few steps."""
    p, b, seeded, ref = reference
    res, st, _ = run(be, p, b, mode=mode, geometry=TINY_POOL, sampling=seeded)
    assert tokens(res) == ref["seeded"]
    pc = st["prefix_cache"]
    assert pc["evictions"] >= 5 and pc["cached_tokens"] > 0, pc
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


def test_fully_cached_prompt_still_computes_its_last_token(be):
    """The same 8-token prompt twice, one after the other: the second takes the first block
    (4 tokens), not the second (it holds the last token, whose logits are needed)."""
    prompt = np.arange(8, dtype=np.int32) + 3
    ref = tokens(run(be, [prompt], [5], prefix_caching=False)[0])
    geo = KVGeometry(max_seqs=8, num_kv_blocks=64, block_size=4, max_context=32)
    from ._prefix import PositionalToy
    from vt.knobs import ExecutorConfig
    toy = PositionalToy(be, geo)
    with Engine(be, toy.step_model(), ExecutorConfig(mode="sync", capture_sizes=(1,))) as eng:
        first = eng.generate([prompt], max_new_tokens=5)
        second = eng.generate([prompt], max_new_tokens=5)
        pc = eng.stats()["prefix_cache"]
    assert tokens(first) == tokens(second) == ref
    assert pc["prompt_tokens"] == 16 and pc["cached_tokens"] == 4


def test_same_prompts_in_one_step_share_blocks_from_the_next_step(be):
    """n requests with one prompt, submitted together: the first computes the prompt, the
    others wait one step and take its blocks (a request never reads a block the step being
    planned writes)."""
    prompt = np.arange(13, dtype=np.int32)
    res, st, _ = run(be, [prompt] * 4, [4] * 4, mode="ring")
    assert len({tuple(r.tokens) for r in res}) == 1
    assert tokens(res)[0] == tokens(run(be, [prompt], [4], prefix_caching=False)[0])[0]
    assert st["prefix_cache"]["cached_tokens"] == 3 * 12


def test_cached_blocks_survive_between_calls_and_are_counted(be):
    p, b = shared_prefix_workload(6, seed=3)
    res, st, _ = run(be, p, b, mode="drain")
    pc = st["prefix_cache"]
    assert pc["cached_blocks"] > 0 and pc["evictable_blocks"] == pc["cached_blocks"]
    assert pc["prompt_tokens"] == sum(len(x) for x in p)


def test_prefix_caching_false_switches_it_off(be):
    p, b = shared_prefix_workload(6, seed=3)
    _, st, _ = run(be, p, b, prefix_caching=False)
    pc = st["prefix_cache"]
    assert not pc["enabled"] and pc["cached_tokens"] == 0 and pc["prompt_tokens"] == 0
    assert pc["note"] == "prefix caching off (prefix_caching=False)"


def test_a_model_that_does_not_declare_it_runs_without_it_and_says_why(be):
    """The toy forward keeps a recurrent state: the default is off, with the reason."""
    with Engine(be, ToyForward(be).step_model()) as eng:
        assert not eng.prefix_caching
        assert "does not declare its KV position-addressed" in eng.prefix_caching_note
        assert eng.stats()["prefix_cache"]["note"] == eng.prefix_caching_note


def test_asking_for_it_on_a_model_that_cannot_is_refused(be):
    with pytest.raises(ValueError, match="prefix_caching=True, but the step model ForwardModel "
                                         "does not declare its KV position-addressed"):
        Engine(be, ToyForward(be).step_model(), prefix_caching=True)


def test_prefix_caching_must_be_a_bool(be):
    with pytest.raises(TypeError, match="prefix_caching must be a bool or None, got 'yes'"):
        Engine(be, ToyForward(be).step_model(), prefix_caching="yes")


def test_the_bundled_hybrid_runs_without_it(be):
    from vt.model import PRESETS, HybridModel
    from tests.engine_runs import preset_weights
    name = next(iter(PRESETS))
    model = HybridModel(be, PRESETS[name], preset_weights(name))
    with Engine(be, model) as eng:
        assert not eng.prefix_caching and "off" in eng.prefix_caching_note


def test_llama_decoder_declares_it():
    torch = pytest.importorskip("torch")  # noqa: F841
    from vt.torch.llama import LlamaDecoder
    assert LlamaDecoder.prefix_cacheable is True
