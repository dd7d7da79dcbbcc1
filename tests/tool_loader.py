"""Import a script of tools/ (not a package) as a module, once per test session."""
import importlib.util
import sys
from pathlib import Path

_TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(name: str):
    """tools/<name>.py as module `vt_tools_<name>`, registered in sys.modules before it runs
    (its dataclasses look their module up) and reused by every later caller."""
    mod_name = f"vt_tools_{name}"
    if mod_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(mod_name, _TOOLS / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[mod_name]
