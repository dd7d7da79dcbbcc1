"""The bundled model's captured prefill buckets (HybridStepModel capture_prefill,
VT_PREFILL_GRAPHS=1): every step that prefills launches its bucket's graph, and an engine
serves exactly the tokens and logits bytes it serves with eager prefill, whole prompts and
chunked ones (first and continuing chunks in one step), greedy and seeded. The graphs go with
the engine's stream. On cuda the model runs batch_invariant=True, as in
test_chunked_prefill.py, so that only the capture itself could make a difference.
"""
import pytest

from vt.engine import Engine
from vt.forward.hybrid import HybridStepModel, prefill_graphs_default
from vt.config import ExecutorConfig
from vt.bundled import PRESETS, HybridModel

from engine_runs import mismatches, preset_weights
from .test_chunked_prefill import _requests


def _serve(be, preset, capture: bool, max_prefill_tokens):
    prompts, budgets, samplings = _requests(preset)
    model = HybridModel(be, PRESETS[preset], preset_weights(preset), max_seqs=8, num_kv_blocks=256,
                        batch_invariant=True if be.name == "cuda" else None)
    step = HybridStepModel(be, model, capture_prefill=capture)
    launches = []
    try:
        config = ExecutorConfig(mode="ring", serving_conc=6, capture_sizes=(1, 2, 4, 8))
        with Engine(be, step, config, record_logits=True,
                    max_prefill_tokens=max_prefill_tokens) as eng:
            graphs = dict(step._graphs)
            for key, g in graphs.items():
                real = g.launch
                g.launch = lambda stream, real=real, key=key: (launches.append(key[1]), real(stream))[1]
            results = eng.generate(prompts, max_new_tokens=budgets, sampling=samplings)
        assert step._graphs == {}, "the engine's close left prefill graphs behind"
    finally:
        model.close()
    return results, graphs, launches


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
@pytest.mark.parametrize("budget", [None, 7], ids=["whole", "chunked"])
def test_captured_prefill_serves_the_tokens_of_eager_prefill(backend, preset, budget):
    eager, no_graphs, _ = _serve(backend, preset, False, budget)
    captured, graphs, launches = _serve(backend, preset, True, budget)
    assert no_graphs == {} and len(graphs) >= 1
    assert launches and set(launches) <= {total for _, total in graphs}
    assert mismatches(eager, captured) == 0


def test_vt_prefill_graphs_is_0_or_1(monkeypatch):
    monkeypatch.delenv("VT_PREFILL_GRAPHS", raising=False)
    assert prefill_graphs_default() is True
    monkeypatch.setenv("VT_PREFILL_GRAPHS", "0")
    assert prefill_graphs_default() is False
    monkeypatch.setenv("VT_PREFILL_GRAPHS", "yes")
    with pytest.raises(ValueError, match="VT_PREFILL_GRAPHS must be 0 or 1, got 'yes'"):
        prefill_graphs_default()
