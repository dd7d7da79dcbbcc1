"""The docs against the code: every code block of README.md, docs/*.md and tools/README.md that
is meant to run runs here and prints what it says; every documented vt command names only flags
its program has; no block stands in two places (each fact lives once); and every link resolves
inside the repository (the docs stand alone).

How a block is treated, by its fence's language:
- `python`: run in this process, in a fresh namespace, on the backend `get_backend()` picks
  (the sim without a GPU). When the block ends in comment lines right after its code, they are
  its stdout, line for line, where `...` matches anything (doctest's ELLIPSIS). A block that
  imports torch skips where PyTorch is not installed.
- `bash`, `sh`: run by `bash -e -o pipefail` as one script, in a scratch directory that links
  every entry of the repository root (so it runs "from the repository root", and what it writes
  stays out of the checkout), with no VT_* variable set and this checkout first on PYTHONPATH.
  It must exit 0, print no traceback, and no answer of a server may be an error (`"error"`).
  What a test cannot or must not do is rewritten, and only that: `python3 -m pip install ...`
  steps are left out (the fresh install of .ci/run runs them), `/tmp/` is a directory of the
  scratch one, port 8000 a free port; what the block started in the background (`vt serve &`)
  is stopped when it ends.
- `console`: each `$ command` runs like a shell block; the lines after it are its output,
  stdout and stderr together, exactly.
- `text`, or no language: not code (diagrams, tables, output).
- A block right after a `<!-- not run: REASON -->` line is not run: it needs a GPU or a
  checkpoint, is an interface sketch, or is the whole test suite. Keep such blocks rare.
Every `vt ...` and `python3 -m vt...` command, in a block (run or not) or inline, has each of its
`--flags` checked against the program's `--help`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import doctest
import functools
import io
import itertools
import os
import pathlib
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tools" / "README.md"]
LANGS = {"python", "bash", "sh", "console", "text", ""}
NOT_RUN = re.compile(r"^<!-- not run: (\S.*?) -->$")
SERVE_DEPS = ("fastapi", "uvicorn", "torch", "transformers")


@dataclasses.dataclass
class Block:
    doc: pathlib.Path
    line: int                 # 1-based line of the opening fence
    lang: str
    code: str
    not_run: str | None       # the reason, when marked

    @property
    def id(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def _blocks(doc: pathlib.Path) -> list[Block]:
    lines = doc.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = NOT_RUN.match(lines[i - 1]) if i else None
        out.append(Block(doc, i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n",
                         marker.group(1) if marker else None))
        i = end + 1
    return out


ALL = [b for doc in DOCS for b in _blocks(doc)]


def _marks(block: Block):
    return [pytest.mark.torch_allocator] if re.search(r"\btorch\b|vt serve|vt generate",
                                                      block.code) else []


def _params(langs):
    return [pytest.param(b, id=b.id, marks=_marks(b)) for b in ALL
            if b.lang in langs and b.not_run is None]


# ------------------------------------------------------------------ the convention itself
def test_every_block_follows_the_convention():
    bad = [f"{b.id}: language {b.lang!r}" for b in ALL if b.lang not in LANGS]
    bad += [f"{b.id}: a not-run marker on a {b.lang or 'plain'} block, which never runs"
            for b in ALL if b.not_run and b.lang in ("text", "")]
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        for n, line in enumerate(lines):
            if "not run" in line and line.startswith("<!--"):
                if not NOT_RUN.match(line):
                    bad.append(f"{doc.name}:{n + 1}: write it as <!-- not run: REASON -->")
                elif n + 1 >= len(lines) or not lines[n + 1].startswith("```"):
                    bad.append(f"{doc.name}:{n + 1}: a not-run marker not right above a fence")
    assert bad == []


def test_commands_look_like_code_blocks():
    """A command written in a plain block would escape the tests: plain blocks hold no
    `vt ...` or `python3 ...` command lines."""
    bad = [b.id for b in ALL if b.lang in ("text", "") and
           re.search(r"^(\$ )?(vt|python3?|curl|bash) ", b.code, re.M)]
    assert bad == []


# ------------------------------------------------------------------ python
def _expected_output(code: str) -> str | None:
    lines = code.rstrip("\n").splitlines()
    tail = list(itertools.takewhile(lambda l: l.startswith("# "), reversed(lines)))
    if not tail or len(tail) == len(lines):
        return None
    return "".join(l[2:] + "\n" for l in reversed(tail))


@pytest.mark.parametrize("block", _params({"python"}))
def test_python_block_runs_and_prints_what_it_says(block):
    if re.search(r"^\s*(import torch|from torch|from vt\.torch|import vt\.torch)", block.code, re.M):
        pytest.importorskip("torch", reason="the block needs PyTorch (pip install \".[torch]\")")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block.code, block.id, "exec"), {"__name__": "__doc_block__"})
    expected = _expected_output(block.code)
    if expected is not None:
        got = out.getvalue()
        assert doctest.OutputChecker().check_output(expected, got, doctest.ELLIPSIS), \
            f"{block.id} prints\n{got}which is not what it says:\n{expected}"


# ------------------------------------------------------------------ shell
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scratch(tmp_path: pathlib.Path) -> pathlib.Path:
    """A directory that looks like the repository root: every entry of it, linked."""
    root = tmp_path / "root"
    root.mkdir()
    for entry in ROOT.iterdir():
        if entry.name != ".git":
            (root / entry.name).symlink_to(entry)
    (tmp_path / "tmp").mkdir()
    return root


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([str(pathlib.Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _as_test_runs_it(code: str, tmp_path: pathlib.Path, port: int) -> str:
    code = re.sub(r"python3 -m pip install [^\n&]*(&&[ \t]*)?", "", code)
    code = code.replace("/tmp/", f"{tmp_path / 'tmp'}/")
    return re.sub(r"\b8000\b", str(port), code)


def _stop_group(pgid: int) -> None:
    """Stop what the block left running in the background (its own process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            os.killpg(pgid, 0)
            time.sleep(0.2)
        os.killpg(pgid, signal.SIGKILL)


def _run_shell(code: str, tmp_path: pathlib.Path, merge: bool = False, timeout: float = 600):
    """(exit code, stdout, stderr) of `code`. Output goes to files, not pipes: a server the block
    leaves in the background holds its copy of them open until it is stopped."""
    cwd = tmp_path / "root" if (tmp_path / "root").exists() else _scratch(tmp_path)
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", code], cwd=cwd,
                                env=_env(), stdin=subprocess.DEVNULL, stdout=out,
                                stderr=out if merge else err, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        _stop_group(proc.pid)
    return rc, out_path.read_text(), err_path.read_text()


def _needs(block: Block) -> None:
    if re.search(r"vt serve|vt generate|tiny_checkpoint", block.code):
        for mod in SERVE_DEPS:
            pytest.importorskip(mod, reason="vt serve needs the serve extra")
    if re.search(r"^\s*curl ", block.code, re.M) and not shutil.which("curl"):
        pytest.skip("no curl on this machine")


@pytest.mark.parametrize("block", _params({"bash", "sh"}))
def test_shell_block_runs(block, tmp_path):
    _needs(block)
    script = _as_test_runs_it(block.code, tmp_path, _free_port())
    rc, out, err = _run_shell(script, tmp_path)
    assert rc == 0 and "Traceback" not in err, f"{block.id}: exit {rc}\n{out}\n{err}"
    assert '"error"' not in out, f"{block.id}: a server answered an error:\n{out}"


@pytest.mark.parametrize("block", _params({"console"}))
def test_console_block_prints_what_it_shows(block, tmp_path):
    steps = re.split(r"^\$ ", block.code, flags=re.M)[1:]
    assert steps, f"{block.id}: a console block without a `$ command` line"
    for step in steps:
        cmd, _, shown = step.partition("\n")
        _, out, _ = _run_shell(_as_test_runs_it(cmd, tmp_path, _free_port()), tmp_path,
                               merge=True, timeout=300)
        assert out == shown, f"{block.id}: `{cmd}` printed\n{out}\nnot\n{shown}"


# ------------------------------------------------------------------ flags of every command
def _commands(block: Block):
    text = block.code.replace("\\\n", " ")
    if block.lang == "console":
        text = "\n".join(l[2:] for l in text.splitlines() if l.startswith("$ "))
    for line in text.splitlines():
        for part in re.split(r"&&|\|\||;|\|", line):
            try:
                words = shlex.split(part, comments=True)
            except ValueError:
                words = part.split()
            if len(words) > 2 and re.fullmatch(r"python3?", words[0]) and words[1] == "-m":
                words = words[2:]          # python3 -m vt run ... is vt run ...
            if words[:1] == ["vt"] and len(words) > 1 and not words[1].startswith("-"):
                yield ("vt", words[1], *_own_parser_workload(words[1], words[2:])), words[2:]
            elif words and words[0].startswith("vt."):
                yield (words[0],), words[1:]


def _own_parser_workload(command: str, args: list[str]) -> tuple[str, ...]:
    """("--workload", NAME) for `vt bench --workload NAME` of a workload with options of its
    own, whose --help lists them; () otherwise."""
    from vt.cli.bench import STANDALONE
    if command != "bench":
        return ()
    for i, arg in enumerate(args):
        name = args[i + 1] if arg == "--workload" and i + 1 < len(args) else (
            arg.split("=", 1)[1] if arg.startswith("--workload=") else None)
        if name is not None:
            return ("--workload", name) if name in STANDALONE else ()
    return ()


@functools.cache
def _help(program: tuple[str, ...]) -> str | None:
    module, *sub = ("vt", *program[1:]) if program[0] == "vt" else program
    p = subprocess.run([sys.executable, "-m", module, *sub, "--help"], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=120)
    if p.returncode and "ModuleNotFoundError" in p.stderr:
        return None    # e.g. a torch benchmark where PyTorch is not installed
    assert p.returncode == 0, (program, p.stderr)
    return p.stdout


SUBCOMMANDS = ("info", "run", "bench", "serve", "generate")


def _documented_commands(doc: pathlib.Path):
    """(where, program, args) of every vt command in `doc`: in its shell blocks, run or not, and
    in its inline code (`vt run --steps N`)."""
    for block in _blocks(doc):
        if block.lang in ("bash", "sh", "console"):
            for program, args in _commands(block):
                yield block.id, program, args
    prose = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)
    for span in re.findall(r"`((?:vt |python3? -m vt)[^`]*)`", prose):
        for program, args in _commands(Block(doc, 0, "bash", span + "\n", None)):
            if program[0] != "vt" or program[1] in SUBCOMMANDS:   # not `vt run: a message`
                yield f"{doc.relative_to(ROOT)}: `{span}`", program, args


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_documented_command_has_its_flags(doc):
    bad = []
    for where, program, args in _documented_commands(doc):
        if program[0] == "vt" and program[1] not in SUBCOMMANDS:
            bad.append(f"{where}: vt has no command {program[1]!r}")
            continue
        text = _help(program)
        if text is None:
            continue
        for flag in (a.split("=")[0] for a in args if a.startswith("--")):
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
                bad.append(f"{where}: {' '.join(program)} has no {flag}")
    assert bad == []


# ------------------------------------------------------------------ each block once
def _normalized(block: Block) -> list[str]:
    out = []
    for line in block.code.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip() if block.lang != "python" else line.strip()
        line = re.sub(r"\s+", " ", line)
        if line and not line.startswith("#") and len(line) > 3 and \
                not re.match(r"import \S|from \S+ import ", line):   # imports: boilerplate
            out.append(line)
    return out


SHARED_LINES = 3   # a run this long in two blocks (imports, comments, blanks aside) is one fact twice


def test_no_block_is_written_twice():
    blocks = [(b, _normalized(b)) for b in ALL]
    shared = []
    for (a, la), (b, lb) in itertools.combinations(blocks, 2):
        if a.lang in ("text", "") and b.lang in ("text", "") and a.doc == b.doc:
            continue
        for i, j in itertools.product(range(len(la)), range(len(lb))):
            k = 0
            while i + k < len(la) and j + k < len(lb) and la[i + k] == lb[j + k]:
                k += 1
            if k >= SHARED_LINES or (k and k == len(la) == len(lb)):
                shared.append(f"{a.id} ~ {b.id}: {k} lines from {la[i]!r}")
                break
    assert shared == [], "\n".join(shared)


# ------------------------------------------------------------------ links
def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(doc: pathlib.Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)
    return {_anchor(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_link_stays_in_the_repository_and_resolves(doc):
    """The docs stand alone: every link is a path in this repository (to a file that exists,
    and to a heading it has), never an address outside it."""
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        path, _, anchor = target.partition("#")
        if re.match(r"\w+:", path):
            bad.append(f"{target}: outside the repository")
            continue
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists() or ROOT not in dest.parents:
            bad.append(f"{target}: no such file in the repository")
        elif anchor and anchor not in _anchors(dest):
            bad.append(f"{target}: {dest.name} has no such heading")
    assert bad == []
