"""tools/bench_step.py and tools/profile_step.py (moved out of vt.model) run end to end on the
sim at toy sizes, through the one replay timer (vt.timing)."""
import importlib.util
import json
from pathlib import Path

_TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"vt_tools_{name}", _TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _small_copy(mod, orig):
    mod.copy_bandwidth = lambda be, s, nbytes=1 << 20: orig(be, s, nbytes)   # not 1 GiB on the CPU


def test_bench_step_on_the_sim(tmp_path, capsys):
    bench_step = _load("bench_step")
    _small_copy(bench_step, bench_step.copy_bandwidth)
    out = tmp_path / "rows.json"
    bench_step.main(["--backend", "sim", "--preset", "tiny-dense", "--batch", "1", "2",
                     "--context", "8", "--iters", "2", "--repeats", "2", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [r["batch"] for r in rows] == [1, 2] and all(r["step_ms"] > 0 for r in rows)
    assert all(r["mallocs_during_capture"] == 0 for r in rows)


def test_profile_step_on_the_sim(capsys):
    profile_step = _load("profile_step")
    _small_copy(profile_step, profile_step.copy_bandwidth)
    profile_step._L2_BYTES = 1 << 16
    profile_step.main(["--backend", "sim", "--preset", "tiny-dense", "--batch", "2",
                       "--context", "8", "--iters", "2", "--repeats", "1", "--mode", "remove"])
    out = capsys.readouterr().out
    assert "S=2: captured step" in out and "gemm" in out and "sample" in out
