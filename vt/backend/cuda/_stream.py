"""Streams: non-blocking streams that vt creates, and a borrowed wrapper of the legacy stream."""
from __future__ import annotations

from cuda.bindings import runtime as cudart

from ._check import check, is_error
from .._handle import HandleOwner

_NOT_READY = cudart.cudaError_t.cudaErrorNotReady
_NOT_CAPTURING = cudart.cudaStreamCaptureStatus.cudaStreamCaptureStatusNone
_INVALIDATED = cudart.cudaStreamCaptureStatus.cudaStreamCaptureStatusInvalidated


class Stream(HandleOwner):
    """A CUDA stream. `handle` is the cudaStream_t as an int (what kernels' run_cupy receive)."""

    _kind = "stream"

    def __init__(self, name: str = "", *, _borrowed_handle: int | None = None):
        self.name = name
        self._cupy = None
        # Name of the vt capture open on this stream. A name, not the Capture: a reference
        # from the stream would keep an orphaned capture from reaching its finalizer.
        self._capture: str | None = None
        if _borrowed_handle is not None:
            self.handle = _borrowed_handle
            self.borrowed = True
            self._borrow()
            return
        # Non-blocking: vt's streams never synchronize implicitly with the legacy stream, which
        # would otherwise serialize them with any library work issued on stream 0.
        stream = check(cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking),
                       "cudaStreamCreateWithFlags")
        self.handle = int(stream)
        self.borrowed = False
        self._own(_destroy_stream, self.handle)

    def synchronize(self) -> None:
        self._require_open()
        check(cudart.cudaStreamSynchronize(self.handle), "cudaStreamSynchronize")

    def query(self) -> bool:
        """True when all work queued on the stream has completed."""
        self._require_open()
        result = cudart.cudaStreamQuery(self.handle)
        if is_error(result, _NOT_READY):
            return False
        check(result, "cudaStreamQuery")
        return True

    def wait_event(self, event) -> None:
        """Make later work on this stream wait for `event` (device side; the host does not block)."""
        self._require_open()
        event._require_open()
        check(cudart.cudaStreamWaitEvent(self.handle, event.handle, 0), "cudaStreamWaitEvent")

    def capture_status(self):
        self._require_open()
        return check(cudart.cudaStreamIsCapturing(self.handle), "cudaStreamIsCapturing")

    def is_capturing(self) -> bool:
        """True while a capture is open on this stream (active or invalidated, not yet ended)."""
        return self.capture_status() != _NOT_CAPTURING

    def cupy_stream(self):
        """This stream as a CuPy stream (cached), to make it CuPy's current stream."""
        self._require_open()
        if self._cupy is None:
            import cupy
            # A small protocol object rather than self: the cached CuPy stream keeps its
            # source alive, and a reference to self would make a cycle around the finalizer.
            self._cupy = cupy.cuda.Stream.from_external(_StreamProtocol(self.handle))
        return self._cupy

    def __cuda_stream__(self):
        return (0, self.handle)

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("borrowed" if self.borrowed else "owned")
        return f"<Stream {self.name!r} handle={self.handle:#x} {state}>"


def legacy_stream() -> Stream:
    """The legacy default stream (handle 0), borrowed: never destroyed, never captured."""
    return Stream("legacy", _borrowed_handle=0)


def end_orphaned_capture(handle: int) -> bool:
    """End a capture left open on `handle` and discard its graph, so the stream is usable.

    Returns True when there was one. Used by finalizers and teardown, so it never raises.
    """
    err, status = cudart.cudaStreamIsCapturing(handle)
    if err != cudart.cudaError_t.cudaSuccess or status == _NOT_CAPTURING:
        return False
    err, graph = cudart.cudaStreamEndCapture(handle)
    if err == cudart.cudaError_t.cudaSuccess and graph is not None and int(graph):
        cudart.cudaGraphDestroy(graph)
    cudart.cudaGetLastError()  # an invalidated capture's end reports an error; it is expected
    return True


class _StreamProtocol:
    """Carries a raw handle through the CUDA stream protocol (`__cuda_stream__`)."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def _destroy_stream(handle: int) -> None:
    end_orphaned_capture(handle)
    check(cudart.cudaStreamDestroy(handle), "cudaStreamDestroy")
