"""Constrained requests through the Engine (sim, every safe mode): each token a request with
a grammar samples is one its grammar allows after the tokens before it, its grammar sees its
tokens in order, and the requests without one beside it sample the tokens they sample alone
(a step's sampler waits for the masks its constrained rows need, docs/sampler.md); a model
without grammar masks refuses a grammar by name."""
import numpy as np
import pytest

from engine_runs import kernel_engine
from toy_grammar import ToyGrammar, follows
from vt import ForwardModel, SamplingParams
from vt.config import SAFE_MODES

VOCAB = 61


class _Wavy:
    def run_numpy(self, table, rows, positions, logits):
        for i, (r, p) in enumerate(zip(rows, positions)):
            t = int(table[r])
            logits[i] = (np.sin(t * 1.7 + p * 0.61 + np.arange(VOCAB) * 0.37) * 4).astype(np.float32)


class _NoMasks(ForwardModel):
    """A step model without grammar masks (as tensor parallel's and speculative's are)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.token_masks = None


def _engine(be, mode, model_class=ForwardModel):
    return kernel_engine(be, _Wavy(), VOCAB, mode, model_class)


@pytest.mark.parametrize("mode", SAFE_MODES)
def test_constrained_tokens_follow_the_grammar_and_neighbours_are_unchanged(sim_backend, mode):
    prompts = [[3, 9, 9], [12, 4], [7, 7, 7, 1], [20], [2, 2, 5, 8, 1]]
    plain = [SamplingParams(0.0), SamplingParams(0.9, seed=4), SamplingParams(0.0),
             SamplingParams(1.3, seed=2), SamplingParams(0.7, seed=9)]
    grammars = [None, ToyGrammar(VOCAB), None, ToyGrammar(VOCAB), None]
    asks = [sp if g is None else SamplingParams(sp.temperature, seed=sp.seed, grammar=g)
            for sp, g in zip(plain, grammars)]
    with _engine(sim_backend, mode) as eng:
        alone = eng.generate(prompts, max_new_tokens=12, sampling=plain)
        mixed = eng.generate(prompts, max_new_tokens=12, sampling=asks)
    for i, (a, m, g) in enumerate(zip(alone, mixed, grammars)):
        if g is None:
            assert m.tokens == a.tokens, (mode, i)
        else:
            assert len(m.tokens) == 12 and follows(m.tokens, VOCAB), (mode, i, m.tokens)
            assert not follows(a.tokens, VOCAB)          # unconstrained, the same request strays
            assert g.seen == m.tokens[:len(g.seen)] and len(g.seen) >= 11


def test_a_grammar_on_a_model_without_masks_is_refused(sim_backend):
    from vt.step.contract import StepModel
    assert StepModel.token_masks is None
    with _engine(sim_backend, "ring", _NoMasks) as eng:
        with pytest.raises(ValueError, match="SamplingParams.grammar: this engine's step model"):
            eng.submit([1, 2], sampling=SamplingParams(grammar=ToyGrammar(VOCAB)))
