"""tools/bench.py on the sim backend: every (mode, conc) cell measured, ring == drain."""
import importlib.util
import json
from pathlib import Path

import numpy as np

from vt.backend import get_backend
from vt.model import PRESETS, HybridModel, init_weights

_PATH = Path(__file__).resolve().parents[2] / "tools" / "bench.py"
_spec = importlib.util.spec_from_file_location("vt_tools_bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_bench_measures_every_cell_and_ring_matches_drain(tmp_path, capsys):
    """A sim run of 2 modes x conc 1, 4: every cell in the JSON with tokens/s > 0, a ceiling
    per conc, and ring's tokens identical to drain's."""
    out = tmp_path / "bench.json"
    assert bench.main(["--backend", "sim", "--preset", "tiny-dense", "--modes", "drain", "ring",
                       "--conc", "1", "4", "--new-tokens", "5", "--prompt-len", "3",
                       "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    cells = {(c["mode"], c["conc"]): c for c in res["cells"]}
    assert set(cells) == {(m, c) for m in ("drain", "ring") for c in (1, 4)}
    for (mode, conc), c in cells.items():
        assert c["tokens"] == 2 * conc * 5, (mode, conc, c["tokens"])
        assert c["tokens_per_s"] > 0 and c["device_ms_per_step"] > 0 and c["graph_steps"] > 0
        assert c["identical_to_drain"], (mode, conc)
        assert c["tokens_sha1"] == cells["drain", conc]["tokens_sha1"]
    assert [c["conc"] for c in res["ceilings"]] == [1, 4]
    assert all(c["tokens_per_s"] > 0 for c in res["ceilings"])
    table = capsys.readouterr().out
    assert "conc" in table and "ring" in table and "ceiling" in table


def test_bench_shared_model_runs_match_a_fresh_model():
    """The bench's premise: a run on a model that served other runs == the run on a fresh one."""
    be = get_backend("sim")
    cfg = PRESETS["tiny-dense"]
    weights = init_weights(cfg, seed=0)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, cfg.vocab, 3).tolist() for _ in range(8)]
    other = [rng.integers(0, cfg.vocab, 5).tolist() for _ in range(8)]

    def fresh_model():
        return HybridModel(be, cfg, weights, max_seqs=4, num_kv_blocks=64)
    try:
        m = fresh_model()
        try:
            _, ref = bench.run_cell(be, m, "drain", 4, prompts, 5)
        finally:
            m.close()
        m = fresh_model()
        try:
            bench.run_cell(be, m, "ring", 4, other, 7)
            _, again = bench.run_cell(be, m, "drain", 4, prompts, 5)
        finally:
            m.close()
    finally:
        be.close()
    assert again == ref
