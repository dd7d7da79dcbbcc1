"""SimBackend: the backend contract on the CPU, with real asynchronous semantics (numpy kernels)."""
from __future__ import annotations

import contextlib
import functools
import math
import time
import warnings
import weakref

import numpy as np

from .._handle import HandleOwner
from ..errors import CaptureError, CudaError
from ..pool import DevicePool
from ._event import Event
from ._graph import Capture, Graph, join_graphs
from ._memory import (DeviceOwner, PinnedOwner, RawMemory, as_bytes, owned_array, owner_of,
                      stream_view)
from ._stream import Op, Stream, check_delay


class SimBackend(HandleOwner):
    """CPU backend. `device_delay_s` sleeps before each device op, so the host runs ahead.

    close() is idempotent: it closes every stream, event and graph of this backend, then the pool.
    """

    name = "sim"
    xp = np

    def __init__(self, *, device_delay_s: float = 0.0, pool_debug: bool = False):
        check_delay(device_delay_s)
        self.device_delay_s = device_delay_s
        self._captures: list[Capture] = []     # open captures (global mode: they affect everyone)
        self._raw = RawMemory(before_malloc=functools.partial(_refuse_in_capture, self._captures))
        self.pool = DevicePool(self._raw, debug=pool_debug)
        self._owned: weakref.WeakSet = weakref.WeakSet()   # streams, events, graphs to close
        self._streams: weakref.WeakSet = weakref.WeakSet()
        self._legacy: Stream | None = None
        self._own(_close_all, self._owned, self.pool)

    # -- objects --------------------------------------------------------------------------
    def stream(self, name: str = "compute") -> Stream:
        self._require_open()
        return self._track(Stream(name, device_delay_s=self.device_delay_s))

    def legacy_stream(self) -> Stream:
        """The legacy default stream (refused for capture, as on CUDA)."""
        self._require_open()
        if self._legacy is None:
            self._legacy = self._track(Stream("legacy", device_delay_s=self.device_delay_s,
                                              legacy=True))
        return self._legacy

    def event(self, blocking_sync: bool = True, timing_enabled: bool = False,
              name: str = "event") -> Event:
        self._require_open()
        return self._track(Event(blocking_sync=blocking_sync, timing_enabled=timing_enabled,
                                 name=name))

    def pinned_empty(self, shape, dtype) -> np.ndarray:
        """A host array the sim treats as pinned: the only host memory copies accept."""
        self._require_open()
        shape, dtype = _shape(shape), np.dtype(dtype)
        mem = np.empty(math.prod(shape) * dtype.itemsize, np.uint8)
        return owned_array(PinnedOwner(mem, shape, dtype), shape)

    def empty(self, shape, dtype, retained: bool = False) -> np.ndarray:
        """A device array over a pool buffer; the buffer returns to the pool when the array dies."""
        self._require_open()
        shape, dtype = _shape(shape), np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        buf = self.pool.alloc_retained(nbytes) if retained else self.pool.alloc(nbytes)
        owner = DeviceOwner(self._raw.view(buf.ptr, nbytes), shape, dtype, keep=buf)
        return owned_array(owner, shape)

    # -- device work ----------------------------------------------------------------------
    def copy_h2d(self, dst: np.ndarray, src: np.ndarray, stream: Stream) -> None:
        self._copy("copy_h2d", dst, DeviceOwner, src, PinnedOwner, stream)

    def copy_d2h(self, dst: np.ndarray, src: np.ndarray, stream: Stream) -> None:
        self._copy("copy_d2h", dst, PinnedOwner, src, DeviceOwner, stream)

    # The cuda backend's mapped copies are kernels reading or writing pinned host memory
    # directly; their semantics are a copy's (data moves when the op runs), which is all the
    # sim models, and like them the host side must be pinned even outside a capture.
    def copy_h2d_mapped(self, dst: np.ndarray, src: np.ndarray, stream: Stream) -> None:
        self._copy("copy_h2d_mapped", dst, DeviceOwner, src, PinnedOwner, stream, mapped=True)

    def copy_d2h_mapped(self, dst: np.ndarray, src: np.ndarray, stream: Stream) -> None:
        self._copy("copy_d2h_mapped", dst, PinnedOwner, src, DeviceOwner, stream, mapped=True)

    def copy_d2d(self, dst: np.ndarray, src: np.ndarray, stream: Stream) -> None:
        self._copy("copy_d2d", dst, DeviceOwner, src, DeviceOwner, stream)

    def launch(self, stream: Stream, kernel, *args, **params) -> None:
        """Enqueue kernel.run_numpy(*args, **params); the worker runs it, reading arrays then."""
        self._require_open()
        run = getattr(kernel, "run_numpy", None)
        if not callable(run):
            raise TypeError(f"{kernel!r} has no run_numpy(); kernels implement run_numpy and run_cupy")
        label = getattr(kernel, "name", type(kernel).__name__)
        args = [stream_view(a) for a in args]
        params = {k: stream_view(v) for k, v in params.items()}
        stream.submit(Op(f"launch({label})", functools.partial(run, *args, **params)))

    def busy_wait(self, stream: Stream, seconds: float) -> None:
        """Queue `seconds` of device time (a sleep op)."""
        self._require_open()
        check_delay(seconds, "busy_wait: seconds")
        stream.submit(Op(f"busy_wait({seconds}s)", functools.partial(time.sleep, seconds)))

    # -- capture --------------------------------------------------------------------------
    @contextlib.contextmanager
    def capture(self, stream: Stream, name: str = "graph"):
        """Record `stream`'s ops into a graph (global mode); `cap.graph` after a clean exit."""
        self._require_open()
        stream._require_open()
        if stream.legacy:
            raise ValueError(f"capture {name!r}: the legacy stream cannot be captured; "
                             f"use be.stream()")
        if stream.capture is not None:
            raise RuntimeError(f"capture {name!r}: stream {stream.name!r} is already capturing "
                               f"{stream.capture.name!r}")
        cap = Capture(name, stream)
        with self.pool.capturing(name):
            stream.capture = cap
            self._captures.append(cap)
            try:
                yield cap
            except Exception as exc:
                # A CUDA error inside the block, or any exception once a call has invalidated
                # the capture, ends it as a failed one (as on cuda); other exceptions
                # (CaptureAllocationError, the caller's own) propagate as they are.
                if not isinstance(exc, CudaError) and cap.first_error is None:
                    raise
                raise CaptureError(name, cap.first_error or exc) from exc
            finally:
                cap.active = False
                stream.capture = None
                self._captures.remove(cap)
        if cap.first_error is not None:
            raise CaptureError(name, cap.first_error)
        if not cap.nodes:
            warnings.warn(f"capture {name!r} recorded no work; its graph does nothing",
                          RuntimeWarning, stacklevel=3)
        cap._graph = self._track(Graph(cap.nodes, name))

    def join_graphs(self, first: Graph, second: Graph, name: str = "joined") -> Graph:
        """One graph that runs `first`, then `second` (one launch instead of two); both stay
        usable and may be closed in any order (see _graph.join_graphs)."""
        self._require_open()
        return self._track(join_graphs(first, second, name))

    def is_capturing(self, stream: Stream) -> bool:
        return stream.capture is not None

    # -- device-wide ----------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for every stream; raise the first recorded op failure."""
        self._require_open()
        _refuse_in_capture(self._captures, "cudaDeviceSynchronize")
        streams = [s for s in list(self._streams) if not s.closed]
        for s in streams:
            s._worker.wait(s._worker.submitted)
        for s in streams:
            s.raise_pending_error()

    def bind_thread(self) -> None:
        """The cuda backend's twin: the sim has no per-thread device state."""

    def info(self) -> dict:
        self._require_open()
        return {"backend": "sim", "device": "CPU simulator (numpy worker threads)",
                "total memory": "host memory", "driver (CUDA)": "none", "runtime (CUDA)": "none",
                "numpy": np.__version__, "device_delay_s": self.device_delay_s,
                "pool": "debug (one allocation per buffer)" if self.pool.debug else "caching"}

    # -- private --------------------------------------------------------------------------
    def _track(self, obj):
        self._owned.add(obj)
        if isinstance(obj, Stream):
            self._streams.add(obj)
        return obj

    def _closed_message(self) -> str:
        return "sim backend is closed"

    def _copy(self, call, dst, dst_kind, src, src_kind, stream, mapped: bool = False) -> None:
        self._require_open()
        for role, arr, kind in (("dst", dst, dst_kind), ("src", src, src_kind)):
            owner = owner_of(arr) if isinstance(arr, np.ndarray) else None
            on_device = isinstance(owner, DeviceOwner)
            if not isinstance(arr, np.ndarray) or on_device != (kind is DeviceOwner):
                where = "a device array (be.empty)" if kind is DeviceOwner else "a host numpy array"
                raise TypeError(f"{call}: {role} must be {where}, got {type(arr).__name__} "
                                f"{getattr(arr, 'shape', '')}{' on the device' if on_device else ''}")
            # A captured copy re-reads the host address at every replay, and a mapped copy's
            # kernel dereferences it on the device: persistent pinned memory that vt owns.
            if ((stream.capture is not None or mapped) and kind is PinnedOwner
                    and not isinstance(owner, PinnedOwner)):
                raise ValueError(f"{call}: {role} host array {arr.shape} {arr.dtype} is not pinned "
                                 f"memory from be.pinned_empty; a captured or mapped copy needs a "
                                 f"persistent pinned buffer")
            if not arr.flags.c_contiguous:
                raise ValueError(f"{call}: {role} must be C-contiguous (shape {arr.shape}, "
                                 f"strides {arr.strides})")
        if dst.nbytes != src.nbytes:
            raise ValueError(f"{call}: dst has {dst.nbytes} bytes ({dst.shape} {dst.dtype}) but "
                             f"src has {src.nbytes} ({src.shape} {src.dtype})")
        dst_bytes, src_bytes = as_bytes(stream_view(dst)), as_bytes(stream_view(src))
        stream.submit(Op(f"{call}({src.nbytes} B)",
                         functools.partial(np.copyto, dst_bytes, src_bytes)))


def _refuse_in_capture(captures: list[Capture], call: str) -> None:
    """Global capture mode: an unsafe call while any capture is open fails and invalidates it."""
    if captures:
        error = CudaError("cudaErrorStreamCaptureUnsupported", call,
                          f"not allowed while capture {captures[0].name!r} is open (global mode)")
        for cap in captures:
            cap.invalidate(error)
        raise error


def _close_all(owned: weakref.WeakSet, pool: DevicePool) -> None:
    for obj in list(owned):
        obj.close()
    pool.close()


def _shape(shape) -> tuple:
    return (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(n) for n in shape)
