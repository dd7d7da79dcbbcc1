"""Every VT_* environment variable vt reads: its name, type, default and meaning, and the one
strict parser that reads them.

This is the only module that looks at os.environ (for VT_* names, and through foreign() and
set_foreign() for the few variables of other libraries vt reads or sets). Everything else asks
`get(name)` (the parsed value, or the default when the variable is unset), so a value is
spelled one way everywhere: a switch is exactly "0" or "1" (not "yes", not "2"), a size is a
positive integer, and anything else is a ValueError that names the variable and the value.
A VT_* name that is not in VARIABLES is almost always a typo of one that is: it is reported
once per process with a warning (UnknownVariableWarning) naming the closest known one.

`check()` parses every VT_* variable that is set and returns the warnings for unknown ones:
the command line runs it before it builds anything, so a bad value is a one-line usage error
instead of a traceback after the model was built.
"""
from __future__ import annotations

import difflib
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

PREFIX = "VT_"
DEFAULT_TRACE_PATH = "vt_trace.json"


class UnknownVariableWarning(UserWarning):
    """A VT_* variable is set that vt does not read (a typo, or a name from another version)."""


@dataclass(frozen=True)
class Variable:
    """name: the environment variable; parse(name, raw) -> value (ValueError naming the
    variable otherwise); default: the value when unset; kind: what values it takes, in words;
    doc: what it does, one line."""
    name: str
    parse: Callable[[str, str], Any]
    default: Any
    kind: str
    doc: str


# ---------------------------------------------------------------------- parsers
def _switch(name: str, raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
    return raw == "1"


def _positive_int(name: str, raw: str) -> int:
    # int() would take "+3", " 3" and "3_000"; a size is written as plain digits.
    if not raw.isdigit() or not raw.isascii() or int(raw) < 1:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}")
    return int(raw)


def _trace(name: str, raw: str) -> str | None:
    # 0/1 like the switches, or a path; a path must end in .json so that a boolean spelled
    # another way (yes, true, on) is refused instead of becoming a file of that name.
    if raw in ("", "0"):
        return None
    if raw == "1":
        return DEFAULT_TRACE_PATH
    if not raw.lower().endswith(".json"):
        raise ValueError(f"{name} must be 0, 1 (writes {DEFAULT_TRACE_PATH}) or a path ending in "
                         f".json, got {raw!r}")
    return raw


def _sizes(name: str, raw: str) -> tuple[int, ...]:
    parts = [p.strip() for p in raw.split(",")]
    if not raw or not all(p.isdigit() and p.isascii() and int(p) >= 1 for p in parts):
        raise ValueError(f"{name} must be comma-separated positive integers, got {raw!r}")
    return tuple(int(p) for p in parts)


def _microseconds(name: str, raw: str) -> float:
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of microseconds >= 0, got {raw!r}") from None
    if not 0 <= v < 1e6:   # NaN fails both comparisons
        raise ValueError(f"{name} must be a number of microseconds in [0, 1e6), got {raw!r}")
    return v


def _label(name: str, raw: str) -> str:
    if not raw or not raw.isprintable():
        raise ValueError(f"{name} must be a non-empty printable label, got {raw!r}")
    return raw


_SWITCH = "0 or 1"
VARIABLES: dict[str, Variable] = {v.name: v for v in (
    # The executor's configuration: ExecutorConfig.from_env (vt/config.py) reads them; the
    # first two name its mode, POISON is vt.hooks.hooks_from_env's.
    Variable("VT_ASYNC_EXECUTOR", _switch, False, _SWITCH,
             "1: mode ring (slot ring + drain skip); 0: mode drain (single slot, drain every step)"),
    Variable("VT_ASYNC_EXECUTOR_NO_DBUF", _switch, False, _SWITCH,
             "1: mode unguarded, the test arm that skips the drain without the ring "
             "(reproduces the host-overwrite hazard)"),
    Variable("VT_ASYNC_EXECUTOR_POISON", _switch, False, _SWITCH,
             "test arm (vt.hooks.Poison): overwrite the next slot's host vectors as soon "
             "as the mode lets the host write them"),
    Variable("VT_ASYNC_EXECUTOR_TRACE", _trace, None, "0, 1 or a path ending in .json",
             f"write a per-step Chrome trace JSON (1: to {DEFAULT_TRACE_PATH})"),
    Variable("VT_ASYNC_SERVING_CONC", _positive_int, 8, "a positive integer",
             "requests the engine runs at once"),
    Variable("VT_CAPTURE_SIZES", _sizes, (1, 2, 4, 8, 16, 24, 32, 48, 64),
             "comma-separated positive integers", "padded batch sizes that get a graph"),
    Variable("VT_WAIT_POLL_US", _microseconds, None, "microseconds in [0, 1e6)",
             "how long the host polls an event before a blocking wait"),
    # Read by the layers below the executor.
    Variable("VT_POOL_DEBUG", _switch, False, _SWITCH,
             "one exact-size driver allocation per buffer (for compute-sanitizer)"),
    Variable("VT_BATCH_INVARIANT", _switch, False, _SWITCH,
             "a request's logits do not depend on its batch: the bundled model on cuda "
             "too, vt.torch's LlamaDecoder on every backend"),
    Variable("VT_PREFILL_GRAPHS", _switch, True, _SWITCH,
             "the bundled model's prefill replays captured graphs (0: eager)"),
    Variable("VT_TRITON_PDL", _switch, True, _SWITCH,
             "vt.torch's Triton kernels over one row use programmatic dependent launch "
             "on compute capability 9.0+ (0: ordinary launches)"),
    Variable("VT_INITCHECK", _switch, False, _SWITCH,
             "zero each GEMM output before cuBLAS writes it (for initcheck)"),
    Variable("VT_COMMIT", _label, None, "a label", "the commit `vt bench` records in its JSON"),
    # The test suite's own switches (tests/).
    Variable("VT_SLOW", _switch, False, _SWITCH, "run the tests marked slow"),
    Variable("VT_FUZZ_SHRINK", _switch, False, _SWITCH, "let the executor fuzz shrink by phase"),
)}

_warned: set[str] = set()
_warned_lock = threading.Lock()


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of VT_* variable `name`: parsed, or its default when unset. ValueError if the
    value is not one the variable takes; KeyError for a name vt does not define."""
    var = VARIABLES[name]
    environ = os.environ if environ is None else environ
    _warn_unknown(environ)
    raw = environ.get(name)
    return var.default if raw is None else var.parse(name, raw.strip())


def switch_argument(who: str, value, name: str) -> bool:
    """A constructor's bool-or-None argument backed by switch variable `name`: None reads the
    variable, a bool is taken as given, anything else is a TypeError naming `who`."""
    if value is None:
        value = get(name)
    if not isinstance(value, bool):
        raise TypeError(f"{who} must be a bool or None, got {value!r}")
    return value


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    return raw(name, environ) is not None


def raw(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The text of VT_* variable `name` as set (None when unset), for messages."""
    if name not in VARIABLES:
        raise KeyError(name)
    return (os.environ if environ is None else environ).get(name)


def foreign(name: str) -> str | None:
    """A variable that is not vt's own but that vt must read, as set (None when unset): what
    another library is configured by (CUDA_VISIBLE_DEVICES for the ranks vt spawns)."""
    if name.startswith("VT_"):
        raise KeyError(f"{name}: read vt's own variables with get()")
    return os.environ.get(name)


def set_foreign(values: Mapping[str, str], *, keep_set: bool = False) -> None:
    """Set variables of other libraries for this process and the ones it starts (NCCL's
    settings, a spawned rank's visible GPU). keep_set: leave those already set as they are
    (the user's choice wins)."""
    for name, value in values.items():
        if name.startswith("VT_"):
            raise KeyError(f"{name}: vt's own variables are the user's to set")
        if not (keep_set and name in os.environ):
            os.environ[name] = value


def check(environ: Mapping[str, str] | None = None) -> list[str]:
    """Parse every VT_* variable that is set (the first bad one raises its ValueError) and
    return one message per unknown VT_* name not reported before (they are then not warned
    about again)."""
    environ = os.environ if environ is None else environ
    for name in sorted(VARIABLES):
        if name in environ:
            VARIABLES[name].parse(name, environ[name].strip())
    return _new_unknown(environ)


def unknown_message(name: str) -> str:
    close = difflib.get_close_matches(name, VARIABLES, n=1)
    hint = f"did you mean {close[0]}?" if close else "vt reads " + ", ".join(sorted(VARIABLES))
    return f"unknown environment variable {name} is ignored; {hint}"


def _new_unknown(environ: Mapping[str, str]) -> list[str]:
    names = [n for n in environ if n.startswith(PREFIX) and n not in VARIABLES]
    with _warned_lock:
        new = sorted(set(names) - _warned)
        _warned.update(new)
    return [unknown_message(n) for n in new]


def _warn_unknown(environ: Mapping[str, str]) -> None:
    for message in _new_unknown(environ):
        warnings.warn(message, UnknownVariableWarning, stacklevel=3)
