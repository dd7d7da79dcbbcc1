"""The package's layers, checked from the source: imports only point down, and no two
modules import each other through any chain (docs/architecture.md draws the picture, and a test
here holds the drawing to RANK).

Ranks, bottom up; a module may import its own package and any package of a lower rank.
Imports inside functions count too (they are still arrows), except `vt/__init__.py`'s lazy
public names, which are the top of the tree by design.
"""
import ast
import pathlib
import re

import pytest

VT = pathlib.Path(__file__).resolve().parents[2] / "vt"

RANK = {
    "env": -1,                # the VT_* variables' registry and parser: below everything
    "validate": -1,           # the one integer check of the constructors
    "errors": -1,             # VtError, the base of every error vt defines
    "atomic_file": -1,        # output files written whole or not at all (the trace, the reports)
    "backend": 0, "config": 0,
    "step": 1,
    "hooks": 2,               # the executor's hooks (the pool pre-grow, the test arms): wraps
                              # the step contract; the graphs, the runner and the engine call it
    "sampling": 0.5,          # pure: the step contract holds its SamplingParams
    "graphs": 3, "bundled": 3,
    "forward": 4,
    "torch": 4.5,             # vt.torch adapts torch forwards through ForwardModel
    "executor": 5,            # the executor: the runner, the eager path, the step plan, timers, trace
    "parallel": 5.5,          # tensor parallelism: wraps the runner, the engine composes it
    "engine": 6,
    "serve": 6.5,             # vt serve's HTTP front end over the engine (and vt.torch models)
    "bench": 6.75,            # the benchmarks: workloads, peers, measurement, reports
    "cli": 7,                 # argument parsing and the front ends (vt bench's over vt.bench)
}
MAX_TOP_LEVEL_FILES = 8
# Past ~500 lines a module likely holds a second concept: a warning asks someone to look.
# Split on concepts, never by trimming docstrings; only past 1,000 does the test fail.
SOFT_MODULE_LINES = 500
MAX_MODULE_LINES = 1000


def _modules():
    for path in sorted(VT.rglob("*.py")):
        rel = path.relative_to(VT.parent).with_suffix("")
        parts = rel.parts if rel.name != "__init__" else rel.parts[:-1]
        yield path, ".".join(parts)


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "vt" else None


def _imports(path: pathlib.Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("vt.")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:   # relative: resolve against this module's package
                base = module.split(".")
                if not path.name == "__init__.py":
                    base = base[:-1]
                base = base[:len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name == "vt":   # `from vt import env`: an arrow to the module vt.env
                out |= {f"vt.{a.name}" for a in node.names if not a.name.startswith("__")}
            elif name.startswith("vt."):
                # `from pkg import sub` is an arrow to pkg.sub when that is a module (the
                # cycle check keeps only names that are); `from . import sub` only that
                if node.module:
                    out.add(name)
                out |= {f"{name}.{a.name}" for a in node.names}
    return out


def _graph():
    return {module: _imports(path, module) for path, module in _modules() if module != "vt"}


def test_every_package_has_a_rank():
    packages = {_package(m) for m in _graph()} - {None, "__main__"}
    assert packages <= set(RANK), f"packages without a layer: {sorted(packages - set(RANK))}"


def test_imports_only_point_down():
    up = []
    for module, imports in _graph().items():
        src = _package(module)
        if src not in RANK:
            continue
        for target in imports:
            dst = _package(target)
            if dst != src and RANK.get(dst, -1) >= RANK[src]:
                up.append(f"{module} -> {target}")
    assert up == [], "arrows up or sideways:\n" + "\n".join(up)


def test_no_import_cycles():
    graph = _graph()
    modules = set(graph)

    def resolve(name):   # a `from vt.x import y` of a module y counts as an arrow to vt.x.y
        return name if name in modules else None

    edges = {m: {r for t in ts if (r := resolve(t)) and r != m} for m, ts in graph.items()}
    seen, stack, cycles = set(), [], []

    def visit(m, path):
        if m in path:
            cycles.append(" -> ".join(path[path.index(m):] + [m]))
            return
        if m in seen:
            return
        seen.add(m)
        for n in edges.get(m, ()):
            visit(n, path + [m])

    for m in sorted(edges):
        visit(m, stack)
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)


def test_the_top_level_is_a_handful_of_files():
    files = sorted(p.name for p in VT.glob("*.py"))
    assert len(files) <= MAX_TOP_LEVEL_FILES, files


@pytest.mark.parametrize("path", sorted(VT.rglob("*.py")), ids=lambda p: str(p.relative_to(VT)))
def test_no_module_is_long(path):
    import warnings
    n = len(path.read_text().splitlines())
    assert n <= MAX_MODULE_LINES, f"{path.relative_to(VT)}: {n} lines; split it on its concepts"
    if n > SOFT_MODULE_LINES:
        warnings.warn(f"{path.relative_to(VT)} has {n} lines: does it hold a second concept?")


def _drawn_layers() -> list[list[str]]:
    """The rows of docs/architecture.md's layer drawing, top down: each row's leading
    `vt/<package>/` or `vt/<module>.py` names (its description follows them)."""
    doc = (VT.parent / "docs" / "architecture.md").read_text()
    block = re.search(r"^## The layers, top down\n+```text\n(.*?)^```", doc, re.S | re.M).group(1)
    rows = []
    for line in block.splitlines():
        lead = re.match(r"((?:vt/\w+(?:/|\.py)(?:\s+|$))+)", line)
        if lead:
            rows.append(re.findall(r"vt/(\w+)", lead.group(1)))
    return rows


def test_the_architecture_doc_draws_the_ranks():
    """Every ranked package once; packages of one rank on one row; rows top down by rank."""
    rows = _drawn_layers()
    drawn = [name for row in rows for name in row]
    assert sorted(drawn) == sorted(RANK), (f"drawn, not ranked: {sorted(set(drawn) - set(RANK))}; "
                                           f"ranked, not drawn: {sorted(set(RANK) - set(drawn))}")
    assert len(drawn) == len(set(drawn)), f"drawn twice: {drawn}"
    ranks = []
    for row in rows:
        assert len({RANK[name] for name in row}) == 1, f"one row, several ranks: {row}"
        ranks.append(RANK[row[0]])
    assert ranks == sorted(set(ranks), reverse=True), \
        "rows out of RANK's order: " + ", ".join(f"{r} ({RANK[r[0]]})" for r in rows)
