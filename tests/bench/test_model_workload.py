"""`vt bench` through `vt`'s main runs the sweep; --wait-poll-us reaches the engines;
the model workload's premise: engines run one after another on one shared model give the
tokens a fresh model gives."""
import json

import numpy as np

from vt.backend import get_backend
from vt.bench.measure import make_engine, run_vt
from vt.cli.main import main as vt_main
from vt.bundled import PRESETS, HybridModel, init_weights


def bench_main(argv) -> int:
    """`vt bench ARGV`, its exit code."""
    return vt_main(["bench", *argv])


def test_vt_bench_runs_the_sweep(tmp_path):
    out = tmp_path / "bench.json"
    assert bench_main(["--backend", "sim", "--device-us", "0", "--conc", "2", "--modes", "drain",
                       "ring", "--steps", "3", "--no-bar", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert {(c["mode"], c["status"]) for c in res["cells"]} == {
        ("drain", "ok"), ("ring", "ok"), ("torch_sync", "absent"), ("torch_async", "absent")}
    assert res["wait_poll_us"] is None


def test_bench_wait_poll_reaches_the_engines(tmp_path):
    """--wait-poll-us sets the engines' poll-before-block time (and is recorded in the JSON)."""
    out = tmp_path / "bench.json"
    assert bench_main(["--backend", "sim", "--device-us", "0", "--conc", "1", "--modes", "ring",
                       "--steps", "2", "--no-bar", "--no-torch", "--wait-poll-us", "250",
                       "--json", str(out)]) == 0
    assert json.loads(out.read_text())["wait_poll_us"] == 250
    be = get_backend("sim")
    try:
        model = HybridModel(be, PRESETS["tiny-dense"], init_weights(PRESETS["tiny-dense"], seed=0),
                            max_seqs=1, num_kv_blocks=8)
        with make_engine(be, model, "ring", 1, profile=False, max_prefill_tokens=4,
                         wait_poll_us=250) as eng:
            assert eng.runner._poll_s == 250e-6
        model.close()
    finally:
        be.close()


def test_bench_shared_model_runs_match_a_fresh_model():
    """A run on a model that served other runs == the run on a fresh one."""
    be = get_backend("sim")
    cfg = PRESETS["tiny-dense"]
    weights = init_weights(cfg, seed=0)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, cfg.vocab, 3).tolist() for _ in range(4)]
    other = [rng.integers(0, cfg.vocab, 5).tolist() for _ in range(4)]

    def fresh_model():
        return HybridModel(be, cfg, weights, max_seqs=4, num_kv_blocks=64)

    def cell(model, mode, ps, new):
        with make_engine(be, model, mode, 4, profile=False, max_prefill_tokens=4 * 5) as eng:
            return run_vt(eng, ps, new)[1]
    try:
        m = fresh_model()
        try:
            ref = cell(m, "drain", prompts, 5)
        finally:
            m.close()
        m = fresh_model()
        try:
            cell(m, "ring", other, 7)
            again = cell(m, "drain", prompts, 5)
        finally:
            m.close()
    finally:
        be.close()
    assert again == ref
