"""tools/fp8_quality.py: its numbers on hand-made logits, and a run on the tiny preset."""
import json
import math

import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install \".[torch]\")")

from tools import fp8_quality  # noqa: E402


def test_compare_worked_by_hand():
    """Relative error, top-1 agreement and perplexities of two tiny logits tensors."""
    ref = torch.tensor([[2.0, 0.0], [0.0, 2.0], [1.0, 0.0]])
    other = torch.tensor([[2.0, 0.0], [2.0, 0.0], [1.0, 0.0]])
    r = fp8_quality.compare(other, ref, [0, 0, 1])   # position p predicts token p + 1
    assert r["top1_agreement"] == pytest.approx(2 / 3)
    assert r["logits_rel_err"] == pytest.approx(math.sqrt(8) / math.sqrt(9))
    nll = (math.log(1 + math.exp(-2)) + math.log(1 + math.exp(-2))) / 2   # ref: both right
    assert r["perplexity_ref"] == pytest.approx(math.exp(nll))
    nll8 = (math.log(1 + math.exp(-2)) + math.log(1 + math.exp(2))) / 2   # fp8: second wrong
    assert r["perplexity_fp8"] == pytest.approx(math.exp(nll8))


def test_the_tool_runs_the_tiny_preset(tmp_path, capsys):
    """--preset tiny on the CPU: a line of numbers and the JSON; FP8 agrees on most tokens."""
    out = tmp_path / "q.json"
    assert fp8_quality.main(["--preset", "tiny", "--tokens", "12", "--json", str(out)]) == 0
    assert "greedy top-1 agreement" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["positions"] == 12 and 0 < r["logits_rel_err"] < 0.1 and r["top1_agreement"] > 0.5


def test_the_tool_takes_the_dtype(tmp_path):
    """--dtype bfloat16 on the CPU: the models run in bf16 (the dtype the report names)."""
    out = tmp_path / "q.json"
    assert fp8_quality.main(["--preset", "tiny", "--tokens", "6", "--dtype", "bfloat16",
                             "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["dtype"] == "bfloat16" and 0 < r["logits_rel_err"] < 0.2
