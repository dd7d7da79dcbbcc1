"""The failures a command reports in one line, raised by the front ends (vt/cli) and by the
workloads they run: a usage error exits 2, a failed run 1. They live below the CLI so that a
workload can name what is wrong without importing the command line."""
from __future__ import annotations

from vt.errors import VtError


class UsageError(SystemExit):
    """A bad flag, VT_* variable or preset: `vt` prints the one-line message and exits 2.

    A SystemExit so that a script calling these helpers outside the CLI still ends with the
    message and no traceback."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class CommandFailed(VtError):
    """The command ran and failed in a way it can name (a wait past its deadline): `vt`
    prints the one-line message and exits 1."""


class OutputError(CommandFailed):
    """An output file could not be written after the work (a full disk): printed after the
    report."""
