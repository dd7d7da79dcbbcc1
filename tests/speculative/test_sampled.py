"""Sampled speculation: a verify step draws the target's token at every position with vt's
sampler (each row's knobs, keyed on its seed and the position) and keeps drafts while they
equal those draws (vt/forward/spec_kernels.py Accept). So the tokens are those decoding
without speculation samples with the same seeds (every proposer, mode and k), independent of
a row's neighbours, and their distribution is the target's: a chi-square at p = 0.001 on
thousands of rows of a trigram toy (tests/speculative/_trigram.py), which a wrong acceptance
rule fails."""
import math

import numpy as np
import pytest

import vt.forward.speculative as speculative_module
from vt.backend import available_backends
from vt.config import ExecutorConfig
from vt.engine.engine import Engine
from vt.engine.speculative import generate_speculative
from vt.forward.spec_kernels import Accept
from vt.forward.speculative import SpeculativeConfig, SpeculativeModel
from vt.hooks import Poison
from vt.sampling import reference as sampler_reference
from vt.step.contract import SamplingParams

from tests.sampling._cases import chi2

from . import _trigram
from ._causal import MODES, SIZES, CausalToy, check_tokens, config, speculative, workload

# (temperature, top_k, top_p) of the chi-square runs
KNOBS = {"temperature": (0.9, 0, 1.0), "top_k": (0.9, 8, 1.0), "top_p": (1.1, 0, 0.8)}


def _samplings(n: int, seed0: int = 40) -> list[SamplingParams]:
    """A mix over the rows: every knob the sampler has, and a greedy row."""
    kinds = [dict(temperature=0.8), dict(temperature=1.0, top_k=5), dict(temperature=1.3, top_p=0.9),
             dict(temperature=0.7, min_p=0.05), dict()]
    return [SamplingParams(**kinds[i % len(kinds)], seed=seed0 + i) for i in range(n)]


def _without_speculation(be, prompts, budgets, samplings):
    """The tokens of the causal toy sampling alone (the engine, mode drain)."""
    with Engine(be, CausalToy(be).step_model(), ExecutorConfig(mode="drain")) as eng:
        return [list(r.tokens) for r in eng.generate(prompts, max_new_tokens=budgets,
                                                     sampling=samplings)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("method", ["ngram", "oracle", "draft"])
def test_sampled_tokens_equal_sampling_without_speculation(sim_backend, method, k, mode):
    """Every proposer, mode and k, under POISON: a seeded request's tokens are the ones the
    target samples alone with the same seed; the oracle proposing them has them accepted.
    (The draft is the target's function: its greedy drafts are kept where the draws take
    the argmax.)"""
    prompts, budgets = workload(6, seed=50 + k, max_new=(8, 20))
    samplings = _samplings(len(prompts))
    want = _without_speculation(sim_backend, prompts, budgets, samplings)
    assert len({tuple(w) for w in want}) == len(want)
    model = speculative(sim_backend, method, k, prompts, want if method == "oracle" else None)
    got, st = generate_speculative(sim_backend, model, ExecutorConfig(mode=mode, capture_sizes=SIZES),
                                   prompts, budgets, sampling=samplings, hooks=Poison())
    check_tokens(got, want)
    if method == "oracle":
        assert st.acceptance_rate > 0.6, st
    assert st.runner["graph_steps"] > 0


@pytest.mark.parametrize("mode", ["ring", "staged"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_the_engine_serves_sampled_requests_with_speculation(sim_backend, method, mode):
    """Through the Engine's continuous batching (14 requests over 8 rows, admitted as rows free
    up): the sampled tokens of the target alone, and again the same on a second run."""
    prompts, budgets = workload(14, seed=61, max_new=(1, 24))
    samplings = _samplings(len(prompts), seed0=7)
    want = _without_speculation(sim_backend, prompts, budgets, samplings)
    for _ in range(2):
        draft = CausalToy(sim_backend, salt=0.05).step_model() if method == "draft" else None
        with Engine(sim_backend, CausalToy(sim_backend).step_model(),
                    ExecutorConfig(mode=mode, capture_sizes=SIZES, serving_conc=8), hooks=Poison(),
                    speculative=config(method, 2, draft=draft)) as eng:
            got = [list(r.tokens) for r in eng.generate(prompts, max_new_tokens=budgets,
                                                        sampling=samplings)]
            assert eng.stats()["speculative"]["verify_rows"] > 0
        check_tokens(got, want)


def test_a_rows_sampled_tokens_do_not_depend_on_its_neighbours(sim_backend):
    """One request alone, then at another row among other prompts and seeds: the same tokens;
    another seed gives others (the check is not vacuous)."""
    prompts, budgets = workload(4, seed=70, max_new=(16, 16))
    samplings = _samplings(4, seed0=90)
    run = lambda ps, sps: generate_speculative(   # noqa: E731
        sim_backend, speculative(sim_backend, "ngram", 2), ExecutorConfig(mode="ring", capture_sizes=SIZES),
        ps, 16, sampling=sps)[0]
    alone = run(prompts[:1], samplings[:1])[0]
    among = run(prompts[1:3] + prompts[:1] + prompts[3:], samplings[1:3] + samplings[:1] + samplings[3:])
    assert list(among[2]) == list(alone)
    reseeded = SamplingParams(temperature=samplings[0].temperature, seed=samplings[0].seed + 1)
    assert list(run(prompts[:1], [reseeded])[0]) != list(alone)


def test_generate_speculative_refuses_what_it_cannot_sample(sim_backend):
    model = speculative(sim_backend, "ngram", 2)
    with pytest.raises(ValueError, match="logprobs=1"):
        generate_speculative(sim_backend, model, ExecutorConfig(mode="sync"), [[1, 2]], 3,
                             sampling=SamplingParams(temperature=0.5, logprobs=1))
    with pytest.raises(ValueError, match="1 SamplingParams for 2 prompts"):
        generate_speculative(sim_backend, model, ExecutorConfig(mode="sync"), [[1, 2], [3]], 3,
                             sampling=[SamplingParams(temperature=0.5)])


# -- the distribution: a chi-square at p = 0.001 -------------------------------------------

ROWS, K, NEW = 2048, 2, 3


def chi2_bound_p001(dof: int) -> float:
    """The chi-square(dof) quantile at p = 0.001 (Wilson-Hilferty; z = 3.0902)."""
    h = 2.0 / (9.0 * dof)
    return dof * (1.0 - h + 3.0902 * math.sqrt(h)) ** 3


def _draws(be, method, accept, knobs, *, mode="sync", capture_sizes=(1,), batches=1):
    """[ROWS * batches, NEW] tokens of the trigram toy with speculation (k = K), each row its
    own prompt (all ending in the same two tokens) and seed, and the acceptance rate; also
    the tokens the target's own sampler draws for those rows. The oracle's references are
    those draws: accept 1.0 proposes exactly what the target samples, accept 0.0 never does."""
    rows = ROWS // batches
    prompts = _trigram.prompts(ROWS)
    seeds = 1000 + np.arange(ROWS)
    own = _trigram.sample_without_speculation(prompts, seeds, NEW + K, *knobs)
    got, accepted, drafts = [], 0, 0
    for b in range(batches):
        ps, ss = prompts[b * rows:(b + 1) * rows], seeds[b * rows:(b + 1) * rows]
        refs = {tuple(int(t) for t in p): list(r) for p, r in zip(ps, own[b * rows:(b + 1) * rows])}
        toy = _trigram.TrigramToy(be, rows, K)
        draft = _trigram.TrigramToy(be, rows, K, seed=DRAFT_TABLE).step_model() \
            if method == "draft" else None
        model = SpeculativeModel(be, toy.step_model(), SpeculativeConfig(
            method, k=K, accept=accept, references=refs if method == "oracle" else None,
            draft=draft))
        t, top_k, top_p = knobs
        sps = [SamplingParams(t, top_k=top_k, top_p=top_p, seed=int(s)) for s in ss]
        out, st = generate_speculative(be, model, ExecutorConfig(mode=mode, capture_sizes=capture_sizes),
                                       ps, NEW, sampling=sps)
        got += [list(o) for o in out]
        accepted, drafts = accepted + st.accepted, drafts + st.drafts
    return np.array(got), accepted / drafts, own[:, :NEW]


def _fit(tokens, knobs) -> list[tuple[str, float, int]]:
    """(what, chi-square, dof) of the second token's marginal and of the second and third
    together (the first two tokens speculation emits) against the target's exact ones."""
    second, joint = _trigram.exact_second_and_third(knobs)
    V = _trigram.VOCAB
    return [("second token", *chi2(np.bincount(tokens[:, 1], minlength=V), second)),
            ("second and third", *chi2(np.bincount(tokens[:, 1] * V + tokens[:, 2], minlength=V * V),
                                       joint.ravel()))]


PROPOSERS = {"accepts every draft": ("oracle", 1.0), "accepts none": ("oracle", 0.0),
             "ngram": ("ngram", 1.0), "draft": ("draft", 1.0)}
# the draft model's logits table: another trigram model than the target's (its greedy
# drafts are accepted with the target's probability of them)
DRAFT_TABLE = 6


@pytest.mark.parametrize("knobs", list(KNOBS), ids=str)
@pytest.mark.parametrize("proposer", list(PROPOSERS), ids=str)
def test_sampled_speculation_draws_the_targets_distribution(sim_backend, proposer, knobs):
    """2048 rows, each its own seed: the first two tokens speculation emits fit the target's
    exact distribution (chi-square, p = 0.001), whether the proposer's drafts are all
    accepted, none is, or the n-gram's or a draft model's are now and then; and they are the
    target's own sampler's tokens."""
    method, accept = PROPOSERS[proposer]
    tokens, rate, own = _draws(sim_backend, method, accept, KNOBS[knobs])
    if proposer == "accepts every draft":
        assert rate == 1.0
    elif proposer == "accepts none":
        assert rate == 0.0
    else:
        assert 0.0 < rate < 1.0
    for what, stat, dof in _fit(tokens, KNOBS[knobs]):
        assert dof >= 8 and stat < chi2_bound_p001(dof), f"{what}: chi-square {stat:.1f} over {dof} dof"
    np.testing.assert_array_equal(tokens, own)


class _WrongAccept(Accept):
    """Acceptance by a wrong rule (`rule(targets_row, drafts_row, verify_logits_row)` -> the
    tokens a row emits), with the real kernel's bookkeeping."""

    def __init__(self, rule):
        self.rule = rule

    def run_numpy(self, targets, v_logits, drafts, token_rows, pos, hist, token_table, records,
                  logits_out, *, k, pad_row):
        S, w = len(token_rows), k + 1
        t = targets[:S * w].reshape(S, w)
        g, d = np.zeros((S, w), np.int32), np.zeros((S, k), np.int32)
        for r in range(S):
            e = self.rule(t[r], drafts[r], v_logits[r * w:(r + 1) * w])
            g[r, :len(e)], d[r, :len(e) - 1] = e, e[:-1]
            if len(e) <= k:          # the real rule then stops after e
                d[r, len(e) - 1] = (e[-1] + 1) % _trigram.VOCAB
        super().run_numpy(g.ravel(), v_logits, d, token_rows, pos, hist, token_table, records,
                          logits_out, k=k, pad_row=pad_row)


def _accept_always(t, d, logits):
    return list(d) + [t[-1]]


def _greedy(t, d, logits):
    """Greedy acceptance (a sampled row treated as a greedy one): the argmax's run."""
    g = np.argmax(logits, axis=1)
    a = 0
    while a < len(d) and d[a] == g[a]:
        a += 1
    return list(g[:a + 1])


def _correction_from_p(knobs):
    """The classic mistake: a draft kept with probability p(d) (an independent uniform), but
    a rejected one replaced by a draw from p itself instead of the residual."""
    rng = np.random.default_rng(3)

    def rule(t, d, logits):
        out = []
        for j in range(len(d)):
            if rng.random() >= sampler_reference.distribution(logits[j], *knobs)[d[j]]:
                return out + [t[j]]
            out.append(d[j])
        return out + [t[-1]]
    return rule


@pytest.mark.parametrize("wrong", ["accept always", "correction from p", "greedy"])
def test_the_chi_square_catches_a_wrong_acceptance_rule(sim_backend, monkeypatch, wrong):
    """The distribution test is not vacuous: with the n-gram proposer, accepting every draft,
    replacing a rejected draft by a draw from p instead of the residual, or accepting
    greedily, fails it."""
    knobs = KNOBS["top_k"]
    rule = {"accept always": _accept_always, "greedy": _greedy,
            "correction from p": _correction_from_p(knobs)}[wrong]
    monkeypatch.setattr(speculative_module, "ACCEPT", _WrongAccept(rule))
    tokens, _, _ = _draws(sim_backend, "ngram", 1.0, knobs)
    worst = max(stat / chi2_bound_p001(dof) for _, stat, dof in _fit(tokens, knobs))
    assert worst > 1.0, f"the wrong rule passed: chi-square at {worst:.2f} of the bound"


@pytest.mark.gpu
@pytest.mark.skipif("cuda" not in available_backends(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("proposer", list(PROPOSERS), ids=str)
def test_sampled_speculation_draws_the_targets_distribution_on_the_gpu(proposer):
    """The GPU twin: the trigram toy on cuda, two batches of 1024 rows in captured ring steps
    (vt's CUDA sampler and the CUDA prologue and accept): the chi-square fits and the tokens
    are the target's own sampler's (its numpy twin's draws)."""
    from vt.backend import get_backend
    be = get_backend("cuda")
    method, accept = PROPOSERS[proposer]
    knobs = KNOBS["top_k"]
    try:
        tokens, rate, own = _draws(be, method, accept, knobs, mode="ring", capture_sizes=(1024,),
                                   batches=2)
    finally:
        be.close()
    for what, stat, dof in _fit(tokens, knobs):
        assert stat < chi2_bound_p001(dof), f"{what}: chi-square {stat:.1f} over {dof} dof"
    np.testing.assert_array_equal(tokens, own)
    if proposer == "accepts every draft":
        assert rate == 1.0


def test_greedy_rows_draw_the_argmax_the_greedy_acceptance_took(sim_backend):
    """A greedy row's verify draws (the sampler at temperature 0) are the greedy pick that
    acceptance took before it sampled: NaN ranks lowest, the lowest id wins a tie (-0.0 ties
    +0.0), and a row with a NaN, a +inf or only -inf gives -1. Random logits with ties too."""
    from vt.sampling.sampler import Sampler

    def greedy_pick(logits):
        x = np.asarray(logits, np.float32)
        finite = np.where(np.isnan(x), -np.inf, x)
        toks = np.argmax(finite, axis=1).astype(np.int32)
        toks[np.isnan(x).any(1) | np.isposinf(x).any(1) | (finite.max(axis=1) == -np.inf)] = -1
        return toks

    rng = np.random.default_rng(4)
    logits = np.round(rng.standard_normal((40, 9)) * 2).astype(np.float32)
    logits[:5] = [[1, 3, 3, 0, 0, 0, 0, 0, 0], [0, np.nan, 5, 1, 0, 0, 0, 0, 0],
                  [np.inf, 0, 0, 0, 0, 0, 0, 0, 0], [-np.inf] * 9, [-0.0, 0.0, -1, -1, -1, -1, -1, -1, -1]]
    n = len(logits)
    tokens = np.full(n, -7, np.int32)
    zero = np.zeros(n, np.float32)
    Sampler().run_numpy(logits.copy(), np.arange(n, dtype=np.int32), np.arange(n, dtype=np.int32),
                        zero, np.zeros(n, np.int32), zero + 1, zero, np.arange(n, dtype=np.uint64),
                        tokens, np.zeros(n, np.int32))
    np.testing.assert_array_equal(tokens, greedy_pick(logits))
    assert tokens[:5].tolist() == [1, -1, -1, -1, 0]
