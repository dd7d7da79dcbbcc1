"""Copies between pinned host memory and device memory done by a kernel, not a memcpy.

With unified addressing, the pointer cudaHostAlloc returns is valid on the device: a kernel
can read or write pinned host memory directly, over the bus. vt's decode graphs move their
input block and their sampled tokens this way because a graph's launch costs the host more
per copy-engine memcpy node it holds (measured on the H200, µs per cudaGraphLaunch from
Python: one kernel 2.4; H2D memcpy + kernel 4.5; H2D + kernel + D2H 6.2; the same with both
copies done by kernels 2.5; docs/design.md). The semantics are a memcpy's: the data is read
(or written) when the node runs, so the hazard and its guards are unchanged.
"""
from __future__ import annotations

import numpy as np

# 16-byte words when both ends are 16-byte aligned and the size is a multiple of 16 (one bus
# request per thread carries four ints), else 4-byte words.
_SOURCE = r"""
extern "C" __global__ void vt_copy_u32(const unsigned int* __restrict__ src,
                                       unsigned int* __restrict__ dst, long long n) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = src[i];
}
extern "C" __global__ void vt_copy_u128(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                        long long n) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = src[i];
}
"""
_THREADS = 256
_MAX_BLOCKS = 1024


class MappedCopy:
    """Compiled and loaded on first use, which must come before any capture that uses it (vt's
    decode graphs: their warm-up copies this way first, vt/graphs/capture.py)."""

    def __init__(self):
        self._kernels = None

    def load(self) -> None:
        if self._kernels is None:
            import cupy
            mod = cupy.RawModule(code=_SOURCE)
            self._kernels = (mod.get_function("vt_copy_u32"), mod.get_function("vt_copy_u128"))

    def launch(self, op: str, dst_ptr: int, src_ptr: int, nbytes: int) -> None:
        """Queue the copy on CuPy's current stream."""
        self.load()
        wide = nbytes % 16 == 0 and dst_ptr % 16 == 0 and src_ptr % 16 == 0
        if not wide and (nbytes % 4 or dst_ptr % 4 or src_ptr % 4):
            raise ValueError(f"{op}: a mapped copy moves 4-byte words; got {nbytes} bytes at "
                             f"{dst_ptr:#x} <- {src_ptr:#x} (use copy_h2d/copy_d2h)")
        words = nbytes // (16 if wide else 4)
        if words == 0:
            return
        blocks = min(-(-words // _THREADS), _MAX_BLOCKS)
        self._kernels[wide]((blocks,), (_THREADS,), (np.uintp(src_ptr), np.uintp(dst_ptr),
                                                     np.int64(words)))
