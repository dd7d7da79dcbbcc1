"""The front ends a new user meets first: the environment, `vt run`, `vt info`, `vt bench
--workload serve`, the docs and the install. Each defect class below has a test that fails
without its fix.

| defect class                                                   | test                                                  |
|----------------------------------------------------------------|-------------------------------------------------------|
| bench serve: a request that finished during submit() is never  | test_closed_loop_sees_requests_that_finish_during_submit, |
|   seen (its done callback subscribed after it ran): a hang     |   test_a_done_callback_runs_once_whenever_it_is_added |
| bench serve: a wait without a deadline (hang, then _queue.Empty)| test_every_serve_wait_has_a_deadline_with_a_message  |
| bench serve flags without bounds (--clients 1025, --rate       | test_serve_flags_out_of_bounds_are_one_line           |
|   1e-300 / nan / inf, --requests 10**9, --requests 0)          |                                                       |
| VT_* read in five places, each its own way (VT_PREFILL_GRAPHS=2| test_every_bad_variable_is_refused_before_any_work,   |
|   a traceback after the model was built; VT_BATCH_INVARIANT=yes|   test_the_model_refuses_a_bad_batch_invariant_variable,|
|   ignored)                                                     |   test_only_vt_env_reads_the_environment,             |
|                                                                |   test_the_registry_knows_every_variable_vt_names     |
| an unknown VT_* variable (a typo) silently ignored             | test_an_unknown_variable_warns_once_with_the_closest  |
| `vt run --preset ""` runs the default preset                   | test_an_empty_preset_is_an_unknown_preset             |
| `vt info|run|bench | head -1`: BrokenPipeError traceback, rc 1 | test_a_closed_stdout_ends_quietly                     |
| SIGTERM while the trace is written leaves a .tmp file          | test_sigterm_while_the_trace_is_written_leaves_no_file|
| a full disk: traceback after the run, vt run's report lost     | test_a_full_disk_prints_the_report_then_one_line      |
| docs vs code: the context rule, submit()'s default, ClosedError| test_docs_state_the_context_rule_the_code_applies,    |
|   not in vt, dir(vt) empty                                     |   test_docs_show_submits_real_signature,              |
|                                                                |   test_vt_exports_closed_error_and_lists_its_names    |
| a pip install of `vt` with an extra installs another PyPI     | test_install_commands_install_this_checkout,          |
|   project (docs, error messages, skip reasons); the torch     |   test_no_file_names_the_pypi_project_vt_with_an_extra,|
|   extra pulls CUDA torch on a CPU machine; CI not the README's |   test_ci_runs_the_readmes_test_commands              |
|   commands                                                     |                                                       |
| a VT_* variable added without its row in docs/configuration.md | test_the_configuration_doc_names_exactly_the_        |
|                                                                |   registered_variables                                |
"""
import ast
import errno
import inspect
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import tomllib
import uuid
import warnings

import numpy as np
import pytest

import vt
import vt.bench.serve_run
import vt.cli.run
from vt import env
from vt.bench.serve import closed_loop, open_loop
from vt.cli.common import CommandFailed
from vt.cli.main import main
from vt.engine.engine import Engine
from vt.config import ENV_VARS, ExecutorConfig
from vt.bundled import PRESETS, HybridModel, init_weights

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tools" / "README.md"]


class Started(AssertionError):
    """Raised where the work would start: the bad value got past the checks."""


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for var in [v for v in os.environ if v.startswith("VT_")]:
        monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)
    return monkeypatch


def _one_line_refusal(capsys, argv, needle):
    rc = main(argv)
    out, err = capsys.readouterr()
    assert (rc, out) == (2, ""), (argv, rc, out, err)
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err, err
    return err


def _sim_engine(sim_backend, conc=2):
    cfg = PRESETS["tiny-dense"]
    model = HybridModel(sim_backend, cfg, init_weights(cfg, seed=0), max_seqs=conc, num_kv_blocks=32)
    return model, Engine(sim_backend, model, ExecutorConfig(serving_conc=conc, capture_sizes=(1, 2)))


# ------------------------------------------------------------------ vt bench --workload serve
def test_closed_loop_sees_requests_that_finish_during_submit(sim_backend, monkeypatch):
    """A submit() that returns only after its request finished (the race, made certain): the
    closed loop still sees every request finish and serves them all."""
    model, engine = _sim_engine(sim_backend)
    submit = engine.submit

    def finished_before_return(prompt, **kw):
        handle = submit(prompt, **kw)
        handle.result(timeout=60)
        return handle
    monkeypatch.setattr(engine, "submit", finished_before_return)
    rng = np.random.default_rng(0)
    requests = [(rng.integers(0, 512, 3).tolist(), 3) for _ in range(5)]
    with engine:
        handles, _ = closed_loop(engine, requests, clients=2, timeout_s=20)
        assert [len(h.result(timeout=0).tokens) for h in handles] == [3] * 5
    model.close()


def test_a_done_callback_runs_once_whenever_it_is_added(sim_backend):
    """Added before the end, or after it: each callback runs exactly once, with the handle."""
    model, engine = _sim_engine(sim_backend)
    calls = []
    with engine:
        for _ in range(20):
            h = engine.submit([1, 2, 3], max_new_tokens=2)
            h.add_done_callback(calls.append)
            h.result(timeout=60)
            h.add_done_callback(calls.append)   # finished already: runs at once, here
    model.close()
    assert len(calls) == 40 and all(c.done() for c in calls)


class _NeverDone:
    """An engine whose requests never finish: only the deadlines can end the loops."""

    class Handle:
        def add_done_callback(self, fn):
            pass

        def done(self):
            return False

        def result(self, timeout=None):
            time.sleep(timeout or 0)
            raise TimeoutError("not finished")

    def submit(self, prompt, *, max_new_tokens):
        return self.Handle()


@pytest.mark.parametrize("loop", ["closed", "open"])
def test_every_serve_wait_has_a_deadline_with_a_message(loop):
    requests = [([1, 2], 2)] * 3
    t0 = time.perf_counter()
    with pytest.raises(CommandFailed, match=r"not served within its 0\.3 s deadline: 0 of 3 "
                                            r"requests finished"):
        if loop == "closed":
            closed_loop(_NeverDone(), requests, 2, timeout_s=0.3)
        else:
            open_loop(_NeverDone(), requests, 1000.0, np.random.default_rng(0), timeout_s=0.3)
    assert time.perf_counter() - t0 < 5


@pytest.mark.parametrize("flags,needle", [
    (["--clients", "1025"], "--clients must be an integer in [1, 1024], got 1025"),
    (["--clients", "0"], "--clients must be an integer in [1, 1024], got 0"),
    (["--rate", "1e-300"], "--rate must be a finite number"),
    (["--rate", "nan"], "--rate must be a finite number"),
    (["--rate", "inf"], "--rate must be a finite number"),
    (["--rate", "5", "5"], "--rate must not repeat"),
    (["--requests", "1000000000"], "--requests must be an integer in [1, 100000]"),
    (["--requests", "0"], "--requests must be an integer in [1, 100000], got 0"),
    (["--output-len", "100000"], "--output-len must be an integer in [1, 4096]"),
    (["--rate", "0.05", "--requests", "100"], "more than half a cell's 600 s deadline"),
])
def test_serve_flags_out_of_bounds_are_one_line(capsys, clean_env, flags, needle):
    def started(*a, **k):
        raise Started("the serve sweep started")
    clean_env.setattr(vt.bench.serve_run, "run_serve", started)
    _one_line_refusal(capsys, ["bench", "--backend", "sim", "--workload", "serve",
                               "--arrival", "closed", "poisson", *flags], needle)


# ------------------------------------------------------------------ the environment
BAD = {   # every registered variable: values it must refuse
    "VT_ASYNC_EXECUTOR": ["yes", "2", "true", ""], "VT_ASYNC_EXECUTOR_NO_DBUF": ["on"],
    "VT_ASYNC_EXECUTOR_POISON": ["-1"], "VT_ASYNC_EXECUTOR_TRACE": ["yes", "out.txt"],
    "VT_ASYNC_SERVING_CONC": ["0", "many", "+8", "8.0"],
    "VT_CAPTURE_SIZES": ["", "1,x", "0,2", "1,,2"],
    "VT_WAIT_POLL_US": ["nan", "-1", "1e6", "fast"], "VT_POOL_DEBUG": ["yes"],
    "VT_BATCH_INVARIANT": ["yes", "2"], "VT_PREFILL_GRAPHS": ["2", "yes", "off"],
    "VT_INITCHECK": ["true"], "VT_TRITON_PDL": ["on", "2"], "VT_COMMIT": ["", "a\tb"],
    "VT_SLOW": ["yes"], "VT_FUZZ_SHRINK": ["2"],
}


def test_the_bad_value_table_covers_the_registry():
    assert set(BAD) == set(env.VARIABLES)


@pytest.mark.parametrize("var,value", [(v, x) for v, xs in BAD.items() for x in xs])
def test_every_bad_variable_is_refused_before_any_work(capsys, clean_env, var, value):
    """vt run: exit 2, one line naming the variable, before a backend or model is made."""
    def started(*a, **k):
        raise Started("work started before the variable was refused")
    clean_env.setattr(vt.cli.run, "build_model", started)
    clean_env.setattr(vt.cli.run, "pick_backend", started)
    clean_env.setenv(var, value)
    err = _one_line_refusal(capsys, ["run", "--backend", "sim"], var)
    assert err.startswith("vt run: ") and "fix or unset the variable" in err
    with pytest.raises(ValueError, match=var):
        env.get(var)


def test_the_model_refuses_a_bad_batch_invariant_variable(sim_backend, clean_env):
    cfg = PRESETS["tiny-dense"]
    clean_env.setenv("VT_BATCH_INVARIANT", "yes")
    with pytest.raises(ValueError, match="VT_BATCH_INVARIANT must be 0 or 1, got 'yes'"):
        HybridModel(sim_backend, cfg, init_weights(cfg, seed=0), max_seqs=1, num_kv_blocks=8)
    clean_env.setenv("VT_BATCH_INVARIANT", "1")
    model = HybridModel(sim_backend, cfg, init_weights(cfg, seed=0), max_seqs=1, num_kv_blocks=8)
    assert model.batch_invariant is True
    model.close()


def test_only_vt_env_reads_the_environment():
    """No module of vt but vt/env.py touches os.environ or os.getenv."""
    readers = []
    for path in sorted((ROOT / "vt").rglob("*.py")):
        if path == ROOT / "vt" / "env.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert readers == []


NOT_VARIABLES = {"VT_BF16"}   # a macro of the CUDA sources in vt/bundled/kernels


def test_the_registry_knows_every_variable_vt_names():
    """Every VT_* name in the code, the tools and the docs is registered (so none warns as
    unknown), and each knob's default is ExecutorConfig's."""
    named = set()
    for path in [*(ROOT / "vt").rglob("*.py"), *(ROOT / "tools").glob("*"),
                 *(ROOT / "tests").rglob("*.py"), *DOCS]:
        if path.is_file() and path.name != "test_front_ends.py":
            named |= set(re.findall(r"\bVT_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")))
    assert named - set(env.VARIABLES) - NOT_VARIABLES == set()
    for field, var in ENV_VARS.items():
        assert env.VARIABLES[var].default == getattr(ExecutorConfig(), field), var


def test_the_configuration_doc_names_exactly_the_registered_variables():
    """docs/configuration.md's table has one row for each variable of vt/env.py's registry: a
    variable added without its row, a row for one that is gone, or a name written twice fails."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    rows = [line.split("|")[1] for line in text.splitlines() if line.startswith("| `VT_")]
    in_table = [v for cell in rows for v in re.findall(r"`(VT_[A-Z0-9_]+)`", cell)]
    assert sorted(in_table) == sorted(env.VARIABLES), (
        f"missing: {sorted(set(env.VARIABLES) - set(in_table))}, "
        f"not registered: {sorted(set(in_table) - set(env.VARIABLES))}")
    assert len(in_table) == len(set(in_table)), in_table


def test_an_unknown_variable_warns_once_with_the_closest(capsys, clean_env):
    typo = f"VT_ASYNC_EXECUTR_{uuid.uuid4().hex[:6].upper()}"
    with pytest.warns(env.UnknownVariableWarning, match=f"{typo} is ignored; did you mean "
                                                        f"VT_ASYNC_EXECUTOR"):
        assert env.get("VT_ASYNC_EXECUTOR", {typo: "1"}) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        env.get("VT_ASYNC_EXECUTOR", {typo: "1"})   # reported once per process
    typo2 = f"VT_PREFIL_GRAPHS_{uuid.uuid4().hex[:6].upper()}"
    clean_env.setenv(typo2, "0")
    clean_env.setattr(vt.cli.run, "build_model", lambda *a, **k: (_ for _ in ()).throw(Started()))
    with pytest.raises(Started):
        main(["run", "--backend", "sim"])
    err = capsys.readouterr().err
    assert err == f"vt run: warning: unknown environment variable {typo2} is ignored; did you " \
                  f"mean VT_PREFILL_GRAPHS?\n"


def test_an_empty_preset_is_an_unknown_preset(capsys, clean_env):
    _one_line_refusal(capsys, ["run", "--backend", "sim", "--preset", ""], "unknown preset ''")


# ------------------------------------------------------------------ pipes, signals, disks
def _clean_env():
    return {k: v for k, v in os.environ.items() if not k.startswith("VT_")} | {
        "PYTHONPATH": str(ROOT)}


@pytest.mark.parametrize("argv", [
    ["info", "--backend", "sim"],
    ["run", "--backend", "sim", "--requests", "2", "--steps", "8", "--prompt-len", "2"],
    ["bench", "--backend", "sim", "--conc", "1", "--device-us", "0", "--modes", "drain",
     "--steps", "3", "--no-bar"],
])
def test_a_closed_stdout_ends_quietly(tmp_path, argv):
    """`vt ... | head -1`: the reader takes one line and leaves; vt ends with no traceback,
    its stderr empty, exit 141 (or 0 when it had written everything already)."""
    p = subprocess.Popen([sys.executable, "-m", "vt", *argv], cwd=tmp_path, env=_clean_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.readline()
    p.stdout.close()
    rc = p.wait(timeout=120)
    err = p.stderr.read().decode()
    assert rc in (0, 141) and err == "", (rc, err)


_TERM_DURING_TRACE = """
import json, os, signal, sys, time
real = json.dump
def dump(obj, f):
    f.write('{"traceEvents": [')     # a partial trace in the temporary file
    f.flush()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)                     # the signal lands here, mid-write
    real(obj, f)
json.dump = dump
from vt.cli.main import main
sys.exit(main(["run", "--backend", "sim", "--requests", "1", "--steps", "2", "--prompt-len",
               "2", "--trace", "t.json"]))
"""


def test_sigterm_while_the_trace_is_written_leaves_no_file(tmp_path):
    p = subprocess.run([sys.executable, "-c", _TERM_DURING_TRACE], cwd=tmp_path, env=_clean_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 143 and p.stderr == "terminated\n", (p.returncode, p.stderr)
    assert sorted(os.listdir(tmp_path)) == []


def _disk_full(fd):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("what", ["run", "bench"])
def test_a_full_disk_prints_the_report_then_one_line(capsys, clean_env, tmp_path, what):
    clean_env.setattr(os, "fsync", _disk_full)
    if what == "run":
        argv = ["run", "--backend", "sim", "--requests", "2", "--steps", "3", "--prompt-len", "2",
                "--trace", "t.json"]
        report, line = "finished: 2 length", "vt run: could not write the trace 't.json': "
    else:
        argv = ["bench", "--backend", "sim", "--conc", "1", "--device-us", "0", "--modes",
                "drain", "--steps", "3", "--no-bar", "--json", "b.json"]
        report, line = "ceiling", "vt bench: could not write --json 'b.json': "
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert report in out and "Traceback" not in err
    assert err == line + "No space left on device\n", err
    assert sorted(os.listdir(tmp_path)) == []


# ------------------------------------------------------------------ docs and install
def test_docs_state_the_context_rule_the_code_applies(capsys, clean_env):
    """Docs: prompt + steps - 1 must fit max_context; and the CLI takes exactly that."""
    for doc in DOCS:
        for m in re.finditer(r"prompt \+ (?:steps|new tokens)[^|.]*must fit", doc.read_text()):
            assert "- 1" in m.group(0), (doc.name, m.group(0))
    ctx = PRESETS["tiny-dense"].max_context
    clean_env.setattr(vt.cli.run, "build_model", lambda *a, **k: (_ for _ in ()).throw(Started()))
    with pytest.raises(Started):
        main(["run", "--backend", "sim", "--prompt-len", "4", "--steps", str(ctx - 3)])
    capsys.readouterr()
    _one_line_refusal(capsys, ["run", "--backend", "sim", "--prompt-len", "4", "--steps",
                               str(ctx - 2)], "exceeds tiny-dense's max_context")


def test_docs_show_submits_real_signature():
    params = list(inspect.signature(Engine.submit).parameters.values())[1:]
    shown = ", ".join(("*, " if p.kind is p.KEYWORD_ONLY and params[i - 1].kind is not
                       p.KEYWORD_ONLY else "") + p.name +
                      ("" if p.default is p.empty else f"={p.default!r}")
                      for i, p in enumerate(params))
    for doc in DOCS:
        for m in re.findall(r"`submit\((prompt[^)]*)\)`", doc.read_text()):
            assert m == shown, (doc.name, m, shown)


def test_vt_exports_closed_error_and_lists_its_names(sim_backend):
    assert set(vt.__all__) <= set(dir(vt)) and "ClosedError" in vt.__all__
    model, engine = _sim_engine(sim_backend)
    engine.close()
    with pytest.raises(vt.ClosedError):
        engine.submit([1, 2], max_new_tokens=2)
    model.close()


def _install_commands():
    for doc in DOCS:
        for line in doc.read_text().splitlines():
            for cmd in re.findall(r"pip install ([^`&#\n]+)", line):
                yield doc.name, cmd.strip()


def test_install_commands_install_this_checkout():
    """The distribution has a name of its own, and every documented pip install of vt names
    the checkout (".", ".[extra]"), never a name on PyPI; PyTorch's CPU build comes first."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "vt-graphs"
    extras = set(project["optional-dependencies"])
    cmds = list(_install_commands())
    assert cmds
    for doc, cmd in cmds:
        assert not re.search(r"(^|[\s'\"])vt(-graphs)?([\[\s'\"]|$)", cmd), (doc, cmd)
        for chosen in re.findall(r"\.\[([^\]]+)\]", cmd):
            assert set(chosen.split(",")) <= extras, (doc, cmd)
    readme = [c for d, c in cmds if d == "README.md"]
    cpu = next(i for i, c in enumerate(readme) if "torch==" in c)
    assert "download.pytorch.org/whl/cpu" in readme[cpu] and "+cpu" in readme[cpu]
    assert any("torch-test" in c for c in readme[cpu + 1:])


def test_no_file_names_the_pypi_project_vt_with_an_extra():
    """`vt` on PyPI is another project: a message, doc or skip reason that tells the user to
    pip-install vt with one of this project's extras installs that one. Each names the
    distribution (vt-graphs) or the checkout (".[extra]") instead."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pypi_vt = re.compile(r"(?<![\w.-])vt\[(%s)(,[\w-]+)*\]" % "|".join(map(re.escape, extras)))
    files = [ROOT / "README.md", ROOT / "pyproject.toml",
             *(f for top in ("vt", "docs", "tools", "tests", ".ci") for f in (ROOT / top).rglob("*")
               if f.is_file() and f.suffix in (".py", ".md", ".toml", ".sh", ".txt", ""))]
    hits = [f"{f.relative_to(ROOT)}:{n}: {line.strip()}" for f in files
            for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1)
            if pypi_vt.search(line)]
    assert not hits, "\n".join(hits)


TORCH_EXTRAS = {"torch", "torch-test", "serve"}   # extras whose PyPI torch is the CUDA build


def test_readme_install_blocks_say_which_machine_each_line_is_for():
    """In the README's own blocks (what a new user pastes), the cuda extra is on a line marked for
    a GPU machine beside a plain install for a CPU one, and an extra that pulls torch comes after
    PyTorch's CPU build line in the same block: no warning left to the prose after it."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    for block in blocks:
        lines = block.splitlines()
        for i, line in enumerate(lines):
            if "pip install" not in line:
                continue
            extras = set(",".join(re.findall(r"\.\[([^\]]+)\]", line)).split(",")) - {""}
            if "cuda" in extras:
                assert "GPU" in line.partition("#")[2], line
                assert any(re.search(r"pip install \.( |$)", other) and "CPU" in other
                           for other in lines), block
            if extras & TORCH_EXTRAS and "torch==" not in line:
                assert any("download.pytorch.org/whl/cpu" in before for before in lines[:i]), block


def test_ci_runs_the_readmes_test_commands():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Test it\n+(?:<!-- not run: [^\n]* -->\n)?```bash\n(.*?)```", readme,
                      re.S).group(1)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for line in block.strip().splitlines():
        assert line in ci, line
    assert "python3 -m venv /tmp/vt-ci-venv" in ci and "rm -rf /tmp/vt-ci-venv" in ci


def test_other_libraries_variables_go_through_vt_env_too(monkeypatch):
    """vt reads CUDA_VISIBLE_DEVICES and sets NCCL's switches only through vt.env, which
    keeps a user's setting when asked to and refuses to touch vt's own variables."""
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "")   # so that the teardown restores it
    monkeypatch.delenv("NVSHMEM_DISABLE_NVLS")
    env.set_foreign({"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}, keep_set=True)
    assert env.foreign("NCCL_NVLS_ENABLE") == "1" and env.foreign("NVSHMEM_DISABLE_NVLS") == "1"
    with pytest.raises(KeyError, match="get()"):
        env.foreign("VT_ASYNC_EXECUTOR")
    with pytest.raises(KeyError, match="the user's to set"):
        env.set_foreign({"VT_ASYNC_EXECUTOR": "1"})
