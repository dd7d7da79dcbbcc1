"""tools/spec_acceptance.py on the tiny checkpoint drafting for itself: one baseline run and one
per proposer, the draft's acceptance and its tokens reported (the numbers on real weights come
from the same tool, docs/speculative.md)."""
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tools import spec_acceptance, tiny_checkpoint  # noqa: E402


def test_the_tool_reports_each_proposers_acceptance_and_tokens(tmp_path, capsys):
    ckpt = tiny_checkpoint.build(tmp_path / "tiny", seed=0)
    text = tmp_path / "text.txt"
    text.write_text("one two three four five six seven eight nine ten " * 20)
    out = tmp_path / "acc.json"
    assert spec_acceptance.main(["--model", str(ckpt), "--draft-model", str(ckpt), "--passages", "2",
                                 "--passage-tokens", "24", "--new", "12", "--num-spec", "3",
                                 "--text", str(text), "--json", str(out)]) == 0
    runs = {r["proposer"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"none", "ngram", f"draft {ckpt}"}
    draft = runs[f"draft {ckpt}"]
    assert draft["acceptance_rate"] > 0.9 and draft["same"] == 2
    assert 1.0 <= runs["ngram"]["mean_accepted_length"] <= 4.0
    assert all(len(t) >= 1 for t in runs["none"]["tokens"])
    assert f"draft {ckpt}: acceptance" in capsys.readouterr().out
