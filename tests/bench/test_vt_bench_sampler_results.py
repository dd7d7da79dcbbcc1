"""`vt bench --from-json` of saved sampler results (`vt bench --workload sampler --json`, a GPU
run): the table again, and the JSON and PNG from it, without a GPU."""
import json

import pytest

from vt.cli.main import main


def _result():
    rows = [dict(S=S, V=V, mode=m, vt_us=1.0 + S, torch_us=4.0 + V / 1e4, ratio=round((1.0 + S) / (4.0 + V / 1e4), 3))
            for V in (32000, 151936) for S in (1, 8) for m in ("greedy", "top_k")]
    return dict(workload="sampler", commit="abc1234", device="a GPU", torch="2.x",
                calls_per_graph=50, repeats=3, rows=rows)


def test_saved_sampler_results_are_reprinted_and_replotted(tmp_path, capsys):
    saved, again, png = tmp_path / "s.json", tmp_path / "again.json", tmp_path / "s.png"
    saved.write_text(json.dumps(_result()))
    pytest.importorskip("matplotlib")
    assert main(["bench", "--from-json", str(saved), "--json", str(again), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "us per call inside a CUDA graph" in out and " 151936    8 " in out
    assert json.loads(again.read_text()) == _result() and png.stat().st_size > 0
