"""`vt run` and `vt bench` never lose work: every bad flag, VT_* variable and output path is
refused before any work with one line and exit code 2, and an interrupted run leaves every
output file whole or absent.

| defect class                                                  | test                                      |
|---------------------------------------------------------------|-------------------------------------------|
| a bad flag or variable: traceback, exit 1, or work done first | test_vt_run_refuses_every_bad_value,      |
|   (capture size above max batch, --wait-poll-us -1,           |   test_vt_bench_refuses_every_bad_value   |
|   --warmup-s inf, NaN/overflowing --sim-delay-ms)             |   (test_every_flag_has_bad_values_drawn   |
|                                                               |   keeps the tables complete)              |
| sizes without an upper bound (--concurrency, --requests,      | the same two (values past each bound),    |
|   capture sizes, --steps, ...)                                |   test_bounds_are_in_the_help             |
| an output path checked only after the work                    | the same two (--trace, --json, --png)     |
| --png on a name without .png reports a file it did not write  | test_png_needs_a_png_name_and_matplotlib  |
| --png without matplotlib exits 0                              | test_png_needs_a_png_name_and_matplotlib  |
| --from-json of a bad file: traceback                          | test_from_json_of_a_bad_file_is_one_line  |
| the CLI refuses a prompt + steps that the API accepts         | test_vt_run_accepts_what_generate_accepts |
| outputs written in place: a second Ctrl-C truncates them      | test_interrupted_runs_leave_whole_or_...  |
|                                                               |   test_atomic_open_keeps_the_old_file_... |
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vt.bench.run
import vt.cli.run
from vt.bench import limits as lim
from vt.atomic_file import atomic_open
from vt.cli.main import main
from vt.config import MODES
from vt.bundled import PRESETS

HYPOTHESIS = settings(max_examples=120, deadline=None, derandomize=True,
                      suppress_health_check=[HealthCheck.function_scoped_fixture])


class Started(AssertionError):
    """Raised where the work would start: the bad value got past the checks."""


@pytest.fixture(autouse=True)
def no_work(monkeypatch, tmp_path):
    """No VT_* variable from the shell; building a model or measuring anything fails the test."""
    for var in [v for v in os.environ if v.startswith("VT_")]:
        monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)

    def started(*args, **kwargs):
        raise Started("work started before the input was refused")
    monkeypatch.setattr(vt.cli.run, "build_model", started)
    monkeypatch.setattr(vt.bench.run, "warm_up_device", started)


def refused(capsys, argv, env=None, monkeypatch=None):
    for var, value in (env or {}).items():
        monkeypatch.setenv(var, value)
    try:
        rc = main(argv)
    finally:
        for var in env or {}:
            monkeypatch.delenv(var)
    out, err = capsys.readouterr()
    assert rc == 2, (argv, env, rc, out, err)
    assert out == "" and "Traceback" not in err, (argv, env, out, err)
    assert err.count("\n") == 1 and err.endswith("\n"), (argv, env, err)
    return err


# ------------------------------------------------------------------ bad values, per flag
def _not(parse):
    """Text that `parse` (int or float) does not accept: argparse's own one-line error."""
    def bad(text):
        try:
            parse(text)
        except ValueError:
            return True
        return False
    return st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                   max_size=8).filter(bad)


def bad_int(lo, hi):
    return st.one_of(st.integers(max_value=lo - 1), st.integers(min_value=hi + 1, max_value=10**30),
                     ).map(str) | _not(int)


def bad_float(lo, hi, *, hi_open=False):
    above = st.floats(min_value=hi, exclude_min=not hi_open, allow_infinity=True)
    return st.one_of(st.sampled_from(["nan", "inf", "-inf", "1e400"]),
                     st.floats(max_value=lo, exclude_max=True), above).map(str) | _not(float)


def bad_choice(choices):
    return st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                   min_size=1, max_size=12).filter(lambda s: s not in choices and not s.startswith("-"))


def bad_path(suffix):
    return st.sampled_from([f"/nonexistent-dir/out{suffix}", "/proc/vt-out" + suffix, ".",
                            "/", f"/dev/null/out{suffix}", ""])


TINY_MAX = PRESETS["tiny-dense"].max_context   # vt run on the sim: tiny-dense, --prompt-len 16, --steps 32

RUN_FLAGS = {
    "--requests": bad_int(1, lim.MAX_REQUESTS),
    "--concurrency": bad_int(1, lim.MAX_SERVING_CONC),
    "--steps": bad_int(1, TINY_MAX + 1 - 16),
    "--prompt-len": bad_int(1, TINY_MAX + 1 - 32),
    "--seed": bad_int(0, lim.MAX_SEED),
    "--sim-delay-ms": bad_float(0, lim.MAX_SIM_DELAY_MS),
    "--mode": bad_choice(list(MODES)),
    "--preset": bad_choice(list(PRESETS)) | st.sampled_from([p for p in PRESETS if p.startswith("bench-")]),
    "--trace": bad_path(".json"),
    "--backend": bad_choice(["auto", "cuda", "sim"]),
    "--force": st.sampled_from(["x", "1", "yes"]),           # a switch given a value
    "--unsafe-unguarded": st.sampled_from(["x", "1", "yes"]),
}
ENV_VARS = {
    "VT_ASYNC_EXECUTOR": bad_choice(["0", "1"]),
    "VT_ASYNC_EXECUTOR_NO_DBUF": st.just("1"),   # the unsafe arm without --unsafe-unguarded
    "VT_ASYNC_SERVING_CONC": bad_int(1, lim.MAX_SERVING_CONC),
    "VT_CAPTURE_SIZES": st.sampled_from(["0", "1,x", "65", "1,2000", ",".join(map(str, range(1, 70))), ""]),
    "VT_WAIT_POLL_US": bad_float(0, 1e6, hi_open=True),
    "VT_ASYNC_EXECUTOR_TRACE": st.sampled_from(["yes", "true", "/nonexistent-dir/t.json"]),
    "VT_POOL_DEBUG": st.sampled_from(["on", "2", "yes"]),
}


@HYPOTHESIS
@given(data=st.data())
def test_vt_run_refuses_every_bad_value(capsys, monkeypatch, data):
    """One bad flag or VT_* variable (and maybe a second): exit 2, one line, no traceback,
    nothing built."""
    env = {}
    argv = ["run", "--backend", "sim"]
    for _ in range(data.draw(st.integers(1, 2))):
        name = data.draw(st.sampled_from(sorted(RUN_FLAGS) + sorted(ENV_VARS)))
        if name in RUN_FLAGS:
            argv.append(f"{name}={data.draw(RUN_FLAGS[name])}")
        else:
            env[name] = data.draw(ENV_VARS[name])
    refused(capsys, argv, env, monkeypatch)


DATA = "vt-bench-input.json"
BENCH_FLAGS = {
    "--backend": bad_choice(["auto", "cuda", "sim"]),
    "--workload": bad_choice(["synthetic", "model", "torch", "sampler"]),
    "--vocab": bad_int(2, lim.MAX_VOCAB),
    "--sampling": bad_choice(["greedy", "top_k", "top_p", "temperature"]),
    "--arrival": bad_choice(["closed", "poisson"]),
    "--clients": st.sampled_from(["0", "-3", "x", "1.5"]),
    "--rate": st.sampled_from(["0", "-1", "nan", "inf", "x"]),
    "--requests": st.sampled_from(["0", "-5", "x"]),
    "--output-len": st.sampled_from(["0", "-1", "x", "5 2"]),
    "--prompt-range": st.sampled_from(["0", "-1", "x"]),
    "--url": st.sampled_from(["x", "localhost:8000", "ftp://127.0.0.1:8000"]),
    "--request-fields": st.sampled_from(["x", "[1]", '{"logprobs": 5}']),   # without --url: refused
    "--request-fields-share": st.sampled_from(["0", "1.5", "x", "0.5"]),
    "--prompt-kernels": bad_choice(["auto", "torch", "vt"]),
    "--device-us": bad_float(0, lim.MAX_DEVICE_US),
    "--conc": bad_int(1, lim.MAX_SERVING_CONC),
    "--modes": bad_choice(list(MODES)),
    "--steps": bad_int(1, lim.MAX_STEPS),
    "--prompt-len": bad_int(1, lim.MAX_PROMPT_LEN),
    "--repeats": bad_int(1, lim.MAX_REPEATS),
    "--ceiling-replays": bad_int(1, lim.MAX_CEILING_REPLAYS),
    "--warmup-s": bad_float(0, lim.MAX_WARMUP_S),
    "--profile": bad_choice(["both", "off"]),
    "--wait-poll-us": bad_float(0, lim.MAX_WAIT_POLL_US, hi_open=True),
    "--seed": bad_int(0, lim.MAX_SEED),
    "--sim-delay-ms": bad_float(0, lim.MAX_SIM_DELAY_MS),
    "--json": bad_path(".json"),
    "--png": bad_path(".png") | st.sampled_from(["plot", "plot.jpg", "plot.json"]),
    "--from-json": st.sampled_from(["missing.json", ".", "empty.json", "list.json", "text.json",
                                    "other.json", "damaged.json"]),
    "--preset": bad_choice(list(PRESETS)),
    "--force": st.sampled_from(["x", "1", "yes"]),           # a switch given a value
    "--no-torch": st.sampled_from(["x", "1", "yes"]),
    "--no-bar": st.sampled_from(["x", "1", "yes"]),
}


def _bad_result_files(directory):
    (directory / "empty.json").write_text("")
    (directory / "list.json").write_text("[1, 2]")
    (directory / "text.json").write_text("{'format': ")
    (directory / "other.json").write_text(json.dumps({"format": "something-else/1"}))
    (directory / "damaged.json").write_text(json.dumps({"format": "vt-bench/1", "workload": "model",
                                                        "cells": [{"mode": 1}]}))


@HYPOTHESIS
@given(data=st.data())
def test_vt_bench_refuses_every_bad_value(capsys, monkeypatch, tmp_path, data):
    _bad_result_files(tmp_path)
    argv = ["bench", "--backend", "sim"]
    for _ in range(data.draw(st.integers(1, 2))):
        name = data.draw(st.sampled_from(sorted(BENCH_FLAGS)))
        argv.append(f"{name}={data.draw(BENCH_FLAGS[name])}")
    refused(capsys, argv)


def test_every_flag_has_bad_values_drawn():
    """A flag added to `vt run` or `vt bench` without bad values in these tables fails here."""
    from vt.cli.main import build_parser
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    for name, table in (("run", RUN_FLAGS), ("bench", BENCH_FLAGS)):
        flags = {a.option_strings[-1] for a in sub[name]._actions if a.option_strings} - {"--help"}
        assert flags == set(table), (name, flags ^ set(table))


def test_vt_bench_model_presets_are_checked_up_front(capsys):
    """Every preset's context, before the first preset is measured."""
    err = refused(capsys, ["bench", "--backend", "sim", "--workload", "model", "--preset",
                           "tiny-dense", "tiny-moe", "--prompt-len", "250"])
    assert "exceeds" in err and "max_context" in err


def test_from_json_of_a_bad_file_is_one_line(capsys, tmp_path):
    _bad_result_files(tmp_path)
    for name, needle in (("text.json", "is not JSON"), ("missing.json", "cannot be read"),
                         ("other.json", "is not a vt bench result"),
                         ("damaged.json", "damaged")):
        assert needle in refused(capsys, ["bench", "--from-json", str(tmp_path / name)])


def test_png_needs_a_png_name_and_matplotlib(capsys, monkeypatch, tmp_path):
    assert "must end in .png" in refused(capsys, ["bench", "--png", str(tmp_path / "plot")])
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import matplotlib: ImportError
    assert "needs matplotlib" in refused(capsys, ["bench", "--png", str(tmp_path / "p.png")])
    assert not list(tmp_path.iterdir())


def test_same_json_and_png_path_is_refused(capsys, tmp_path):
    path = str(tmp_path / "x.png")
    assert "name the same file" in refused(capsys, ["bench", "--json", path, "--png", path])


def test_bounds_are_in_the_help(capsys):
    for argv, needles in ((["run", "--help"], [str(lim.MAX_REQUESTS), str(lim.MAX_SERVING_CONC)]),
                          (["bench", "--help"], [str(lim.MAX_STEPS), str(lim.MAX_REPEATS),
                                                 str(lim.MAX_SERVING_CONC), ".png"])):
        assert main(argv) == 0
        out = " ".join(capsys.readouterr().out.split())
        for needle in needles:
            assert needle in out, (argv, needle)


def test_vt_run_accepts_what_generate_accepts(capsys, monkeypatch):
    """generate() serves prompt + new - 1 <= max_context tokens: so does vt run, one past it
    is refused."""
    monkeypatch.setattr(vt.cli.run, "pick_backend", lambda *a, **k: (_ for _ in ()).throw(Started()))
    with pytest.raises(Started):
        main(["run", "--backend", "sim", "--prompt-len", str(TINY_MAX - 31), "--steps", "32"])
    refused(capsys, ["run", "--backend", "sim", "--prompt-len", str(TINY_MAX - 30), "--steps", "32"])


# ------------------------------------------------------------------ atomic outputs
def test_atomic_open_keeps_the_old_file_when_the_write_is_interrupted(tmp_path):
    path = tmp_path / "out.json"
    path.write_text('{"old": 1}')
    with pytest.raises(KeyboardInterrupt):
        with atomic_open(str(path)) as f:
            f.write('{"new": ')
            raise KeyboardInterrupt
    assert json.loads(path.read_text()) == {"old": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]   # no temporary left behind
    with atomic_open(str(path)) as f:
        f.write('{"new": 2}')
    assert json.loads(path.read_text()) == {"new": 2}
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


RUN_CMD = [sys.executable, "-m", "vt", "run", "--backend", "sim", "--steps", "12", "--requests",
           "4", "--concurrency", "2", "--prompt-len", "4", "--trace", "trace.json"]
BENCH_CMD = [sys.executable, "-m", "vt", "bench", "--backend", "sim", "--conc", "2",
             "--device-us", "0", "50", "--modes", "drain", "ring", "--steps", "6", "--repeats", "1",
             "--no-bar", "--json", "bench.json"]
COMMANDS = {"run": (RUN_CMD, "trace.json"), "bench": (BENCH_CMD, "bench.json")}


def _cli_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("VT_")}
    env["VT_CAPTURE_SIZES"] = "1,2"
    return env


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """run(which): the command left alone, once per module: (its wall time on this machine,
    startup included; the finished process; its output path)."""
    done = {}

    def run(which):
        if which not in done:
            cmd, out = COMMANDS[which]
            cwd = tmp_path_factory.mktemp(f"{which}-whole")
            t0 = time.perf_counter()
            p = subprocess.run(cmd, cwd=cwd, env=_cli_env(), capture_output=True, text=True,
                               timeout=120)
            done[which] = (time.perf_counter() - t0, p, cwd / out)
        return done[which]
    return run


@settings(max_examples=8, deadline=None, derandomize=True)
@given(which=st.sampled_from(["run", "bench"]), at=st.floats(0.1, 1.1),
       second=st.one_of(st.none(), st.floats(0.0, 0.3)))
def test_interrupted_runs_leave_whole_or_absent_outputs(tmp_path_factory, uninterrupted, which,
                                                        at, second):
    """SIGINT once, or twice, at a random moment of a real run: every output file is absent
    or valid JSON. `at` is a fraction of the run's uninterrupted time, measured on this
    machine (startup included), so that it lands before, in and after the moment the output
    is written."""
    full_s = uninterrupted(which)[0]
    cwd = tmp_path_factory.mktemp(which)
    cmd, out = COMMANDS[which]
    p = subprocess.Popen(cmd, cwd=cwd, env=_cli_env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    time.sleep(at * full_s)
    p.send_signal(signal.SIGINT)
    if second is not None:
        time.sleep(second)
        p.send_signal(signal.SIGINT)
    try:
        p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    out = cwd / out
    if out.exists():
        json.loads(out.read_text())   # whole, or this raises


@pytest.mark.parametrize("which", ["run", "bench"])
def test_an_uninterrupted_run_writes_its_output(uninterrupted, which):
    """The twin of the interrupt test (the very runs it measured): the same commands do write
    valid JSON when left alone (so "absent" above is not the only outcome the test ever sees)."""
    wall, p, out = uninterrupted(which)
    assert p.returncode == 0, p.stderr
    assert json.loads(out.read_text())
    assert wall < 60
