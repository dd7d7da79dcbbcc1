"""GEMMs: out[M, N] (+)= x[M, K] @ w[N, K]^T, weights stored [out, in] as in HF checkpoints;
also batched over a leading expert axis (w [B, N, K], x [M, K] shared or [B, M, K]).

cuda: nvmath-python's low-level cuBLAS bindings (`gemm_ex` / `gemm_strided_batched_ex`),
because CuPy refuses cuBLAS on a capturing stream (measured: docs/design.md). Each stream gets its
own cuBLAS handle whose stream and workspace are set on the first EAGER call on that stream,
never during a capture; the workspaces are pre-allocated by the model from vt's pool.
Inputs are storage dtype, compute is fp32, the output is fp32 or storage. alpha/beta are host
scalars read when the call is enqueued, so under capture they are baked like kernel params.

cuBLAS is column-major: a row-major [R, C] array is a column-major [C, R] one. With
y^T = w x^T: A = w (col-major [K, N], op T), B = x (col-major [K, M], op N), C = y
(col-major [N, M]), m = N, n = M, k = K, leading dims = row strides.

A custom skinny tensor-core GEMM was measured 1.3-1.8x slower than cuBLAS for these shapes on the
H200, so cuBLAS is the one GEMM path.

Batch invariance (a row's result independent of M and of the other rows):
- numpy: every row is its own [1, K] x [K, N] product (`rowwise_matmul`): one BLAS call of
  the same shape per row, so a row gets the same bits at any M. A 2-D np.matmul does not:
  OpenBLAS runs gemv for M = 1 and gemm kernels whose blocking depends on M otherwise.
- cuda: cuBLAS picks its kernel (tiling, split-K) from the shape, so the bits of a row change
  with M. With `rows_block=B` every call runs in blocks of exactly B rows (M must be a
  multiple of B: the model pads its buffers), each block one cuBLAS call of one fixed shape,
  so every row goes through the same kernel at any batch size. The padded rows cost device
  time (measured in docs/data/invariance-h200.json), so this is an option (HybridModel's
  batch_invariant).
"""
from __future__ import annotations

import functools
import weakref

import numpy as np

from vt import env

from ._common import cuda_function, f32, f64, i32, store
from vt.validate import integer

WORKSPACE_BYTES = 32 << 20  # cuBLAS's recommended workspace on Hopper

_CUDA_TYPE = {np.dtype(np.float16): 2, np.dtype(np.uint16): 14, np.dtype(np.float32): 0}  # cudaDataType

# compute-sanitizer initcheck (2025.3.1, H200) does not see cuBLAS's writes: every element of
# every gemm_ex output tried (fp16, M 1..1024 x N 8..520) read as uninitialised in the next
# kernel, so each vt kernel that reads a GEMM output (gdn's proj, silu_mul's gate/up, rope's
# qkv, sample's logits ...) was reported. With VT_INITCHECK=1 (tools/sanitize.sh sets it for
# initcheck) a CuPy fill writes zeros over the output first, a write initcheck sees, standing in
# for the one cuBLAS makes; vt's kernels are then checked on what they really read. Off
# otherwise (one more kernel per GEMM).
@functools.cache
def _initcheck() -> bool:
    return env.get("VT_INITCHECK")


def _mark_written(out, accumulate=False) -> None:
    """Under initcheck: write the GEMM output before cuBLAS does (see _initcheck). An
    accumulating GEMM reads its output, so that was written already."""
    if not accumulate and _initcheck():
        out.fill(0)  # a CuPy kernel on the current (= launch) stream; capturable


class Gemm:
    """One object per model; one cuBLAS handle per stream it has run on."""

    name = "gemm"

    def __init__(self, workspaces=(), rows_block: int | None = None):
        self.rows_block = None if rows_block is None else integer("Gemm: rows_block", rows_block, 1)
        self._free_ws = list(workspaces)  # device uint8 arrays of WORKSPACE_BYTES
        self._used_ws: dict[int, object] = {}  # stream handle -> its handle's workspace
        self._handles: dict[int, int] = {}     # stream handle -> cuBLAS handle
        self._alpha = np.ones(1, np.float32)
        self._beta = {False: np.zeros(1, np.float32), True: np.ones(1, np.float32)}
        # Backstop: a Gemm dropped without close() still destroys its handles (each holds
        # device memory that compute-sanitizer's leak check would report).
        self._finalizer = weakref.finalize(self, _destroy_handles, self._handles)

    def run_numpy(self, x, w, out, *, accumulate=False):
        y = rowwise_matmul(f32(x), f32(w))
        if x.ndim == 2 and out.ndim == 4:   # [C, E, B, N]: blocks of B rows per expert (run_cupy)
            C, _, B, _ = out.shape
            y = np.swapaxes(y.reshape(y.shape[0], C, B, -1), 0, 1)
        if accumulate:
            y = y + f32(out)
        store(out, y)

    def _handle(self, stream_handle: int) -> int:
        h = self._handles.get(stream_handle)
        if h is not None:
            return h
        import cupy as cp
        from nvmath.bindings import cublas

        if cp.cuda.runtime.streamIsCapturing(stream_handle):
            raise RuntimeError(f"Gemm: first use of stream {stream_handle:#x} is inside a capture; "
                               f"run the model once eagerly on that stream before capturing")
        if not self._free_ws:
            raise RuntimeError(f"Gemm: no pre-allocated cuBLAS workspace left for stream "
                               f"{stream_handle:#x}: {len(self._handles)} streams hold one "
                               f"(HybridModel(..., gemm_streams=N) sets how many; "
                               f"release_stream() returns a finished stream's)")
        ws = self._free_ws.pop()
        h = cublas.create()
        cublas.set_stream(h, stream_handle)
        cublas.set_workspace(h, ws.data.ptr, ws.nbytes)
        self._handles[stream_handle] = h
        self._used_ws[stream_handle] = ws
        return h

    def release_stream(self, stream_handle: int) -> None:
        """The caller is done with this stream (its graphs are destroyed): destroy its cuBLAS
        handle and return the workspace for another stream. No-op for a stream never used."""
        h = self._handles.pop(stream_handle, None)
        if h is None:
            return
        from nvmath.bindings import cublas

        cublas.destroy(h)
        self._free_ws.append(self._used_ws.pop(stream_handle))

    def run_cupy(self, stream_handle, x, w, out, *, accumulate=False):
        """x [M, K] or [..., M, K]; out [M, N], [E, M, N], or [C, E, B, N] (w [E, N, K] in C
        blocks of B rows: x [C * B, K] or [C, E, B, K]). With rows_block, M (or B) must be it,
        or a multiple of it for 2-D out; each block is one cuBLAS call of rows_block rows."""
        B = self.rows_block
        if out.ndim == 4:
            Bo = out.shape[2]
            if B is not None and Bo != B:
                raise ValueError(f"Gemm: rows_block={B}, but out {out.shape} has blocks of {Bo} rows")
            for c in range(out.shape[0]):
                self._call(stream_handle, x[c] if x.ndim == 4 else x[c * Bo: (c + 1) * Bo], w,
                           out[c], accumulate)
            return
        if B is None:
            return self._call(stream_handle, x, w, out, accumulate)
        M = x.shape[-2]
        if M % B or (w.ndim == 3 and M != B):
            raise ValueError(f"Gemm: rows_block={B} needs M a multiple of it (and M = {B} over "
                             f"experts, else out [C, E, B, N]), got x {x.shape}, w {w.shape}")
        for c in range(M // B):
            self._call(stream_handle, x[c * B: (c + 1) * B], w, out[c * B: (c + 1) * B], accumulate)

    def _call(self, stream_handle, x, w, out, accumulate):
        from nvmath.bindings import cublas

        M, K = x.shape[-2:]
        N = w.shape[-2]
        if M == 0:
            return
        for a in (x, w, out):
            if a.strides[-1] != a.itemsize:
                raise ValueError(f"Gemm: arrays must be contiguous in their last axis, got strides {a.strides}")
        h = self._handle(stream_handle)
        _mark_written(out, accumulate)
        beta = self._beta[bool(accumulate)].ctypes.data
        t = (_CUDA_TYPE[w.dtype], _CUDA_TYPE[x.dtype], _CUDA_TYPE[out.dtype])
        ldb, ldc = x.strides[-2] // x.itemsize, out.strides[-2] // out.itemsize
        compute, algo, op_t, op_n = 68, -1, 1, 0  # CUBLAS_COMPUTE_32F, GEMM_DEFAULT, OP_T, OP_N
        if w.ndim == 2:
            cublas.gemm_ex(h, op_t, op_n, N, M, K, self._alpha.ctypes.data, w.data.ptr, t[0], K,
                           x.data.ptr, t[1], ldb, beta, out.data.ptr, t[2], ldc, compute, algo)
        else:
            sb = 0 if x.ndim == 2 else x.strides[0] // x.itemsize
            cublas.gemm_strided_batched_ex(
                h, op_t, op_n, N, M, K, self._alpha.ctypes.data, w.data.ptr, t[0], K, N * K,
                x.data.ptr, t[1], ldb, sb, beta, out.data.ptr, t[2], ldc,
                out.strides[0] // out.itemsize, w.shape[0], compute, algo)

    def close(self):
        """Destroy the cuBLAS handles (idempotent)."""
        self._finalizer()


class RoutedGemm:
    """The top-k experts of each row only: out[b] = x[row or b] @ w[topk.flat[b]]^T for
    b = row * k + slot, one cuBLAS batched GEMM (gemm_batched_ex) of n * k single-column
    products on the Gemm's handle.

    x is [n, K] (gate/up: each row's input, shared by its k slots) or [n * k, K] (down: one
    activation per slot); w is [E, N, K]; topk [n, k] int32; out [n * k, N]. The A/B/C pointer
    arrays are written on the device by a small kernel from topk, so a captured graph follows
    each replay's routing; they live in vt's pool (be.launch routes CuPy's allocations there).
    Reads n * k expert matrices, against all E for Gemm over the expert axis: the model takes
    this path when n * k < E (kernels/moe.py).
    """

    name = "gemm_routed"

    def __init__(self, gemm: Gemm):
        self._gemm = gemm
        self._beta0 = np.zeros(1, np.float32)

    @staticmethod
    def _per_slot(x, topk) -> bool:
        n, k = topk.shape
        if x.shape[0] == n:
            return False
        if x.shape[0] == n * k:
            return True
        raise ValueError(f"RoutedGemm: x has {x.shape[0]} rows for topk {topk.shape}: "
                         f"expected {n} (one per row) or {n * k} (one per slot)")

    def run_numpy(self, x, w, topk, out):
        per_slot, k = self._per_slot(x, topk), topk.shape[1]
        experts = np.asarray(topk).reshape(-1)
        xs = f32(x)
        # The same one-row product as Gemm.run_numpy, so routed and all-expert steps agree bit
        # for bit on the sim.
        y = [rowwise_matmul(xs[b if per_slot else b // k][None], f32(w[e]))[0] for b, e in enumerate(experts)]
        store(out, np.stack(y) if y else np.zeros(out.shape, np.float32))

    def run_cupy(self, stream_handle, x, w, topk, out):
        import cupy as cp
        from nvmath.bindings import cublas

        n, k = topk.shape
        count = n * k
        if count == 0:
            return
        per_slot = self._per_slot(x, topk)
        _, N, K = w.shape
        for a in (x, w, out, topk):
            if not a.flags.c_contiguous:
                raise ValueError(f"RoutedGemm: arrays must be C-contiguous, got strides {a.strides}")
        h = self._gemm._handle(stream_handle)
        ptrs = cp.empty((3, count), cp.int64)
        fn = cuda_function(_PTRS, "routed_ptrs", np.float16)
        fn((-(-count // 128),), (128,),
           (topk, ptrs, np.int64(w.data.ptr), np.int64(w.strides[0]), np.int64(x.data.ptr),
            np.int64(x.strides[0]), np.int64(out.data.ptr), np.int64(out.strides[0]),
            i32(count), i32(k), i32(per_slot)))
        t = (_CUDA_TYPE[w.dtype], _CUDA_TYPE[x.dtype], _CUDA_TYPE[out.dtype])
        _mark_written(out)
        cublas.gemm_batched_ex(h, 1, 0, N, 1, K, self._gemm._alpha.ctypes.data,
                               ptrs[0].data.ptr, t[0], K, ptrs[1].data.ptr, t[1], K,
                               self._beta0.ctypes.data, ptrs[2].data.ptr, t[2], N, count, 68, -1)


_PTRS = r"""
// Pointer arrays of RoutedGemm's batched GEMM (bytes): A = expert topk[b]'s weights,
// B = the input of row b / k (or of slot b), C = output row b.
extern "C" __global__ void routed_ptrs(const int* __restrict__ topk, long long* __restrict__ ptrs,
                                       long long w, long long w_stride, long long x, long long x_stride,
                                       long long out, long long out_stride, int count, int k,
                                       int per_slot) {
  int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= count) return;
  ptrs[b] = w + (long long)topk[b] * w_stride;
  ptrs[count + b] = x + (long long)(per_slot ? b : b / k) * x_stride;
  ptrs[2 * count + b] = out + (long long)b * out_stride;
}
"""


def reference_routed(x, w, topk):
    """float64: [n * k, N] products of each slot's input with its expert's weights."""
    topk = np.asarray(topk)
    per_slot, k = RoutedGemm._per_slot(x, topk), topk.shape[1]
    xs = f64(x)
    return np.stack([f64(w[e]) @ xs[b if per_slot else b // k] for b, e in enumerate(topk.reshape(-1))])


def _destroy_handles(handles: dict) -> None:
    if handles:
        from nvmath.bindings import cublas

        for h in handles.values():
            cublas.destroy(h)
        handles.clear()


def rowwise_matmul(x, w):
    """x [..., M, K] @ w[..., N, K]^T in float32, each row as its own [1, K] x [K, N] product
    (numpy loops the broadcast axes and makes the same gemv call for every row), so a row's
    bits do not depend on M or on the other rows."""
    xr = x[..., :, None, :]                                   # [..., M, 1, K]
    wt = np.swapaxes(w, -1, -2)[..., None, :, :]               # [..., 1, K, N]
    return np.matmul(xr, wt, dtype=np.float32)[..., 0, :]


def reference(x, w, out=None):
    y = np.matmul(f64(x), np.swapaxes(f64(w), -1, -2))
    return y if out is None else y + f64(out)
