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


def test_steps_of_several_rows_give_each_position_the_logits_of_one_row_steps():
    """--rows: R consecutive positions as R rows of one step (the last step overlapping the
    one before it) give the dense model the logits one row a step gives, within float32
    summation noise."""
    from vt.bench.torch_workload import model_config
    from vt.torch.llama import LlamaDecoder
    cfg = model_config("torch-tiny")
    tokens = torch.randint(0, cfg.vocab, (12,), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    geo, cpu = fp8_quality._geometry(12, 5), torch.device("cpu")
    one = LlamaDecoder(cfg, geo, dtype=torch.float32, device=cpu)
    weights = one.state_dict()
    five = LlamaDecoder(cfg, geo, dtype=torch.float32, device=cpu)   # a fresh cache
    five.load_state_dict(weights)
    ref = fp8_quality.position_logits(one, tokens.tolist())
    got = fp8_quality.position_logits(five, tokens.tolist(), rows=5)
    assert got.shape == ref.shape == (12, cfg.vocab)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_sixteen_rows_take_the_w8a8_path(tmp_path):
    """--rows 16 names the W8A8 path and measures a different FP8 model than one row does
    (its activations are quantized): the same dense logits, other FP8 logits."""
    runs = {}
    for rows in (1, 16):
        out = tmp_path / f"q{rows}.json"
        assert fp8_quality.main(["--preset", "tiny", "--tokens", "20", "--rows", str(rows),
                                 "--json", str(out)]) == 0
        runs[rows] = json.loads(out.read_text())
    assert runs[1]["what_runs"].startswith("FP8 weights")
    assert runs[16]["what_runs"].startswith("W8A8")
    assert runs[16]["perplexity_ref"] == pytest.approx(runs[1]["perplexity_ref"], rel=1e-5)
    assert runs[16]["logits_rel_err"] != pytest.approx(runs[1]["logits_rel_err"], rel=1e-3)


def test_rows_beyond_the_positions_are_refused(capsys):
    with pytest.raises(SystemExit):
        fp8_quality.main(["--preset", "tiny", "--tokens", "4", "--rows", "5"])
    assert "--rows 5: between 1 and --tokens (4)" in capsys.readouterr().err


def test_the_kv_cache_is_measured_with_or_without_fp8_weights(tmp_path):
    """--kv-cache-dtype fp8 adds the FP8 cache to what is measured; with --weights dense it is
    measured alone: a smaller error than FP8 weights', the same reference, the report saying
    what ran in FP8."""
    runs = {}
    for args in (("--weights", "fp8"), ("--kv-cache-dtype", "fp8"),
                 ("--weights", "dense", "--kv-cache-dtype", "fp8")):
        out = tmp_path / "q.json"
        assert fp8_quality.main(["--preset", "tiny", "--tokens", "16", *args,
                                 "--json", str(out)]) == 0
        runs[args] = json.loads(out.read_text())
    weights, both, kv = runs.values()
    assert kv["what_runs"] == "weights in the dtype; an FP8 KV cache"
    assert both["what_runs"].endswith("; an FP8 KV cache")
    assert "FP8 KV" not in weights["what_runs"]
    assert 0 < kv["logits_rel_err"] < weights["logits_rel_err"]
    assert both["logits_rel_err"] != pytest.approx(weights["logits_rel_err"], rel=1e-3)
    assert kv["perplexity_ref"] == weights["perplexity_ref"] == both["perplexity_ref"]


def test_quantizing_nothing_is_refused(capsys):
    with pytest.raises(SystemExit):
        fp8_quality.main(["--preset", "tiny", "--tokens", "4", "--weights", "dense"])
    assert "quantizes nothing" in capsys.readouterr().err
