"""MoE routing and combine. Expert compute takes one of two paths, chosen per shape (so a
captured graph keeps its path):

- all experts (n * k >= E, e.g. batch 32, top-4 of 32): two batched GEMMs over every expert
  for every row (gemm.Gemm on [E, N, K] weights), each expert's weights read once; Combine
  adds each row's top-k expert outputs only, so the unselected (computed, unused) outputs
  never reach the residual;
- routed (n * k < E, small decode batches): gemm.RoutedGemm computes only each row's top-k
  experts (n * k expert matrices read instead of E), and CombineRouted adds them up.

Both combines add a row's k weighted expert outputs in its top-k order (fp32, one product
added at a time), so a row's sum does not depend on the path, on n or on the other rows.
"""
from __future__ import annotations

import numpy as np

from ._common import cuda_function, f32, f64, i32

_CODE = r"""
// One thread per row: softmax over experts restricted to the top k (= softmax, top-k,
// renormalise), ties to the lower expert index. E <= 1024.
extern "C" __global__ void router(const float* __restrict__ logits, float* __restrict__ wd,
                                  int* __restrict__ topk, int n, int E, int k) {
  int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= n) return;
  const float* x = logits + (long)r * E;
  float* w = wd + (long)r * E;
  for (int e = 0; e < E; ++e) w[e] = 0.f;
  float prev = INFINITY; int prev_i = -1; float top = 0.f, sum = 0.f;
  for (int t = 0; t < k; ++t) {
    int bi = -1; float bv = -INFINITY;
    for (int e = 0; e < E; ++e) {
      float v = x[e];
      bool below = v < prev || (v == prev && e > prev_i);  // strictly after the last pick
      if (below && (bi < 0 || v > bv)) { bv = v; bi = e; }
    }
    if (t == 0) top = bv;
    float p = __expf(bv - top);
    w[bi] = p; sum += p; topk[(long)r * k + t] = bi;
    prev = bv; prev_i = bi;
  }
  for (int t = 0; t < k; ++t) w[topk[(long)r * k + t]] /= sum;
}

// out[r, :] += sum_t wd[r, e_t] * y[r / B, e_t, r % B, :], e_t = topk[r, t], t = 0..k-1 in order
// (y: [C, E, B, H], expert outputs in blocks of B rows; [E, n, H] is C = 1, B = n).
extern "C" __global__ void combine(const float* __restrict__ wd, const int* __restrict__ topk,
                                   const u16* __restrict__ y, float* __restrict__ out, int n,
                                   int E, int k, int H, int B) {
  int r = blockIdx.x;
  long y0 = (long)(r / B) * E * B + r % B;   // y row of (r, expert 0); expert e is + e * B
  for (int c = threadIdx.x; c < H; c += blockDim.x) {
    float acc = 0.f;
    for (int t = 0; t < k; ++t) {
      int e = topk[(long)r * k + t];
      acc += wd[(long)r * E + e] * LD(y[(y0 + (long)e * B) * H + c]);
    }
    out[(long)r * H + c] += acc;
  }
}

// out[r, :] += sum_t wd[r, topk[r, t]] * y[r * k + t, :]   (y: RoutedGemm's per-slot rows)
extern "C" __global__ void combine_routed(const float* __restrict__ wd, const int* __restrict__ topk,
                                          const u16* __restrict__ y, float* __restrict__ out,
                                          int n, int E, int k, int H) {
  int r = blockIdx.x;
  for (int c = threadIdx.x; c < H; c += blockDim.x) {
    float acc = 0.f;
    for (int t = 0; t < k; ++t)
      acc += wd[(long)r * E + topk[(long)r * k + t]] * LD(y[((long)r * k + t) * H + c]);
    out[(long)r * H + c] += acc;
  }
}
"""


def _order(x):
    """Row-wise expert order: value descending, then index ascending (the kernel's rule)."""
    idx = np.arange(x.shape[-1])
    return np.lexsort((np.broadcast_to(idx, x.shape), -x), axis=-1)


class Router:
    """logits [N, E] fp32 -> dense routing weights wd [N, E] (0 = unselected), topk [N, k]."""

    name = "moe_router"

    def run_numpy(self, logits, wd, topk, *, k):
        x = np.asarray(logits, np.float32)
        sel = _order(x)[:, :k]
        p = np.exp(np.take_along_axis(x, sel, -1) - x[np.arange(len(x)), sel[:, 0]][:, None])
        wd[...] = 0
        np.put_along_axis(wd, sel, (p / p.sum(-1, keepdims=True)).astype(np.float32), -1)
        topk[...] = sel

    def run_cupy(self, stream_handle, logits, wd, topk, *, k):
        fn = cuda_function(_CODE, "router", np.float16)
        n, E = logits.shape
        if n:
            fn((-(-n // 64),), (64,), (logits, wd, topk, i32(n), i32(E), i32(k)))


def _topk_sum(w, ys):
    """sum_t w[:, t] * ys[:, t] in t order, one rounded product and sum at a time (the CUDA
    kernels' order), so a row's bits depend on that row only: w [N, k], ys [N, k, H]."""
    acc = np.zeros((ys.shape[0], ys.shape[2]), np.float32)
    for t in range(ys.shape[1]):
        acc = acc + w[:, t, None] * ys[:, t]
    return acc


class Combine:
    """out [N, H] fp32 += sum_t wd[:, topk[:, t]] * (that expert's row of y); y storage,
    [E, N, H] or [C, E, B, H] (expert outputs in blocks of B rows, N <= C * B)."""

    name = "moe_combine"

    def run_numpy(self, wd, topk, y, out):
        topk = np.asarray(topk)
        yb = y if y.ndim == 4 else y[None]
        B, r = yb.shape[2], np.arange(topk.shape[0])[:, None]
        w = np.take_along_axis(np.asarray(wd, np.float32), topk, -1)        # [N, k]
        out += _topk_sum(w, f32(yb[r // B, topk, r % B]))

    def run_cupy(self, stream_handle, wd, topk, y, out):
        fn = cuda_function(_CODE, "combine", y.dtype)
        n, H = out.shape
        if n:
            fn((n,), (256,), (wd, topk, y, out, i32(n), i32(wd.shape[1]), i32(topk.shape[1]),
                              i32(H), i32(y.shape[-2])))


class CombineRouted:
    """out [N, H] fp32 += sum_t wd[r, topk[r, t]] * y[r * k + t] (y [N * k, H] storage)."""

    name = "moe_combine_routed"

    def run_numpy(self, wd, topk, y, out):
        n, k = topk.shape
        w = np.take_along_axis(np.asarray(wd, np.float32), np.asarray(topk), -1)   # [N, k]
        out += _topk_sum(w, f32(y).reshape(n, k, -1))

    def run_cupy(self, stream_handle, wd, topk, y, out):
        fn = cuda_function(_CODE, "combine_routed", y.dtype)
        n, H = out.shape
        if n:
            fn((n,), (256,), (wd, topk, y, out, i32(n), i32(wd.shape[1]), i32(topk.shape[1]), i32(H)))


def reference_router(logits, k):
    """float64: softmax, top-k, renormalise. Returns (dense weights [N, E], topk [N, k])."""
    x = np.asarray(logits, np.float64)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    sel = _order(x)[:, :k]
    wd = np.zeros_like(p)
    ps = np.take_along_axis(p, sel, -1)
    np.put_along_axis(wd, sel, ps / ps.sum(-1, keepdims=True), -1)
    return wd, sel


def reference_combine(wd, y, out):
    wd = np.asarray(wd, np.float64)
    return f64(out) + np.einsum("ne,enh->nh", wd, np.where((wd.T != 0)[:, :, None], f64(y), 0.0))


def reference_combine_routed(wd, topk, y, out):
    n, k = np.asarray(topk).shape
    w = np.take_along_axis(np.asarray(wd, np.float64), np.asarray(topk), -1)
    return f64(out) + np.einsum("nk,nkh->nh", w, f64(y).reshape(n, k, -1))
