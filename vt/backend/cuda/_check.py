"""The one choke point for CUDA runtime return codes.

Every cuda.bindings call returns `(err, *values)`; `check` raises `CudaError` (message starting
with the error's name and naming the call) or returns the values. Captures register a recorder
here so that the first failing call inside a capture block is known even if the caller caught
the CudaError (the capture is invalidated either way).
"""
from __future__ import annotations

import threading

from cuda.bindings import runtime as cudart

from vt.backend.errors import CudaError

SUCCESS = cudart.cudaError_t.cudaSuccess
_recorders = threading.local()


def check(result: tuple, call: str):
    """Unpack `(err, *values)`: raise CudaError on failure, else return None / the value / the values."""
    err, *values = result
    if err != SUCCESS:
        raise cuda_error(err, call)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def error_name(err) -> str:
    try:
        return cudart.cudaError_t(err).name
    except ValueError:
        return f"cudaError({int(err)})"


def is_error(result: tuple, err) -> bool:
    """True when the call's return code is `err` (e.g. cudaErrorNotReady for a query)."""
    return result[0] == err


def push_recorder(record) -> list:
    """Call `record(CudaError)` for every failing check on this thread until it is removed from
    the returned list (this thread's recorders)."""
    stack = getattr(_recorders, "stack", None)
    if stack is None:
        stack = _recorders.stack = []
    stack.append(record)
    return stack


def cuda_error(err, call: str) -> CudaError:
    """The CudaError for return code `err` of `call` (recorded by any open capture)."""
    name = error_name(err)
    ok, text = cudart.cudaGetErrorString(err)
    detail = text.decode() if ok == SUCCESS and text else ""
    # A failed runtime call also sets the thread's last-error state; clear it so a later
    # cudaGetLastError (CuPy calls it after some launches) does not report this error again.
    cudart.cudaGetLastError()
    error = CudaError(name, call, detail)
    for record in getattr(_recorders, "stack", ()):
        record(error)
    return error
