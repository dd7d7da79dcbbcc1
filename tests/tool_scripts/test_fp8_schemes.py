"""tools/fp8_schemes.py: each scheme on random weights, and a run on the tiny checkpoint whose
per-channel row is vt's own FP8 model (tools/fp8_quality.py) but for summation order."""
import json

import pytest

torch = pytest.importorskip("torch", reason="the schemes are torch functions")
pytest.importorskip("transformers", reason="the tool runs the model through transformers")

from tools import fp8_quality, fp8_schemes, tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint.build(tmp_path_factory.mktemp("tiny-llama"), seed=0)


def test_each_scheme_lands_on_its_grid_and_the_searched_scale_is_never_worse():
    """On a fresh random weight: relative error near e4m3's (3 mantissa bits) for every FP8
    scheme and near bf16's for bf16; per-tensor values are one scale times e4m3 values; the
    searched per-channel scale's error is at most amax's in every row (amax is a candidate)."""
    w = torch.randn(96, 160, generator=torch.Generator().manual_seed(7)) * 0.02
    got = {name: fn(w) for name, fn in fp8_schemes.schemes().items()}
    err = {name: ((q - w).norm() / w.norm()).item() for name, q in got.items()}
    assert err["bf16"] < 3e-3
    for name in ("channel", "tensor", "block", "channel-mse"):
        assert 5e-3 < err[name] < 4e-2, (name, err[name])
    scale = w.abs().amax() / 448
    assert torch.equal((got["tensor"] / scale).to(torch.float8_e4m3fn).float() * scale,
                       got["tensor"])
    row_err = lambda q: (q - w).square().sum(dim=1)   # noqa: E731
    assert bool((row_err(got["channel-mse"]) <= row_err(got["channel"])).all())
    assert err["channel-mse"] < err["channel"]


def test_the_tool_reports_every_scheme_and_its_channel_row_is_vts_model(checkpoint, tmp_path,
                                                                        capsys):
    out = tmp_path / "schemes.json"
    assert fp8_schemes.main(["--model", str(checkpoint), "--tokens", "24",
                             "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = {r["scheme"]: r for r in json.loads(out.read_text())}
    assert list(rows) == list(fp8_schemes.schemes())
    for name in rows:
        assert name in printed
    assert rows["bf16"]["logits_rel_err"] < rows["channel"]["logits_rel_err"]
    vt_run = fp8_quality.run_checkpoint(str(checkpoint), None, 24, torch.device("cpu"),
                                        torch.float32)
    assert rows["channel"]["logits_rel_err"] == pytest.approx(vt_run["logits_rel_err"],
                                                              rel=1e-4)
    assert rows["channel"]["perplexity_ref"] == pytest.approx(vt_run["perplexity_ref"],
                                                              rel=1e-4)
