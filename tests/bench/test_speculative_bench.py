"""`vt bench --workload torch-decode --speculative ...` runs tiny on the sim: the baseline and
each speculative run per rows, their tokens equal, the ratios from the one run."""
import json

import pytest

pytest.importorskip("torch")

from vt.cli.main import main  # noqa: E402

FLAGS = ["bench", "--workload", "torch-decode", "--preset", "tiny", "--backend", "sim",
         "--rows", "1", "--live", "16", "--steps", "8", "--repeats", "1",
         "--max-context", "64", "--num-spec", "2"]


def test_the_oracle_bench_reports_every_ratio_from_one_run(tmp_path, capsys):
    path = tmp_path / "spec.json"
    assert main([*FLAGS, "--speculative", "oracle", "--accept", "1.0", "0.5",
                 "--json", str(path)]) == 0
    s = json.loads(path.read_text())["speculative"]
    runs = {(r["rows"], r["accept"]): r for r in s["runs"]}
    assert set(runs) == {(1, a) for a in (None, 1.0, 0.5)}
    for (S, a), r in runs.items():
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0
        if a is not None:   # the sim's decoder is batch-invariant: the oracle's drafts hold
            assert r["tokens_equal"] and r["speedup"] > 0
            assert r["acceptance"] == pytest.approx(a, abs=0.25)
    assert s["verify_over_step"] > 0
    out = capsys.readouterr().out
    assert "verify step (k + 1 = 3 tokens, 1 row) / one-token step:" in out


def test_the_ngram_bench_runs_one_speculative_engine(capsys):
    assert main([*FLAGS, "--speculative", "ngram"]) == 0
    out = capsys.readouterr().out
    assert "speculative ngram, k=2" in out and "ngram:" in out and "baseline" in out


@pytest.mark.parametrize("extra,words", [
    (["--speculative", "oracle", "--num-spec", "0"], "--num-spec 0: must be in [1, 16]"),
    (["--speculative", "oracle", "--accept", "1.5"], "--accept [1.5]"),
    (["--speculative", "oracle", "--live", "62"], "within --max-context 64"),
])
def test_bad_speculative_bench_flags_are_refused_in_one_line(extra, words, capsys):
    assert main([*FLAGS, *extra]) == 2
    assert words in capsys.readouterr().err
