"""The executor's modes on the bundled model (tiny-dense and tiny-moe), on every backend."""
import numpy as np
import pytest

from vt.engine.engine import Engine
from vt.forward.hybrid import HybridStepModel
from vt.config import ExecutorConfig
from vt.bundled import PRESETS, HybridModel
from vt.hooks import NULL_HOOKS, Poison, with_device_work

from engine_runs import mismatches, preset_weights

DEVICE_WORK_S = 0.002


def _prompts(preset, n, seed):
    rng = np.random.default_rng(seed)
    vocab = PRESETS[preset].vocab
    prompts = [rng.integers(0, vocab, size=int(rng.integers(1, 9))) for _ in range(n)]
    return prompts, [int(b) for b in rng.integers(3, 9, size=n)]


def run_model(be, preset, prompts, budgets, *, device_work_s=0.0, hooks=NULL_HOOKS, **cfg):
    """One generate() on a fresh model; device_work_s queues device time before each decode
    so the host runs ahead of the device on any backend."""
    model = HybridModel(be, PRESETS[preset], preset_weights(preset), max_seqs=32, num_kv_blocks=256)
    step = with_device_work(HybridStepModel(be, model), device_work_s)
    config = ExecutorConfig(capture_sizes=(1, 2, 4, 8, 16, 32), **cfg)
    try:
        with Engine(be, step, config, hooks=hooks, record_logits=True) as eng:
            results = eng.generate(prompts, max_new_tokens=budgets)
            stats = eng.stats()
    finally:
        model.close()   # destroys its cuBLAS handles (memcheck's leak check counts them)
    return results, stats


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
@pytest.mark.parametrize("conc", [1, 32])
def test_model_off_path_is_byte_identical_to_a_synchronous_run(backend, preset, conc):
    """Mode drain on the bundled model == mode sync: tokens and logits bytes."""
    prompts, budgets = _prompts(preset, 40 if conc > 1 else 3, seed=conc)
    ref, _ = run_model(backend, preset, prompts, budgets, mode="sync", serving_conc=conc)
    off, st = run_model(backend, preset, prompts, budgets, device_work_s=DEVICE_WORK_S,
                        serving_conc=conc)
    assert st["graph_steps"] > 0
    assert all(len(r.tokens) == b for r, b in zip(ref, budgets))
    assert mismatches(ref, off) == 0


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
@pytest.mark.parametrize("conc", [4, 32])
def test_model_ring_with_poison_matches_off(backend, preset, conc):
    """Ring ON + POISON with the host running ahead == OFF, on the bundled model."""
    prompts, budgets = _prompts(preset, conc + 8, seed=100 + conc)
    off, _ = run_model(backend, preset, prompts, budgets, serving_conc=conc)
    ring, st = run_model(backend, preset, prompts, budgets, device_work_s=DEVICE_WORK_S,
                         serving_conc=conc, mode="ring", hooks=Poison())
    assert st["graph_steps"] > 0
    assert mismatches(off, ring) == 0


@pytest.mark.needs_overlap
@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_model_unguarded_with_poison_is_detected(backend, preset):
    """Mode unguarded + POISON on the bundled model: mismatches (counted)."""
    prompts, budgets = _prompts(preset, 16, seed=7)
    off, _ = run_model(backend, preset, prompts, budgets, serving_conc=16)
    bad_results, _ = run_model(backend, preset, prompts, budgets, device_work_s=DEVICE_WORK_S,
                               serving_conc=16, mode="unguarded", hooks=Poison())
    bad = mismatches(off, bad_results)
    print(f"unguarded+poison {preset} on {backend.name}: {bad} of {len(prompts)} requests mismatched")
    assert bad > 0


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_model_serving_makes_no_driver_malloc_after_warm_up(backend, preset):
    """The bundled model from the first generate() on, prompts of 1 to max_context tokens:
    0 driver mallocs (prefill padded to warmed token buckets, decode to warmed sizes)."""
    cfg = PRESETS[preset]
    rng = np.random.default_rng(11)
    lengths = [1, cfg.max_context - 4, 2, 100, 37, 3] + [int(n) for n in rng.integers(1, 80, size=6)]
    prompts = [rng.integers(0, cfg.vocab, size=n) for n in lengths]
    budgets = [int(b) for b in rng.integers(2, 5, size=len(prompts))]
    model = HybridModel(backend, cfg, preset_weights(preset), max_seqs=8, num_kv_blocks=512)
    config = ExecutorConfig(mode="ring", serving_conc=6, capture_sizes=(1, 2, 4))
    try:
        with Engine(backend, HybridStepModel(backend, model), config) as eng:
            before = backend.pool.stats()
            results = eng.generate(prompts, max_new_tokens=budgets)
            after = backend.pool.stats()
            st = eng.stats()
    finally:
        model.close()
    assert [len(r.tokens) for r in results] == budgets
    assert st["prefill_steps"] + st["mixed_steps"] > 1 and st["graph_steps"] > 0
    assert st["eager_steps"] + st["mixed_steps"] > 0
    assert after.driver_mallocs == before.driver_mallocs, (before, after)


def test_engines_one_after_another_share_one_model(backend):
    """Engine.close() gives back the model's per-stream resources (its cuBLAS handle and
    workspace): with room for one GEMM stream, three engines still run on one model in turn,
    and each drain run on the shared model yields the same tokens and logits bytes."""
    preset = "tiny-dense"
    prompts, budgets = _prompts(preset, 6, seed=5)
    model = HybridModel(backend, PRESETS[preset], preset_weights(preset), max_seqs=8,
                        num_kv_blocks=64, gemm_streams=1)
    runs = []
    try:
        for _ in range(3):
            # Each engine captures on its own new stream; the warm-up's first GEMM on it needs
            # the one workspace, which the previous engine's close() returned.
            with Engine(backend, HybridStepModel(backend, model),
                        ExecutorConfig(capture_sizes=(1, 2, 4, 8), serving_conc=4),
                        record_logits=True) as eng:
                runs.append(eng.generate(prompts, max_new_tokens=budgets))
    finally:
        model.close()
    assert mismatches(runs[0], runs[1]) == 0 and mismatches(runs[0], runs[2]) == 0
