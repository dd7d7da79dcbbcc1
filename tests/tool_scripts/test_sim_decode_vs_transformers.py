"""tools/sim_decode_vs_transformers.py runs end to end at a test size: vt on the sim and
transformers' generate on the same weights, each side's tokens/s and their ratio printed."""
import re

import pytest

pytest.importorskip("torch", reason="the tool runs vt.torch's decoder")
pytest.importorskip("transformers", reason="the tool's peer is transformers' generate")

from tools import sim_decode_vs_transformers as tool  # noqa: E402


@pytest.mark.parametrize("extra", [[], ["--requests", "2", "--batch-invariant"]])
def test_the_tool_prints_both_rates_and_their_ratio(capsys, extra):
    assert tool.main(["--shape", "tiny", "--max-context", "64", "--prompt", "5", "--new", "4",
                      "--repeats", "1", *extra]) == 0
    out = capsys.readouterr().out
    rates = re.findall(r"^(vt|transformers) +([0-9.]+) tokens/s", out, re.M)
    assert [name for name, _ in rates] == ["vt", "transformers"]
    assert all(float(rate) > 0 for _, rate in rates)
    assert re.search(r"^vt / transformers: [0-9.]+x; greedy tokens (agree|differ)$", out, re.M)
    assert ("batch_invariant True" in out) == bool(extra)


def test_the_tool_refuses_more_requests_than_the_sim_serves(capsys):
    with pytest.raises(SystemExit):
        tool.main(["--requests", "9"])
    assert "--requests 9 must be in 1..8" in capsys.readouterr().err
