"""`vt bench` (vt/bench/): the default sim sweep's JSON has every column with sane values, the
model workload, the metrics' formulas, the progress lines, the CLI's checks, the torch peer."""
import contextlib
import importlib.util
import io
import json
import math
import time
import types

import numpy as np
import pytest

from vt.backend import available_backends
from vt.bench import cells, torch_peer
from vt.cli.bench import DEFAULT_SPIN_US
from vt.cli.main import main as vt_main
from vt.bench.progress import ProgressBar
from vt.bench.synthetic import SYNTH_VOCAB, Logits, expected_tokens, next_token
from vt.backend.timing import timed_ms
from vt.config import SAFE_MODES


def main(argv) -> int:
    """`vt bench ARGV`, its exit code."""
    return vt_main(["bench", *argv])


@pytest.fixture(scope="module")
def sim_sweep(tmp_path_factory):
    """The CI command with its defaults: `vt bench --backend sim --workload synthetic`."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    t0 = time.perf_counter()
    rc = main(["--backend", "sim", "--workload", "synthetic", "--no-bar", "--json", str(out)])
    return rc, time.perf_counter() - t0, json.loads(out.read_text())


def test_sim_sweep_finishes_in_under_a_minute_with_every_cell(sim_sweep):
    rc, wall, res = sim_sweep
    assert rc == 0 and wall < 60, (rc, wall)
    assert res["workload"] == "synthetic" and res["backend"] == "sim"
    assert res["columns"] == list(cells.COLUMNS)
    assert res["modes"] == list(SAFE_MODES) and res["concs"] == [1, 32]
    assert res["spin_us"] == list(DEFAULT_SPIN_US)
    assert res["warmup_s"] == 0.0   # the sim's default: no clocks to raise
    want = {(m, c, float(d)) for m in (*SAFE_MODES, *torch_peer.VARIANTS) for c in (1, 32)
            for d in DEFAULT_SPIN_US}
    got = {(r["mode"], r["conc"], r["spin_us"]) for r in res["cells"]}
    assert got == want and len(res["cells"]) == len(want)
    for r in res["cells"]:
        assert list(r) == list(cells.COLUMNS), r["mode"]


def test_sim_sweep_vt_cells_have_sane_values(sim_sweep):
    _, _, res = sim_sweep
    steps = res["steps"]
    for r in (r for r in res["cells"] if r["impl"] == "vt"):
        where = (r["mode"], r["conc"], r["spin_us"])
        assert r["status"] == "ok" and r["absent_reason"] is None, where
        assert r["decode_steps"] == steps and r["decode_tokens"] == steps * r["conc"], where
        assert r["prefill_steps"] >= 1 and r["prefill_tokens"] == r["conc"], where
        assert r["steps_per_s"] > 0 and math.isclose(r["tokens_per_s"], r["steps_per_s"] * r["conc"])
        assert math.isclose(r["step_us"] * r["steps_per_s"], 1e6)
        # every step waits for at least D of device time on the sim (a sleep)
        assert r["step_us"] >= r["spin_us"], where
        assert r["tokens_ok"] is True and r["identical_to_drain"] is True, where
        assert r["driver_mallocs_since_warm_up"] == 0, where
        runs = r["step_us_runs"]   # the row is the median of --repeats timed runs
        assert len(runs) == res["repeats"] == 3, where
        assert math.isclose(r["step_us"], sorted(runs)[1], rel_tol=1e-9), where
        for p in cells.HOST_PARTS:
            assert r[f"host_{p}_us"] >= 0, (where, p)
        assert r["host_drain_us"] >= 0 and r["host_us"] > 0 and r["wait_us"] >= 0, where
        assert 0 < r["host_busy_us"] <= r["step_us"], where
        assert math.isclose(r["host_machinery_us"], r["host_refresh_us"] + r["host_acquire_us"]
                            + r["host_launch_us"]), where
        assert r["device_us"] >= r["spin_us"] and r["gpu_idle_us"] >= 0, where
        assert r["ceiling_us"] >= r["spin_us"] and r["ceiling_steps_per_s"] > 0, where
        assert 0 < r["fraction_of_ceiling"] < 10, where   # the sim's ceiling is noisy
        assert r["ratio_to_drain"] > 0 and r["overlap_efficiency"] > 0, where
        assert r["overlap_efficiency_hd"] > 0 and r["overlap_h_us"] > 0, where
        assert r["ratio_to_torch_async"] is None, where   # no torch on the sim
        assert r["profiled_steps_per_s"] > 0, where
        pairs = r["profiled_host_ratio_pairs"]   # a profiled run against its unprofiled neighbour
        assert len(pairs) == 3 and all(x > 0 for x in pairs), where
        assert r["profiled_host_ratio"] == sorted(pairs)[1], where
        if r["mode"] == "drain":
            assert r["ratio_to_drain"] == 1.0
    assert any(r["host_drain_us"] > 0 for r in res["cells"] if r["mode"] == "drain")


def test_sim_sweep_marks_the_torch_peer_absent(sim_sweep):
    _, _, res = sim_sweep
    assert res["torch"]["available"] is False and "sim" in res["torch"]["absent_reason"]
    peer = [r for r in res["cells"] if r["impl"] == "torch"]
    assert len(peer) == 2 * 2 * len(DEFAULT_SPIN_US)
    for r in peer:
        assert r["status"] == "absent" and r["absent_reason"] == res["torch"]["absent_reason"]
        assert r["steps_per_s"] is None and r["ratio_to_drain"] is None


def test_sim_sweep_prints_the_tables(sim_sweep, capsys):
    _, _, res = sim_sweep
    from vt.bench.report import table
    text = table(res)
    for needle in ("S=1: us per decode step", "S=32: steps/s ratio to drain", "ceiling",
                   "torch_async", "absent", "staged S=32 D=1000", "torch peer absent"):
        assert needle in text, needle


def test_model_workload_on_the_sim(tmp_path, capsys):
    out, png = tmp_path / "m.json", tmp_path / "m.png"
    # --png without matplotlib is refused before the run (tests/cli/test_frontends.py)
    plot = ["--png", str(png)] if importlib.util.find_spec("matplotlib") else []
    assert main(["--backend", "sim", "--workload", "model", "--preset", "tiny-dense",
                 "--conc", "1", "3", "--modes", "drain", "ring", "--steps", "4",
                 "--prompt-len", "3", "--no-bar", "--json", str(out), *plot]) == 0
    res = json.loads(out.read_text())
    assert res["workload"] == "model" and res["presets"] == ["tiny-dense"]
    assert res["torch"]["available"] is False
    assert {(r["mode"], r["conc"]) for r in res["cells"]} == {(m, c) for m in ("drain", "ring")
                                                              for c in (1, 3)}
    for r in res["cells"]:
        assert r["preset"] == "tiny-dense" and r["spin_us"] is None
        assert r["decode_steps"] == 4 and r["tokens_per_s"] > 0 and r["ceiling_us"] > 0
        assert r["identical_to_drain"] is True and r["tokens_ok"] is None
    text = capsys.readouterr().out
    assert "tiny-dense: us per decode step" in text
    assert png.exists() == bool(plot)
    # the tables again from the saved JSON, merged with itself, measuring nothing
    again = tmp_path / "again.json"
    assert main(["--from-json", str(out), str(out), "--json", str(again)]) == 0
    merged = json.loads(again.read_text())
    assert len(merged["cells"]) == 2 * len(res["cells"]) and merged["presets"] == ["tiny-dense"]


def test_a_peer_that_fails_to_set_up_leaves_the_vt_cells(tmp_path, monkeypatch):
    from vt.bench import run as run_mod

    class Broken:
        def __init__(self, S, vocab):
            raise RuntimeError("no graph for you")
    monkeypatch.setattr(run_mod, "torch_absent_reason", lambda be, args: None)
    monkeypatch.setattr(torch_peer, "TorchPeer", Broken)
    out = tmp_path / "b.json"
    assert main(["--backend", "sim", "--device-us", "0", "--conc", "2", "--modes", "drain",
                 "--steps", "3", "--no-bar", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["torch"]["available"] is False and "no graph for you" in res["torch"]["absent_reason"]
    by = {r["mode"]: r for r in res["cells"]}
    assert by["drain"]["status"] == "ok" and by["torch_async"]["status"] == "absent"


def test_overlap_efficiency_and_ratios():
    """Drain: 1 ms steps, 600 us of them host work, a 500 us device ceiling. Perfect overlap
    takes max(600, 500) = 600 us: the best speed-up is 1/0.6; a ring at 1.5x drain (667 us)
    gets 0.6 * 1.5 = 0.9 of it. Read literally with drain's profiled h = d = 100 us, the
    ideal is 2x and the same ring scores 0.75."""
    base = dict(workload="synthetic", conc=32, spin_us=100.0, impl="vt")
    drain = dict(cells.blank_row(mode="drain", **base), steps_per_s=1000.0, step_us=1000.0,
                 host_busy_us=600.0, ceiling_us=500.0, host_us=100.0, device_us=100.0,
                 tokens_sha1="a")
    ring = dict(cells.blank_row(mode="ring", **base), steps_per_s=1500.0, step_us=1e6 / 1500,
                tokens_sha1="a")
    peer = dict(cells.blank_row(mode="torch_async", **dict(base, impl="torch")),
                steps_per_s=3000.0, tokens_sha1="b")
    cells.add_comparisons([drain, ring, peer])
    assert ring["ratio_to_drain"] == 1.5
    assert math.isclose(ring["overlap_efficiency"], 0.9)
    assert math.isclose(ring["overlap_efficiency_hd"], 0.75)
    assert (ring["overlap_h_us"], ring["overlap_d_us"]) == (600.0, 500.0)
    assert math.isclose(drain["overlap_efficiency"], 0.6)   # drain itself: max(h, d) / T_drain
    assert ring["ratio_to_torch_async"] == 0.5 and peer["ratio_to_torch_async"] == 1.0
    assert ring["identical_to_drain"] and not peer["identical_to_drain"]
    assert peer["overlap_efficiency"] is None and peer["overlap_efficiency_hd"] is None


def test_stats_delta_subtracts_nested_numbers():
    before = dict(steps=3, mode="ring", phases=dict(decode=dict(steps=2, wall_s=0.5)))
    after = dict(steps=10, mode="ring", phases=dict(decode=dict(steps=8, wall_s=2.0)))
    assert cells.stats_delta(before, after) == dict(
        steps=7, mode="ring", phases=dict(decode=dict(steps=6, wall_s=1.5)))


def test_synthetic_logits_follow_the_host_vectors():
    """The numpy kernel's argmax is next_token(table[rows], positions): a poisoned row or
    position (another value) changes the token."""
    table = np.array([5, 9, 4000, 0], np.int32)
    rows, pos = np.array([0, 2, 1], np.int32), np.array([3, 0, 7], np.int32)
    logits = np.zeros((3, SYNTH_VOCAB), np.float32)
    Logits().run_numpy(table, rows, pos, logits)
    want = next_token(table[rows], pos)
    assert (logits.argmax(1) == want).all() and (logits.sum(1) == 1).all()
    Logits().run_numpy(table, np.array([1, 2, 1], np.int32), pos, logits)
    assert logits.argmax(1)[0] != want[0]
    assert expected_tokens([1, 2, 3], 3) == [int(next_token(3, 2)), int(next_token(next_token(3, 2), 3)),
                                             int(next_token(next_token(next_token(3, 2), 3), 4))]


def test_timed_ms_on_the_sim(sim_backend):
    s = sim_backend.stream()
    ms = timed_ms(sim_backend, s, lambda: sim_backend.busy_wait(s, 2e-3), 3, 2, warmup=1)
    assert ms >= 1.5
    with pytest.raises(ValueError):
        timed_ms(sim_backend, s, lambda: None, 0, 1)


def test_progress_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    with ProgressBar(2, out=out) as p:
        p.step("set-up")
        p.log("a note")
        p.step("cell")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[1/2") and lines[0].endswith("set-up")
    assert lines[1] == "a note" and lines[2].startswith("[2/2")


@pytest.mark.parametrize("argv,needle", [
    (["--conc", "0"], "--conc must be positive"),
    (["--warmup-s", "-1"], "--warmup-s must be a finite number in [0, 600]"),
    (["--device-us", "-5"], "--device-us must be a finite number in [0, 1e+06]"),
    (["--modes", "ring", "ring"], "--modes must not repeat"),
    (["--workload", "model", "--preset", "nope"], "unknown preset"),
    (["--workload", "model", "--preset", "bench-dense"],
     "preset(s) ['bench-dense'] are GPU benchmark models; on the sim backend they need "
     "gigabytes of host memory and minutes per step: use tiny-dense or tiny-moe, or add --force"),
])
def test_bad_arguments_are_refused_before_any_work(argv, needle, capsys):
    assert main(["--backend", "sim", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


def test_vt_cli_has_the_bench_subcommand():
    from vt.cli.main import build_parser
    args = build_parser().parse_args(["bench", "--backend", "sim", "--conc", "4"])
    assert args.func.__name__ == "cmd_bench" and args.conc == [4]


def test_torch_peer_reason_when_it_cannot_run():
    reason = torch_peer.unavailable_reason()
    if reason is None:
        pytest.skip("the torch peer can run here (tested by the gpu test below)")
    assert any(w in reason for w in ("torch", "cupy", "CUDA"))


def test_torch_peer_loops_on_cpu_tensors():
    """The peer's host loops (sync and depth 2: which graph and pinned block, which step's
    tokens when) and its sampling + feedback, on CPU tensors: graph b's replay copies
    pinned_in[b] in, runs the forward in torch ops and the peer's own _sample_and_feed_back,
    and copies the tokens to pinned_tok[b]; events and stream are no-ops."""
    torch = pytest.importorskip("torch")
    S, V = 3, SYNTH_VOCAB

    class _NoOp:
        def record(self, *a):
            pass

        def synchronize(self):
            pass

    peer = object.__new__(torch_peer.TorchPeer)
    # The loops enter torch.cuda.stream(peer.stream): a no-op here, also where CUDA exists.
    cuda = types.SimpleNamespace(stream=lambda s: contextlib.nullcontext())
    torch_cpu = types.SimpleNamespace(tensor=torch.tensor, int32=torch.int32,
                                      argmax=torch.argmax, cuda=cuda)
    peer.torch, peer.S, peer.vocab, peer.stream = torch_cpu, S, V, _NoOp()
    peer.table = torch.zeros(S + 1, dtype=torch.int32)
    peer.inputs = torch.zeros(2, S, dtype=torch.int32)
    peer.logits = torch.zeros(S, V)
    peer.tokens = torch.zeros(S, dtype=torch.int32)
    peer.pinned_in = [torch.zeros(2, S, dtype=torch.int32) for _ in range(2)]
    peer.pinned_tok = [torch.zeros(S, dtype=torch.int32) for _ in range(2)]
    peer.np_in, peer.np_tok = [p.numpy() for p in peer.pinned_in], [p.numpy() for p in peer.pinned_tok]
    peer.tok_ready = [_NoOp(), _NoOp()]

    class _Graph:
        """Graph b: pinned_in[b] in, the forward, sampling + feedback, tokens to pinned_tok[b]."""
        def __init__(self, b):
            self.b = b

        def replay(self):
            peer.inputs.copy_(peer.pinned_in[self.b])
            rows, pos = peer.inputs[0].long(), peer.inputs[1].long()
            target = (peer.table[rows].long() % V * 7 + pos * 13 + 1) % V
            peer.logits.zero_()
            peer.logits[torch.arange(S), target] = 1.0
            peer._sample_and_feed_back()
            peer.pinned_tok[self.b].copy_(peer.tokens)
    peer.graphs = [_Graph(0), _Graph(1)]
    prompts = [[5, 17], [4000, 1, 2], [9]]
    want = [expected_tokens(p, 7) for p in prompts]
    for variant in torch_peer.VARIANTS:
        res = peer.run(variant, prompts, 6)
        assert res["tokens"] == want, variant


@pytest.mark.torch_allocator
@pytest.mark.gpu
def test_torch_peer_tokens_match_the_synthetic_forward():
    if "cuda" not in available_backends() or torch_peer.unavailable_reason() is not None:
        pytest.skip(f"torch peer unavailable: {torch_peer.unavailable_reason()}")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, SYNTH_VOCAB, 4).tolist() for _ in range(4)]
    peer = torch_peer.TorchPeer(4)
    try:
        peer.set_device_us(20)
        assert peer.ceiling_us(20) >= 20
        for variant in torch_peer.VARIANTS:
            res = peer.run(variant, prompts, 10)
            assert res["tokens"] == [expected_tokens(p, 11) for p in prompts], variant
            assert res["wall_s"] > 10 * 20e-6 and 0 <= res["wait_s"] <= res["wall_s"]
    finally:
        peer.close()


def test_median_run_picks_the_middle_run_and_keeps_every_time():
    from vt.bench.measure import median_run
    runs = [dict(s=3e-6), dict(s=1e-6), dict(s=9e-6), dict(s=2e-6)]
    chosen, times = median_run(runs, lambda r: r["s"])
    assert chosen is runs[3]                      # lower middle of 1, 2, 3, 9
    assert times == pytest.approx([3.0, 1.0, 9.0, 2.0])
    assert median_run(runs[:1], lambda r: r["s"])[0] is runs[0]
