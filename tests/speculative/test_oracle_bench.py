"""`vt bench --workload torch-decode --speculative oracle` on the sim's tiny decoder: with the
batch-invariant decoder (the default) an oracle run accepts exactly the drafts it proposes
right and its tokens are the baseline's, and a run that does not fails the bench in one line;
--no-batch-invariant runs the default kernels, said in the table, and checks nothing."""
import json

import pytest

pytest.importorskip("torch")

from vt.backend import available_backends  # noqa: E402
from vt.cli.main import main  # noqa: E402
from vt.forward import spec_kernels  # noqa: E402

# k = 2 and 8 new tokens after prompts of 10: a request's last verify step proposes tokens past
# its 8th (the first comes from the prompt, 7 = 2 x 3 + 1), which the references (the
# baseline's warm run, k tokens longer) hold.
FLAGS = ["bench", "--workload", "torch-decode", "--preset", "tiny", "--live", "14", "--steps",
         "8", "--repeats", "1", "--max-context", "64", "--num-spec", "2", "--speculative",
         "oracle"]


def _late_oracle(self, token_rows, pos, ref, drafts, *, right, vocab):
    """OracleDrafts.run_numpy reading its reference one position too far."""
    for r, row in enumerate(token_rows):
        for j in range(drafts.shape[1]):
            t = int(ref[row, min(int(pos[row]) + 2 + j, ref.shape[1] - 1)])
            drafts[r, j] = t if j < right else (t + 1) % vocab


def _bench(tmp_path, *extra, backend="sim"):
    path = tmp_path / "spec.json"
    rc = main([*FLAGS, "--backend", backend, *extra, "--json", str(path)])
    return rc, json.loads(path.read_text())["speculative"]


def test_the_oracle_accepts_exactly_its_right_drafts_on_the_batch_invariant_decoder(
        tmp_path, capsys):
    """accept 1.0: every draft; 0.5: one of 2; tokens the baseline's (a verify step's 3 rows
    against one-token steps), and the table and the JSON say which decoder ran."""
    rc, s = _bench(tmp_path, "--rows", "1", "--accept", "1.0", "0.5")
    spec = {(r["rows"], r["accept"]): r for r in s["runs"] if "acceptance" in r}
    assert set(spec) == {(1, 1.0), (1, 0.5)}
    for (S, a), r in spec.items():
        assert r["tokens_equal"], (S, a)
        assert r["acceptance"] == a, (S, a, r["acceptance"])
    assert rc == 0 and s["failure"] is None
    assert s["batch_invariant"] is True and s["baseline_repeatable"] is True
    assert "vt mode ring, batch-invariant decoder: speculative oracle, k=2" in capsys.readouterr().out


def test_an_oracle_that_proposes_wrong_tokens_fails_the_bench_in_one_line(
        tmp_path, capsys, monkeypatch):
    """An oracle off by one position has none of its drafts accepted (the target still
    decides every token, so they equal the baseline's): exit 1 with one line after the
    table, naming the run and what it accepted."""
    monkeypatch.setattr(spec_kernels.OracleDrafts, "run_numpy", _late_oracle)
    rc, s = _bench(tmp_path, "--rows", "1", "--accept", "1.0")
    out, err = capsys.readouterr()
    assert rc == 1
    assert "  1   accept 1.0" in out   # the table came first
    lines = err.strip().splitlines()
    assert lines == [s["failure"]]
    assert lines[0] == ("vt bench: torch-decode --speculative with the batch-invariant decoder: "
                        "oracle accept 1.0 at S=1 accepted 0.000 of its drafts, 1.000 of them "
                        "right: the oracle or the verify step is broken")


def test_no_batch_invariant_runs_the_default_kernels_and_checks_nothing(
        tmp_path, capsys, monkeypatch):
    """--no-batch-invariant: the default decoder, said in the table with what it may cost;
    an acceptance below the right drafts is reported, not failed (there it can come from
    the kernels' rounding)."""
    monkeypatch.setattr(spec_kernels.OracleDrafts, "run_numpy", _late_oracle)
    rc, s = _bench(tmp_path, "--rows", "1", "--accept", "1.0", "--no-batch-invariant")
    out = capsys.readouterr().out
    assert rc == 0 and s["batch_invariant"] is False and s["failure"] is None
    assert all(r["acceptance"] == 0.0 for r in s["runs"] if "acceptance" in r)
    assert "default kernels (not batch-invariant): speculative oracle" in out
    assert "greedy tokens may differ from the baseline's" in out


def test_the_draft_bench_runs_a_draft_of_draft_layers_and_keeps_the_tokens(tmp_path, capsys):
    """--speculative draft --draft-layers 1: one speculative engine whose draft is the tiny
    decoder's shape with one layer; its tokens are the baseline's, and the table says its
    random-weight acceptance means nothing."""
    path = tmp_path / "draft.json"
    argv = [a if a != "oracle" else "draft" for a in FLAGS]
    rc = main([*argv, "--backend", "sim", "--rows", "1", "--draft-layers", "1", "--json", str(path)])
    s = json.loads(path.read_text())["speculative"]
    out = capsys.readouterr().out
    assert rc == 0 and s["failure"] is None and s["draft_layers"] == 1
    (run,) = [r for r in s["runs"] if "acceptance" in r]
    assert run["tokens_equal"] and 0.0 <= run["acceptance"] <= 1.0
    assert "speculative draft, k=2" in out and "draft: the target's shape with 1 layers" in out
    assert "its acceptance on random weights means nothing" in out


@pytest.mark.parametrize("extra,words", [
    (["--speculative", "draft"], "--speculative draft needs --draft-layers N"),
    (["--speculative", "ngram", "--draft-layers", "2"], "--draft-layers needs --speculative draft"),
    (["--speculative", "draft", "--draft-layers", "0"], "--draft-layers 0: must be at least 1"),
])
def test_draft_bench_flags_are_refused_in_one_line(extra, words, capsys):
    assert main(["bench", "--workload", "torch-decode", "--preset", "tiny", "--backend", "sim",
                 *extra]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif("cuda" not in available_backends(), reason="needs a CUDA GPU")
def test_the_oracle_accepts_exactly_its_right_drafts_on_the_gpu(tmp_path):
    """The GPU twin: the tiny decoder on cuda, batch-invariant, every check of the bench."""
    rc, s = _bench(tmp_path, "--rows", "1", "3", "--accept", "1.0", "0.5", backend="cuda")
    assert set((r["rows"], r["accept"]) for r in s["runs"]) == {
        (S, a) for S in (1, 3) for a in (None, 1.0, 0.5)}
    assert rc == 0 and s["failure"] is None and s["batch_invariant"] is True
    for r in s["runs"]:
        if "acceptance" in r:
            assert r["tokens_equal"] and r["acceptance"] == r["accept"]


def test_no_batch_invariant_without_speculative_is_refused_in_one_line(capsys):
    assert main(["bench", "--workload", "torch-decode", "--preset", "tiny", "--backend", "sim",
                 "--no-batch-invariant"]) == 2
    assert "--no-batch-invariant: only with --speculative" in capsys.readouterr().err
