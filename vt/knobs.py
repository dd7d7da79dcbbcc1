"""ExecutorConfig: every executor knob, as a validated dataclass and as an environment variable.

The knobs' variables are read (through vt/env.py's parser) only by `ExecutorConfig.from_env`;
everything below it receives the config object explicitly, so a test can run two modes side by
side in one process.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vt import env
from vt.env import DEFAULT_TRACE_PATH, H2D_MODES  # noqa: F401 (re-exported)

DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)

# Upper bounds, refused up front by ExecutorConfig (and so by `vt run` and `vt bench`): past
# them a typo builds gigabytes of buffers or hundreds of graphs before anything fails.
MAX_SERVING_CONC = 1024   # serving_conc: rows of one decode step
MAX_RING_DEPTH = 8        # ring_depth: slots (graphs + buffers) per captured size
MAX_CAPTURE_SIZE = 1024   # each capture_sizes entry
MAX_CAPTURE_SIZES = 64    # how many sizes get a graph

# One spelling per executor mode, shared by the engine, the CLI and the bench: name -> the
# ExecutorConfig fields that make it.
MODES = {
    "sync": dict(depth=1),                              # the reference: launch, wait, read
    "drain": dict(),                                    # the default (VT_ASYNC_EXECUTOR off)
    "ring": dict(async_executor=True),                  # the fast path: slot ring + drain skip
    "staged": dict(async_executor=True, h2d="staged"),  # Option A: out-of-graph H2D copy
    "no_dbuf": dict(no_dbuf=True),                      # the unsafe arm: proves the hazard
}
SAFE_MODES = tuple(m for m in MODES if m != "no_dbuf")

# field -> environment variable (vt/env.py parses it). The first five are the design's own knobs
# (docs/design.md); the rest make every field settable the same way for the bench and the CLI.
ENV_VARS = {
    "async_executor": "VT_ASYNC_EXECUTOR",
    "no_dbuf": "VT_ASYNC_EXECUTOR_NO_DBUF",
    "poison": "VT_ASYNC_EXECUTOR_POISON",
    "trace": "VT_ASYNC_EXECUTOR_TRACE",
    "serving_conc": "VT_ASYNC_SERVING_CONC",
    "ring_depth": "VT_ASYNC_EXECUTOR_RING",
    "h2d": "VT_ASYNC_EXECUTOR_H2D",
    "capture_sizes": "VT_CAPTURE_SIZES",
    "wait_poll_us": "VT_WAIT_POLL_US",
}


@dataclass(frozen=True)
class ExecutorConfig:
    """How the decode executor schedules, guards and records its steps.

    async_executor: the slot ring (k slots per size) and the drain skip for graph steps.
    no_dbuf: skip the drain WITHOUT the ring: the unsafe arm that reproduces hazard-C.
    poison: after each launch, overwrite the next slot's host vectors as early as the mode
        lets the host write them, with a pattern that makes a late read visibly wrong.
    trace: path of a Chrome trace JSON written at close (None: no trace).
    serving_conc: how many requests the engine runs at once, at most MAX_SERVING_CONC.
    ring_depth: k, slots per size when the ring is on (2 by default, at most MAX_RING_DEPTH:
        depth 2 keeps at most two steps in flight, so a third slot only costs memory and
        capture time).
    capture_sizes: padded batch sizes that get a graph; larger batches run eagerly. At most
        MAX_CAPTURE_SIZES sizes, each at most MAX_CAPTURE_SIZE (and the model's max batch).
    h2d: "graph" bakes the H2D into each slot's graph; "staged" copies out of graph into
        persistent device buffers from a double-buffered pinned staging area (one graph/size).
    depth: 2 is the async pipeline (step N+1 launched before step N's tokens are read);
        1 is the fully synchronous reference (launch, wait, read, repeat).
    skip_pool_reserve: test hook: skip the pool pre-grow before capture.
    wait_poll_us: how long the host polls an event before a blocking wait (vt/backend/waits.py);
        None: the measured default on cuda, 0 (block at once) on the sim.
    """
    async_executor: bool = False
    no_dbuf: bool = False
    poison: bool = False
    trace: str | None = None
    serving_conc: int = 8
    ring_depth: int = 2
    capture_sizes: tuple[int, ...] = DEFAULT_CAPTURE_SIZES
    h2d: str = "graph"
    depth: int = 2
    skip_pool_reserve: bool = False
    wait_poll_us: float | None = None

    def __post_init__(self):
        for name in ("async_executor", "no_dbuf", "poison", "skip_pool_reserve"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ExecutorConfig.{name} must be a bool, got {getattr(self, name)!r}")
        _positive_int("serving_conc", self.serving_conc, MAX_SERVING_CONC)
        _positive_int("ring_depth", self.ring_depth, MAX_RING_DEPTH)
        if self.ring_depth < 2:
            raise ValueError(f"ExecutorConfig.ring_depth must be >= 2 (a ring of one slot is the "
                             f"OFF path: set async_executor=False), got {self.ring_depth}")
        if self.depth not in (1, 2):
            raise ValueError(f"ExecutorConfig.depth must be 1 (synchronous) or 2 (async), got {self.depth!r}")
        if self.wait_poll_us is not None and (isinstance(self.wait_poll_us, bool) or
                                              not isinstance(self.wait_poll_us, (int, float)) or
                                              not 0 <= self.wait_poll_us < 1e6):
            raise ValueError(f"ExecutorConfig.wait_poll_us must be a number of microseconds in "
                             f"[0, 1e6) or None, got {self.wait_poll_us!r}")
        if self.h2d not in H2D_MODES:
            raise ValueError(f"ExecutorConfig.h2d must be one of {H2D_MODES}, got {self.h2d!r}")
        if self.trace is not None and (not isinstance(self.trace, str) or not self.trace):
            raise ValueError(f"ExecutorConfig.trace must be a file path or None, got {self.trace!r}")
        if isinstance(self.capture_sizes, (str, bytes)) or not hasattr(self.capture_sizes, "__iter__"):
            raise TypeError(f"ExecutorConfig.capture_sizes must be a sequence of ints, got "
                            f"{self.capture_sizes!r}")
        sizes = tuple(self.capture_sizes)
        if len(sizes) > MAX_CAPTURE_SIZES:
            raise ValueError(f"ExecutorConfig.capture_sizes has {len(sizes)} sizes; at most "
                             f"{MAX_CAPTURE_SIZES} get a graph")
        for s in sizes:
            _positive_int("capture_sizes entry", s, MAX_CAPTURE_SIZE)
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"ExecutorConfig.capture_sizes has duplicates: {sizes}")
        object.__setattr__(self, "capture_sizes", tuple(sorted(sizes)))
        if self.no_dbuf and self.async_executor:
            raise ValueError(
                "no_dbuf=True with async_executor=True makes no sense: NO_DBUF is the unsafe arm "
                "that skips the drain WITHOUT the ring, and the ring already skips it safely; "
                "set one of them")
        if self.no_dbuf and self.depth == 1:
            raise ValueError("no_dbuf=True with depth=1 makes no sense: a synchronous run "
                             "waits for every step, so there is no drain to skip")

    @property
    def mode(self) -> str:
        """The name in MODES this config runs (poison and trace are orthogonal to it)."""
        if self.depth == 1:
            return "sync"
        if self.no_dbuf:
            return "no_dbuf"
        if not self.async_executor:
            return "drain"
        return "staged" if self.h2d == "staged" else "ring"

    @classmethod
    def for_mode(cls, mode: str, **overrides) -> "ExecutorConfig":
        """The config of a mode by its name in MODES; keyword overrides for the other fields."""
        if mode not in MODES:
            raise ValueError(f"unknown executor mode {mode!r}; choose from {', '.join(MODES)}")
        return cls(**{**MODES[mode], **overrides})

    @property
    def slots_per_size(self) -> int:
        """k slots per size with the ring; a single slot otherwise (OFF and NO_DBUF)."""
        return self.ring_depth if self.async_executor else 1

    @property
    def skips_graph_drain(self) -> bool:
        """Whether a step after a graph step (non-owning logits view) skips the drain."""
        return self.async_executor or self.no_dbuf

    def replace(self, **changes) -> "ExecutorConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ=None, **overrides) -> "ExecutorConfig":
        """Config from VT_* environment variables; keyword overrides win over the environment."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(overrides) - fields
        if unknown:
            raise TypeError(f"ExecutorConfig has no field(s) {sorted(unknown)}; fields: {sorted(fields)}")
        values = {}
        for field, var in ENV_VARS.items():
            if field not in overrides and env.is_set(var, environ):
                values[field] = env.get(var, environ)
        values.update(overrides)
        try:
            return cls(**values)
        except ValueError as e:
            from_vars = [ENV_VARS[f] + "=" + env.raw(ENV_VARS[f], environ) for f in values
                         if f in ENV_VARS and f not in overrides]
            raise ValueError(f"{e} (environment: {', '.join(from_vars) or 'none set'})") from None


def _positive_int(name, v, hi):
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"ExecutorConfig.{name} must be an int, got {v!r}")
    if not 1 <= v <= hi:
        raise ValueError(f"ExecutorConfig.{name} must be a positive int of at most {hi}, got {v!r}")
