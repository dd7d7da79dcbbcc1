"""Errors raised by vt's backends. Messages start with the CUDA error name when there is one."""

from vt.errors import VtError


class CudaError(VtError, RuntimeError):
    """A CUDA runtime call failed. `name` is the cudaError_t name, `call` the API that failed."""

    def __init__(self, name: str, call: str, detail: str = ""):
        self.name = name
        self.call = call
        msg = f"{name}: {call} failed"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class CaptureError(VtError, RuntimeError):
    """A stream capture failed; the capture has been ended and the stream is usable again."""

    def __init__(self, capture: str, first_error: BaseException | None, detail: str = ""):
        self.capture = capture
        self.first_error = first_error
        first = f"; first failing call: {first_error}" if first_error is not None else ""
        super().__init__(f"capture {capture!r} failed{first}{': ' + detail if detail else ''}")


class CaptureAllocationError(VtError, RuntimeError):
    """The pool was asked for memory during a capture that pre-grown memory cannot serve."""

    def __init__(self, requested: int, free: int, capture: str, kind: str, pool_state: str = ""):
        self.requested = requested
        self.free = free
        self.capture = capture
        super().__init__(
            f"capture {capture!r} needs a {kind} block of {requested} bytes that pre-grown memory "
            f"cannot serve ({free} bytes of {kind} memory free) and the pool must not call the "
            f"driver while capturing"
            f"{' (' + pool_state + ')' if pool_state else ''}; pre-grow the pool before capture "
            f"(DevicePool.reserve / reserve_scratch, or run the warm-up)")


class ClosedError(VtError, RuntimeError):
    """An object was used after close()."""
