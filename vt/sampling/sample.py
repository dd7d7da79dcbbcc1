"""Sampling on the device: greedy argmax, or temperature + top-k with a counter-based RNG.

Each row reads its own temperature, top_k and seed from device vectors (DecodeInputs), so
requests with different sampling share one graph. The random number of a row is a hash of
(seed, position) only, read from device arrays: a replayed graph draws fresh numbers each step
with no host involvement, and a request's draws do not depend on its row, its batch mates,
the padded size or the schedule. The sampled token goes to out_tokens[r] and to
token_table[token_rows[r]] (the next step's input, read on the device by EmbedTokens).
"""
from __future__ import annotations

import numpy as np

from vt.step.contract import MAX_TOP_K, SamplingParams  # noqa: F401  (SamplingParams: re-exported)


_CODE = r"""
#define INFINITY __int_as_float(0x7f800000)
typedef unsigned long long u64;
__device__ __forceinline__ u64 mix64(u64 z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
  return bi < 0 || v > bv || (v == bv && i < bi);
}
// grid rows, block 256. Pass t picks the largest logit strictly after pass t-1's pick in the
// order (value desc, index asc), so k passes give the top k without any sort buffer.
extern "C" __global__ void sample(const float* __restrict__ logits, const int* __restrict__ rows,
                                  const int* __restrict__ pos, const float* __restrict__ temp,
                                  const int* __restrict__ top_k, const u64* __restrict__ seeds,
                                  int* __restrict__ out, int* __restrict__ table, int V) {
  __shared__ float sv[256], wv[8];
  __shared__ int si[256], wi[8];
  const float* x = logits + (long)blockIdx.x * V;
  const float t_row = temp[blockIdx.x];
  // Greedy rows (temperature 0) take the top 1; the kernel keeps at most 256 in shared memory.
  const int k = t_row > 0.f ? max(1, min(top_k[blockIdx.x], 256)) : 1;
  const double inv_temp = t_row > 0.f ? 1.0 / (double)t_row : 1.0;
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  float prev = INFINITY; int prev_i = -1;
  for (int t = 0; t < k; ++t) {
    float bv = -INFINITY; int bi = -1;
    for (int c = threadIdx.x; c < V; c += blockDim.x) {
      float v = x[c];
      if ((v < prev || (v == prev && c > prev_i)) && better(v, c, bv, bi)) { bv = v; bi = c; }
    }
    for (int o = 16; o > 0; o >>= 1) {
      float ov = __shfl_xor_sync(0xffffffffu, bv, o); int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (oi >= 0 && better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    if (lane == 0) { wv[w] = bv; wi[w] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int i = 1; i < (blockDim.x >> 5); ++i)
        if (wi[i] >= 0 && better(wv[i], wi[i], wv[0], wi[0])) { wv[0] = wv[i]; wi[0] = wi[i]; }
      sv[t] = wv[0]; si[t] = wi[0];
    }
    __syncthreads();
    prev = sv[t]; prev_i = si[t];
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  int r = blockIdx.x, tok = si[0];
  if (k > 1 && si[0] >= 0) {
    double total = 0.0;
    for (int t = 0; t < k && si[t] >= 0; ++t) total += exp(((double)sv[t] - sv[0]) * inv_temp);
    u64 h = mix64(seeds[r] * 0x9e3779b97f4a7c15ull + (u64)(unsigned)pos[r]);
    double u = (double)(h >> 11) * (1.0 / 9007199254740992.0) * total, acc = 0.0;
    for (int t = 0; t < k && si[t] >= 0; ++t) {
      tok = si[t];
      acc += exp(((double)sv[t] - sv[0]) * inv_temp);
      if (u < acc) break;
    }
  }
  if (tok < 0) tok = 0;  // an all-NaN row: a valid token id keeps the next embedding in range
  out[r] = tok;
  table[rows[r]] = tok;
}
"""


def _mix64(z):
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniforms(seeds, positions):
    """The kernel's per-row uniform in [0, 1): hash of (seed, position)."""
    with np.errstate(over="ignore"):
        key = np.asarray(positions).astype(np.uint32).astype(np.uint64)
        h = _mix64(np.asarray(seeds, np.uint64) * np.uint64(0x9E3779B97F4A7C15) + key)
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


class Sample:
    """logits [S, V] fp32 -> out_tokens [S] int32, token_table[token_rows] = out_tokens; each
    row's temperature [S] f32, top_k [S] i32 and seed [S] u64 from device vectors."""

    name = "sample"

    def run_numpy(self, logits, token_rows, positions, temperature, top_k, seed, out_tokens,
                  token_table):
        out_tokens[...] = sample_reference(logits, positions, temperature, top_k, seed)
        token_table[token_rows] = out_tokens

    def run_cupy(self, stream_handle, logits, token_rows, positions, temperature, top_k, seed,
                 out_tokens, token_table):
        from vt.backend.nvrtc import compiled_function

        fn = compiled_function(_CODE, "sample")
        n, V = logits.shape
        if n:
            fn((n,), (256,), (logits, token_rows, positions, temperature, top_k, seed, out_tokens,
                              token_table, np.int32(V)))


def sample_reference(logits, positions, temperature, top_k, seed):
    """float64 reference of the kernel: same order, same uniforms, same inverse-CDF rule."""
    x = np.asarray(logits, np.float32)
    n = x.shape[0]
    temperature = np.broadcast_to(np.asarray(temperature, np.float32), (n,))
    k_rows = np.where(temperature > 0, np.clip(np.broadcast_to(top_k, (n,)), 1, MAX_TOP_K), 1)
    valid = ~np.isnan(x)
    order = np.lexsort((np.broadcast_to(np.arange(x.shape[1]), x.shape), -np.where(valid, x, -np.inf)), axis=-1)
    toks = order[:, 0].copy()
    u = uniforms(np.broadcast_to(np.asarray(seed, np.uint64), (n,)), positions)
    for r in np.flatnonzero(k_rows > 1):
        sel = order[r, :k_rows[r]]
        v = x[r, sel].astype(np.float64)
        p = np.exp((v - v[0]) * (1.0 / np.float64(temperature[r])))  # the kernel multiplies by 1/T
        c = np.cumsum(p)
        toks[r] = sel[min(int((c <= u[r] * c[-1]).sum()), k_rows[r] - 1)]
    toks[~valid.any(-1)] = 0
    return toks.astype(np.int32)
