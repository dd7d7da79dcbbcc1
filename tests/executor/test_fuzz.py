"""Reproducibility, property-based: random serving workloads through every safe mode against
the synchronous run, token for token.

The harness is tools/fuzz.py (the GPU runner uses it too; tests/executor/_fuzz.py adds the
hypothesis drawer). A failing example prints its case as JSON with the command that replays
it exactly (`python3 tools/fuzz.py --backend sim --replay '{...}'`) and hypothesis'
@reproduce_failure blob (or rerun with --hypothesis-seed); the seed tests also name the numpy
seed of tools/fuzz.py's own drawer. Each test prints the steps it ran (pytest -s). CI runs
the share below (12 cases of the main property, ~5-10k steps over all modes, about half a
minute on 2 cores; hypothesis draws new cases on every run, no database); `--run-slow` or
VT_SLOW=1 runs the rest (~120k more steps, ~4 min).
"""
import dataclasses

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from vt.backend import get_backend
from vt.config import SAFE_MODES

from tests.speculative._broken import accept_first_drafts

from ._fuzz import UNSAFE, Tally, cases, fuzz_settings, harness, numpy_case, run_case

CI_EXAMPLES, SLOW_EXAMPLES = 12, 120


def _check_safe_modes(rep):
    assert not rep.safe_failures() and not rep.problems, (
        "safe mode differs from the synchronous run\n" + rep.describe())


def _fuzz_modes(examples, min_steps, name, drawn=None):
    """Hypothesis draws `examples` cases (`drawn`, default cases(max_requests=24)); every safe
    mode's tokens equal the synchronous run's, over at least min_steps steps in all."""
    tally = Tally(name)

    @fuzz_settings(examples)
    @given(case=drawn if drawn is not None else cases(max_requests=24))
    def prop(case):
        rep = run_case(case)
        tally.add(rep)
        _check_safe_modes(rep)

    prop()
    print(tally)
    assert tally.steps >= min_steps, tally


def test_every_safe_mode_matches_the_synchronous_run():
    """sync vs drain, ring, staged (POISON on for the async ones, drawn for
    drain), on random admissions, budgets, stop tokens, sampling, capture sizes, concurrency,
    ring depth, KV geometry and sim delays: identical tokens, finish reasons, logits bytes."""
    _fuzz_modes(CI_EXAMPLES, 2000, "fuzz (CI share)")


@pytest.mark.slow
def test_every_safe_mode_matches_the_synchronous_run_long():
    _fuzz_modes(SLOW_EXAMPLES, 10_000, "fuzz (slow)")


def test_prefix_caching_on_gives_the_bytes_of_caching_off():
    """The positional toy (position-addressed KV): prompts sharing prefixes, over rounds on one
    engine, with prefix caching on in drain, ring and staged against the synchronous run with
    it off: identical tokens, finish reasons, logits bytes, and the cache served some tokens."""
    tally, cached = Tally("fuzz positional (prefix caching)"), []

    @fuzz_settings(5)
    @given(case=cases(model="positional", max_requests=16))
    def prop(case):
        rep = run_case(case)
        tally.add(rep)
        _check_safe_modes(rep)
        cached.append(rep.runs["ring"].stats["prefix_cache"]["cached_tokens"])
        assert rep.runs["sync"].stats["prefix_cache"]["cached_tokens"] == 0

    prop()
    for seed in (1, 2):   # the runner's drawer: these hit the cache
        rep = run_case(numpy_case(seed, model="positional", max_requests=16))
        tally.add(rep)
        _check_safe_modes(rep)
        assert rep.runs["ring"].stats["prefix_cache"]["cached_tokens"] > 0, rep.describe()
    print(tally, "cached prompt tokens per drawn case's ring run:", cached)


def _fuzz_seeds(examples, name):
    """The GPU runner's own distribution (numpy seeds): a failure names the seed to replay."""
    tally = Tally(name)

    @fuzz_settings(examples)
    @given(seed=st.integers(0, 2**31 - 1))
    def prop(seed):
        case = numpy_case(seed, sim_delays=(0.0, 1e-4, 3e-4), max_requests=16)
        rep = run_case(case)
        tally.add(rep)
        assert not rep.safe_failures() and not rep.problems, (
            f"numpy seed {seed} of tools/fuzz.py's drawer\n{rep.describe()}")

    prop()
    print(tally)


def test_every_safe_mode_matches_sync_on_the_runners_seeds():
    _fuzz_seeds(6, "fuzz seeds (CI share)")


@pytest.mark.slow
def test_every_safe_mode_matches_sync_on_the_runners_seeds_long():
    _fuzz_seeds(20, "fuzz seeds (slow)")


# -- the harness is not blind -------------------------------------------------------------
@pytest.mark.needs_overlap
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_harness_reports_the_unsafe_arm(seed):
    """Mode unguarded + POISON on a delayed sim, through the same harness: mismatches reported (with
    the request and where its tokens diverge), while the safe modes of the case stay clean."""
    case = numpy_case(seed, max_requests=16)
    case = dataclasses.replace(case, capture_sizes=(1, 2, 4, 8, 16), sim_delay_s=5e-4)
    rep = run_case(case, unsafe=True)
    _check_safe_modes(rep)
    assert rep.runs[UNSAFE].stats["graph_steps"] > 0
    found = rep.mismatches[UNSAFE]
    print(f"seed {seed}: unsafe arm {len(found)} of {case.requests} requests mismatched")
    assert found, "the harness did not see unguarded+poison: it is blind\n" + rep.describe()
    assert {"round", "request", "kind"} <= found[0].keys()
    assert f"mismatches vs sync: {len(found)}" in rep.describe()


def _unsafe_property(examples, name):
    tally = Tally(name)

    @fuzz_settings(examples)
    @given(case=cases(max_requests=12, sim_delays=(2e-4, 5e-4)))
    def prop(case):
        rep = run_case(case, modes=("sync",), unsafe=True)
        assume(rep.runs[UNSAFE].stats["graph_steps"] >= 8)
        tally.add(rep)
        assert rep.mismatches[UNSAFE], "unguarded+poison not detected\n" + rep.describe()

    prop()
    print(tally)


@pytest.mark.needs_overlap
def test_the_unsafe_arm_is_caught_on_random_cases():
    """Any case with a few graph steps, on a delayed sim: the unsafe arm mismatches."""
    _unsafe_property(8, "unsafe arm (CI share)")


@pytest.mark.slow
@pytest.mark.needs_overlap
def test_the_unsafe_arm_is_caught_on_random_cases_long():
    _unsafe_property(40, "unsafe arm (slow)")


# -- a seeded request is the same alone and in any batch ---------------------------------
def _alone_vs_batch(examples, name):
    tally = Tally(name)

    @fuzz_settings(examples)
    @given(case=cases(max_requests=16, max_rounds=1, sim_delays=(0.0,)), data=st.data())
    def prop(case, data):
        reqs = case.rounds[0]
        j = data.draw(st.integers(0, len(reqs) - 1), label="target")
        target = reqs[j]
        if target.temperature == 0:   # mostly sampled targets: the seed is what is tested
            target = dataclasses.replace(target, temperature=1.0, top_k=case.vocab,
                                         seed=data.draw(st.integers(0, 2**63 - 1), label="seed"))
        batch = dataclasses.replace(case, rounds=(reqs[:j] + (target,) + reqs[j + 1:],))
        alone = dataclasses.replace(
            case, rounds=((target,),), serving_conc=1,
            capture_sizes=tuple(data.draw(st.sets(st.sampled_from((1, 2, 4, 8))), label="sizes")))
        mode = data.draw(st.sampled_from(SAFE_MODES), label="mode")
        be = get_backend("sim")
        models = harness.Models()
        try:
            got_alone = harness.run_mode(be, models, alone, "sync", reference=True)
            got_batch = harness.run_mode(be, models, batch, mode, reference=True)
        finally:
            be.close()
        tally.steps += got_alone.stats["steps"] + got_batch.stats["steps"]
        tally.cases += 1
        a, b = got_alone.rounds[0][0], got_batch.rounds[0][j]
        assert (a.tokens, a.finish_reason) == (b.tokens, b.finish_reason), (
            f"request {j} ({target}) alone: {a.tokens} {a.finish_reason}; in a batch of "
            f"{len(reqs)} (conc {case.serving_conc}, sizes {case.capture_sizes}, mode {mode}): "
            f"{b.tokens} {b.finish_reason}\nbatch case: {batch.to_json()}")
        assert a.logits.tobytes() == b.logits.tobytes()

    prop()
    print(tally)


def test_a_seeded_request_gives_the_same_tokens_alone_and_in_any_batch():
    """Different batch mates, rows, capture sizes, concurrency and mode: same tokens, same
    finish reason, same logits bytes (the sampler keys on seed and position only)."""
    _alone_vs_batch(16, "alone vs batch (CI share)")


@pytest.mark.slow
def test_a_seeded_request_gives_the_same_tokens_alone_and_in_any_batch_long():
    _alone_vs_batch(60, "alone vs batch (slow)")


# -- speculative decoding ------------------------------------------------------------------
SPEC_MATRIX = [(method, k) for method in harness.SPEC_METHODS for k in harness.SPEC_KS]


def _spec_case(method, k, **kw):
    """Numpy seed 23 of the positional toy: two rounds of 13 requests (greedy and sampled, a
    stop token in the second) at concurrency 6, with `method` and k."""
    return harness.with_speculation(numpy_case(23, model="positional", max_requests=12,
                                               sim_delays=(0.0,)), method, k, **kw)


def _check_speculative(rep):
    _check_safe_modes(rep)
    assert set(rep.runs) >= {harness.REFERENCE, *SAFE_MODES}, sorted(rep.runs)
    for mode in SAFE_MODES:
        assert rep.runs[mode].stats["speculative"]["verify_rows"] > 0, rep.describe()
    assert rep.runs[harness.REFERENCE].stats["speculative"] is None


@pytest.mark.parametrize("method,k", SPEC_MATRIX)
def test_speculative_engines_give_the_tokens_of_decoding_without_speculation(method, k):
    """Every proposer and k in {1, 2, 4}: the positional toy served through a speculative
    engine in sync, drain, ring and staged (POISON on for the async ones, prefix caching on)
    gives the greedy and seeded sampled tokens and finish reasons of the reference (sync,
    no speculation, caching off). The draft is the target's twin at k = 2 (all greedy, every
    draft accepted: checked), a noisy draft otherwise; the oracle keeps half its drafts
    right at k = 4."""
    noise = 0.0 if k == 2 else 0.01
    case = _spec_case(method, k, draft_noise=noise, oracle_accept=0.5 if k == 4 else 1.0)
    rep = run_case(case)
    _check_speculative(rep)
    if method == "draft" and noise == 0.0:
        assert rep.runs["ring"].stats["speculative"]["acceptance_rate"] == 1.0


def test_speculative_fuzz_cases_give_the_references_tokens():
    """Hypothesis draws speculative cases (proposer, k, draft, oracle fraction, workload and
    geometry): the same property."""
    _fuzz_modes(4, 0, "fuzz speculative (CI share)",
                cases(model="positional", max_requests=8, speculative=True))


def test_the_fuzz_reports_a_speculative_engine_that_accepts_a_wrong_draft(monkeypatch):
    """The fuzz can fail: with acceptance broken to keep a wrong draft, the speculative runs'
    tokens differ from the reference's, request by request."""
    accept_first_drafts(monkeypatch)
    case = _spec_case("ngram", 2)
    rep = run_case(case, modes=("sync", "ring"))
    wrong = [mm for m in ("sync", "ring") for mm in rep.mismatches[m] if mm["kind"] == "tokens"]
    assert wrong, "a broken acceptance went unseen\n" + rep.describe()
    assert rep.safe_failures()


def test_the_fuzz_reports_a_draft_that_misses_an_accepted_tokens_kv(monkeypatch):
    """The draft's pass 0 re-writes position p - 1 (the last draft of a step that accepted
    all k, which the draft never ran): without it, the twin's tokens stay exact but it
    drafts from a stale KV slot, and the fuzz reports its acceptance below 1."""
    from vt.forward import spec_kernels
    original = spec_kernels.DraftPrologue.run_numpy

    def without_p_minus_1(self, token_rows, block_tables, pos, hist, d_table, d_rows, d_pos,
                          d_lens, d_slots, *args, pad_slot, **kw):
        original(self, token_rows, block_tables, pos, hist, d_table, d_rows, d_pos, d_lens,
                 d_slots, *args, pad_slot=pad_slot, **kw)
        d_slots[:len(token_rows)] = pad_slot    # pass 0's rows at p - 1 write nothing

    monkeypatch.setattr(spec_kernels.DraftPrologue, "run_numpy", without_p_minus_1)
    case = _spec_case("draft", 2)
    rep = run_case(case, modes=("sync", "ring"))
    assert not rep.safe_failures(), rep.describe()   # the tokens are the target's still
    assert any("the target's twin as the draft" in p for p in rep.problems), rep.describe()
