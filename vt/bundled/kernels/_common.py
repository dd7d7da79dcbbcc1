"""Shared pieces of the model's kernels: storage-dtype conversion (numpy and CUDA) and the
CUDA prelude they are compiled behind (the compile cache itself is vt.backend.nvrtc).

Storage tensors are fp16 (numpy float16) or bf16 (raw bits in numpy uint16: numpy has no
bfloat16). CUDA code sees both as `u16` and converts with PTX `cvt`, so no CUDA header
(cuda_fp16.h / cuda_bf16.h) has to be found by NVRTC on the target machine.
"""
from __future__ import annotations

import numpy as np

from vt.backend import nvrtc as _nvrtc
from vt.backend.nvrtc import sm_count  # noqa: F401  (re-exported for the model's kernels)

# ---------------------------------------------------------------- numpy side


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, NaN kept NaN (same rule as the CUDA `f2b` below)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    return np.where((u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000), np.uint16(0x7FC0), r)


def f32(a: np.ndarray) -> np.ndarray:
    """A stored tensor (fp16, bf16-as-uint16, fp32 or int) as float32 values."""
    if a.dtype == np.uint16:
        return bf16_to_f32(a)
    return a.astype(np.float32, copy=False)


def f64(a: np.ndarray) -> np.ndarray:
    return f32(a).astype(np.float64)


def to_storage(x: np.ndarray, dtype) -> np.ndarray:
    """float values -> an array of storage dtype `dtype` (float16, uint16 = bf16, float32)."""
    dtype = np.dtype(dtype)
    if dtype == np.uint16:
        return f32_to_bf16(np.asarray(x, np.float32))
    return np.asarray(x).astype(dtype)


def store(out: np.ndarray, x: np.ndarray) -> None:
    """Write float values into `out` in place, converted to out's storage dtype."""
    out[...] = to_storage(x, out.dtype).reshape(out.shape)


# ---------------------------------------------------------------- CUDA side

PRELUDE = r"""
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
typedef unsigned short u16;
__device__ __forceinline__ float h2f(u16 h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ u16 f2h(float f) { u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float b2f(u16 b) { return __uint_as_float(((unsigned)b) << 16); }
__device__ __forceinline__ u16 f2b(float f) {
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#if VT_BF16
#define LD(x) b2f(x)
#define ST(x) f2b(x)
#else
#define LD(x) h2f(x)
#define ST(x) f2h(x)
#endif
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
__device__ float block_sum(float v, float* sh32) {
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) sh32[w] = v;
  __syncthreads();
  v = lane < nw ? sh32[lane] : 0.f;
  return warp_sum(v);
}
"""

def cuda_function(code: str, name: str, storage, **defines):
    """The compiled CuPy function `name` from `code` (behind PRELUDE) for a storage dtype and
    `defines`, from the shared compile cache of vt.backend.nvrtc."""
    return _nvrtc.cuda_function(PRELUDE + code, name, VT_BF16=int(np.dtype(storage) == np.uint16), **defines)


def nvrtc_options(bf16: bool, defines: dict) -> tuple[str, ...]:
    """The NVRTC options of a model kernel build (the compile test builds with the same ones)."""
    return _nvrtc.nvrtc_options(dict(defines, VT_BF16=int(bf16)))


def i32(v) -> np.int32:
    return np.int32(v)


def f32s(v) -> np.float32:
    return np.float32(v)
