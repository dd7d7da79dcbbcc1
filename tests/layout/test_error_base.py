"""One base for vt's own errors: every exception class defined under vt/ derives from
vt.VtError (vt/errors.py), beside the built-in base it has, so `except vt.VtError` catches
whatever vt raises on its own account and `except ValueError` still catches a
RequestTooLargeError. Warnings, and the command line's exits that must stay outside
`except Exception` (a SystemExit, a bare BaseException), are not errors and are left out.

The classes are found from the source (every `class` statement under vt/), then looked up in
their imported module, so a class in a module this machine cannot import (it needs CuPy or a
GPU library) is reported as such, not silently passed."""
import ast
import functools
import importlib
import pathlib

import pytest

import vt
from vt.errors import VtError

VT = pathlib.Path(__file__).resolve().parents[2] / "vt"


def _classes():
    """(module name, class name) of every top-level or nested class statement under vt/."""
    for path in sorted(VT.rglob("*.py")):
        rel = path.relative_to(VT.parent).with_suffix("")
        module = ".".join(rel.parts if rel.name != "__init__" else rel.parts[:-1])
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                yield module, node.name


@functools.cache
def _exception_classes():
    found, unimportable = [], []
    for module, name in _classes():
        if module == "vt.__main__":   # importing it runs the command line
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and e.name.split(".")[0] in ("vt", "tests"):
                raise
            unimportable.append(f"{module} ({e.name} missing)")
            continue
        cls = getattr(mod, name, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            found.append(cls)
    return found, unimportable


def test_every_exception_class_vt_defines_is_a_vt_error():
    found, _ = _exception_classes()
    errors = [c for c in found if issubclass(c, Exception) and not issubclass(c, Warning)]
    assert len(errors) >= 20, [c.__qualname__ for c in errors]   # the scan found them
    outside = [f"{c.__module__}.{c.__qualname__}" for c in errors if not issubclass(c, VtError)]
    assert outside == [], f"exception classes without vt.VtError among their bases: {outside}"


def test_only_warnings_and_exits_stay_outside_the_base():
    """What is left out is left out for its reason: a warning, or an exit that an
    `except Exception` must not swallow."""
    found, _ = _exception_classes()
    left_out = sorted(f"{c.__module__}.{c.__qualname__}" for c in found if not issubclass(c, VtError))
    for name in left_out:
        module, _, qualname = name.rpartition(".")
        cls = getattr(importlib.import_module(module), qualname)
        assert issubclass(cls, Warning) or not issubclass(cls, Exception), name


def test_the_modules_scanned_import_here():
    """A module skipped for a missing library would hide its classes from the checks above:
    none may be skipped where vt's test dependencies are installed, except the CUDA ones."""
    _, unimportable = _exception_classes()
    assert all(any(lib in entry for lib in ("cupy", "cuda", "nvmath", "triton"))
               for entry in unimportable), unimportable


@pytest.mark.parametrize("name, builtin", [("RequestTooLargeError", ValueError),
                                            ("EngineBusyError", RuntimeError),
                                            ("ClosedError", RuntimeError)])
def test_public_errors_keep_their_builtin_base(name, builtin):
    cls = getattr(vt, name)
    assert issubclass(cls, VtError) and issubclass(cls, builtin)


def test_vt_exports_the_base():
    assert vt.VtError is VtError and "VtError" in vt.__all__
