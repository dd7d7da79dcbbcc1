"""CudaBackend: the Backend contract of docs/architecture.md on cuda-python + CuPy."""
from __future__ import annotations

import contextlib
import math
import weakref

import numpy as np

from ._copy import copy_d2d, copy_d2h, copy_d2h_mapped, copy_h2d, copy_h2d_mapped
from ._device import Device
from ._event import Event, EventOptions
from ._graph import Capture, Graph, join_graphs
from .._handle import HandleOwner
from ._memory import RawMemory, device_array, pinned_empty
from ._mapped import MappedCopy
from ._spin import BusyWait
from ._stream import Stream, legacy_stream


class CudaBackend(HandleOwner):
    """Streams, events, memory, copies, kernel launches and graph capture on one CUDA device.

    Every CuPy allocation made while vt launches a kernel (or captures) is served by `self.pool`:
    CuPy's own pool, cold, would cudaMalloc inside a capture and break it (docs/design.md).
    """

    name = "cuda"
    _kind = "backend"

    def __init__(self, pool_debug: bool = False, device: int = 0):
        import cupy

        from vt.backend.pool import DevicePool

        self.xp = cupy
        self.device = Device(device)
        cupy.cuda.Device(device).use()  # CuPy and vt share the device's primary context
        self.raw_memory = RawMemory()
        self.pool = DevicePool(self.raw_memory, debug=pool_debug)
        self.pool_debug = pool_debug
        self._owned: weakref.WeakSet = weakref.WeakSet()  # streams, events, graphs made here
        self._captures: weakref.WeakSet = weakref.WeakSet()
        self._busy_wait = BusyWait()
        self._mapped_copy = MappedCopy()
        self._legacy: Stream | None = None
        self._own(_close_all, self._captures, self._owned, self.pool, self.device)

    def bind_thread(self) -> None:
        """Make this backend's device current in the calling thread: the runtime API and CuPy
        keep the current device per thread, so a thread that launches work here (the
        engine's serving thread) calls this first."""
        import cupy
        self.device.set_current()
        cupy.cuda.Device(self.device.ordinal).use()

    # -- information --------------------------------------------------------------------
    def info(self) -> dict:
        self._require_open()
        import cuda.bindings
        import cupy
        return {
            "backend": self.name,
            **self.device.info(),
            "cuda-bindings": cuda.bindings.__version__,
            "cupy": cupy.__version__,
            "numpy": np.__version__,
            "nvmath-python": _nvmath_version(),
            "pool": "debug (one cudaMalloc per buffer)" if self.pool_debug else "caching",
        }

    # -- streams and events -------------------------------------------------------------
    def stream(self, name: str = "") -> Stream:
        self._require_open()
        return self._track(Stream(name))

    def legacy_stream(self) -> Stream:
        """The legacy default stream, borrowed (never destroyed; refused for capture)."""
        self._require_open()
        if self._legacy is None:
            self._legacy = legacy_stream()
        return self._legacy

    def event(self, blocking_sync: bool = True, timing_enabled: bool = False, name: str = "") -> Event:
        self._require_open()
        return self._track(Event(EventOptions(blocking_sync=blocking_sync, timing_enabled=timing_enabled), name))

    # -- memory and copies --------------------------------------------------------------
    def pinned_empty(self, shape, dtype) -> np.ndarray:
        self._require_open()
        return pinned_empty(shape, dtype)

    def empty(self, shape, dtype, retained: bool = False):
        """A CuPy array over a pool block (a retained block for graph outputs); no copy, no init."""
        self._require_open()
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        buffer = None
        if nbytes:
            buffer = self.pool.alloc_retained(nbytes) if retained else self.pool.alloc(nbytes)
        return device_array(buffer, shape, dtype, self.device.ordinal)

    def copy_h2d(self, dst, src: np.ndarray, stream: Stream) -> None:
        self._require_open()
        copy_h2d(dst, src, stream, capturing=stream._capture is not None)

    def copy_d2h(self, dst: np.ndarray, src, stream: Stream) -> None:
        self._require_open()
        copy_d2h(dst, src, stream, capturing=stream._capture is not None)

    def copy_h2d_mapped(self, dst, src: np.ndarray, stream: Stream) -> None:
        """copy_h2d done by a kernel that reads the pinned `src` through the device's mapping
        of it (vt/backend/cuda/_mapped.py): a graph holding it launches faster than one holding
        a memcpy node. Sizes and addresses must be multiples of 4 bytes."""
        self._require_open()
        copy_h2d_mapped(dst, src, stream, self._mapped_copy)

    def copy_d2h_mapped(self, dst: np.ndarray, src, stream: Stream) -> None:
        """copy_d2h done by a kernel that writes the pinned `dst` through the device's mapping."""
        self._require_open()
        copy_d2h_mapped(dst, src, stream, self._mapped_copy)

    def copy_d2d(self, dst, src, stream: Stream) -> None:
        self._require_open()
        copy_d2d(dst, src, stream, capturing=stream._capture is not None)

    # -- kernels ------------------------------------------------------------------------
    def launch(self, stream: Stream, kernel, *args, **params) -> None:
        """kernel.run_cupy(stream.handle, ...) with `stream` current in CuPy and CuPy's
        allocations served by the pool (capture-safe: the pool never mallocs while capturing)."""
        self._require_open()
        run = getattr(kernel, "run_cupy", None)
        if not callable(run):
            raise TypeError(f"{kernel!r} has no run_cupy(); kernels implement run_numpy and run_cupy")
        with stream.cupy_stream(), self.xp.cuda.using_allocator(self._cupy_malloc):
            run(stream.handle, *args, **params)

    def busy_wait(self, stream: Stream, seconds: float) -> None:
        """Queue about `seconds` of device time on `stream` (a one-thread spin kernel)."""
        self._require_open()
        with stream.cupy_stream():
            self._busy_wait.launch(seconds)

    # -- graphs -------------------------------------------------------------------------
    def capture(self, stream: Stream, name: str = "capture") -> Capture:
        """`with be.capture(s, name) as cap: ...` then `cap.graph` (see Capture)."""
        self._require_open()
        cap = Capture(stream, name, self.pool, self._routing(stream), self._track)
        self._captures.add(cap)
        return cap

    def join_graphs(self, first: Graph, second: Graph, name: str = "joined") -> Graph:
        """One graph that runs `first`, then `second` (one launch instead of two); both stay
        usable and may be closed in any order (see _graph.join_graphs)."""
        self._require_open()
        return self._track(join_graphs(first, second, name))

    def is_capturing(self, stream: Stream) -> bool:
        self._require_open()
        return stream.is_capturing()

    def synchronize(self) -> None:
        """Wait for all work on the device."""
        self._require_open()
        self.device.synchronize()

    # -- private --------------------------------------------------------------------------
    def _track(self, obj):
        self._owned.add(obj)
        return obj

    @contextlib.contextmanager
    def _routing(self, stream: Stream):
        with stream.cupy_stream(), self.xp.cuda.using_allocator(self._cupy_malloc):
            yield

    def _cupy_malloc(self, nbytes: int):
        """CuPy allocator: pool blocks wrapped as CuPy memory; the block returns when CuPy drops it."""
        buffer = self.pool.alloc(nbytes) if nbytes else None
        ptr, size = (buffer.ptr, buffer.nbytes) if buffer is not None else (0, 0)
        memory = self.xp.cuda.UnownedMemory(ptr, size, buffer, self.device.ordinal)
        return self.xp.cuda.MemoryPointer(memory, 0)

    def __repr__(self) -> str:
        return f"<CudaBackend device={self.device.ordinal} {'closed' if self.closed else 'open'}>"


_CLOSE_ORDER = {Graph: 0, Event: 1, Stream: 2}


def _close_all(captures, owned, pool, device) -> None:
    """Teardown: end open captures, wait for the device, close graphs, events, streams, the pool.

    Every step runs even if an earlier one fails; the first failure is raised at the end.
    """
    errors = []

    def attempt(fn, *args):
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 (collected and re-raised below)
            errors.append(exc)

    for cap in list(captures):
        attempt(cap.abandon)
    attempt(device.synchronize)
    for obj in sorted(owned, key=lambda o: _CLOSE_ORDER.get(type(o), 3)):
        attempt(obj.close)
    attempt(pool.close)
    try:
        import cupy
        # Only blocks cached by CuPy's own pool (arrays made outside be.launch): releasing them
        # keeps compute-sanitizer's leak check about vt's memory.
        attempt(cupy.get_default_memory_pool().free_all_blocks)
    except ImportError:
        pass
    if errors:
        raise errors[0]


def _nvmath_version() -> str:
    try:
        import nvmath
    except ImportError:
        return "not installed"
    return getattr(nvmath, "__version__", "installed")
