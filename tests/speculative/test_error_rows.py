"""A NaN-logits (error) row under speculation: a verify step computes logits at its draft
positions, so an error there must end the request only when the tokens before it were
accepted (a rejected draft equal to the bad input ends nothing), with the tokens before the
error token; and the step in flight past the error still feeds the target in-range input
tokens, as the sampler's error rows do (token 0 in place of -1)."""
import sys

import numpy as np
import pytest

from vt.config import ExecutorConfig
from vt.engine.engine import Engine
from vt.forward import spec_kernels
from vt.forward.spec_kernels import ACCEPT, TOKENS
from vt.forward.user import ForwardModel
from vt.sampling.logprobs import RECORD_WORDS

from ._causal import VOCAB, CausalToy, config, workload
from ._cuda_on_cpu import build, compiler, cuda_function_on_cpu


class _NaNInputs:
    """After the causal toy: NaN logits for the rows whose input token is `token`; records
    every input token a live row gave the target (pad rows read the pad row's entry)."""

    name = "nan_inputs"

    def run_numpy(self, table, rows, logits, *, token, seen, nan_rows):
        tok = table[rows]
        seen.append(tok.copy())
        logits[:len(rows)][tok == token] = np.nan
        nan_rows.append(int((tok == token).sum()))


class _NaNToy(CausalToy):
    def __init__(self, be, nan_token, **kw):
        super().__init__(be, **kw)
        self.nan_token, self.seen, self.nan_rows, self._nan = nan_token, [], [], _NaNInputs()

    def __call__(self, stream, inputs, logits_out) -> None:
        super().__call__(stream, inputs, logits_out)
        self.be.launch(stream, self._nan, self.token_table, inputs.token_rows, logits_out,
                       token=self.nan_token, seen=self.seen, nan_rows=self.nan_rows)

    def step_model(self, **kw) -> ForwardModel:
        return ForwardModel(self.be, self, vocab=self.vocab, token_table=self.token_table,
                            geometry=self.geometry)


def _reference(be, prompts, budgets):
    with Engine(be, CausalToy(be).step_model(), ExecutorConfig(mode="sync")) as eng:
        return [r.tokens for r in eng.generate(prompts, max_new_tokens=budgets)]


def _expected(prompt, ref, nan_token):
    inputs = [int(prompt[-1])] + list(ref[:-1])
    at = next((i for i, t in enumerate(inputs) if t == nan_token), None)
    return (list(ref[:at]) if at is not None else list(ref)), at


@pytest.mark.parametrize("mode", ["sync", "ring"])
@pytest.mark.parametrize("method", ["ngram", "oracle", "draft"])
def test_an_error_row_ends_the_request_at_its_token_and_feeds_the_target_in_range_tokens(
        sim_backend, method, mode):
    prompts, budgets = workload(8, seed=7, max_new=(12, 20))
    refs = _reference(sim_backend, prompts, budgets)
    # a token the answers take as input in a decode step (not the prompt's last): its error
    # row falls in a verify step
    nan_token = int(refs[0][3])
    target = _NaNToy(sim_backend, nan_token)
    draft = CausalToy(sim_backend, salt=0.5).step_model() if method == "draft" else None
    spec = config(method, 4, prompts, refs if method == "oracle" else None, accept=0.5,
                  draft=draft)
    with Engine(sim_backend, target.step_model(),
                ExecutorConfig(mode=mode, capture_sizes=(1, 2, 4, 8)), speculative=spec) as eng:
        res = eng.generate(prompts, max_new_tokens=budgets)
    errors = 0
    for p, ref, r in zip(prompts, refs, res):
        want, at = _expected(p, ref, nan_token)
        assert r.tokens == want, (r.tokens, want, at)
        assert r.finish_reason == ("error" if at is not None else "length"), r
        if at is not None:
            errors += 1
            assert f"token {at} " in r.error, r.error
    assert errors >= 1
    seen = np.concatenate(target.seen)
    assert seen.min() >= 0 and seen.max() < VOCAB, \
        f"the target was fed input tokens outside [0, {VOCAB}): {sorted(set(seen[seen < 0]))}"


@pytest.mark.parametrize("mode", ["sync", "ring"])
def test_a_rejected_draft_equal_to_the_error_token_ends_nothing(sim_backend, mode):
    """The oracle at acceptance 0 proposes each row's next token + 1, always rejected: with
    the error token one of those drafts (and never a request's real input), verify rows get
    NaN logits at rejected positions, and every request still ends "length" with its
    tokens."""
    prompts, budgets = workload(8, seed=9, max_new=(12, 20))
    refs = _reference(sim_backend, prompts, budgets)
    inputs = {int(p[-1]) for p in prompts} | {int(t) for r in refs for t in r}
    drafted = {(int(t) + 1) % VOCAB for r in refs for t in r[1:]}
    nan_token = min(drafted - inputs)
    target = _NaNToy(sim_backend, nan_token)
    with Engine(sim_backend, target.step_model(),
                ExecutorConfig(mode=mode, capture_sizes=(1, 2, 4, 8)),
                speculative=config("oracle", 2, prompts, refs, accept=0.0)) as eng:
        res = eng.generate(prompts, max_new_tokens=budgets)
    assert sum(target.nan_rows) > 0, "no verify row had NaN logits: the test proves nothing"
    for ref, r in zip(refs, res):
        assert (r.tokens, r.finish_reason) == (list(ref), "length"), r


@pytest.fixture
def accept_on_cpu(tmp_path, monkeypatch):
    """ACCEPT's run_cupy with the CUDA source run on the CPU (tests/speculative/_cuda_on_cpu.py)."""
    if compiler() is None:
        pytest.skip("needs g++ to build the CUDA source for the CPU")
    from vt.backend import nvrtc
    lib = build(spec_kernels.CODE, tmp_path)
    monkeypatch.setattr(nvrtc, "cuda_function", cuda_function_on_cpu(lib, spec_kernels.CODE))
    monkeypatch.setitem(sys.modules, "cupy", np)
    return lambda *args, **kw: ACCEPT.run_cupy(None, *args, **kw)


@pytest.mark.parametrize("path", ["numpy", "cuda"])
def test_acceptance_writes_an_error_token_into_the_history_as_0(accept_on_cpu, path):
    """Row 0 accepts its first draft, then its target token is an error (-1): its record
    ends with the -1 (the host ends the request there), but the history the proposers read
    and the token table hold 0, an input token in range."""
    k, V, row, p = 2, 8, 1, 3
    targets = np.array([5, -1, 3], np.int32)
    drafts = np.array([[5, 6]], np.int32)
    pos = np.array([0, p, 0], np.int32)
    hist = np.full((3, 10), 7, np.int32)
    table = np.full(12, 7, np.int32)
    records = np.full((1, RECORD_WORDS), -7, np.int32)
    logits = np.zeros((3, V), np.float32)
    run = accept_on_cpu if path == "cuda" else ACCEPT.run_numpy
    run(targets, logits, drafts, np.array([row], np.int32), pos, hist, table, records,
        np.zeros((1, V), np.float32), k=k, pad_row=2)
    assert list(records[0, TOKENS:TOKENS + 2]) == [5, -1]
    assert list(hist[row, p + 1:p + 3]) == [5, 0] and pos[row] == p + 2 and table[row] == 0
