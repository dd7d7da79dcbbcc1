"""Paged attention over block tables (GQA), one query token per row: the decode step, and
prefill (each prompt token attends to the cache prefix written for it, rows = its sequence).
"""
from __future__ import annotations

import numpy as np

from ._common import cuda_function, f32, f64, f32s, i32, sm_count, store

_CODE = r"""
#define NW 4
#define D (EPL * LPK)
#define KPW (32 / LPK)
#define NG (NW * KPW)
// Keys per group per batch: 4 while a lane's q and acc are small, else 2, so that the kernel
// fits the 128 registers of __launch_bounds__(.., 4) without spilling (splits() relies on it).
#define U (G * EPL <= 8 ? 4 : 2)
#if EPL % 8 == 0
typedef uint4 vec_t;
#define VW 8
#elif EPL % 4 == 0
typedef uint2 vec_t;
#define VW 4
#elif EPL % 2 == 0
typedef unsigned vec_t;
#define VW 2
#else
typedef u16 vec_t;
#define VW 1
#endif
// EPL consecutive storage values at p (aligned to their size) as floats, in VW-wide loads.
__device__ __forceinline__ void load_vec(const u16* __restrict__ p, float* f) {
  const vec_t* v = reinterpret_cast<const vec_t*>(p);
#pragma unroll
  for (int i = 0; i < EPL / VW; ++i) {
    union { vec_t r; u16 h[VW]; } x;
    x.r = v[i];
#pragma unroll
    for (int e = 0; e < VW; ++e) f[i * VW + e] = LD(x.h[e]);
  }
}

// Sum over the LPK lanes of one key group (all 32 lanes must call it).
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = LPK / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Split-context decode attention. grid (rows, kv heads, P), block NW warps: block (n, g, p)
// takes keys [p*c, (p+1)*c) of row n (c = ceil(L/P), L read on the device) for the G query
// heads of KV head g, so each K/V row is read once for all G heads. A warp is KPW key groups
// of LPK lanes; lane l of a group holds head elements [l*EPL, (l+1)*EPL), so one load
// instruction reads KPW whole rows (16-byte loads for EPL = 8) and a dot product needs
// log2(LPK) shuffles instead of the 5 of a warp-wide row (the shuffles, not DRAM, bounded
// the warp-per-row kernel at 32 rows). Key j0 + i belongs to group i % NG of the block and is
// read in batches of U keys per group (U*KPW rows in flight per warp). Each group keeps an
// online softmax per head; groups merge by shuffles, warps through shared memory. P == 1
// writes the output; otherwise the block writes (acc, max, sum) to part[n, h, p] and
// paged_attn_combine merges the P splits.
extern "C" __global__ void __launch_bounds__(NW * 32, 4) paged_attn_split(
    const u16* __restrict__ qkv, const u16* __restrict__ kc, const u16* __restrict__ vc,
    const int* __restrict__ bt, const int* __restrict__ lens, const int* __restrict__ rows,
    u16* __restrict__ out, float* __restrict__ part, int row_stride, int q_heads, int kv_heads,
    int max_blocks, int block_size, float scale) {
  __shared__ float sm[NW][G], sl[NW][G], sacc[NW][G][D];
  int n = blockIdx.x, kvh = blockIdx.y, p = blockIdx.z, P = gridDim.z;
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, kg = lane / LPK, e0 = (lane % LPK) * EPL;
  int L = lens[n], c = (L + P - 1) / P, j0 = p * c, j1 = min(L, j0 + c);
  const int* table = bt + (long)rows[n] * max_blocks;
  float qv[G][EPL], acc[G][EPL], m[G], l[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    load_vec(qkv + (long)n * row_stride + (kvh * G + g) * D + e0, qv[g]);
#pragma unroll
    for (int t = 0; t < EPL; ++t) { qv[g][t] *= scale; acc[g][t] = 0.f; }
    m[g] = -INFINITY; l[g] = 0.f;
  }
  // jb is warp-uniform, so every lane of the warp reaches the shuffles of each batch.
  for (int jb = j0 + w * KPW; jb < j1; jb += NG * U) {
    float kf[U][EPL], vf[U][EPL];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      int jj = jb + kg + u * NG;
      if (jj < j1) {
        long off = (((long)table[jj / block_size] * block_size + jj % block_size) * kv_heads + kvh) * D + e0;
        load_vec(kc + off, kf[u]);
        load_vec(vc + off, vf[u]);
      } else {
#pragma unroll
        for (int t = 0; t < EPL; ++t) kf[u][t] = vf[u][t] = 0.f;
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float s[U], mx = m[g];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        float d = 0.f;
#pragma unroll
        for (int t = 0; t < EPL; ++t) d += qv[g][t] * kf[u][t];
        s[u] = group_sum(d);
        if (jb + kg + u * NG < j1) mx = fmaxf(mx, s[u]);
      }
      // mx stays -inf only while this group has seen no key (then acc and l are 0).
      float corr = mx == -INFINITY ? 1.f : __expf(m[g] - mx);
      l[g] *= corr;
#pragma unroll
      for (int t = 0; t < EPL; ++t) acc[g][t] *= corr;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (jb + kg + u * NG < j1) {
          float pr = __expf(s[u] - mx);
          l[g] += pr;
#pragma unroll
          for (int t = 0; t < EPL; ++t) acc[g][t] += pr * vf[u][t];
        }
      }
      m[g] = mx;
    }
  }
  // Merge the KPW groups of the warp: lanes l and l ^ o (o >= LPK) hold the same elements.
#pragma unroll
  for (int o = LPK; o < 32; o <<= 1) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float mo = __shfl_xor_sync(0xffffffffu, m[g], o), lo = __shfl_xor_sync(0xffffffffu, l[g], o);
      float M = fmaxf(m[g], mo);
      float f = m[g] == -INFINITY ? 0.f : __expf(m[g] - M), fo = mo == -INFINITY ? 0.f : __expf(mo - M);
      l[g] = l[g] * f + lo * fo;
#pragma unroll
      for (int t = 0; t < EPL; ++t) acc[g][t] = acc[g][t] * f + __shfl_xor_sync(0xffffffffu, acc[g][t], o) * fo;
      m[g] = M;
    }
  }
  if (kg == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (lane == 0) { sm[w][g] = m[g]; sl[w][g] = l[g]; }
#pragma unroll
      for (int t = 0; t < EPL; ++t) sacc[w][g][e0 + t] = acc[g][t];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * D; i += NW * 32) {
    int g = i / D, d = i % D, h = kvh * G + g;
    float M = -INFINITY, Ls = 0.f, v = 0.f;
    for (int k = 0; k < NW; ++k) M = fmaxf(M, sm[k][g]);
    for (int k = 0; k < NW; ++k) {
      float f = sm[k][g] == -INFINITY ? 0.f : __expf(sm[k][g] - M);
      Ls += sl[k][g] * f;
      v += sacc[k][g][d] * f;
    }
    if (P == 1) {
      out[(long)n * q_heads * D + h * D + d] = ST(Ls > 0.f ? v / Ls : 0.f);  // no keys: zeros
    } else {
      float* pr = part + (((long)n * q_heads + h) * P + p) * (D + 2);
      pr[d] = v;
      if (d == 0) { pr[D] = M; pr[D + 1] = Ls; }
    }
  }
}

// grid (rows, q heads), block D: merge the P splits of paged_attn_split.
extern "C" __global__ void paged_attn_combine(const float* __restrict__ part, u16* __restrict__ out,
                                              int q_heads, int P) {
  int n = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
  const float* pr = part + ((long)n * q_heads + h) * P * (D + 2);
  float M = -INFINITY, Ls = 0.f, v = 0.f;
  for (int p = 0; p < P; ++p) M = fmaxf(M, pr[p * (D + 2) + D]);
  for (int p = 0; p < P; ++p) {
    float mp = pr[p * (D + 2) + D], f = mp == -INFINITY ? 0.f : __expf(mp - M);
    Ls += pr[p * (D + 2) + D + 1] * f;
    v += pr[p * (D + 2) + d] * f;
  }
  out[(long)n * q_heads * D + h * D + d] = ST(Ls > 0.f ? v / Ls : 0.f);
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
                  kv_heads, head_dim, fixed_splits=None):
        # One row at a time, shapes from that row only: batch-invariant as it is.
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
                 q_heads, kv_heads, head_dim, fixed_splits=None):
        """fixed_splits: context splits per row. None picks them from the row count (one
        wave), which changes a row's merge order with the batch; a fixed count keeps it
        (invariant_splits)."""
        import cupy as cp

        g = q_heads // kv_heads
        if g * head_dim > 2048:
            raise ValueError(f"PagedAttention: (q_heads/kv_heads) * head_dim = {g * head_dim} > 2048 "
                             f"(the per-block merge buffer would exceed 32 KB of shared memory)")
        defs = dict(LPK=lanes_per_key(head_dim), G=g)
        defs["EPL"] = head_dim // defs["LPK"]
        n = qkv.shape[0]
        if not n:
            return
        P = splits(n * kv_heads) if fixed_splits is None else fixed_splits
        part = cp.empty((n, q_heads, P, head_dim + 2), np.float32) if P > 1 else None
        cuda_function(_CODE, "paged_attn_split", qkv.dtype, **defs)(
            (n, kv_heads, P), (128,),
            (qkv, k_cache, v_cache, block_tables, lens, rows, out,
             part if part is not None else np.uint64(0), i32(qkv.shape[1]), i32(q_heads),
             i32(kv_heads), i32(block_tables.shape[1]), i32(k_cache.shape[1]),
             f32s(1.0 / np.sqrt(head_dim))))
        if part is not None:
            cuda_function(_CODE, "paged_attn_combine", qkv.dtype, **defs)(
                (n, q_heads), (head_dim,), (part, out, i32(q_heads), i32(P)))


def lanes_per_key(head_dim: int) -> int:
    """Lanes that read one K/V row: the most (a power of two <= 32) that still give each lane
    >= 8 elements, i.e. one 16-byte load (D=128: 16 lanes, 2 rows per warp instruction)."""
    lpk = 32
    while lpk > 1 and (head_dim % lpk or head_dim // lpk < 8):
        lpk //= 2
    return lpk


def splits(blocks_per_split: int) -> int:
    """Context splits per (row, KV head): as many as fit ONE wave of 4 resident blocks per SM
    (the launch bounds guarantee 4), at most 32. Rounding up instead (the old ceil) gave 3
    splits = 768 blocks at 32 rows x 8 KV heads, a second partial wave on 132 SMs."""
    return max(1, min(32, 4 * sm_count() // blocks_per_split))


def invariant_splits(kv_heads: int) -> int:
    """The fixed split count of a batch-invariant model: what 4 rows get from splits() (at 1
    row the grid is 4x smaller than splits(kv_heads), at 32 rows 8x larger than needed)."""
    return splits(4 * kv_heads)


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
