"""KV-cache write: copy each row's k and v heads into the paged cache at slot_mapping[i]."""
from __future__ import annotations

import numpy as np

from ._common import cuda_function, i32


_CODE = r"""
// grid rows; the cache is [num_blocks * block_size, kv_heads * head_dim] viewed flat, so a
// slot index addresses one token's K (or V) row directly.
extern "C" __global__ void kv_write(const u16* __restrict__ qkv, const int* __restrict__ slots,
                                    u16* __restrict__ kc, u16* __restrict__ vc,
                                    int row_stride, int k_off, int width) {
  const u16* r = qkv + (long)blockIdx.x * row_stride + k_off;
  long s = (long)slots[blockIdx.x] * width;
  for (int c = threadIdx.x; c < width; c += blockDim.x) { kc[s + c] = r[c]; vc[s + c] = r[width + c]; }
}
"""


class KVWrite:
    """k_cache/v_cache [blocks, block_size, kv_heads, D]: token i's k/v go to slot_mapping[i]
    (slot = block * block_size + offset). Padded rows point at the scratch block."""

    name = "kv_write"

    def run_numpy(self, qkv, slot_mapping, k_cache, v_cache, *, q_heads, kv_heads, head_dim):
        w = kv_heads * head_dim
        k0 = q_heads * head_dim
        kc = k_cache.reshape(-1, w)
        vc = v_cache.reshape(-1, w)
        kc[slot_mapping] = qkv[:, k0: k0 + w]
        vc[slot_mapping] = qkv[:, k0 + w: k0 + 2 * w]

    def run_cupy(self, stream_handle, qkv, slot_mapping, k_cache, v_cache, *, q_heads, kv_heads,
                 head_dim):
        fn = cuda_function(_CODE, "kv_write", qkv.dtype)
        n = qkv.shape[0]
        if n:
            fn((n,), (128,), (qkv, slot_mapping, k_cache, v_cache, i32(qkv.shape[1]),
                              i32(q_heads * head_dim), i32(kv_heads * head_dim)))


def reference(qkv, slot_mapping, k_cache, v_cache, q_heads, kv_heads, head_dim):
    """New (k_cache, v_cache) copies, written token by token through block/offset indexing."""
    kc, vc = np.array(k_cache), np.array(v_cache)
    bs = kc.shape[1]
    w = kv_heads * head_dim
    for i, slot in enumerate(np.asarray(slot_mapping)):
        row = np.asarray(qkv[i])[q_heads * head_dim:]
        kc[slot // bs, slot % bs] = row[:w].reshape(kv_heads, head_dim)
        vc[slot // bs, slot % bs] = row[w: 2 * w].reshape(kv_heads, head_dim)
    return kc, vc
