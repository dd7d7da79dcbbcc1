"""Memory: raw device allocations for the pool, pinned host arrays, CuPy arrays over pool blocks."""
from __future__ import annotations

import math

import numpy as np
from cuda.bindings import runtime as cudart

from ._check import check
from .._handle import HandleOwner


class RawMemory:
    """The driver-facing provider under vt.backend.pool.DevicePool: one cudaMalloc per call.

    The pool is the only caller during normal use and never calls it while capturing; tests
    call it directly to show that a cudaMalloc inside a global-mode capture invalidates it.
    """

    def malloc(self, nbytes: int) -> int:
        return int(check(cudart.cudaMalloc(nbytes), f"cudaMalloc({nbytes})"))

    def free(self, ptr: int) -> None:
        check(cudart.cudaFree(ptr), "cudaFree")


class PinnedBuffer(HandleOwner):
    """Page-locked host memory (cudaHostAlloc), exported to numpy without a copy.

    numpy arrays made from it keep it alive (it is their `.base`); it is freed with cudaFreeHost
    when the last array dies, or by close() — after which every array over it is dangling.
    """

    _kind = "pinned buffer"

    def __init__(self, shape: tuple[int, ...], dtype):
        self.dtype = np.dtype(dtype)
        if not self.dtype.isbuiltin or self.dtype.hasobject:
            raise ValueError(f"pinned_empty: dtype {self.dtype} is not a plain numeric dtype")
        self.shape = tuple(int(n) for n in shape)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        # cudaHostAlloc(0) returns no pointer: keep one byte so every buffer has an address.
        self.ptr = int(check(cudart.cudaHostAlloc(max(self.nbytes, 1), cudart.cudaHostAllocDefault),
                             f"cudaHostAlloc({self.nbytes})"))
        self._own(_free_host, self.ptr)

    @property
    def __array_interface__(self) -> dict:
        self._require_open()
        return {"version": 3, "shape": self.shape, "typestr": self.dtype.str,
                "data": (self.ptr, False), "strides": None}

    def contains(self, ptr: int, nbytes: int) -> bool:
        return not self.closed and self.ptr <= ptr and ptr + nbytes <= self.ptr + self.nbytes

    def __repr__(self) -> str:
        return f"<PinnedBuffer {self.shape} {self.dtype} {self.ptr:#x}{' closed' if self.closed else ''}>"


def pinned_empty(shape, dtype) -> np.ndarray:
    """A numpy array over new pinned memory; `arr.base` is its PinnedBuffer (close() it to free early)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return np.asarray(PinnedBuffer(shape, dtype))


def pinned_owner(arr: np.ndarray) -> PinnedBuffer | None:
    """The PinnedBuffer under `arr` (following views), or None for pageable memory."""
    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, PinnedBuffer) and base.contains(arr.ctypes.data, arr.nbytes):
        return base
    return None


def device_array(buffer, shape, dtype, device_id: int):
    """A CuPy array over a pool DeviceBuffer (or None for 0 bytes); the array owns the buffer.

    UnownedMemory keeps `buffer` alive as its owner, so the block goes back to the pool when
    the last array or view over it dies.
    """
    import cupy
    ptr, nbytes = (buffer.ptr, buffer.nbytes) if buffer is not None else (0, 0)
    memory = cupy.cuda.UnownedMemory(ptr, nbytes, buffer, device_id)
    return cupy.ndarray(shape, dtype, memptr=cupy.cuda.MemoryPointer(memory, 0))


def memory_type(ptr: int):
    """cudaPointerGetAttributes(ptr).type (cudaMemoryTypeHost for pinned memory)."""
    return check(cudart.cudaPointerGetAttributes(ptr), "cudaPointerGetAttributes").type


# cudaFreeHost while a global-mode capture is open fails and invalidates that capture. A
# pinned array can die at any moment (the cyclic garbage collector runs where it likes), so
# frees that come while a capture is open wait for the last capture to end.
_open_captures = 0
_deferred_frees: list[int] = []


def capture_opened() -> None:
    global _open_captures
    _open_captures += 1


def capture_closed() -> None:
    global _open_captures
    _open_captures -= 1
    while _open_captures == 0 and _deferred_frees:
        _free_host(_deferred_frees.pop())


def _free_host(ptr: int) -> None:
    if _open_captures:
        _deferred_frees.append(ptr)
        return
    check(cudart.cudaFreeHost(ptr), "cudaFreeHost")
