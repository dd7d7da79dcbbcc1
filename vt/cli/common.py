"""What `vt run` and `vt bench` share: the one-line usage error and the parser that prints
it, the exit codes, the checks of output paths, and picking a backend, a preset and a model."""
from __future__ import annotations

import argparse
import math
import os
import re
import signal
import sys
import threading

import numpy as np


class UsageError(SystemExit):
    """A bad flag, VT_* variable or preset: `vt` prints the one-line message and exits 2.

    A SystemExit so that a script calling these helpers outside the CLI (tools/bench.py)
    still ends with the message and no traceback."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class OneLineParser(argparse.ArgumentParser):
    """argparse with a one-line usage error: what is wrong, then where the flags are listed
    (the default prints the whole usage block before the one line that matters)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message}; see {self.prog} --help\n")


class RemovedFlag(argparse.Action):
    """A flag vt no longer takes: hidden from --help, and refused with one line that names
    what replaced it (add_argument(..., action=RemovedFlag, replacement="use ..."))."""

    def __init__(self, option_strings, dest, *, replacement: str, **kwargs):
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs="?",
                         default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.replacement = replacement

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} was removed; {self.replacement}")


def mode_name(value: str) -> str:
    """argparse type of a mode flag: a mode's old name is refused with its new one."""
    from vt.knobs import RENAMED_MODES
    if value in RENAMED_MODES:
        raise argparse.ArgumentTypeError(f"mode {value!r} was renamed: use {RENAMED_MODES[value]}")
    return value


class CommandFailed(Exception):
    """The command ran and failed in a way it can name (a wait past its deadline): `vt`
    prints the one-line message and exits 1."""


class OutputError(CommandFailed):
    """An output file could not be written after the work (a full disk): printed after the
    report."""


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that cleanup runs (an output file being written
    is removed whole, the engine is closed) before `vt` exits 143."""


def write_output(who: str, what: str, path: str, write):
    """write() the output `what` at `path` (its result returned); an OSError becomes an
    OutputError naming both."""
    try:
        return write()
    except OSError as e:
        raise OutputError(f"{who}: could not write {what} {path!r}: {e.strerror or e}") from None


def run_command(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """Parse argv, check the VT_* variables, and run the command it names, with the exit codes
    of main(). A closed stdout (`vt info | head -1`) ends the command quietly with 141."""
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:   # --help and --version (0), a bad flag (2): returned, not raised
        return e.code
    who = " ".join(filter(None, (parser.prog, getattr(args, "command", None))))
    previous = _on_sigterm()
    try:
        _check_environment(who)
        return args.func(args)
    except UsageError as e:
        print(e.message, file=sys.stderr)
        return 2
    except CommandFailed as e:
        print(e, file=sys.stderr)
        return 1
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        _drop_stdout()
        return 141   # what a shell reports for a writer killed by SIGPIPE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("terminated", file=sys.stderr)
        return 143
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _check_environment(who: str) -> None:
    """Every VT_* variable parsed before any work (vt/env.py); unknown ones warned about."""
    from vt import env
    try:
        unknown = env.check()
    except ValueError as e:
        raise UsageError(f"{who}: {e}; fix or unset the variable") from None
    for message in unknown:
        print(f"{who}: warning: {message}", file=sys.stderr)


def _raise_terminated(signum, frame):
    raise Terminated()


def _on_sigterm():
    """SIGTERM raises Terminated in the main thread (elsewhere signals cannot be set): the
    previous handler, to restore, or None."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_terminated)


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (the EPIPE was ours, not some socket's)."""
    import select
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):   # no descriptor, or no poll() here
        return False


def _drop_stdout() -> None:
    """After EPIPE: point stdout at /dev/null, so that the flush at exit does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):   # a stdout without a file descriptor (captured by a test)
        pass


def what_to_do(error: Exception, who: str) -> str:
    """The end of a usage message: a VT_* variable named in the error is the thing to fix."""
    return "fix or unset the variable" if re.search(r"\bVT_\w+", str(error)) else f"see {who} --help"


def check_output_path(who: str, source: str, path: str) -> None:
    """UsageError now, not after the work, when `path` cannot be written (vt/executor/atomic_file.py)."""
    from vt.executor.atomic_file import output_path_problem
    why = output_path_problem(path)
    if why:
        raise UsageError(f"{who}: {source} {path!r} {why}")


def backend_name(name: str) -> str:
    """What get_backend(name) would open ("auto" resolved), without opening it."""
    if name != "auto":
        return name
    from vt.backend import available_backends
    return "cuda" if "cuda" in available_backends() else "sim"


def pick_backend(name: str, sim_delay_ms: float = 0.0, *, who: str = "vt"):
    """get_backend(name), with the sim-only per-op device delay when one is asked for; a bad
    name or option, a bad VT_POOL_DEBUG or cuda without a GPU is a UsageError."""
    from vt.backend import available_backends, get_backend
    try:
        return get_backend(name, **({"device_delay_s": sim_delay_ms / 1e3} if sim_delay_ms else {}))
    except ValueError as e:   # get_backend's own checks, made before it opens anything
        raise UsageError(f"{who}: {e}; {what_to_do(e, who)}") from None
    except RuntimeError as e:
        if name == "cuda" and "cuda" not in available_backends():
            raise UsageError(f"{who}: {e}; run with --backend sim (or auto) here") from None
        raise


def _weight_gb(cfg) -> float:
    from vt.model.weights import weight_shapes
    return sum(math.prod(shape) * np.dtype(dt).itemsize
               for shape, dt in weight_shapes(cfg).values()) / 1e9


def pick_preset(backend: str, preset: str | None, context: int, who: str, *, force: bool = False):
    """(name, ModelConfig) for backend "cuda" or "sim": the given preset, or the backend's
    default (bench-dense on cuda, tiny-dense on sim). UsageError if it is unknown, if a
    request of `context` = prompt + new tokens does not fit its max_context (the last new
    token needs no KV slot: prompt + new - 1 must fit, as generate() counts), or if it is a bench
    preset on the sim backend and not `force`."""
    from vt.model import PRESETS
    if preset is None:   # not given; an empty name is a name, and unknown
        preset = "bench-dense" if backend == "cuda" else "tiny-dense"
    name = preset
    if name not in PRESETS:
        raise UsageError(f"{who}: unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    cfg = PRESETS[name]
    # The last new token needs no KV slot: prompt + new - 1 tokens must fit, as in generate().
    if context - 1 > cfg.max_context:
        raise UsageError(f"{who}: prompt + new tokens - 1 = {context - 1} exceeds {name}'s "
                         f"max_context {cfg.max_context}; use a shorter prompt or fewer new tokens")
    # Bench presets are sized for the GPU's bandwidth: numpy on the CPU needs gigabytes of
    # host memory and minutes per step, with nothing printed meanwhile.
    if backend == "sim" and name.startswith("bench-") and not force:
        raise UsageError(f"{who}: preset {name} is a GPU benchmark model ({_weight_gb(cfg):.1f} GB "
                         f"of weights, several times that in host memory while they are made, "
                         f"minutes per step on the CPU) and this run uses the sim backend; use "
                         f"tiny-dense or tiny-moe, or add --force to run it anyway")
    return name, cfg


def resolve_preset(be, preset: str | None, context: int, who: str, *, force: bool = True):
    """pick_preset for an open backend (tools/bench.py); exits with the message on bad input."""
    return pick_preset(be.name, preset, context, who, force=force)


def build_model(be, cfg, *, max_seqs: int, context: int, seed: int, log=lambda msg: None):
    """A HybridModel with seeded random weights and KV blocks for max_seqs sequences of
    `context` tokens each."""
    from vt.model import HybridModel, init_weights
    log(f"  initialising weights (seed {seed}) ...")
    weights = init_weights(cfg, seed=seed)
    log(f"  uploading the model and allocating KV cache for {max_seqs} sequences ...")
    return HybridModel(be, cfg, weights, max_seqs=max_seqs,
                       num_kv_blocks=max_seqs * -(-context // cfg.kv_block_size))


def random_prompts(rng, vocab: int, n: int, length: int) -> list[list[int]]:
    return [rng.integers(0, vocab, length).tolist() for _ in range(n)]
