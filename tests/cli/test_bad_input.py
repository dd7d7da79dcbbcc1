"""Bad input to `vt` and to the model's constructor: one line that names the value and what to
do, exit code 2, no traceback, and (for the CLI) nothing started before the check."""
import os
import subprocess
import sys

import pytest

import vt
import vt.backend
import vt.cli.run
from vt.cli.main import main
from vt.bundled import PRESETS, HybridModel, init_weights

TINY_RUN = ["run", "--backend", "sim", "--steps", "2", "--requests", "3", "--concurrency", "2",
            "--prompt-len", "4"]


class Reached(Exception):
    """Raised in place of building the model: the run got past every check."""


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No VT_* variable from the caller's shell; a default trace path would land in tmp_path."""
    for var in [v for v in os.environ if v.startswith("VT_")]:
        monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def nothing_started(monkeypatch):
    """Fail the test if the CLI opens a backend or builds a model before refusing."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a backend was opened or a model built before the input was checked")
    monkeypatch.setattr(vt.backend, "get_backend", forbidden)
    monkeypatch.setattr(vt.cli.run, "build_model", forbidden)


@pytest.fixture
def stop_before_model(monkeypatch):
    def reached(*args, **kwargs):
        raise Reached
    monkeypatch.setattr(vt.cli.run, "build_model", reached)


def refused(capsys, argv, *needles):
    """Run `vt argv`: exit code 2, nothing on stdout, one line on stderr holding every needle."""
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    assert out == "" and "Traceback" not in err
    assert err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


# ------------------------------------------------------------------ flags
@pytest.mark.parametrize("flag,value", [
    ("--concurrency", "0"), ("--steps", "0"), ("--prompt-len", "-1"), ("--prompt-len", "0"),
    ("--requests", "0"), ("--requests", "-2")])
def test_sizes_must_be_positive(capsys, nothing_started, flag, value):
    refused(capsys, ["run", flag, value], f"vt run: {flag} must be a positive integer, got {value}")


def test_negative_seed(capsys, nothing_started):
    refused(capsys, ["run", "--seed", "-1"], "vt run: --seed must be an integer in [0, 9223372036854775807], got -1")


@pytest.mark.parametrize("value", ["-5", "nan", "inf"])
def test_sim_delay_must_be_finite_and_non_negative(capsys, nothing_started, value):
    refused(capsys, ["run", "--sim-delay-ms", value], "--sim-delay-ms must be a finite number in [0, 1000]")


def test_sim_delay_with_cuda_is_refused(capsys, monkeypatch, nothing_started):
    monkeypatch.setattr(vt.cli.run, "backend_name", lambda name: "cuda")
    refused(capsys, ["run", "--sim-delay-ms", "2"], "--sim-delay-ms applies to the sim backend",
            "--backend sim")


def test_not_an_integer_is_one_line(capsys):
    refused(capsys, ["run", "--concurrency", "x"], "--concurrency", "invalid int value: 'x'",
            "see vt run --help")


def test_unknown_mode_lists_the_canonical_names(capsys):
    refused(capsys, ["run", "--mode", "fast"], "'fast'", "staged", "unguarded")


def test_bench_refuses_an_unknown_mode(capsys, nothing_started):
    refused(capsys, ["bench", "--modes", "ring", "fast"], "'fast'", "staged", "unguarded")


def test_trace_in_a_missing_directory_is_refused_before_the_run(capsys, nothing_started):
    refused(capsys, ["run", "--trace", "/nonexistent/x.json"], "'/nonexistent/x.json'",
            "directory '/nonexistent', which does not exist", "write elsewhere")


def test_trace_under_a_file_or_at_a_directory_is_refused(capsys, nothing_started, tmp_path):
    (tmp_path / "f").write_text("")
    refused(capsys, ["run", "--trace", str(tmp_path / "f" / "x.json")], "which is not a directory")
    refused(capsys, ["run", "--trace", str(tmp_path)], "is a directory", "trace.json")


def test_unknown_preset(capsys, nothing_started):
    refused(capsys, ["run", "--backend", "sim", "--preset", "huge"], "unknown preset 'huge'",
            "tiny-dense")


def test_context_beyond_the_preset(capsys, nothing_started):
    refused(capsys, ["run", "--backend", "sim", "--prompt-len", "300"],
            "prompt + new tokens - 1 = 331 exceeds tiny-dense's max_context 256", "shorter prompt")


@pytest.mark.skipif("cuda" in vt.backend.available_backends(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_says_why(capsys):
    refused(capsys, ["run", "--backend", "cuda"], "the cuda backend is unavailable",
            "--backend sim")
    # vt info prints the package versions first: they are what explains a missing backend.
    assert main(["info", "--backend", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vt info: the cuda backend is unavailable") and err.count("\n") == 1


BENCH_PRESETS = [name for name in PRESETS if name.startswith("bench-")]


def test_the_bench_presets_are_the_ones_refused():
    assert {"bench-dense", "bench-moe"} <= set(BENCH_PRESETS)


@pytest.mark.parametrize("preset", BENCH_PRESETS)
def test_bench_presets_on_the_sim_are_refused(capsys, nothing_started, preset):
    refused(capsys, ["run", "--backend", "sim", "--preset", preset],
            f"preset {preset} is a GPU benchmark model", "GB of weights", "--force")


def test_force_runs_a_bench_preset_on_the_sim(capsys, stop_before_model):
    with pytest.raises(Reached):
        main(["run", "--backend", "sim", "--preset", "bench-dense", "--force"])
    assert "preset=bench-dense" in capsys.readouterr().out


# ------------------------------------------------------------------ environment
@pytest.mark.parametrize("var,value,needle", [
    ("VT_ASYNC_EXECUTOR", "yes", "VT_ASYNC_EXECUTOR must be 0 or 1, got 'yes'"),
    ("VT_ASYNC_SERVING_CONC", "0", "VT_ASYNC_SERVING_CONC must be a positive integer, got '0'"),
    ("VT_CAPTURE_SIZES", "1,x", "VT_CAPTURE_SIZES must be comma-separated positive integers"),
    ("VT_ASYNC_EXECUTOR_TRACE", "yes", "VT_ASYNC_EXECUTOR_TRACE must be 0, 1"),
])
def test_bad_environment_variable(capsys, monkeypatch, nothing_started, var, value, needle):
    monkeypatch.setenv(var, value)
    refused(capsys, ["run"], needle, "fix or unset the variable")


def test_trace_variable_yes_writes_no_file(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("VT_ASYNC_EXECUTOR_TRACE", "yes")
    refused(capsys, ["run"], "path ending in .json")
    assert not (tmp_path / "yes").exists()


def test_trace_variable_in_a_missing_directory(capsys, monkeypatch, nothing_started):
    monkeypatch.setenv("VT_ASYNC_EXECUTOR_TRACE", "/nonexistent/t.json")
    refused(capsys, ["run"], "VT_ASYNC_EXECUTOR_TRACE '/nonexistent/t.json'", "does not exist")


def test_contradicting_variables_are_named(capsys, monkeypatch, nothing_started):
    monkeypatch.setenv("VT_ASYNC_EXECUTOR", "1")
    monkeypatch.setenv("VT_ASYNC_EXECUTOR_NO_DBUF", "1")
    refused(capsys, ["run"], "VT_ASYNC_EXECUTOR=1, VT_ASYNC_EXECUTOR_NO_DBUF=1")


def test_bad_pool_debug_variable(capsys, monkeypatch, stop_before_model):
    monkeypatch.setenv("VT_POOL_DEBUG", "on")
    refused(capsys, ["run", "--backend", "sim"], "VT_POOL_DEBUG must be 0 or 1, got 'on'",
            "fix or unset")


def test_mode_flag_replaces_the_mode_variables(capsys, monkeypatch, stop_before_model):
    """--mode is the whole mode: VT_ASYNC_EXECUTOR_NO_DBUF=1 does not leak into --mode ring."""
    monkeypatch.setenv("VT_ASYNC_EXECUTOR_NO_DBUF", "1")
    with pytest.raises(Reached):
        main([*TINY_RUN, "--mode", "ring"])
    out, err = capsys.readouterr()
    assert "mode=ring " in out and err == ""


# ------------------------------------------------------------------ the unsafe arm
def test_unguarded_mode_needs_the_opt_in(capsys, nothing_started):
    refused(capsys, ["run", "--mode", "unguarded"], "--mode unguarded is the unsafe test arm",
            "add --unsafe-unguarded")


def test_unguarded_variable_needs_the_opt_in(capsys, monkeypatch, nothing_started):
    monkeypatch.setenv("VT_ASYNC_EXECUTOR_NO_DBUF", "1")
    refused(capsys, ["run"], "VT_ASYNC_EXECUTOR_NO_DBUF=1 is the unsafe test arm",
            "add --unsafe-unguarded")


@pytest.mark.parametrize("how", ["flag", "env"])
def test_opted_in_unguarded_warns(capsys, monkeypatch, stop_before_model, how):
    if how == "env":
        monkeypatch.setenv("VT_ASYNC_EXECUTOR_NO_DBUF", "1")
    with pytest.raises(Reached):
        main([*TINY_RUN, "--unsafe-unguarded"] + (["--mode", "unguarded"] if how == "flag" else []))
    out, err = capsys.readouterr()
    assert "mode=unguarded " in out
    assert err.startswith("vt run: WARNING: mode unguarded") and "WRONG" in err


# ------------------------------------------------------------------ what good input does
def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"vt {vt.__version__}\n"


def test_the_drain_mode_and_requests_are_honoured(capsys, stop_before_model):
    with pytest.raises(Reached):
        main([*TINY_RUN, "--mode", "drain"])
    out = capsys.readouterr().out
    assert "mode=drain " in out and "requests=3 " in out


def test_an_opted_in_unguarded_run_completes_with_the_warning(capsys):
    """End to end on the sim: the warning on stderr, the summary and exit code 0."""
    assert main([*TINY_RUN, "--mode", "unguarded", "--unsafe-unguarded"]) == 0
    out, err = capsys.readouterr()
    assert "WARNING: mode unguarded" in err
    assert "mode unguarded" in out and "finished: 3 length" in out


def test_a_real_process_exits_2_with_one_line():
    env = {k: v for k, v in os.environ.items() if not k.startswith("VT_")}
    p = subprocess.run([sys.executable, "-m", "vt", "run", "--concurrency", "0"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout) == (2, "")
    assert p.stderr == "vt run: --concurrency must be a positive integer, got 0\n"
    p = subprocess.run([sys.executable, "-m", "vt", "--version"], capture_output=True, text=True,
                       timeout=60)
    assert (p.returncode, p.stdout) == (0, f"vt {vt.__version__}\n")


# ------------------------------------------------------------------ the model's sizes
@pytest.mark.parametrize("kwargs,error,needle", [
    (dict(max_seqs=0), ValueError, "max_seqs (None: the default) must be an integer in [1, 2147483647], got 0"),
    (dict(max_seqs=-1), ValueError, "got -1"),
    (dict(max_seqs=2.5), TypeError, "got 2.5"),
    (dict(max_seqs=True), TypeError, "got True"),
    (dict(num_kv_blocks=-5), ValueError, "num_kv_blocks (None: the default) must be an integer in [1, "),
    (dict(num_kv_blocks=0), ValueError, "num_kv_blocks (None: the default) must be an integer"),
])
def test_hybrid_model_rejects_bad_sizes(sim_backend, kwargs, error, needle):
    """vt.validate's one message: a non-integer is a TypeError, an integer out of range a
    ValueError."""
    cfg = PRESETS["tiny-dense"]
    with pytest.raises(error, match="HybridModel: ") as e:
        HybridModel(sim_backend, cfg, init_weights(cfg), **kwargs)
    assert needle in str(e.value)
