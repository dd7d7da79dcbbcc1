"""`vt bench --workload serve --url URL` against a real `vt serve` (the session's, on the sim):
every request streams exactly its drawn output length, token by token; a cell's report has
the in-process cell's keys; the drawn requests are the in-process bench's; bad flags are one
line. And tools/serve_http_ab.py end to end at a tiny size."""
import json

import httpx
import numpy as np
import pytest

from vt.cli.main import main as vt_main
from vt.bench.serve import draw_requests, draw_work
from vt.bench.serve_http import ClientPool, closed_loop, describe_server, http_cell

from .conftest import CONTEXT

FLAGS = ["--workload", "serve", "--no-bar", "--clients", "2", "3", "--requests", "5",
         "--prompt-range", "2", "20", "--output-len", "3", "12"]


def bench_main(argv) -> int:
    """`vt bench ARGV`, its exit code."""
    return vt_main(["bench", *argv])


def test_the_server_describes_itself(served_url):
    info = describe_server(served_url)
    assert (info.model, info.vocab, info.max_context, info.mode) == ("tiny", 400, CONTEXT, "ring")


def test_every_request_streams_its_drawn_length_token_by_token(served_url):
    """ignore_eos and one chunk per token: the ids add up to max_tokens whatever text the
    tokens decode to (ids past the tokenizer, partial characters)."""
    info = describe_server(served_url)
    requests = draw_requests(np.random.default_rng(1), 6, info.vocab, (2, 20), (1, 15))
    pool = ClientPool(served_url, info.model, timeout_s=60)
    try:
        done, wall = closed_loop(pool, requests, 3, timeout_s=120)
    finally:
        pool.close()
    assert wall > 0
    for (prompt, n), c in zip(requests, done):
        assert len(c.token_ids) == len(c.token_times) == c.completion_tokens == n
        assert c.finish_reason == "length" and c.token_times == sorted(c.token_times)
        assert c.token_times[0] > c.sent_at


def test_a_streamed_chunk_carries_each_token_once(served_url):
    body = {"model": "tiny", "prompt": [1, 5, 399, 200], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", served_url + "/v1/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    ids = [c["choices"][0]["token_ids"] for c in chunks]
    # one id a chunk; after them the held-back text (if any) and finish_reason, with none
    assert [len(i) for i in ids[:12]] == [1] * 12 and not any(ids[12:])
    whole = httpx.post(served_url + "/v1/completions", json={**body, "stream": False},
                       timeout=60).json()
    assert sum(ids, []) == whole["choices"][0]["token_ids"]


def test_an_http_cell_has_the_in_process_cells_keys(served_url):
    from vt.bench.serve import serve_cell
    from vt.engine.engine import Engine
    from vt.config import ExecutorConfig
    from vt.bundled import PRESETS, HybridModel, init_weights
    from vt.backend import get_backend
    info = describe_server(served_url)
    requests = draw_requests(np.random.default_rng(2), 4, info.vocab, (2, 8), (2, 5))
    pool = ClientPool(served_url, info.model, timeout_s=60)
    try:
        row, tokens = http_cell(pool, served_url, requests, "closed", 2, 0)
    finally:
        pool.close()
    assert [len(t) for t in tokens] == [n for _, n in requests]
    assert row["tokens"] == sum(n for _, n in requests) and row["steps"] > 0
    assert row["output_tok_per_s"] == pytest.approx(row["tokens"] / row["wall_s"])
    be = get_backend("sim")
    cfg = PRESETS["tiny-dense"]
    model = HybridModel(be, cfg, init_weights(cfg, seed=0), max_seqs=2, num_kv_blocks=64)
    try:
        with Engine(be, model, ExecutorConfig(mode="ring", serving_conc=2)) as eng:
            engine_row, _ = serve_cell(eng, [([1, 2], 3), ([3], 2)], "closed", 2, 0)
    finally:
        model.close()
        be.close()
    assert set(row) == set(engine_row)


def test_vt_bench_url_prints_one_table_and_writes_the_json(served_url, tmp_path, capsys):
    out = tmp_path / "http.json"
    assert bench_main([*FLAGS, "--url", served_url, "--arrival", "closed", "poisson",
                       "--rate", "40", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["format"] == "vt-bench-serve/1" and res["url"] == served_url
    assert {(c["arrival"], c["load"], c["via"], c["mode"]) for c in res["cells"]} == {
        ("closed", 2, "http", "ring"), ("closed", 3, "http", "ring"),
        ("poisson", 40, "http", "ring")}
    # the requests the in-process bench draws from the same flags, to the token
    work, _ = draw_work(0, [("closed", 2), ("closed", 3), ("poisson", 40.0)], 5, 400, (2, 20),
                        (3, 12), 3)
    for c in res["cells"]:
        drawn = work[c["arrival"], c["load"]]
        assert c["requests"] == 5 and c["tokens"] == sum(n for _, n in drawn)
        for m in ("ttft_ms", "tpot_ms", "itl_ms"):
            ps = [c[f"{m}_p{p}"] for p in (50, 90, 99)]
            assert None not in ps and ps == sorted(ps)
    printed = capsys.readouterr().out
    assert "through HTTP against" in printed and "http   closed" in printed
    again = tmp_path / "again.json"     # the saved result reprints like an in-process one
    assert bench_main(["--from-json", str(out), "--json", str(again)]) == 0


@pytest.mark.parametrize("argv,needle", [
    (["--url", "localhost:1"], "--url must be an http:// or https:// address"),
    (["--url", "http://127.0.0.1:9", "--modes", "ring"], "--modes does not apply with --url"),
    (["--url", "http://127.0.0.1:9", "--preset", "tiny-dense"], "--preset does not apply"),
    (["--workload", "synthetic", "--url", "http://x"], "--url applies to --workload serve only"),
])
def test_bad_url_arguments_are_one_line(argv, needle, capsys):
    args = argv if "--workload" in argv else ["--workload", "serve", *argv]
    assert bench_main(["--backend", "sim", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_a_server_that_is_not_there_is_one_line(capsys):
    from vt.cli.main import main
    assert main(["bench", *FLAGS, "--url", "http://127.0.0.1:9"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vt bench: --url http://127.0.0.1:9: Connect"), err


def test_a_context_too_small_for_the_traffic_is_one_line(served_url, capsys):
    from vt.cli.main import main
    assert main(["bench", *FLAGS[:-4], "--prompt-range", "60", "--output-len", "10",
                 "--url", served_url]) == 1
    err = capsys.readouterr().err
    assert "need a context of 69; the server's is 64" in err
