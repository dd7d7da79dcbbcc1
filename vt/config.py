"""ExecutorConfig: the executor's configuration, one validated mode plus the sizes around it.

One way to build it: the constructor, with keyword fields (`ExecutorConfig(mode="ring",
serving_conc=8)`); it reads no environment. `ExecutorConfig.from_env()` is the one reader of
the configuration's VT_* variables (keyword overrides win over them), and `Engine(config=None)`
calls it.

The mode is the whole of how steps are scheduled and guarded; everything the executor does
differently per mode is a property derived from it (ExecutorConfig's docstring lists them),
so a config cannot say one thing and run another. Everything below the engine receives the
config object explicitly, so a test can run two modes side by side in one process.
Test arms (poison, no pool pre-grow, injected device work) are not configuration: they are
hooks (vt/hooks.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vt import env
from vt.env import DEFAULT_TRACE_PATH  # noqa: F401 (re-exported)
from vt.validate import integer

DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)

# Upper bounds, refused up front by ExecutorConfig (and so by `vt run` and `vt bench`): past
# them a typo builds gigabytes of buffers or hundreds of graphs before anything fails.
MAX_SERVING_CONC = 1024   # serving_conc: rows of one decode step
MAX_CAPTURE_SIZE = 1024   # each capture_sizes entry
MAX_CAPTURE_SIZES = 64    # how many sizes get a graph

# Slots per size in the ring modes. The pipeline is depth 2: at most two steps are in flight,
# so the slot a step reuses is the one of the step before the last, and a third slot would
# only cost memory and capture time (docs/design.md, "What limits a depth-2 loop").
RING_SLOTS = 2

# One spelling per executor mode, shared by the engine, the CLI and the bench: name -> what
# it is. ExecutorConfig derives each mode's behaviour from its name.
MODES = {
    "sync": "the reference: launch a step, wait for it, read its tokens (depth 1)",
    "drain": "the default: depth 2, but the host waits for step N before it writes step "
             "N+1's inputs (one slot per size)",
    "ring": "the fast path: two slots per size, each guarded by its event, so graph steps "
            "skip the drain",
    "staged": "the ring with the inputs' H2D copy outside the graph, into device buffers "
              "shared by the size's slots (one graph per size)",
    "unguarded": "the unsafe test arm: skips the drain without the ring, so the host "
                 "overwrites inputs the device has not read yet (the host-overwrite hazard); "
                 "its tokens are wrong on purpose",
}
SAFE_MODES = tuple(m for m in MODES if m != "unguarded")

# field -> environment variable (vt/env.py parses it). The mode has two variables of its own
# (_mode_from_env).
ENV_VARS = {
    "trace": "VT_ASYNC_EXECUTOR_TRACE",
    "serving_conc": "VT_ASYNC_SERVING_CONC",
    "capture_sizes": "VT_CAPTURE_SIZES",
    "wait_poll_us": "VT_WAIT_POLL_US",
}
MODE_VARS = ("VT_ASYNC_EXECUTOR", "VT_ASYNC_EXECUTOR_NO_DBUF")

@dataclass(frozen=True)
class ExecutorConfig:
    """How the decode executor schedules, guards and records its steps.

    mode: a name of MODES. What each runs is derived from it:
        depth           1 for sync; 2 (step N+1 launched before step N's tokens are read)
                        for the others;
        slots_per_size  RING_SLOTS for ring and staged, 1 for the others;
        guarded         ring and staged: acquiring a slot waits on its event first;
        staged_h2d      staged: the inputs' H2D runs outside the graph;
        skips_graph_drain  ring, staged and unguarded: a step after a graph step (whose
                        logits are a graph's view) is launched without waiting for it.
        unguarded is the one mode that skips the drain without a guard: unsafe.
    trace: path of a Chrome trace JSON written at close (None: no trace).
    serving_conc: how many requests the engine runs at once, at most MAX_SERVING_CONC.
    capture_sizes: padded batch sizes that get a graph; larger batches run eagerly. At most
        MAX_CAPTURE_SIZES sizes, each at most MAX_CAPTURE_SIZE (and the model's max batch).
    wait_poll_us: how long the host polls an event before a blocking wait (vt/backend/waits.py);
        None: the measured default on cuda, 0 (block at once) on the sim.
    """
    mode: str = "drain"
    trace: str | None = None
    serving_conc: int = 8
    capture_sizes: tuple[int, ...] = DEFAULT_CAPTURE_SIZES
    wait_poll_us: float | None = None

    def __post_init__(self):
        if not isinstance(self.mode, str) or self.mode not in MODES:
            raise ValueError(f"ExecutorConfig.mode must be one of {', '.join(MODES)}, got "
                             f"{self.mode!r}")
        integer("ExecutorConfig.serving_conc", self.serving_conc, 1, MAX_SERVING_CONC)
        if self.wait_poll_us is not None and (isinstance(self.wait_poll_us, bool) or
                                              not isinstance(self.wait_poll_us, (int, float)) or
                                              not 0 <= self.wait_poll_us < 1e6):
            raise ValueError(f"ExecutorConfig.wait_poll_us must be a number of microseconds in "
                             f"[0, 1e6) or None, got {self.wait_poll_us!r}")
        if self.trace is not None and (not isinstance(self.trace, str) or not self.trace):
            raise ValueError(f"ExecutorConfig.trace must be a file path or None, got {self.trace!r}")
        if isinstance(self.capture_sizes, (str, bytes)) or not hasattr(self.capture_sizes, "__iter__"):
            raise TypeError(f"ExecutorConfig.capture_sizes must be a sequence of ints, got "
                            f"{self.capture_sizes!r}")
        sizes = tuple(self.capture_sizes)
        if len(sizes) > MAX_CAPTURE_SIZES:
            raise ValueError(f"ExecutorConfig.capture_sizes has {len(sizes)} sizes; at most "
                             f"{MAX_CAPTURE_SIZES} get a graph")
        sizes = tuple(integer("ExecutorConfig.capture_sizes entry", s, 1, MAX_CAPTURE_SIZE)
                      for s in sizes)
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"ExecutorConfig.capture_sizes has duplicates: {sizes}")
        object.__setattr__(self, "capture_sizes", tuple(sorted(sizes)))
        object.__setattr__(self, "serving_conc", int(self.serving_conc))

    # -- what the mode runs -------------------------------------------------------------
    @property
    def depth(self) -> int:
        """Steps in flight: 1 for sync (launch, wait, read), 2 for the others."""
        return 1 if self.mode == "sync" else 2

    @property
    def guarded(self) -> bool:
        """Whether acquiring a slot first waits on its event (the ring modes)."""
        return self.mode in ("ring", "staged")

    @property
    def slots_per_size(self) -> int:
        """RING_SLOTS with the guard, else one slot per size."""
        return RING_SLOTS if self.guarded else 1

    @property
    def staged_h2d(self) -> bool:
        """Whether the inputs' H2D runs outside the graph (one graph per size)."""
        return self.mode == "staged"

    @property
    def skips_graph_drain(self) -> bool:
        """Whether a step after a graph step (non-owning logits view) skips the drain: safe
        with the guard, the host-overwrite hazard without it (unguarded)."""
        return self.guarded or self.mode == "unguarded"

    @property
    def safe(self) -> bool:
        """False only for the unguarded test arm, whose tokens are wrong on purpose."""
        return self.mode != "unguarded"

    def describe(self) -> str:
        """What the mode runs, in words (what `vt run` prints)."""
        return (f"{self.slots_per_size} slot(s) per size, "
                f"{'guarded' if self.guarded else 'unguarded'}, "
                f"H2D {'staged' if self.staged_h2d else 'in the graph'}, "
                f"graph steps {'skip' if self.skips_graph_drain else 'wait for'} the drain, "
                f"depth {self.depth}")

    # -- building one -------------------------------------------------------------------
    def replace(self, **changes) -> "ExecutorConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ=None, **overrides) -> "ExecutorConfig":
        """Config from VT_* environment variables; keyword overrides win over the environment
        (a `mode` override replaces the mode variables entirely). The one place the
        configuration reads the environment; Engine(config=None) calls it."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(overrides) - fields
        if unknown:
            raise TypeError(f"ExecutorConfig has no field(s) {sorted(unknown)}; fields: {sorted(fields)}")
        values, from_vars = {}, []
        if "mode" not in overrides:
            values["mode"] = _mode_from_env(environ)
            from_vars += [v for v in MODE_VARS if env.is_set(v, environ)]
        for field, var in ENV_VARS.items():
            if field not in overrides and env.is_set(var, environ):
                values[field] = env.get(var, environ)
                from_vars.append(var)
        values.update(overrides)
        try:
            return cls(**values)
        except ValueError as e:
            shown = [f"{v}={env.raw(v, environ)}" for v in from_vars]
            raise ValueError(f"{e} (environment: {', '.join(shown) or 'none set'})") from None


def _mode_from_env(environ=None) -> str:
    """The mode the environment names: VT_ASYNC_EXECUTOR=1 the ring, VT_ASYNC_EXECUTOR_NO_DBUF=1
    the unguarded test arm, neither the drain (the default)."""
    ring = env.get("VT_ASYNC_EXECUTOR", environ)
    unguarded = env.get("VT_ASYNC_EXECUTOR_NO_DBUF", environ)
    if ring and unguarded:
        raise ValueError(
            "VT_ASYNC_EXECUTOR=1 with VT_ASYNC_EXECUTOR_NO_DBUF=1 makes no sense: NO_DBUF is the "
            "unsafe arm that skips the drain WITHOUT the ring, and the ring already skips it "
            "safely; set one of them (environment: VT_ASYNC_EXECUTOR=1, "
            "VT_ASYNC_EXECUTOR_NO_DBUF=1)")
    return "ring" if ring else "unguarded" if unguarded else "drain"
