"""tools/serve_http_ab.py end to end on the sim at a tiny size (a checkpoint built, the
in-process cells, `vt serve` as a subprocess through HTTP, the table, the ratios, the JSON),
its one-line argument errors, and tools/tiny_checkpoint.py's sharded bf16 writer of the large
shape (its vocabulary padded past the tokenizer's), loaded back by vt.torch.hf."""
import json

import pytest

for _mod in ("torch", "transformers", "fastapi", "uvicorn", "httpx"):
    pytest.importorskip(_mod, reason="the A/B serves a checkpoint with vt serve")

from tools import serve_http_ab, tiny_checkpoint  # noqa: E402


def test_the_ab_runs_both_sides_on_the_same_requests(tmp_path, capsys):
    out = tmp_path / "ab.json"
    assert serve_http_ab.main(["--backend", "sim", "--clients", "2", "3", "--requests", "4",
                               "--prompt-range", "4", "20", "--output-len", "3", "8",
                               "--checkpoint-dir", str(tmp_path / "ck"),
                               "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    cells = {(c["via"], c["load"]): c for c in res["cells"]}
    assert set(cells) == {(v, n) for v in ("engine", "http") for n in (2, 3)}
    for n in (2, 3):
        engine, http = cells["engine", n], cells["http", n]
        assert engine["tokens"] == http["tokens"] and engine["requests"] == http["requests"] == 4
        assert set(engine) == set(http) and http["mode"] == engine["mode"] == "ring"
    assert [(r["load"], r["tok_per_s_http_to_engine"]) for r in res["ab"]] == [
        (n, pytest.approx(cells["http", n]["output_tok_per_s"] /
                          cells["engine", n]["output_tok_per_s"])) for n in (2, 3)]
    for r in res["ab"]:
        assert r["ttft_p50_limit_ms"] == pytest.approx(1.1 * r["ttft_p50_engine_ms"] + 2)
    printed = capsys.readouterr().out
    assert "engine closed" in printed and "http   closed" in printed
    assert "through HTTP / in process" in printed and "TTFT p50" in printed


@pytest.mark.parametrize("argv,needle", [
    (["--clients", "0"], "--clients must be an integer in [1, 1024], got 0"),
    (["--output-len", "5", "2"], "--output-len must be N or MIN MAX"),
    (["--model", "/no/such/dir"], "is not a checkpoint directory"),
    (["--model", "x", "--shape", "tiny"], "not allowed with argument"),
    (["--start-timeout", "0"], "--start-timeout must be in"),
])
def test_bad_arguments_are_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        serve_http_ab.main(["--backend", "sim", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_the_large_shape_writer_shards_and_pads_the_vocabulary(tmp_path, monkeypatch):
    """A small stand-in for llama3-8b through the same writer: several shards and an index,
    bf16, config vocab 1000 past the tokenizer's 400, loaded by vt.torch.hf."""
    import torch

    from vt.step import KVGeometry
    from vt.torch import hf
    shape = dict(tiny_checkpoint.LLAMA3_8B, hidden_size=32, intermediate_size=64,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=1000)
    monkeypatch.setitem(tiny_checkpoint.SHAPES, "padded", shape)
    monkeypatch.setattr(tiny_checkpoint, "SHARD_BYTES", 100_000)
    lines = []
    path = tiny_checkpoint.build(tmp_path / "ck", shape="padded", log=lines.append)
    files = sorted(p.name for p in path.glob("*.safetensors"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(files) > 1 and sorted(set(index["weight_map"].values())) == files
    assert len(lines) == len(files)
    geo = KVGeometry(max_seqs=1, num_kv_blocks=5, block_size=4, max_context=16)
    model = hf.load(path, geo, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert model.cfg.vocab == 1000 and model.cfg.layers == 2
    assert model.embed.weight.dtype == torch.bfloat16
    assert len(tiny_checkpoint.train_tokenizer()) == 400
