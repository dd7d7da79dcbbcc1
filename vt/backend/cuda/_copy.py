"""Asynchronous copies between pinned host arrays and device arrays, on a stream."""
from __future__ import annotations

import numpy as np
from cuda.bindings import runtime as cudart

from ._check import check
from ._memory import pinned_owner

_H2D = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
_D2H = cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
_D2D = cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice


def copy_h2d(dst, src: np.ndarray, stream, capturing: bool) -> None:
    _check_pair("copy_h2d", dst, src, device_dst=True, device_src=False, capturing=capturing)
    _memcpy(dst.data.ptr, src.ctypes.data, dst.nbytes, _H2D, stream, "cudaMemcpyAsync(HostToDevice)")


def copy_d2h(dst: np.ndarray, src, stream, capturing: bool) -> None:
    _check_pair("copy_d2h", dst, src, device_dst=False, device_src=True, capturing=capturing)
    _memcpy(dst.ctypes.data, src.data.ptr, dst.nbytes, _D2H, stream, "cudaMemcpyAsync(DeviceToHost)")


def copy_h2d_mapped(dst, src: np.ndarray, stream, mapped) -> None:
    _check_pair("copy_h2d_mapped", dst, src, device_dst=True, device_src=False, capturing=True)
    _mapped(mapped, "copy_h2d_mapped", dst.data.ptr, src.ctypes.data, dst.nbytes, stream)


def copy_d2h_mapped(dst: np.ndarray, src, stream, mapped) -> None:
    _check_pair("copy_d2h_mapped", dst, src, device_dst=False, device_src=True, capturing=True)
    _mapped(mapped, "copy_d2h_mapped", dst.ctypes.data, src.data.ptr, dst.nbytes, stream)


def copy_d2d(dst, src, stream, capturing: bool) -> None:
    _check_pair("copy_d2d", dst, src, device_dst=True, device_src=True, capturing=capturing)
    _memcpy(dst.data.ptr, src.data.ptr, dst.nbytes, _D2D, stream, "cudaMemcpyAsync(DeviceToDevice)")


def _memcpy(dst: int, src: int, nbytes: int, kind, stream, call: str) -> None:
    stream._require_open()
    if nbytes:
        check(cudart.cudaMemcpyAsync(dst, src, nbytes, kind, stream.handle), call)


def _mapped(mapped, op: str, dst: int, src: int, nbytes: int, stream) -> None:
    stream._require_open()
    with stream.cupy_stream():
        mapped.launch(op, dst, src, nbytes)


def _check_pair(op: str, dst, src, *, device_dst: bool, device_src: bool, capturing: bool) -> None:
    import cupy
    for arr, role, on_device in ((dst, "dst", device_dst), (src, "src", device_src)):
        want = cupy.ndarray if on_device else np.ndarray
        if not isinstance(arr, want):
            where = "a device array (cupy, be.empty)" if on_device else "a host numpy array"
            raise TypeError(f"{op}: {role} must be {where}, got {type(arr).__name__} "
                            f"{getattr(arr, 'shape', '')}")
        if not arr.flags.c_contiguous:
            raise ValueError(f"{op}: {role} must be C-contiguous (shape {arr.shape}, strides {arr.strides})")
        # A captured copy re-reads (or re-writes) the host address at every replay, and a mapped
        # copy's kernel dereferences it on the device: it must be memory that vt owns and keeps
        # pinned, never a temporary pageable numpy array. (`capturing` is True for mapped copies.)
        if capturing and not on_device and pinned_owner(arr) is None:
            raise ValueError(f"{op}: {role} host array {arr.shape} {arr.dtype} is not pinned memory from "
                             f"be.pinned_empty; a captured or mapped copy needs a persistent pinned buffer")
    if dst.nbytes != src.nbytes:
        raise ValueError(f"{op}: size mismatch: dst {dst.shape} {dst.dtype} ({dst.nbytes} bytes) vs "
                         f"src {src.shape} {src.dtype} ({src.nbytes} bytes)")
