"""Rotary position embedding (rotate-half / NeoX layout), in place on the q and k heads of a
fused qkv row [q heads | k heads | v heads], at positions read from a device array."""
from __future__ import annotations

import numpy as np

from ._common import cuda_function, f32, f64, f32s, i32, store

_CODE = r"""
// grid (rows, rotated heads), block head_dim/2: thread j rotates the pair (j, j + D/2).
extern "C" __global__ void rope(u16* __restrict__ qkv, const int* __restrict__ pos,
                                int row_stride, int head_dim, float log2_theta) {
  int half = head_dim >> 1, j = threadIdx.x;
  u16* x = qkv + (long)blockIdx.x * row_stride + (long)blockIdx.y * head_dim;
  float inv_freq = exp2f(-log2_theta * (2.f * j) / head_dim);
  float s, c;
  sincosf((float)pos[blockIdx.x] * inv_freq, &s, &c);
  float x1 = LD(x[j]), x2 = LD(x[j + half]);
  x[j] = ST(x1 * c - x2 * s);
  x[j + half] = ST(x2 * c + x1 * s);
}
"""


def _angles(positions, head_dim, theta, xp=np, dtype=np.float32):
    j = xp.arange(head_dim // 2, dtype=dtype)
    inv_freq = xp.exp2(-dtype(np.log2(theta)) * (dtype(2) * j) / dtype(head_dim))
    return positions.astype(dtype)[:, None] * inv_freq[None, :]  # [N, D/2]


class RoPE:
    """Rotate heads [0, n_heads) of each row of qkv [N, row_stride] in place."""

    name = "rope"

    def run_numpy(self, qkv, positions, *, n_heads, head_dim, theta):
        n = qkv.shape[0]
        x = qkv[:, : n_heads * head_dim].reshape(n, n_heads, head_dim)
        ang = _angles(positions, head_dim, theta)[:, None, :]
        c, s = np.cos(ang), np.sin(ang)
        h = head_dim // 2
        v = f32(x)
        x1, x2 = v[..., :h], v[..., h:]
        store(x, np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1))

    def run_cupy(self, stream_handle, qkv, positions, *, n_heads, head_dim, theta):
        fn = cuda_function(_CODE, "rope", qkv.dtype)
        n = qkv.shape[0]
        if n:
            fn((n, n_heads), (head_dim // 2,),
               (qkv, positions, i32(qkv.shape[1]), i32(head_dim), f32s(np.log2(theta))))


def reference(x, positions, theta):
    """x [N, H, D] float64 -> rotated float64."""
    x = f64(x)
    d = x.shape[-1]
    ang = np.asarray(positions, np.float64)[:, None] * theta ** (-2.0 * np.arange(d // 2) / d)
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
