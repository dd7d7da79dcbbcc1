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

from ._prefix import run, run_turns, shared_prefix_workload, tokens

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
    from vt.config import ExecutorConfig
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
    from vt.bundled import PRESETS, HybridModel
    from tests.engine_runs import preset_weights
    name = next(iter(PRESETS))
    model = HybridModel(be, PRESETS[name], preset_weights(name))
    with Engine(be, model) as eng:
        assert not eng.prefix_caching and "off" in eng.prefix_caching_note


def test_llama_decoder_declares_it():
    torch = pytest.importorskip("torch")  # noqa: F841
    from vt.torch.llama import LlamaDecoder
    assert LlamaDecoder.prefix_cacheable is True


# -- a conversation's next turn: the blocks the first turn's decoding wrote are cached -----
TURN_POOL = KVGeometry(max_seqs=8, num_kv_blocks=24, block_size=4, max_context=40)


@pytest.fixture(scope="module")
def turns_reference(be):
    """Caching off, sync: both turns' tokens, greedy and seeded, of 8 conversations whose
    answers fill whole blocks (prompts of 5-11 tokens, 9-12 new tokens)."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 64, int(rng.integers(5, 12))).astype(np.int32) for _ in range(8)]
    budgets = [int(rng.integers(9, 13)) for _ in range(8)]
    ref = {}
    for kind, seed in (("greedy", None), ("seeded", 5)):
        first, second, _, _, _ = run_turns(be, prompts, budgets, prefix_caching=False, seed=seed)
        ref[kind] = (tokens(first), tokens(second))
    return prompts, budgets, ref


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ("greedy", "seeded"))
def test_second_turn_takes_the_first_turns_answer_from_the_cache(be, turns_reference, mode, kind):
    """Every second-turn prompt finds cached all full blocks of its history but the last
    answer token (whose KV no step wrote): the answer's blocks, not only the first prompt's;
    tokens equal those with caching off, and the hit rate counts the answer's blocks."""
    prompts, budgets, ref = turns_reference
    first, second, second_prompts, st1, st2 = run_turns(
        be, prompts, budgets, mode=mode, seed=None if kind == "greedy" else 5)
    assert (tokens(first), tokens(second)) == ref[kind]
    bs = 4
    expected = sum(min((len(p) + len(r.tokens) - 1) // bs, (len(q) - 1) // bs) * bs
                   for p, r, q in zip(prompts, first, second_prompts))
    prompt_only = sum(len(p) // bs * bs for p in prompts)
    assert st2["cached_tokens"] - st1["cached_tokens"] == expected > prompt_only
    assert st2["prompt_tokens"] - st1["prompt_tokens"] == sum(map(len, second_prompts))
    assert st2["evictions"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_second_turn_tokens_equal_under_eviction_pressure(be, turns_reference, mode):
    """23 usable blocks for 4 conversations of up to 10 blocks each at a time: answer
    blocks are cached, evicted and rewritten while the second turn runs."""
    prompts, budgets, ref = turns_reference
    first, second, _, _, st2 = run_turns(be, prompts, budgets, mode=mode, geometry=TURN_POOL, seed=5)
    assert (tokens(first), tokens(second)) == ref["seeded"]
    assert st2["evictions"] >= 5 and st2["cached_tokens"] > 0, st2


def test_a_stopped_answer_is_cached_only_as_far_as_its_tokens(be):
    """A request ended by a stop token names the full blocks of the tokens it returned, not
    the ones its row decoded after the stop: the next turn, sending the history up to the
    stop, matches exactly that many blocks and equals the uncached run."""
    prompt = np.arange(3, 10, dtype=np.int32)
    geo = KVGeometry(max_seqs=8, num_kv_blocks=64, block_size=4, max_context=40)
    from ._prefix import PositionalToy
    from vt.config import ExecutorConfig
    free = tokens(run(be, [prompt], [20], prefix_caching=False, geometry=geo)[0])[0][0]
    stop = free[9]          # the 10th token ends the answer (the first time it appears)
    n = free.index(stop) + 1
    outs = {}
    for caching in (False, True):
        toy = PositionalToy(be, geo)
        with Engine(be, toy.step_model(), ExecutorConfig(mode="ring", capture_sizes=(1,)),
                    prefix_caching=caching) as eng:
            a = eng.generate([prompt], max_new_tokens=20, stop_token=stop)[0]
            nxt = np.concatenate([prompt, np.asarray(a.tokens, np.int32), [1, 2]]).astype(np.int32)
            b = eng.generate([nxt], max_new_tokens=6)[0]
            outs[caching] = (a.tokens, a.finish_reason, b.tokens, eng.stats()["prefix_cache"])
    assert outs[True][:3] == outs[False][:3]
    assert outs[True][0] == free[:n] and outs[True][1] == "stop"
    assert outs[True][3]["cached_tokens"] == (len(prompt) + n - 1) // 4 * 4
