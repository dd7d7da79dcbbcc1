"""Batch invariance on the bundled model, property-based: a request's tokens and logits bytes
are the same alone and inside any batch of other requests, in every executor mode.

Each example draws a batch of 1..16 random requests (prompts of 1..24 tokens, 1..6 new
tokens, greedy or seeded sampling with a temperature and top_k), so the decode batch crosses
the padded sizes 1, 2, 4, 8, 16 and shrinks as requests finish, and prefill runs 1..16
prompts at once. The batch runs in each of sync, drain, ring and staged; every request also
runs alone (sync, cached per request). A case is one request compared in one mode: its
tokens and every logits byte must match. Runs on HybridModel(batch_invariant=True) (what
the GPU needs) on every backend, and on the sim's default model too (the sim's numpy
kernels are row-invariant either way).
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vt.engine import Engine
from vt.forward.hybrid import HybridStepModel
from vt.config import ExecutorConfig
from vt.bundled import PRESETS, HybridModel
from vt.step import GREEDY, SamplingParams

from engine_runs import preset_weights

BATCH_MODES = ("sync", "drain", "ring", "staged")
MAX_SEQS = 16


class Engines:
    """One model + engine per mode on one backend (closed together)."""

    def __init__(self, be, preset, invariant):
        self.vocab = PRESETS[preset].vocab
        self._models, self.engines = [], {}
        for mode in BATCH_MODES:
            m = HybridModel(be, PRESETS[preset], preset_weights(preset), max_seqs=MAX_SEQS,
                            batch_invariant=invariant)
            self._models.append(m)
            cfg = ExecutorConfig(serving_conc=MAX_SEQS, capture_sizes=(1, 2, 4, 8, 16), mode=mode)
            self.engines[mode] = Engine(be, HybridStepModel(be, m), cfg, record_logits=True)
        self._alone = {}
        self.cases = dict.fromkeys(BATCH_MODES, 0)

    def alone(self, req):
        key = (tuple(req[0]), req[1], req[2])
        if key not in self._alone:
            self._alone[key] = self.engines["sync"].generate([req[0]], max_new_tokens=[req[1]],
                                                             sampling=[req[2]])[0]
        return self._alone[key]

    def close(self):
        for e in self.engines.values():
            e.close()
        for m in self._models:
            m.close()


def _request(vocab):
    sampled = st.builds(SamplingParams, temperature=st.floats(0.05, 3.0),
                        top_k=st.one_of(st.none(), st.integers(1, 64)),
                        top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
                        min_p=st.one_of(st.just(0.0), st.floats(0.0, 0.5)),
                        seed=st.integers(0, 2**63 - 1))
    return st.tuples(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=24), st.integers(1, 6),
                     st.one_of(st.just(GREEDY), sampled))


def _check_examples(eng, examples):
    @settings(max_examples=examples, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(reqs=st.integers(1, MAX_SEQS).flatmap(
        lambda n: st.lists(_request(eng.vocab), min_size=n, max_size=n)))
    def prop(reqs):
        alone = [eng.alone(r) for r in reqs]
        for mode, e in eng.engines.items():
            got = e.generate([r[0] for r in reqs], max_new_tokens=[r[1] for r in reqs],
                             sampling=[r[2] for r in reqs])
            for i, (a, b) in enumerate(zip(alone, got)):
                assert a.tokens == b.tokens, f"{mode}: request {i} of {len(reqs)}: tokens {b.tokens} != alone {a.tokens}"
                assert a.logits.tobytes() == b.logits.tobytes(), \
                    f"{mode}: request {i} of {len(reqs)}: logits differ from alone (max |diff| " \
                    f"{np.abs(a.logits - b.logits).max():.3g})"
            eng.cases[mode] += len(reqs)
    prop()


def _run(be, preset, invariant, examples, min_cases):
    eng = Engines(be, preset, invariant)
    try:
        _check_examples(eng, examples)
    finally:
        eng.close()
    print(f"{be.name} {preset} batch_invariant={invariant}: cases per mode {eng.cases}")
    assert min(eng.cases.values()) >= min_cases, eng.cases


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_request_is_bit_identical_alone_and_in_any_batch_on_the_sim(sim_backend, preset):
    """sim, batch_invariant=True: >= 70 cases per mode (>= 280 per preset, 560 in all)."""
    _run(sim_backend, preset, True, examples=16, min_cases=70)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_default_sim_model_is_batch_invariant_too(sim_backend, preset):
    """sim, default model (routed MoE for small batches, unpadded GEMMs): still invariant."""
    _run(sim_backend, preset, False, examples=5, min_cases=25)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_request_is_bit_identical_alone_and_in_any_batch_on_cuda(preset):
    """cuda, batch_invariant=True: >= 200 cases per mode."""
    from vt.backend.cuda import CudaBackend
    with CudaBackend() as be:
        _run(be, preset, True, examples=40, min_cases=200)
