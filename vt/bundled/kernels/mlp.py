"""Gated MLP activation: out = SiLU(gate) * up, from the fused gate|up GEMM output."""
from __future__ import annotations

import numpy as np

from ._common import cuda_function, f32, f64, i32, store

_CODE = r"""
extern "C" __global__ void silu_mul(const u16* __restrict__ gu, u16* __restrict__ out, long n, int f) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
    long r = i / f; int c = i % f;
    float g = LD(gu[r * 2 * f + c]), u = LD(gu[r * 2 * f + f + c]);
    out[i] = ST(g / (1.f + __expf(-g)) * u);
  }
}
"""


class SiluMul:
    """gu [N, 2F] = [gate | up] -> out [N, F] (N may be experts*rows, flattened)."""

    name = "silu_mul"

    def run_numpy(self, gu, out):
        f = out.shape[-1]
        g = f32(gu.reshape(-1, 2 * f))
        store(out, g[:, :f] / (1 + np.exp(-g[:, :f])) * g[:, f:])

    def run_cupy(self, stream_handle, gu, out):
        fn = cuda_function(_CODE, "silu_mul", out.dtype)
        n = out.size
        if n:
            fn((min(-(-n // 256), 8192),), (256,), (gu, out, np.int64(n), i32(out.shape[-1])))


def reference(gu):
    g = f64(gu)
    f = g.shape[-1] // 2
    return g[..., :f] / (1 + np.exp(-g[..., :f])) * g[..., f:]
