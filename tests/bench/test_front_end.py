"""`vt bench` reaches every benchmark: the ones with options of their own (torch-decode,
torch-ttft, invariance) through `vt bench --workload NAME`, their flags listed by its --help
and refused in one line; vt/cli stays argument parsing and front ends over vt.bench."""
import pathlib

import pytest

from vt.backend import available_backends
from vt.cli.bench import STANDALONE
from vt.cli.main import main

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_vt_bench_help_lists_every_workload(capsys):
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for name in ("synthetic", "model", "torch", "sampler", "serve", "torch-decode", "torch-ttft",
                 "invariance", "prefix-cache"):
        assert name in out, name


@pytest.mark.parametrize("name, flag", [("torch-decode", "--rows"), ("torch-ttft", "--single"),
                                        ("invariance", "--parts"), ("prefix-cache", "--shapes")])
@pytest.mark.parametrize("spelling", ["split", "joined"])
def test_a_workload_with_options_of_its_own_lists_them(capsys, name, flag, spelling):
    """`vt bench --workload NAME --help` (or --workload=NAME) is that workload's parser."""
    workload = ["--workload", name] if spelling == "split" else [f"--workload={name}"]
    assert main(["bench", *workload, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: vt bench --workload {name}") and flag in out


@pytest.mark.parametrize("argv, message", [
    (["--workload", "invariance", "--live", "5000"],
     "vt bench --workload invariance: --live and --prompts must be 1..2048 tokens, got 5000"),
    (["--workload", "torch-ttft", "--preset", "tiny", "--prompt-len", "600"],
     "vt bench --workload torch-ttft: --prompt-len 600 must be in [1, --context 512)"),
    (["--workload", "torch-decode", "--steps", "3"],
     "vt bench --workload torch-decode: --steps must be even and >= 2"),
    (["--workload", "torch-decode", "--conc", "4"],
     "vt bench --workload torch-decode: unrecognized arguments: --conc 4"),
])
def test_a_bad_flag_of_such_a_workload_is_one_line_and_exit_2(capsys, argv, message):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


@pytest.mark.skipif("cuda" in available_backends(), reason="on a GPU the workload runs")
def test_the_invariance_workload_is_refused_without_a_gpu(capsys):
    assert main(["bench", "--workload", "invariance", "--parts", "step"]) == 2
    assert "--workload invariance needs a CUDA GPU" in capsys.readouterr().err


def test_the_other_workloads_still_parse_the_shared_flags(capsys):
    """A standalone workload's name elsewhere in argv (a --json path) is not a workload."""
    assert main(["bench", "--backend", "sim", "--workload", "synthetic", "--conc", "0",
                 "--json", "torch-decode"]) == 2
    assert "--conc must be positive" in capsys.readouterr().err


def test_every_standalone_workload_module_has_the_front_ends_interface():
    import importlib
    for name, (module, what) in STANDALONE.items():
        mod = importlib.import_module(f"vt.bench.{module}")
        assert all(callable(getattr(mod, f, None))
                   for f in ("add_arguments", "check_arguments", "run_and_report")), name
        assert what


def test_vt_cli_is_argument_parsing_and_front_ends():
    """The benchmarks live in vt/bench; vt/cli stays small (at most 1,500 lines)."""
    lines = sum(len(p.read_text().splitlines()) for p in (ROOT / "vt" / "cli").rglob("*.py"))
    assert lines <= 1500, f"vt/cli has {lines} lines: move what is not a front end to vt/bench"
