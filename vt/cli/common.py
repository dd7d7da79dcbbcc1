"""What the `vt` commands share: the parser that prints a one-line usage error, the exit codes,
the checks of output paths. The one-line failures and the backend, preset and model set-up are
vt.bench's (errors, setup), which the workloads use too; they are imported here for the front
ends."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from vt.cli.interrupt import forget_unhandled_mark, sigint_raises
from vt.bench.errors import CommandFailed, OutputError, UsageError  # noqa: F401 (the front ends')
from vt.bench.setup import (backend_name, build_model, pick_backend, pick_preset,  # noqa: F401
                            random_prompts, resolve_preset, what_to_do)


class OneLineParser(argparse.ArgumentParser):
    """argparse with a one-line usage error: what is wrong, then where the flags are listed
    (the default prints the whole usage block before the one line that matters)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message}; see {self.prog} --help\n")


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
        with sigint_raises():
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
        forget_unhandled_mark()
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


def check_output_path(who: str, source: str, path: str) -> None:
    """UsageError now, not after the work, when `path` cannot be written (vt/atomic_file.py)."""
    from vt.atomic_file import output_path_problem
    why = output_path_problem(path)
    if why:
        raise UsageError(f"{who}: {source} {path!r} {why}")


