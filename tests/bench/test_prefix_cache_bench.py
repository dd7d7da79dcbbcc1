"""`vt bench --workload prefix-cache` on the sim: every traffic shape (multi-turn chat, a
shared system prompt, a long cached prefix, prompts that never hit) runs with caching on and
off in one command, writes its JSON and prints its table; the hit rates say what was reused."""
import json

import pytest

from vt.cli.main import main

TINY = ["--preset", "tiny", "--backend", "sim", "--clients", "2", "--turns", "2", "3",
        "--turn-tokens", "8", "12", "--output-len", "6", "--system-len", "32", "32",
        "--requests", "3", "--long-prompt", "48", "--long-cached", "32", "--short-prompt", "8",
        "--no-hit-len", "8", "--repeats", "1", "--max-prefill-tokens", "64"]


def test_every_shape_runs_on_the_sim_with_caching_on_and_off(capsys, tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "prefix.json"
    assert main(["bench", "--workload", "prefix-cache", *TINY, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    r = json.loads(out.read_text())
    for shape in ("chat", "system", "no-hit"):
        for key in ("on", "off"):
            cell = r[key][shape]
            assert cell["output_tokens"] == cell["requests"] * 6 and cell["output_tok_per_s"] > 0
            assert cell["ttft_ms_p50"] > 0 and cell["tpot_ms_p50"] > 0
            assert f"{shape:<12} {key:<5}" in table
        assert r["off"][shape]["hit_rate"] == 0.0
        assert set(r["ratios"][shape]) == {"ttft_p50_off_over_on", "tok_per_s_on_over_off"}
    # chat: 2 or 3 turns per client; every turn after the first finds its history cached,
    # the previous answers' full blocks included (an answer of 6 tokens after 8-12 new ones)
    assert r["on"]["chat"]["requests"] >= 4 and r["on"]["chat"]["hit_rate"] > 0.3
    assert r["on"]["system"]["hit_rate"] > 0.5          # 32 of 40-44 tokens, but the first's
    assert r["on"]["no-hit"]["cached_tokens"] == 0
    lp = r["on"]["long-prefix"]
    assert lp["cached_tokens_per_long"] == 32 and lp["ttft_long_ms"] > 0 and lp["ttft_short_ms"] > 0
    assert r["ratios"]["long-prefix"]["ttft_long_cached_over_short"] > 0
    assert r["tokens_differ"] == {"chat": 0, "system": 0, "no-hit": 0}
    assert "long-prefix: TTFT of 48 tokens with 32 cached" in table


def test_a_cached_prefix_that_is_not_whole_blocks_is_refused(capsys):
    assert main(["bench", "--workload", "prefix-cache", *TINY[:-4], "--long-cached", "30"]) == 2
    err = capsys.readouterr().err
    assert "--long-cached 30: a positive multiple of 16 below --long-prompt 48" in err
    assert err.count("\n") == 1


@pytest.mark.slow   # a checkpoint and two vt serve start-ups: about 35 s on 2 cores
def test_every_shape_runs_through_http_against_vt_serve_with_caching_on_and_off(
        capsys, tmp_path):
    """--http DIR: two `vt serve --model DIR` on the sim, caching on then off; the same table
    and keys, the hit rates from the servers' /metrics, the same tokens from both."""
    for mod in ("torch", "transformers", "fastapi", "uvicorn", "httpx"):
        pytest.importorskip(mod)
    from tools import tiny_checkpoint
    ckpt = tiny_checkpoint.build(tmp_path / "tiny-llama", seed=0)
    out = tmp_path / "prefix-http.json"
    flags = [f for f in TINY if f not in ("--preset", "tiny")]
    assert main(["bench", "--workload", "prefix-cache", *flags, "--http", str(ckpt),
                 "--json", str(out)]) == 0
    table = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["via"] == "http"
    for shape in ("chat", "system", "no-hit"):
        for key in ("on", "off"):
            cell = r[key][shape]
            assert cell["output_tokens"] == cell["requests"] * 6 and cell["ttft_ms_p50"] > 0
            assert f"{shape:<12} {key:<5}" in table
        assert r["off"][shape]["cached_tokens"] == 0
    assert r["on"]["chat"]["hit_rate"] > 0.3 and r["on"]["system"]["hit_rate"] > 0.5
    assert r["on"]["no-hit"]["cached_tokens"] == 0
    assert r["on"]["long-prefix"]["cached_tokens_per_long"] == 32
    assert r["tokens_differ"] == {"chat": 0, "system": 0, "no-hit": 0}
