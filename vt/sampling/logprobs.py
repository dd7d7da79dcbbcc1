"""The sampler's token records: each row's sampled token, and for rows that ask (logprobs >= 0)
its log-probability and the n most likely tokens with theirs, in one fixed-shape int32 record
per row, so that they travel with the token (one D2H copy, no host sync, nothing allocated).

Record [RECORD_WORDS] int32 of a row: [0] the token; [1] its logprob (float32 bits);
[2, 2 + MAX_LOGPROBS) the top tokens, most likely first (logit desc, token id asc on ties);
[2 + MAX_LOGPROBS, 2 + 2 * MAX_LOGPROBS) their logprobs (float32 bits). Only a row's first n top
entries are written; a row that does not ask, or an error row (-1), gets UNASKED in [1] and
nothing after it, so the host finds the rows with logprobs with one vector compare.

The distribution is the one the sampler draws from before truncation: log_softmax(logits /
temperature) (temperature 0: log_softmax(logits)), computed in float64 on the host and with
double accumulation on the device. top_k, top_p and min_p do not change it (vLLM's choice).

The CUDA kernel runs after the sampling kernel, one block per row: a row that does not ask
copies its token and returns, so such rows cost one tiny launch per step for the whole batch.
"""
from __future__ import annotations

import numpy as np

from .params import MAX_LOGPROBS

RECORD_WORDS = 2 + 2 * MAX_LOGPROBS
UNASKED = 0x7FC0DEAD   # [1] of a row without logprobs: a NaN's bits, never a logprob's
TOP_IDS = slice(2, 2 + MAX_LOGPROBS)
TOP_LOGPROBS = slice(2 + MAX_LOGPROBS, 2 + 2 * MAX_LOGPROBS)


def write_records(records: np.ndarray, logits, tokens, temperature, logprobs) -> None:
    """The numpy twin of the kernel: records [S, RECORD_WORDS] int32 from tokens [S] and each
    row's logprobs count (-1: none)."""
    records[:, 0] = tokens
    n = np.asarray(logprobs).reshape(-1)
    asked = (n >= 0) & (np.asarray(tokens) >= 0)
    records[~asked, 1] = UNASKED
    rows = np.flatnonzero(asked)
    if not rows.size:
        return
    x = np.asarray(logits, np.float32)[rows]
    t = np.asarray(temperature, np.float32).reshape(-1)[rows].astype(np.float64)
    inv_t = np.where(t > 0, 1.0 / np.where(t > 0, t, 1.0), 1.0)
    z = x.astype(np.float64) * inv_t[:, None]          # [r, V]
    zmax = z.max(axis=1)
    with np.errstate(under="ignore"):
        lse = zmax + np.log(np.exp(z - zmax[:, None]).sum(axis=1))
    lp = (z - lse[:, None]).astype(np.float32)
    tok = np.asarray(tokens)[rows]
    f32 = records.view(np.float32)
    f32[rows, 1] = lp[np.arange(rows.size), tok]
    k_max = int(n[rows].max())
    if k_max:
        order = np.argsort(-np.where(x == 0, np.float32(0), x), axis=1, kind="stable")[:, :k_max]
        for j, r in enumerate(rows):
            k = int(n[r])
            records[r, TOP_IDS][:k] = order[j, :k]
            f32[r, TOP_LOGPROBS][:k] = lp[j, order[j, :k]]


def read_record(record: np.ndarray, n: int) -> tuple[float, list[tuple[int, float]]]:
    """(the sampled token's logprob, [(token, logprob)] of the n most likely) of one record."""
    f32 = record.view(np.float32)
    return float(f32[1]), [(int(i), float(v)) for i, v in zip(record[TOP_IDS][:n], f32[TOP_LOGPROBS][:n])]


CODE = r"""
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
typedef unsigned long long u64;
typedef unsigned int u32;
#define LP_NT 256
#define LP_MAX %(max)d
#define LP_UNASKED %(unasked)d

__device__ __forceinline__ u64 lp_key(float x, int i) {   // logit desc, then token id asc
  u32 b = __float_as_uint(x == 0.f ? 0.f : x);
  b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return ((u64)b << 32) | (u64)(0xffffffffu - (u32)i);
}
__device__ __forceinline__ float lp_logit(u64 key) {
  const u32 k = (u32)(key >> 32);
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
__device__ double lp_block_max(double v) {
  __shared__ double sm[LP_NT / 32];
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sm[threadIdx.x >> 5] = v;
  __syncthreads();
  for (int j = 0; j < LP_NT / 32; ++j) v = fmax(v, sm[j]);
  return v;
}
__device__ double lp_block_sum(double v) {
  __shared__ double sm[LP_NT / 32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sm[threadIdx.x >> 5] = v;
  __syncthreads();
  v = 0.0;
  for (int j = 0; j < LP_NT / 32; ++j) v += sm[j];
  return v;
}
__device__ u64 lp_block_max_key(u64 v) {
  __shared__ u64 sm[LP_NT / 32];
  for (int o = 16; o > 0; o >>= 1) { const u64 t = __shfl_xor_sync(0xffffffffu, v, o); v = t > v ? t : v; }
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sm[threadIdx.x >> 5] = v;
  __syncthreads();
  for (int j = 0; j < LP_NT / 32; ++j) v = sm[j] > v ? sm[j] : v;
  return v;
}

// One block per row. records[row * W]: the token (from tokens[row]); a row with n = nlp[row]
// >= 0 and a valid token also gets its logprob and its n most likely tokens (module doc).
extern "C" __global__ void __launch_bounds__(LP_NT) token_records(
    const float* __restrict__ logits, const int* __restrict__ tokens, const float* __restrict__ temp,
    const int* __restrict__ nlp, int* __restrict__ records, int V, int W) {
  const int row = blockIdx.x, tok = tokens[row], n = nlp[row];
  int* rec = records + (size_t)row * W;
  if (n < 0 || tok < 0) {
    if (threadIdx.x == 0) { rec[0] = tok; rec[1] = LP_UNASKED; }
    return;
  }
  if (threadIdx.x == 0) rec[0] = tok;
  const float* x = logits + (size_t)row * V;
  const float t = temp[row];
  const double inv_t = t > 0.f ? 1.0 / (double)t : 1.0;
  double m = -INFINITY;
  for (int i = threadIdx.x; i < V; i += LP_NT) m = fmax(m, (double)x[i]);
  const double zmax = lp_block_max(m) * inv_t;
  double s = 0.0;
  for (int i = threadIdx.x; i < V; i += LP_NT) s += exp((double)x[i] * inv_t - zmax);
  const double lse = zmax + log(lp_block_sum(s));
  if (threadIdx.x == 0) rec[1] = __float_as_int((float)((double)x[tok] * inv_t - lse));
  if (n == 0) return;
  // Each thread keeps its own n best keys, sorted, in its column of `best` (no other thread
  // touches it); then n rounds take the block's best head and advance the thread that held it.
  __shared__ u64 best[LP_MAX * LP_NT];
  int have = 0;
  for (int i = threadIdx.x; i < V; i += LP_NT) {
    const u64 key = lp_key(x[i], i);
    if (have == n && key <= best[(n - 1) * LP_NT + threadIdx.x]) continue;
    int j = have < n ? have++ : n - 1;
    for (; j > 0 && best[(j - 1) * LP_NT + threadIdx.x] < key; --j)
      best[j * LP_NT + threadIdx.x] = best[(j - 1) * LP_NT + threadIdx.x];
    best[j * LP_NT + threadIdx.x] = key;
  }
  int head = 0;
  for (int r = 0; r < n; ++r) {
    const u64 mine = head < have ? best[head * LP_NT + threadIdx.x] : 0ull;   // real keys are > 0
    const u64 top = lp_block_max_key(mine);
    if (mine == top && top != 0ull) {                    // keys are unique: one thread
      ++head;
      rec[2 + r] = (int)(0xffffffffu - (u32)top);
      rec[2 + LP_MAX + r] = __float_as_int((float)((double)lp_logit(top) * inv_t - lse));
    }
  }
}
""" % {"max": MAX_LOGPROBS, "unasked": UNASKED}

KERNELS = ("token_records",)


def launch_records(logits, tokens, temperature, logprobs, records) -> None:
    """The kernel on the current CuPy stream: records [S, RECORD_WORDS] from tokens [S]."""
    from vt.backend.nvrtc import cuda_function

    S, V = logits.shape
    cuda_function(CODE, "token_records")(
        (S,), (256,), (logits, tokens, temperature, logprobs, records, np.int32(V), np.int32(RECORD_WORDS)))
