"""The bounds of every size and number `vt run` and `vt bench` accept, and the checks both
front ends make with them before any work (each returns why a value is refused, or None).

A bound is where a value stops being a measurement and becomes a mistake that would run for
minutes or take gigabytes before failing (`--concurrency 100000`, `--requests 10**21`). The
executor's own bounds (concurrency, capture sizes) are ExecutorConfig's (vt/config.py), so the
API refuses the same values the command line does.
"""
from __future__ import annotations

import math

from vt.config import MAX_CAPTURE_SIZE, MAX_SERVING_CONC  # noqa: F401 (re-exported)

MAX_VOCAB = 1 << 20            # vt bench --vocab: a million tokens, beyond any served LLM
MAX_REQUESTS = 100_000        # vt run --requests: prompts are made up front, 100k is seconds
MAX_STEPS = 100_000           # vt bench --steps: decode steps per cell
MAX_PROMPT_LEN = 4096         # vt bench --prompt-len (vt run's is bounded by the preset)
MAX_REPEATS = 100             # vt bench --repeats
MAX_CEILING_REPLAYS = 100_000 # vt bench --ceiling-replays
MAX_LIST_VALUES = 32          # vt bench: values of one list flag (--conc, --device-us, ...)
MAX_DEVICE_US = 1e6           # vt bench --device-us: one second of device work per step
MAX_WARMUP_S = 600.0          # vt bench --warmup-s
MAX_SIM_DELAY_MS = 1000.0     # --sim-delay-ms: the sim backend's delay per device op
MAX_WAIT_POLL_US = 1e6        # --wait-poll-us, exclusive (ExecutorConfig.wait_poll_us's bound)
MIN_RATE = 0.01               # vt bench --rate (open loop): one arrival per 100 s
MAX_RATE = 1e6                # vt bench --rate: a million arrivals per second
MAX_SEED = 2**63 - 1          # --seed: numpy's generators take any int; JSON readers do not


def int_problem(flag: str, value, lo: int, hi: int) -> str | None:
    """Why the integer `value` of `flag` is refused: outside [lo, hi]."""
    if value is None or lo <= value <= hi:
        return None
    return f"{flag} must be an integer in [{lo}, {hi}], got {value}"


def float_problem(flag: str, value, lo: float, hi: float, *, hi_open: bool = False) -> str | None:
    """Why the number `value` of `flag` is refused: NaN, infinite, or outside [lo, hi]
    ([lo, hi) with hi_open)."""
    if value is None:
        return None
    inside = math.isfinite(value) and lo <= value and (value < hi if hi_open else value <= hi)
    if inside:
        return None
    return f"{flag} must be a finite number in [{lo:g}, {hi:g}{')' if hi_open else ']'}, got {value}"


def list_problem(flag: str, values: list) -> str | None:
    """Why a list flag's values are refused as a whole: too many, or a value repeated."""
    if len(values) > MAX_LIST_VALUES:
        return f"{flag} takes at most {MAX_LIST_VALUES} values, got {len(values)}"
    if len(set(values)) != len(values):
        return f"{flag} must not repeat a value, got {values}"
    return None


def png_problem(path: str) -> str | None:
    """Why `--png path` cannot be honoured, beyond the path itself: a name that is not a .png
    (matplotlib would pick the format from it, or add .png, and the file reported would not
    be the file written), or matplotlib missing."""
    if not path.lower().endswith(".png"):
        return f"--png {path!r} must end in .png (the file written is exactly the name given)"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--png needs matplotlib, which is not installed: pip install matplotlib, or drop --png"
    return None
