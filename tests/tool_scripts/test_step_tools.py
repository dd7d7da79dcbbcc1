"""tools/bench_step.py and tools/profile_step.py (moved out of vt.model) run end to end on the
sim at toy sizes, through the one replay timer (vt.backend.timing)."""
import json

from tools import bench_step, profile_prefill, profile_step, sampler_ablation


def _small_copy(monkeypatch, mod):
    orig = mod.copy_bandwidth   # not 1 GiB on the CPU
    monkeypatch.setattr(mod, "copy_bandwidth", lambda be, s, nbytes=1 << 20: orig(be, s, nbytes))


def test_bench_step_on_the_sim(tmp_path, capsys, monkeypatch):
    _small_copy(monkeypatch, bench_step)
    out = tmp_path / "rows.json"
    bench_step.main(["--backend", "sim", "--preset", "tiny-dense", "--batch", "1", "2",
                     "--context", "8", "--iters", "2", "--repeats", "2", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [r["batch"] for r in rows] == [1, 2] and all(r["step_ms"] > 0 for r in rows)
    assert all(r["mallocs_during_capture"] == 0 for r in rows)


def test_profile_step_on_the_sim(capsys, monkeypatch):
    _small_copy(monkeypatch, profile_step)
    monkeypatch.setattr(profile_step, "_L2_BYTES", 1 << 16)
    profile_step.main(["--backend", "sim", "--preset", "tiny-dense", "--batch", "2",
                       "--context", "8", "--iters", "2", "--repeats", "1", "--mode", "remove"])
    out = capsys.readouterr().out
    assert "S=2: captured step" in out and "gemm" in out and "sample" in out


def test_profile_prefill_on_the_sim(tmp_path):
    """Each (seqs, prompt length) prefills eagerly and from a captured graph, with no driver
    malloc during the capture (the fixture counts them), and reports all three times."""
    out = tmp_path / "prefill.json"
    assert profile_prefill.main(["--backend", "sim", "--preset", "tiny-dense", "--max-seqs", "4",
                                 "--seqs", "1", "2", "--prompt-len", "5", "--iters", "2",
                                 "--repeats", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["seqs"], r["prompt_len"]) for r in rows] == [(1, 5), (2, 5)]
    assert all(r["host_ms"] > 0 and r["eager_ms"] > 0 and r["graph_ms"] > 0 for r in rows)


def test_sampler_ablation_edits_still_match_the_kernel(capsys):
    """Each variant of tools/sampler_ablation.py edits the kernel source text exactly once: a
    kernel change that moves a stage fails here, not on the GPU by timing the wrong thing."""
    assert sampler_ablation.main(["--check"]) == 0
    assert f"{len(sampler_ablation.VARIANTS)} variants apply" in capsys.readouterr().out
