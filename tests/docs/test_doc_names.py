"""The docs name only what the code has: every `vt/...py` path (and `vt/.../` folder) and every
`vt.`-qualified name (`vt.config.ExecutorConfig.from_env`, `vt.Engine`) written in README.md,
docs/*.md, tools/README.md, or in the comments and docstrings of vt/ itself, exists.

Names are resolved from the source, not by importing it: a name in a module that needs CuPy or
Triton is checked on a machine without them, and importing has no side effects. A name is found
when the module defines it at its top level (def, class, assignment, import, or vt/__init__.py's
lazy `_LAZY` table), or when it is a submodule; after a class, a member is found in the class
body, as a `self.NAME` the class assigns, or in a base class the module can name; after an
import from another vt module, in that module. Past anything else (a value, a third-party
object) the rest of the name is not checked. Words that look like names but are files
(`vt.json`) are not names.
"""
from __future__ import annotations

import ast
import functools
import io
import pathlib
import re
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
VT = ROOT / "vt"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tools" / "README.md"]

# Preceded by none of [\w/.-], so `tools/vt/x.py`, `out/vt.json` and `--vt.x` are not ours.
PATH = re.compile(r"(?<![\w/.-])vt/(?:\w+/)*\w+\.py\b")
FOLDER = re.compile(r"(?<![\w/.-])vt/(?:\w+/)+(?![\w.])")
NAME = re.compile(r"(?<![\w/.-])vt(?:\.[A-Za-z_]\w*)+")
FILE_SUFFIX = re.compile(r"\.(json|jsonl|md|py|txt|png|log|csv|npz|safetensors|toml|sh|html)$")


# ------------------------------------------------------------------ the source, statically
@functools.cache
def _module_file(module: str) -> pathlib.Path | None:
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@functools.cache
def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text())


def _targets(node) -> list[str]:
    out = []
    for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
        out += [e.id for e in ast.walk(t) if isinstance(e, ast.Name)]
    return out


@functools.cache
def _scope(module: str) -> dict[str, tuple]:
    """Top-level names of `module`: name -> ("class", node) | ("import", module, name) |
    ("module", module) | ("value",)."""
    out: dict[str, tuple] = {}
    body = list(_tree(_module_file(module)).body)
    while body:   # top-level `if`/`try` blocks define top-level names too
        node = body.pop(0)
        if isinstance(node, (ast.If, ast.Try)):
            body[:0] = [*node.body, *node.orelse, *getattr(node, "handlers", []),
                        *getattr(node, "finalbody", [])]
        elif isinstance(node, ast.ExceptHandler):
            body[:0] = node.body
        elif isinstance(node, ast.ClassDef):
            out[node.name] = ("class", node, module)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = ("value",)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for name in _targets(node):
                out[name] = ("value",)
            if isinstance(node, ast.Assign) and _targets(node) == ["_LAZY"] and \
                    isinstance(node.value, ast.Dict):   # vt/__init__.py's lazy public names
                for k, v in zip(node.value.keys, node.value.values):
                    out[k.value] = ("import", v.value, k.value)
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:   # relative: from the package (an __init__.py is its package)
                package = module.split(".")
                if _module_file(module).name != "__init__.py":
                    package = package[:-1]
                package = package[:len(package) - (node.level - 1)]
                source = ".".join(package + ([node.module] if node.module else []))
            for a in node.names:
                out[a.asname or a.name] = ("import", source, a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    out[a.asname] = ("module", a.name)
    return out


def _class_has(cls: ast.ClassDef, module: str, member: str, seen=()) -> bool:
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                node.name == member:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and member in _targets(node):
            return True
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id == "self" and node.attr == member and \
                isinstance(node.ctx, ast.Store):
            return True
    for base in cls.bases:
        if not isinstance(base, ast.Name):
            return True        # a base it cannot follow (pkg.Base, Generic[T]): not checked
        found = _lookup(module, base.id)
        if found is None or found[0] != "class":
            return True        # a built-in or third-party base: not checked
        if (found[2], found[1].name) not in seen and \
                _class_has(found[1], found[2], member, (*seen, (found[2], found[1].name))):
            return True
    return False


def _lookup(module: str, name: str):
    """What `name` is in `module`, following imports between vt modules: a _scope entry, or
    None when the module has no such name."""
    entry = _scope(module).get(name)
    if entry is None:
        sub = f"{module}.{name}"
        return ("module", sub) if _module_file(sub) else None
    if entry[0] == "import":
        source, attr = entry[1], entry[2]
        if _module_file(f"{source}.{attr}"):
            return ("module", f"{source}.{attr}")
        if source.split(".")[0] == "vt" and _module_file(source) and source != module:
            return _lookup(source, attr) or ("missing", f"{source}.{attr}")
        return ("value",)
    return entry


def unresolved(name: str) -> str | None:
    """None when the code has `name` (a dotted vt. name), else what is missing."""
    parts = name.split(".")
    i = max(k for k in range(1, len(parts) + 1) if _module_file(".".join(parts[:k])))
    kind, where = ("module", ".".join(parts[:i])), ".".join(parts[:i])
    for part in parts[i:]:
        if kind[0] == "module":
            found = _lookup(kind[1], part)
            if found is None:
                return f"{kind[1]} has no {part}"
            if found[0] == "missing":
                return f"{where} imports {found[1]}, which does not exist"
            kind = found
        elif kind[0] == "class":
            if not _class_has(kind[1], kind[2], part):
                return f"{where} has no {part}"
            kind = ("value",)
        else:
            return None          # past a value: not checked
        where = f"{where}.{part}"
    return None


# ------------------------------------------------------------------ what the texts name
def _doc_texts():
    for doc in DOCS:
        yield str(doc.relative_to(ROOT)), doc.read_text()


def _code_texts():
    """The comments and strings (docstrings, messages) of every module under vt/."""
    for path in sorted(VT.rglob("*.py")):
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        yield (str(path.relative_to(ROOT)),
               "\n".join(t.string for t in tokens if t.type in (tokenize.COMMENT, tokenize.STRING)))


# A line of a diagram that names classes, then the file they are in ("Runner.collect(handle)
# vt/executor/runner.py"): each CamelCase name before the path, with its member, is checked there.
DRAWN = re.compile(r"^(.*?)[ \t](vt/(?:\w+/)*\w+\.py)\b", re.M)
CAMEL = re.compile(r"(?<![\w.])([A-Z][A-Za-z0-9]*[a-z]\w*)(?:\.(\w+))?")


def _diagrams(text: str) -> str:
    """The lines of the text (and plain) code blocks of a markdown document."""
    blocks = re.findall(r"^```(?:text)?\n(.*?)^```", text, re.S | re.M)
    return "".join(blocks)


def stale_drawn_names(where: str, text: str) -> list[str]:
    bad = []
    for m in DRAWN.finditer(_diagrams(text)):
        module = m.group(2)[:-3].replace("/", ".")
        if not _module_file(module):
            continue   # a missing file is reported as such
        for name, member in CAMEL.findall(m.group(1)):
            dotted = f"{module}.{name}" + (f".{member}" if member else "")
            missing = unresolved(dotted)
            if missing:
                bad.append(f"{where}: {name}{'.' + member if member else ''} beside "
                           f"{m.group(2)} ({missing})")
    return bad


def stale_names(where: str, text: str) -> list[str]:
    bad = [f"{where}: {m.group()} (no such file)" for m in PATH.finditer(text)
           if not (ROOT / m.group()).is_file()]
    bad += stale_drawn_names(where, text)
    bad += [f"{where}: {m.group()} (no such folder)" for m in FOLDER.finditer(text)
            if not (ROOT / m.group()).is_dir()]
    for m in NAME.finditer(text):
        if not FILE_SUFFIX.search(m.group()):
            missing = unresolved(m.group())
            if missing:
                bad.append(f"{where}: {m.group()} ({missing})")
    return sorted(set(bad))


@pytest.mark.parametrize("where, text", list(_doc_texts()), ids=lambda x: x if "\n" not in x else "")
def test_every_name_a_doc_gives_exists(where, text):
    assert stale_names(where, text) == []


def test_every_name_the_code_comments_give_exists():
    bad = [b for where, text in _code_texts() for b in stale_names(where, text)]
    assert bad == [], "\n".join(bad)


# ------------------------------------------------------------------ the checker itself
@pytest.mark.parametrize("text", [
    "the outputs live in `vt.engine.engine.CallOutputs`",     # a class that was removed
    "validated as in vt/submit.py's checks",                   # a module at a wrong path
    "see `vt/engine/no_such_folder/`",
    "`vt.config.ExecutorConfig.no_such_method()`",
    "`vt.NoSuchName`",
    "```text\n  CallOutputs        vt/engine/token_buffer.py   a call's tokens\n```\n",
    "```text\n  Runner.no_such()   vt/executor/runner.py\n```\n",
])
def test_a_name_the_code_lacks_is_reported(text):
    assert stale_names("example", text) != []


@pytest.mark.parametrize("text", [
    "`vt.config.ExecutorConfig.from_env()` and `vt.Engine`, in vt/engine/engine.py",
    "vt.torch's decoder, vt.step.contract.StepModel.decode, vt/step/",
    "the mode name (vt.config.MODES); `vt bench --json out/vt.json`; tools/vt/x.py",
    "vt.engine.requests.Request.phase and vt.forward.user.ForwardModel.prefill_mode",
    "```text\n  <- Runner.collect(handle)   vt/executor/runner.py   wait, tokens out\n```\n",
])
def test_prose_and_names_the_code_has_pass(text):
    assert stale_names("example", text) == []
