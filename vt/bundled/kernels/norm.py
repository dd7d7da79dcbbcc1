"""RMSNorm: fp32 (residual) or storage rows in, storage rows out, fp32 statistics."""
from __future__ import annotations

import numpy as np

from ._common import cuda_function, f32, f64, f32s, i32, store

_CODE = r"""
#if IN_F32
typedef float in_t;
#define IN(x) (x)
#else
typedef u16 in_t;
#define IN(x) LD(x)
#endif
// One block per row: mean of squares by a block reduction, then scale by the weight.
extern "C" __global__ void rmsnorm(const in_t* __restrict__ x, const u16* __restrict__ w,
                                   u16* __restrict__ out, int cols, float eps) {
  __shared__ float sh[32];
  const in_t* r = x + (long)blockIdx.x * cols;
  float ss = 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) { float v = IN(r[c]); ss += v * v; }
  float inv = rsqrtf(block_sum(ss, sh) / cols + eps);
  u16* o = out + (long)blockIdx.x * cols;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) o[c] = ST(IN(r[c]) * inv * LD(w[c]));
}
"""


class RMSNorm:
    """out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w  (x [N, C] fp32 or storage; out storage)."""

    name = "rmsnorm"

    def run_numpy(self, x, w, out, *, eps):
        v = f32(x)
        inv = 1.0 / np.sqrt((v * v).mean(axis=-1, keepdims=True) + np.float32(eps))
        store(out, v * inv * f32(w))

    def run_cupy(self, stream_handle, x, w, out, *, eps):
        fn = cuda_function(_CODE, "rmsnorm", out.dtype, IN_F32=int(x.dtype == np.float32))
        n, cols = x.shape
        if n:
            fn((n,), (min(1024, max(32, -(-cols // 4) // 32 * 32)),), (x, w, out, i32(cols), f32s(eps)))


def reference(x, w, eps):
    v = f64(x)
    return v / np.sqrt((v * v).mean(axis=-1, keepdims=True) + eps) * f64(w)
