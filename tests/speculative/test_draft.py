"""The draft-model proposer (vt/forward/spec_proposers.py DraftProposer) on the causal toy over
the sim: greedy tokens equal the target's alone in every mode and k, with a draft that is the
target's own function (every draft accepted, which holds only if the draft's KV holds every
accepted token, after a step that accepted all its drafts too), a near one and a bad one;
through the Engine with prefix caching; no allocation in any capture; and the refusals."""
import pytest

from vt.config import ExecutorConfig
from vt.engine.engine import Engine
from vt.engine.speculative import generate_speculative
from vt.forward.speculative import SpeculativeConfig, SpeculativeModel
from vt.forward.toy import ToyForward
from vt.forward.user import ForwardModel
from vt.hooks import Poison
from vt.step.contract import KVGeometry

from ._causal import (GEOMETRY, MODES, SIZES, CausalToy,
                      check_tokens, reference, speculative, workload)

# the draft's salt (tests/speculative/_causal.py): 0 is the target's own function
DRAFTS = {"itself": 0.0, "near": 0.05, "bad": 1.3}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("draft", ["itself", "bad"])
def test_draft_greedy_tokens_equal_the_targets(sim_backend, draft, k, mode):
    """Every mode and k, under POISON: the target's own tokens. The target as its own draft
    has every draft accepted (k + 1 tokens a step): its KV then holds every accepted token,
    also the last draft of a step that accepted all k, which no pass of that step ran on.
    A bad draft is rarely accepted and changes no token."""
    prompts, budgets = workload(6, seed=k)
    want = reference(sim_backend, prompts, budgets)
    model = speculative(sim_backend, "draft", k, draft_salt=DRAFTS[draft])
    got, st = generate_speculative(sim_backend, model, ExecutorConfig(mode=mode, capture_sizes=SIZES),
                                   prompts, budgets, hooks=Poison())
    check_tokens(got, want)
    if draft == "itself":
        assert st.acceptance_rate == 1.0 and st.mean_accepted_length == k + 1, st
    else:
        assert st.acceptance_rate < 0.1, st
    assert st.runner["graph_steps"] > 0


@pytest.mark.parametrize("mode", ["ring", "staged"])
def test_a_draft_that_agrees_now_and_then_changes_no_token(sim_backend, mode):
    """A near draft: some steps accept a few drafts, others none or all; the tokens stay the
    target's."""
    prompts, budgets = workload(8, seed=21, max_new=(20, 30))
    want = reference(sim_backend, prompts, budgets)
    model = speculative(sim_backend, "draft", 4, draft_salt=DRAFTS["near"])
    got, st = generate_speculative(sim_backend, model, ExecutorConfig(mode=mode, capture_sizes=SIZES),
                                   prompts, budgets, hooks=Poison())
    check_tokens(got, want)
    assert 0.2 < st.acceptance_rate < 0.8, st


def _draft_config(be, k, salt=0.0):
    return SpeculativeConfig("draft", k=k, draft=CausalToy(be, salt=salt).step_model(prefix_cacheable=True))


@pytest.mark.parametrize("mode", ["sync", "ring"])
def test_a_draft_through_the_engine_reuses_its_kv_of_cached_blocks(sim_backend, mode):
    """Prefix caching on: a second turn (a first turn's prompt, its answer and two more tokens)
    starts from the first turn's cached blocks, the target's and, at the same block ids,
    the draft's. Budgets of 1 + 2 (k + 1) tokens end each first turn on a step that accepted
    all k drafts, with the answer's last position closing a named block: the draft's KV
    there is written by the step still in flight when the answer ends. The target as its
    own draft then accepts every draft of both turns, and nothing is allocated after warm-up.
    At depth 1 (sync) as at depth 2 (ring)."""
    be, k = sim_backend, 4
    prompts = [[5, 9], [7, 1, 2, 30, 4, 11], [3, 3], [8, 2, 6, 1, 0, 12]]   # 2 + 10, 6 + 10: blocks of 4
    budget = 1 + 2 * (k + 1)
    cfg = ExecutorConfig(mode=mode, capture_sizes=SIZES, serving_conc=4)
    with Engine(be, CausalToy(be).step_model(prefix_cacheable=True), cfg) as eng:
        want = [list(r.tokens) for r in eng.generate(prompts, max_new_tokens=budget)]
        turn2 = [p + w + [3, 4] for p, w in zip(prompts, want)]
        want2 = [list(r.tokens) for r in eng.generate(turn2, max_new_tokens=9)]
    with Engine(be, CausalToy(be).step_model(prefix_cacheable=True), cfg,
                speculative=_draft_config(be, k)) as eng:
        assert eng.prefix_caching
        got = [list(r.tokens) for r in eng.generate(prompts, max_new_tokens=budget)]
        got2 = [list(r.tokens) for r in eng.generate(turn2, max_new_tokens=9)]
        st = eng.stats()
    assert got == want and got2 == want2
    # every full block of each first turn's prompt and answer but its last token
    assert st["prefix_cache"]["cached_tokens"] == sum((len(p) + budget - 1) // 4 * 4 for p in prompts)
    assert st["speculative"]["acceptance_rate"] == 1.0, st["speculative"]
    assert st["driver_mallocs_since_warm_up"] == 0
    assert be.pool.capture_counts[1] == 0


def test_a_draft_that_is_not_position_addressed_turns_prefix_caching_off(sim_backend):
    """The draft's cached blocks are reused with the target's: a draft whose KV is not
    position-addressed leaves the speculative model not prefix-cacheable."""
    be = sim_backend
    target = CausalToy(be).step_model(prefix_cacheable=True)
    model = SpeculativeModel(be, target, SpeculativeConfig("draft", k=2,
                                                           draft=CausalToy(be).step_model()))
    assert target.prefix_cacheable and not model.prefix_cacheable
    with pytest.raises(ValueError, match="prefix_caching=True"):
        Engine(be, CausalToy(be).step_model(prefix_cacheable=True), ExecutorConfig(mode="sync"),
               prefix_caching=True,
               speculative=SpeculativeConfig("draft", k=2, draft=CausalToy(be).step_model()))


def test_bad_drafts_are_refused_by_name(sim_backend):
    be = sim_backend
    target = CausalToy(be).step_model()
    with pytest.raises(TypeError, match="method 'draft' needs draft, a vt StepModel .* got NoneType"):
        SpeculativeConfig("draft")
    with pytest.raises(ValueError, match="draft is for method 'draft', got method 'ngram'"):
        SpeculativeConfig("ngram", draft=target)
    refuse = lambda match: pytest.raises(ValueError, match=match)   # noqa: E731
    with refuse("the draft's vocab 16 differs from the target's 32"):
        SpeculativeModel(be, target, SpeculativeConfig(
            "draft", draft=CausalToy(be, vocab=16).step_model()))
    other = KVGeometry(max_seqs=8, num_kv_blocks=160, block_size=8, max_context=64)
    with refuse("the draft's geometry .*block_size=8.* differs from the target's "
                      ".*block_size=4"):
        SpeculativeModel(be, target, SpeculativeConfig("draft", draft=CausalToy(be, geometry=other).step_model()))
    with refuse("the draft shares the target's step model"):
        SpeculativeModel(be, target, SpeculativeConfig("draft", draft=target))
    toy = CausalToy(be)
    twin = ForwardModel(be, toy, vocab=toy.vocab, token_table=toy.token_table, geometry=GEOMETRY)
    with refuse("the draft shares the target's token table"):
        SpeculativeModel(be, toy.step_model(), SpeculativeConfig("draft", draft=twin))
    with refuse("the draft ForwardModel does not declare verifies_by_decode"):
        SpeculativeModel(be, target, SpeculativeConfig("draft", draft=ToyForward(be).step_model()))
    with refuse("the draft's token table has 25 entries; its passes need 49"):
        SpeculativeModel(be, target, SpeculativeConfig("draft", k=4,
                                                       draft=CausalToy(be, max_k=1).step_model()))
