"""VtError: the one base of the errors vt raises on its own account.

Every exception class vt defines derives from it, beside the built-in base it had, so that
`except vt.VtError` catches what vt refuses or reports (a request too large, a capture that
failed, a rank that died, a request the server refuses) and `except ValueError` and the like
keep working. Two kinds stay outside it: warnings (UnknownVariableWarning, a UserWarning) and
the command line's exits (UsageError, a SystemExit; Terminated, a BaseException), which an
`except Exception` must not catch.

It imports nothing, so every layer may import it.
"""
from __future__ import annotations


class VtError(Exception):
    """An error vt raises on its own account (its subclasses keep their built-in bases too:
    RequestTooLargeError is also a ValueError, CudaError a RuntimeError)."""
