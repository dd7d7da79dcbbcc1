"""`vt bench --workload serve` on the sim at a small size: every mode side by side on the same
requests, the per-cell metrics and their formulas, the JSON, the PNG, the argument checks."""
import json
import re
import types

import numpy as np
import pytest

from vt.cli.main import main as vt_main
from vt.bench.serve import PCTS, cell_metrics, draw_requests
from vt.bench.serve_report import _prefill_ms
from vt.config import SAFE_MODES


def main(argv) -> int:
    """`vt bench ARGV`, its exit code."""
    return vt_main(["bench", *argv])


@pytest.fixture(scope="module")
def sim_serve(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve") / "serve.json"
    rc = main(["--backend", "sim", "--workload", "serve", "--arrival", "closed", "poisson",
               "--no-bar", "--json", str(out)])
    return rc, json.loads(out.read_text())


def test_sim_serve_runs_every_mode_on_the_same_requests(sim_serve):
    rc, res = sim_serve
    assert rc == 0 and res["format"] == "vt-bench-serve/1" and res["backend"] == "sim"
    assert res["modes"] == list(SAFE_MODES) and res["tokens_compared"] is True
    cells = {(c["mode"], c["arrival"], c["load"]) for c in res["cells"]}
    assert cells == {(m, a, float(x)) for m in SAFE_MODES
                     for a, x in [("closed", 2), ("closed", 4), ("poisson", 200)]}
    for c in res["cells"]:
        assert c["tokens_identical_to_drain"] is True, c
        assert c["requests"] == res["requests"] == 8
        assert res["output_len"][0] * 8 <= c["tokens"] <= res["output_len"][1] * 8


def test_sim_serve_metrics_are_consistent(sim_serve):
    _, res = sim_serve
    for c in res["cells"]:
        where = (c["mode"], c["arrival"], c["load"])
        assert c["output_tok_per_s"] == pytest.approx(c["tokens"] / c["wall_s"]), where
        assert c["requests_per_s"] == pytest.approx(c["requests"] / c["wall_s"]), where
        for m in ("ttft_ms", "tpot_ms", "itl_ms"):
            ps = [c[f"{m}_p{p}"] for p in PCTS]
            assert all(p is not None and p >= 0 for p in ps) and ps == sorted(ps), (where, m)
        # The busy fraction is an estimate: each phase's timed steps' mean device time times
        # its steps, over the wall (a sample, so it may pass 1 on a loaded host).
        busy_s = sum(ph["device_ms"] / ph["device_steps"] * ph["steps"]
                     for ph in c["phases"].values() if ph["device_steps"]) / 1e3
        assert c["gpu_busy"] > 0 and c["gpu_busy"] == pytest.approx(busy_s / c["wall_s"]), where
        assert c["steps"] == c["graph_steps"] + c["eager_steps"] + c["mixed_steps"] + c["prefill_steps"]
        assert c["drains"] == sum(c["drains_after"].values()), where
        assert c["drained_fraction"] == pytest.approx(c["drains"] / c["steps"]), where
        if c["mode"] == "ring":   # the ring drains only after steps that own their logits
            assert set(c["drains_after"]) <= {"prefill", "mixed", "eager"}, where
        if c["mode"] == "drain":
            assert c["drains_after"].get("graph", 0) > 0, where
        # the host time of every step that prefills (not a sample): what the table divides
        n = c["mixed_steps"] + c["prefill_steps"]
        assert n > 0 and c["eager_launch_s"] > 0 and c["eager_steps"] == 0, where
        host = float(_prefill_ms(c).split("/")[1])
        assert host == pytest.approx(1e3 * c["eager_launch_s"] / n, abs=0.006), where


def test_cell_metrics_formulas_on_known_token_times():
    """Two requests with hand-made token times: TTFT, TPOT, ITL and throughput by formula."""
    def handle(submitted):
        return types.SimpleNamespace(submitted_at=submitted)   # RequestHandle.submitted_at

    res = [types.SimpleNamespace(tokens=[1, 2, 3], token_times=np.array([1.0, 1.5, 2.5])),
           types.SimpleNamespace(tokens=[4, 5], token_times=np.array([2.0, 2.2]))]
    zero = dict(steps=0, graph_steps=0, eager_steps=0, mixed_steps=0, prefill_steps=0,
                drains=0, drain_s=0.0, device_ms=0.0, token_wait_s=0.0, ring_waits=0,
                eager_launch_s=0.0, drains_after={}, phases={k: dict(steps=0, wall_s=0.0, wait_s=0.0, device_ms=0.0,
                                                 device_steps=0, timed_steps=0, plan_s=0.0,
                                                 launch_s=0.0, collect_s=0.0, drain_s=0.0)
                                         for k in ("decode", "prefill")})
    # the profile timed 2 of the 8 decode steps (250 ms each) and 1 of the 2 mixed (500 ms,
    # 3 ms of it the host enqueueing it); the host enqueued both mixed steps in 8 ms
    after = dict(zero, steps=10, graph_steps=8, mixed_steps=2, drains=2, device_ms=1000.0,
                 eager_launch_s=0.008,
                 drains_after={"mixed": 2},
                 phases=dict(decode=dict(zero["phases"]["decode"], steps=8, device_ms=500.0,
                                         device_steps=2),
                             prefill=dict(zero["phases"]["prefill"], steps=2, device_ms=500.0,
                                          device_steps=1, timed_steps=1, launch_s=0.003)))
    m = cell_metrics([handle(0.5), handle(1.0)], res, 4.0, zero, after)
    assert m["phases"]["prefill"]["launch_s"] / m["phases"]["prefill"]["timed_steps"] == 0.003
    assert m["eager_launch_s"] == 0.008 and _prefill_ms(m) == "500.00/4.00"   # 500 ms / 1, 8 ms / 2
    assert m["ttft_ms_p50"] == pytest.approx(np.percentile([500.0, 1000.0], 50))
    assert m["tpot_ms_p99"] == pytest.approx(np.percentile([750.0, 200.0], 99))
    assert m["itl_ms_p50"] == pytest.approx(np.percentile([500.0, 1000.0, 200.0], 50))
    assert m["output_tok_per_s"] == 5 / 4.0 and m["requests_per_s"] == 0.5
    assert m["gpu_busy"] == pytest.approx(0.75) and m["drained_fraction"] == 0.2


def test_draw_requests_is_seeded_and_within_the_ranges():
    a = draw_requests(np.random.default_rng(3), 20, 100, (2, 5), (7, 7))
    b = draw_requests(np.random.default_rng(3), 20, 100, (2, 5), (7, 7))
    assert a == b and all(2 <= len(p) <= 5 and n == 7 for p, n in a)


def test_sim_serve_writes_the_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "serve.png"
    assert main(["--backend", "sim", "--workload", "serve", "--modes", "drain", "ring",
                 "--clients", "2", "--requests", "3", "--no-bar", "--png", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_sim_serve_repeats_take_turns_and_report_the_median_run(tmp_path, capsys):
    """--repeats 3: every cell runs three times, the modes taking turns on the same requests in
    an order that flips each repeat; the row is the median run by tokens/s, every run is kept,
    and ring's runs are paired with drain's of the same repeat (also printed)."""
    out = tmp_path / "serve.json"
    assert main(["--backend", "sim", "--workload", "serve", "--modes", "drain", "ring",
                 "--clients", "2", "--requests", "3", "--repeats", "3", "--no-bar",
                 "--json", str(out)]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    order = re.findall(r"(drain|ring) +closed 2: ", captured.out + captured.err)
    assert order == ["drain", "ring", "ring", "drain", "drain", "ring"], order
    res = json.loads(out.read_text())
    cells = {c["mode"]: c for c in res["cells"]}
    assert set(cells) == {"drain", "ring"}
    for c in cells.values():
        runs = c["output_tok_per_s_runs"]
        assert len(runs) == 3 and c["output_tok_per_s"] == sorted(runs)[1]
        assert c["tokens_identical_to_drain"] is True
    for key in ("output_tok_per_s", "tpot_ms_p50", "ttft_ms_p99"):
        ring, drain = cells["ring"][f"{key}_runs"], cells["drain"][f"{key}_runs"]
        assert len(ring) == len(drain) == 3, key
        assert cells["ring"][f"{key}_to_drain_runs"] == pytest.approx(
            [r / d for r, d in zip(ring, drain)]), key
    assert "x drain per repeat" in printed and "closed 2 ring: tok/s " in printed
    assert "TPOT p50 " in printed and "TTFT p99 " in printed


def test_median_run_is_the_middle_run_by_tokens_per_s_and_latency_the_median_over_runs():
    from vt.bench.serve_run import median_run
    ttft99 = [50.0, 10.0, 90.0, 40.0]     # the median tok/s run (tag 2) has the worst tail
    rows = [dict(output_tok_per_s=x, tpot_ms_p50=x / 10, ttft_ms_p99=t, itl_ms_p99=None, tag=i)
            for i, (x, t) in enumerate(zip([5.0, 1.0, 3.0, 4.0], ttft99))]
    row = median_run(rows)
    assert row["tag"] == 2 and row["output_tok_per_s_runs"] == [5.0, 1.0, 3.0, 4.0]
    assert row["output_tok_per_s"] == 3.0    # the run's own, with its phases
    assert row["tpot_ms_p50_runs"] == [0.5, 0.1, 0.3, 0.4]
    assert row["tpot_ms_p50"] == pytest.approx(0.35)
    assert row["ttft_ms_p99_runs"] == ttft99 and row["ttft_ms_p99"] == 45.0
    assert row["itl_ms_p99"] is None         # a run without the value: left as the run's
    assert median_run(rows[:1])["tag"] == 0


@pytest.mark.parametrize("argv,needle", [
    (["--output-len", "5", "2"], "--output-len must be N or MIN MAX with 1 <= MIN <= MAX"),
    (["--prompt-range", "0"], "--prompt-range must be N or MIN MAX"),
    (["--clients", "0"], "--clients must be an integer in [1, 1024], got 0"),
    (["--preset", "torch-tiny", "--prompt-kernels", "vt"],
     "--prompt-kernels vt runs vt's kernels, which need the cuda backend"),
    (["--preset", "tiny-dense", "--prompt-kernels", "vt"],
     "--prompt-kernels applies to vt.torch presets only"),
])
def test_bad_serve_arguments_are_refused_before_any_work(argv, needle, capsys):
    assert main(["--backend", "sim", "--workload", "serve", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_png_without_matplotlib_is_refused_up_front(monkeypatch, capsys):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["--backend", "sim", "--workload", "serve", "--png", "x.png"]) == 2
    assert "--png needs matplotlib" in capsys.readouterr().err


def test_tokens_are_compared_only_where_the_model_is_batch_invariant():
    """On cuda's default model a request's batch (and so its logits bits) depends on timing
    that differs between modes: a token difference there is not a wrong token."""
    from vt.bench.serve_run import compare_to_drain
    def cells():
        base = dict(preset="p", arrival="closed", load=2, output_tok_per_s=1.0, tpot_ms_p50=1.0,
                    ttft_ms_p99=1.0, **{f"{k}_runs": [1.0] for k in
                                        ("output_tok_per_s", "tpot_ms_p50", "ttft_ms_p99")})
        return [dict(base, mode="drain", token_ids=[[1, 2]]), dict(base, mode="ring", token_ids=[[1, 3]])]
    checked, unchecked = cells(), cells()
    compare_to_drain(checked, compare_tokens=True)
    compare_to_drain(unchecked, compare_tokens=False)
    assert [c["tokens_identical_to_drain"] for c in checked] == [True, False]
    assert [c["tokens_identical_to_drain"] for c in unchecked] == [None, None]


def test_saved_serve_results_are_reprinted_and_replotted(sim_serve, tmp_path, capsys):
    """--from-json takes serve results too: the same table, the JSON and the PNG from them
    without measuring; serve and decode results together are refused in one line."""
    _, res = sim_serve
    saved = tmp_path / "serve.json"
    saved.write_text(json.dumps(res))
    again, png = tmp_path / "again.json", tmp_path / "again.png"
    pytest.importorskip("matplotlib")
    assert main(["--from-json", str(saved), str(saved), "--json", str(again), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "tokens compared across modes" in out and png.stat().st_size > 0
    merged = json.loads(again.read_text())
    assert len(merged["cells"]) == 2 * len(res["cells"]) and merged["modes"] == res["modes"]
    decode = tmp_path / "decode.json"
    decode.write_text(json.dumps(dict(format="vt-bench/1", workload="synthetic")))
    from vt.cli.main import main as vt_main
    assert vt_main(["bench", "--from-json", str(saved), str(decode)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "one workload" in err[0], err


def test_sim_serve_runs_a_torch_preset_beside_a_bundled_one(tmp_path, capsys):
    """--preset torch-tiny serves the vt.torch Llama decoder (prefill "flat") through the same
    cells as a bundled preset; its tokens are not compared across modes (not batch-invariant
    without VT_BATCH_INVARIANT=1), so the run's tokens_compared is False; every request got
    its tokens."""
    pytest.importorskip("torch", reason="a torch preset needs PyTorch")
    out = tmp_path / "serve.json"
    assert main(["--backend", "sim", "--workload", "serve", "--preset", "torch-tiny", "tiny-dense",
                 "--modes", "drain", "ring", "--clients", "2", "--requests", "4", "--no-bar",
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["tokens_compared"] is False
    # "auto" as the decoder resolved it: vt's kernels, on the CPU too; a bundled model's own
    # prefill
    assert res["prompt_kernels"] == {"torch-tiny": "vt", "tiny-dense": None}
    assert {(c["preset"], c["mode"]) for c in res["cells"]} == {
        (p, m) for p in ("torch-tiny", "tiny-dense") for m in ("drain", "ring")}
    for c in res["cells"]:
        assert c["requests"] == 4 and c["tokens"] >= 4 * res["output_len"][0]
    assert "VT_BATCH_INVARIANT=1 makes it so" in capsys.readouterr().out


def test_an_unknown_serve_preset_lists_the_torch_presets_too(capsys):
    assert main(["--backend", "sim", "--workload", "serve", "--preset", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown preset(s) ['nope']" in err and "torch-llama3-8b" in err
