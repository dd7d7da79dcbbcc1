"""No module reaches into another object's private state, checked from the source of vt/.

A name with a leading underscore belongs to its class (or module): only that class's own
methods read or write it, through `self` (or `cls`). Reaching `other._x` couples a caller to
state its owner may change or rely on being alone to touch; a collaborator gets what it
needs passed in, or asks through a public method. The check, by ast over every module:

- an attribute `X._name` where X is not the bare name `self` or `cls` (so `self._a._b` counts:
  `_b` is `self._a`'s, not ours); dunders (`__name__`) are public;
- `getattr`/`setattr`/`hasattr`/`delattr` of such an X with a literal private name;
- `from vt.m import _name` of a name that is not a submodule (a private module of a package,
  `vt.backend.cuda._copy`, is the package's own).

ALLOWED lists what vt does today outside vt/engine, one line of reason each, so that only a
new reach fails; vt/engine has none. An entry nothing matches any more fails too: delete it.
"""
import ast
import pathlib

VT = pathlib.Path(__file__).resolve().parents[2] / "vt"
_OWN = {"self", "cls"}

_CUDA_BACKEND = "the cuda backend's Stream/Event/Graph and their helpers share one private protocol"
_SIM_BACKEND = "the sim backend mirrors the cuda one: its Stream/Event/Graph/memory share one protocol"
_SAME_CLASS = "another instance of the same class (elapsed_ms between two events)"
_THIRD_PARTY = "a third-party library's private name: it has no public one for this"
_WRAPPED_GEMM = "RoutedGemm launches through the cuBLAS handle and alpha of the Gemm it wraps"

# (module path under vt/, the expression as ast.unparse writes it) -> why it stays
ALLOWED = {
    ("backend/cuda/_copy.py", "stream._require_open"): _CUDA_BACKEND,
    ("backend/cuda/_event.py", "stream._require_open"): _CUDA_BACKEND,
    ("backend/cuda/_event.py", "start._require_open"): _SAME_CLASS,
    ("backend/cuda/_event.py", "start._event"): _SAME_CLASS,
    ("backend/cuda/_event.py", "ev._label"): _SAME_CLASS,
    ("backend/cuda/_graph.py", "stream._require_open"): _CUDA_BACKEND,
    ("backend/cuda/_graph.py", "stream._capture"): _CUDA_BACKEND,
    ("backend/cuda/_graph.py", "self._stream._capture"): _CUDA_BACKEND,
    ("backend/cuda/_stream.py", "event._require_open"): _CUDA_BACKEND,
    ("backend/cuda/backend.py", "stream._capture"): _CUDA_BACKEND,
    ("backend/sim/_event.py", "stream._require_open"): _SIM_BACKEND,
    ("backend/sim/_event.py", "start._require_open"): _SAME_CLASS,
    ("backend/sim/_event.py", "start._time"): _SAME_CLASS,
    ("backend/sim/_event.py", "ev._time"): _SAME_CLASS,
    ("backend/sim/_event.py", "ev._completed"): _SAME_CLASS,
    ("backend/sim/_graph.py", "stream._require_open"): _SIM_BACKEND,
    ("backend/sim/_memory.py", "owner._view_dtype"): _SIM_BACKEND,
    ("backend/sim/_memory.py", "owner._mem"): _SIM_BACKEND,
    ("backend/sim/backend.py", "stream._require_open"): _SIM_BACKEND,
    ("backend/sim/backend.py", "cap._graph"): _SIM_BACKEND,
    ("backend/sim/backend.py", "s._worker"): _SIM_BACKEND,
    ("bundled/kernels/gemm.py", "self._gemm._handle"): _WRAPPED_GEMM,
    ("bundled/kernels/gemm.py", "self._gemm._alpha"): _WRAPPED_GEMM,
    ("bundled/kernels/gemm.py", "RoutedGemm._per_slot"):
        "the float64 reference beside RoutedGemm, in its module, reuses its slot helper",
    ("bench/torch_ttft.py", "model.config._attn_implementation"): _THIRD_PARTY,
    ("torch/simcapture.py", "torch.ops.aten._local_scalar_dense"): _THIRD_PARTY,
    ("torch/fp8.py", "torch._scaled_mm"): _THIRD_PARTY,
    ("torch/simcapture.py", "torch._subclasses"): _THIRD_PARTY,
    ("torch/simcapture.py", "func._schema"): _THIRD_PARTY,
    ("parallel/communicator.py", "getattr(c10d, '_abort_process_group', None)"): _THIRD_PARTY,
    ("parallel/worker.py", "os._exit"):
        "the standard library's exit without cleanup, for a worker whose state is broken",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _foreign(node: ast.expr) -> bool:
    """Anything but the bare `self` or `cls`."""
    return not (isinstance(node, ast.Name) and node.id in _OWN)


def _is_module(package: str, name: str) -> bool:
    base = VT.parent.joinpath(*package.split("."), name)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _reaches(source: str):
    """(line, expression) of every reach into a private name in one module's source."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr) and _foreign(node.value):
            yield node.lineno, ast.unparse(node)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and
              node.func.id in ("getattr", "setattr", "hasattr", "delattr") and
              len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and
              isinstance(node.args[1].value, str) and _private(node.args[1].value) and
              _foreign(node.args[0])):
            yield node.lineno, ast.unparse(node)
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("vt"):
            for alias in node.names:
                if _private(alias.name) and not _is_module(node.module, alias.name):
                    yield node.lineno, f"from {node.module} import {alias.name}"


def _all_reaches() -> dict:
    found = {}
    for path in sorted(VT.rglob("*.py")):
        rel = path.relative_to(VT).as_posix()
        for line, expr in _reaches(path.read_text()):
            found.setdefault((rel, expr), []).append(line)
    return found


def test_no_module_reaches_another_objects_private_names():
    found = _all_reaches()
    new = [f"vt/{rel}:{lines[0]}: {expr}" for (rel, expr), lines in sorted(found.items())
           if (rel, expr) not in ALLOWED]
    assert new == [], ("private names reached from outside their owner (pass what is needed "
                       "in, or add a public method):\n" + "\n".join(new))


def test_the_engine_reaches_nothing_private():
    """vt/engine has no allowed exceptions: its classes hand each other what they need."""
    assert not [key for key in ALLOWED if key[0].startswith("engine/")]
    assert not [key for key in _all_reaches() if key[0].startswith("engine/")]


def test_every_allowed_reach_still_exists():
    stale = sorted(set(ALLOWED) - set(_all_reaches()))
    assert stale == [], f"allowed reaches that no longer occur (delete them from ALLOWED): {stale}"


def test_the_check_sees_a_reach():
    """The detector itself: a foreign private attribute, a getattr of one and a private
    import are found; self/cls access, dunders and a private submodule are not."""
    src = ("from vt.backend.cuda import _copy\nfrom vt.cli.common import _what_to_do\n"
           "self._a; cls._b; x.__name__; other._c; self._d._e; getattr(o, '_f')\n")
    got = [expr for _, expr in _reaches(src)]
    assert sorted(got) == sorted(["from vt.cli.common import _what_to_do", "other._c",
                                  "self._d._e", "getattr(o, '_f')"]), got
