"""Row gathers: the embedding lookup through the device token table, and last-token rows."""
from __future__ import annotations

import numpy as np

from ._common import cuda_function, f32, f64, i32, store

_CODE = r"""
#if IN_F32
typedef float in_t;
#define IN(x) (x)
#else
typedef u16 in_t;
#define IN(x) LD(x)
#endif
#if OUT_F32
typedef float out_t;
#define OUT(x) (x)
#else
typedef u16 out_t;
#define OUT(x) ST(x)
#endif
// One block per output row. `tok` is null for a direct gather (row = idx[i]).
extern "C" __global__ void gather_rows(const in_t* __restrict__ src, const int* __restrict__ idx,
                                       const int* __restrict__ tok, out_t* __restrict__ out,
                                       int cols) {
  int i = blockIdx.x;
  long r = tok ? tok[idx[i]] : idx[i];
  const in_t* s = src + r * (long)cols;
  out_t* o = out + (long)i * cols;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) o[c] = OUT(IN(s[c]));
}
"""


def _launch(src, idx, tok, out):
    storage = src.dtype if src.dtype.itemsize == 2 else out.dtype
    fn = cuda_function(_CODE, "gather_rows", storage, IN_F32=int(src.dtype == np.float32),
                       OUT_F32=int(out.dtype == np.float32))
    n, cols = out.shape
    if n:
        fn((n,), (256,), (src, idx, tok if tok is not None else np.uint64(0), out, i32(cols)))


class EmbedTokens:
    """out[i] = emb[token_table[token_rows[i]]]: the token of each row is read on the device,
    so a captured decode graph embeds whatever the previous step's sampler wrote."""

    name = "embed_tokens"

    def run_numpy(self, emb, token_table, token_rows, out):  # emb [V, H]; out [S, H]
        store(out, f32(emb)[token_table[token_rows]])

    def run_cupy(self, stream_handle, emb, token_table, token_rows, out):
        _launch(emb, token_rows, token_table, out)


class GatherRows:
    """out[i] = src[idx[i]] (prefill: embed prompt tokens; pick each sequence's last row)."""

    name = "gather_rows"

    def run_numpy(self, src, idx, out):  # src [N, C]; idx [M]; out [M, C]
        store(out, f32(src)[idx])

    def run_cupy(self, stream_handle, src, idx, out):
        _launch(src, idx, None, out)


def reference_embed(emb, token_table, token_rows):
    return f64(emb)[np.asarray(token_table)[np.asarray(token_rows)]]


def reference_gather(src, idx):
    return f64(src)[np.asarray(idx)]
