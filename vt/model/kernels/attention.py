"""Paged attention over block tables (GQA), one query token per row: the decode step, and
prefill (each prompt token attends to the cache prefix written for it, rows = its sequence).
"""
from __future__ import annotations

import numpy as np

from ._common import cuda_function, f32, f64, f32s, i32, store

_CODE = r"""
#define NW 4
// grid (rows, q heads), block NW warps. Warp w takes keys w, w+NW, ...; lane l holds head
// elements l, l+32, ... (DPL of them), so each K/V row is read by one warp, coalesced. Each
// warp keeps an online softmax (m, l, acc); the warps are merged through shared memory.
extern "C" __global__ void paged_attn(const u16* __restrict__ qkv, const u16* __restrict__ kc,
                                      const u16* __restrict__ vc, const int* __restrict__ bt,
                                      const int* __restrict__ lens, const int* __restrict__ rows,
                                      u16* __restrict__ out, int row_stride, int q_heads,
                                      int kv_heads, int max_blocks, int block_size, float scale) {
  __shared__ float sm[NW], sl[NW], sacc[NW][DPL * 32];
  int n = blockIdx.x, h = blockIdx.y, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  int kvh = h / (q_heads / kv_heads), L = lens[n];
  const int* table = bt + (long)rows[n] * max_blocks;
  const u16* q = qkv + (long)n * row_stride + h * (DPL * 32);
  float qv[DPL], acc[DPL];
  for (int t = 0; t < DPL; ++t) { qv[t] = LD(q[lane + 32 * t]) * scale; acc[t] = 0.f; }
  float m = -INFINITY, l = 0.f;
  for (int j = w; j < L; j += NW) {
    long off = (((long)table[j / block_size] * block_size + j % block_size) * kv_heads + kvh) * (DPL * 32);
    float s = 0.f;
    for (int t = 0; t < DPL; ++t) s += qv[t] * LD(kc[off + lane + 32 * t]);
    s = warp_sum(s);
    float mn = fmaxf(m, s), corr = __expf(m - mn), p = __expf(s - mn);
    l = l * corr + p;
    for (int t = 0; t < DPL; ++t) acc[t] = acc[t] * corr + p * LD(vc[off + lane + 32 * t]);
    m = mn;
  }
  if (lane == 0) { sm[w] = m; sl[w] = l; }
  for (int t = 0; t < DPL; ++t) sacc[w][lane + 32 * t] = acc[t];
  __syncthreads();
  float M = -INFINITY;
  for (int i = 0; i < NW; ++i) M = fmaxf(M, sm[i]);
  float Ls = 0.f, f[NW];
  for (int i = 0; i < NW; ++i) { f[i] = sm[i] == -INFINITY ? 0.f : __expf(sm[i] - M); Ls += sl[i] * f[i]; }
  u16* o = out + (long)n * (q_heads * DPL * 32) + h * (DPL * 32);
  for (int d = threadIdx.x; d < DPL * 32; d += blockDim.x) {
    float v = 0.f;
    for (int i = 0; i < NW; ++i) v += sacc[i][d] * f[i];
    o[d] = ST(Ls > 0.f ? v / Ls : 0.f);  // a row with no keys (length 0) yields zeros
  }
}
"""


def _slots(table_row, length, block_size):
    nb = -(-length // block_size)
    return (table_row[:nb, None] * block_size + np.arange(block_size)).ravel()[:length]


class PagedAttention:
    """out[n, h] = softmax(q[n,h] . K^T / sqrt(D)) V over the lens[n] cached tokens of block
    table row rows[n]; q is the head block of the fused qkv row. out [N, q_heads * D]."""

    name = "paged_attention"

    def run_numpy(self, qkv, k_cache, v_cache, block_tables, lens, rows, out, *, q_heads,
                  kv_heads, head_dim):
        g = q_heads // kv_heads
        bs = k_cache.shape[1]
        kc = k_cache.reshape(-1, kv_heads, head_dim)
        vc = v_cache.reshape(-1, kv_heads, head_dim)
        q = f32(qkv[:, : q_heads * head_dim]).reshape(-1, kv_heads, g, head_dim)
        q = q * np.float32(1.0 / np.sqrt(head_dim))
        res = np.zeros((qkv.shape[0], kv_heads, g, head_dim), np.float32)
        for n in range(qkv.shape[0]):
            if lens[n] <= 0:
                continue
            sl = _slots(block_tables[rows[n]], int(lens[n]), bs)
            k, v = f32(kc[sl]), f32(vc[sl])                      # [L, kvh, D]
            s = np.einsum("hgd,lhd->hgl", q[n], k)
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            res[n] = np.einsum("hgl,lhd->hgd", p, v) / p.sum(axis=-1, keepdims=True)
        store(out, res.reshape(out.shape))

    def run_cupy(self, stream_handle, qkv, k_cache, v_cache, block_tables, lens, rows, out, *,
                 q_heads, kv_heads, head_dim):
        fn = cuda_function(_CODE, "paged_attn", qkv.dtype, DPL=head_dim // 32)
        n = qkv.shape[0]
        if n:
            fn((n, q_heads), (128,), (qkv, k_cache, v_cache, block_tables, lens, rows, out,
                                      i32(qkv.shape[1]), i32(q_heads), i32(kv_heads),
                                      i32(block_tables.shape[1]), i32(k_cache.shape[1]),
                                      f32s(1.0 / np.sqrt(head_dim))))


def reference(q, k_cache, v_cache, block_tables, lens, rows):
    """q [N, Hq, D]; caches [blocks, bs, kvh, D]; float64 loop, one head at a time."""
    q = f64(q)
    n_rows, hq, d = q.shape
    kvh = k_cache.shape[2]
    out = np.zeros_like(q)
    for n in range(n_rows):
        sl = _slots(np.asarray(block_tables)[rows[n]], int(lens[n]), k_cache.shape[1])
        for h in range(hq):
            if len(sl) == 0:
                continue
            k = f64(k_cache.reshape(-1, kvh, d)[sl, h // (hq // kvh)])
            v = f64(v_cache.reshape(-1, kvh, d)[sl, h // (hq // kvh)])
            s = k @ q[n, h] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[n, h] = p @ v / p.sum()
    return out
