"""Sim device memory: numpy byte blocks at fake aligned addresses, and arrays that own pool buffers."""
from __future__ import annotations

import bisect
import threading

import numpy as np

from ..errors import CudaError

_BASE_ADDRESS = 0x7F00_0000_0000
_GAP = 4096         # unmapped bytes between blocks, so neighbouring addresses never alias
_POISON = 0xFF      # fresh and freed memory reads as NaN / -1: a missed write is visible


class RawMemory:
    """The raw provider of the sim's DevicePool (the sim's cudaMalloc / cudaFree).

    `before_malloc` is the backend's global-capture check: like CUDA in global capture mode, a
    raw allocation while any stream captures fails and invalidates the capture.
    """

    def __init__(self, before_malloc=None):
        self._before_malloc = before_malloc
        self._lock = threading.Lock()
        self._blocks: dict[int, np.ndarray] = {}
        self._bases: list[int] = []           # sorted, for address lookup
        self._next = _BASE_ADDRESS

    def malloc(self, nbytes: int) -> int:
        if self._before_malloc is not None:
            self._before_malloc("cudaMalloc")
        if nbytes <= 0:
            raise CudaError("cudaErrorInvalidValue", "cudaMalloc", f"nbytes={nbytes}")
        with self._lock:
            ptr = self._next
            self._next += -(-nbytes // _GAP) * _GAP + _GAP
            self._blocks[ptr] = np.full(nbytes, _POISON, np.uint8)
            bisect.insort(self._bases, ptr)
            return ptr

    def free(self, ptr: int) -> None:
        with self._lock:
            block = self._blocks.pop(ptr, None)
            if block is None:
                raise CudaError("cudaErrorInvalidValue", "cudaFree", f"{ptr:#x} is not a block")
            self._bases.remove(ptr)
        block.fill(_POISON)  # arrays still viewing it read poison, as after a real cudaFree

    def view(self, ptr: int, nbytes: int) -> np.ndarray:
        """The uint8 bytes [ptr, ptr + nbytes) of a live block."""
        with self._lock:
            i = bisect.bisect_right(self._bases, ptr) - 1
            block = self._blocks[self._bases[i]] if i >= 0 else None
            offset = ptr - self._bases[i] if i >= 0 else 0
        if block is None or offset + nbytes > block.nbytes:
            raise CudaError("cudaErrorIllegalAddress", "sim memory access",
                            f"[{ptr:#x}, +{nbytes}) is outside every live block")
        return block[offset:offset + nbytes]

    @property
    def live_blocks(self) -> int:
        return len(self._blocks)


class _Owner:
    """Owns the memory under a numpy array (`array.base` chain ends here)."""

    def __init__(self, mem: np.ndarray, shape: tuple, dtype: np.dtype, keep=None):
        self.keep = keep  # the pool buffer (device) whose lifetime this owner carries
        self._mem = mem
        native = dtype.kind != "V"  # extension dtypes (bfloat16) travel as bytes, then view
        self.__array_interface__ = {
            "shape": shape if native else (mem.nbytes,),
            "typestr": dtype.str if native else "|u1",
            "data": (mem.ctypes.data, False),
            "version": 3,
        }
        self._view_dtype = None if native else dtype


class DeviceOwner(_Owner):
    """Owner of a sim device array: keeps its DeviceBuffer alive, frees it when the array dies."""


class PinnedOwner(_Owner):
    """Owner of a sim pinned host array (host memory, never device memory)."""


def owned_array(owner: _Owner, shape: tuple) -> np.ndarray:
    arr = np.asarray(owner)
    return arr if owner._view_dtype is None else arr.view(owner._view_dtype).reshape(shape)


def owner_of(arr) -> _Owner | None:
    """The DeviceOwner / PinnedOwner an array (or a view of one) lives in, else None."""
    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    return base if isinstance(base, _Owner) else None


def stream_view(arr):
    """What a queued op holds instead of a device array: the same bytes, without the pool
    buffer's ownership. CUDA's pool semantics: a buffer whose last array dies goes back to the
    pool at once and may serve the next allocation while queued work still uses it, which is
    safe on one stream because the stream runs in order. Holding the owner here instead would
    keep every buffer of a queued op in use, so how many blocks a step needs would depend on
    how far the host ran ahead: the sim would need memory CUDA does not."""
    owner = owner_of(arr) if isinstance(arr, np.ndarray) else None
    if not isinstance(owner, DeviceOwner) or owner.keep is None:
        return arr
    offset = arr.__array_interface__["data"][0] - owner._mem.ctypes.data
    return np.ndarray(arr.shape, arr.dtype, buffer=owner._mem, offset=offset, strides=arr.strides)


def as_bytes(arr: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (a view: reading happens when it is used)."""
    return arr.reshape(-1).view(np.uint8)
