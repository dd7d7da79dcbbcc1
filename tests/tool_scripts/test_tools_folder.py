"""tools/ holds what a user or a test runs, each listed in tools/README.md, and none of them
reaches into the CLI: benchmark code comes from vt.bench."""
import ast
import pathlib
import re

TOOLS = pathlib.Path(__file__).resolve().parents[2] / "tools"
# vt serve's engine config, which tools/serve_http_ab.py reproduces to compare with the server
CLI_NAMES_ALLOWED = {("vt.cli.serve", "serving_config")}


def _scripts():
    return sorted(p for p in TOOLS.iterdir()
                  if p.suffix in (".py", ".sh") and p.name != "__init__.py")


def test_every_tool_is_in_the_readme_and_every_readme_tool_exists():
    readme = (TOOLS / "README.md").read_text()
    named = set(re.findall(r"tools/(\w+\.(?:py|sh))", readme)) - {"__init__.py"}
    have = {p.name for p in _scripts()}
    assert have - named == set(), f"not in tools/README.md: {sorted(have - named)}"
    assert named - have == set(), f"tools/README.md names missing tools: {sorted(named - have)}"


def test_no_tool_imports_the_cli():
    reached = []
    for path in _scripts():
        if path.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vt.cli"):
                reached += [(path.name, node.module, a.name) for a in node.names
                            if (node.module, a.name) not in CLI_NAMES_ALLOWED]
            elif isinstance(node, ast.Import):
                reached += [(path.name, a.name, "") for a in node.names
                            if a.name.startswith("vt.cli")]
    assert reached == [], f"tools importing vt.cli (use vt.bench): {reached}"
