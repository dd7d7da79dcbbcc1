"""Gated delta rule (GDN) linear attention, Qwen3-Next style, over segments of tokens.

Per head, with the fp32 state S [dk, dv] of the segment's sequence (states[state_idx[b]]):
  alpha = exp(-exp(A_log) * softplus(a + dt_bias)),  beta = sigmoid(b)
  q, k L2-normalised (q also scaled by dk^-1/2)
  S <- alpha S;  S <- S + k (beta (v - S^T k))^T     (= a S (I - b k k^T) + b v k^T, transposed)
  o = S^T q;  out = rmsnorm(o) * norm_w * silu(z)
A decode step is B segments of one token (cu = 0..B, fresh=False: every state goes on).
Prefill passes fresh=True and a segment per sequence: a segment whose first token is at
position 0 starts from a zero state, one that starts later (a chunk after earlier chunks)
goes on from its sequence's state, so one launch can mix first and continuing chunks.
Padded rows point at the scratch state.
The fused projection row is [q (H*dk) | k (H*dk) | v (H*dv) | z (H*dv) | a (H) | b (H)].
"""
from __future__ import annotations

import numpy as np

from ._common import cuda_function, f32, f64, f32s, i32, store

_CODE = r"""
#define NP 4                 // parts a state column is split into
#define RPT (DK / NP)        // state rows per thread
#define NT (NP * DV)         // threads per block
// grid (segments, heads), block NT threads: thread (p, j) = (tid / DV, tid % DV) owns rows
// [p*RPT, (p+1)*RPT) of column j of S in registers (RPT values: no spill at 128x128), so S
// is read once and written once per segment, coalesced (a warp covers 32 columns of a row).
// The two dot products over dk (S^T k and S^T q) are summed over the NP parts in shared
// memory; the gated output norm over dv is a block reduction.
extern "C" __global__ void __launch_bounds__(NT, 1024 / NT) gdn(
    const u16* __restrict__ proj, const float* __restrict__ A_log, const float* __restrict__ dt_bias,
    const u16* __restrict__ norm_w, float* __restrict__ states, const int* __restrict__ state_idx,
    const int* __restrict__ cu, const int* __restrict__ positions, u16* __restrict__ out,
    int heads, int fresh, float eps) {
  __shared__ float qs[DK], ks[DK], sh[32], ab[2], ru[NP][DV], ro[NP][DV];
  int b = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, j = tid % DV, p = tid / DV;
  int width = 2 * heads * (DK + DV) + 2 * heads;
  float* S = states + ((long)state_idx[b] * heads + h) * (DK * DV) + (long)p * RPT * DV + j;
  // A segment that starts the sequence (position 0) starts from zero, not the slot's old state.
  bool zero = fresh && cu[b] < cu[b + 1] && positions[cu[b]] == 0;
  float s[RPT];
#pragma unroll
  for (int r = 0; r < RPT; ++r) s[r] = zero ? 0.f : S[r * DV];
  float w = LD(norm_w[j]), Al = expf(A_log[h]), dtb = dt_bias[h];
  for (int t = cu[b]; t < cu[b + 1]; ++t) {
    const u16* row = proj + (long)t * width;
    float qq = 0.f, kk = 0.f;
    for (int i = tid; i < DK; i += NT) {
      float qv = LD(row[h * DK + i]), kv = LD(row[heads * DK + h * DK + i]);
      qs[i] = qv; ks[i] = kv; qq += qv * qv; kk += kv * kv;
    }
    if (tid == 0) {
      float x = LD(row[2 * heads * (DK + DV) + h]) + dtb;
      float sp = x > 20.f ? x : log1pf(expf(x));
      ab[0] = expf(-Al * sp);
      ab[1] = 1.f / (1.f + expf(-LD(row[2 * heads * (DK + DV) + heads + h])));
    }
    qq = block_sum(qq, sh);  // its barriers also publish qs, ks, ab
    kk = block_sum(kk, sh);
    float qn = rsqrtf(qq + 1e-6f) * rsqrtf((float)DK), kn = rsqrtf(kk + 1e-6f);
    float alpha = ab[0], beta = ab[1];
    float v = LD(row[2 * heads * DK + h * DV + j]);
    float z = LD(row[2 * heads * DK + heads * DV + h * DV + j]);
    float u = 0.f;
#pragma unroll
    for (int r = 0; r < RPT; ++r) { s[r] *= alpha; u += s[r] * ks[p * RPT + r]; }
    ru[p][j] = u;
    __syncthreads();
    u = 0.f;
#pragma unroll
    for (int i = 0; i < NP; ++i) u += ru[i][j];
    float delta = beta * (v - u * kn);
    float o = 0.f;
#pragma unroll
    for (int r = 0; r < RPT; ++r) { s[r] += ks[p * RPT + r] * kn * delta; o += s[r] * qs[p * RPT + r]; }
    ro[p][j] = o;
    __syncthreads();
    o = 0.f;
#pragma unroll
    for (int i = 0; i < NP; ++i) o += ro[i][j];
    o *= qn;
    float inv = rsqrtf(block_sum(p == 0 ? o * o : 0.f, sh) / DV + eps);
    if (p == 0) out[(long)t * heads * DV + h * DV + j] = ST(o * inv * w * (z / (1.f + expf(-z))));
    // The next token rewrites qs/ks/ab/ru/ro only after block_sum's barriers above, which
    // every thread passes after its last read of them.
  }
#pragma unroll
  for (int r = 0; r < RPT; ++r) S[r * DV] = s[r];
}
"""


def _split(p, heads, dk, dv):
    hk, hv = heads * dk, heads * dv
    q = p[:, :hk].reshape(-1, heads, dk)
    k = p[:, hk: 2 * hk].reshape(-1, heads, dk)
    v = p[:, 2 * hk: 2 * hk + hv].reshape(-1, heads, dv)
    z = p[:, 2 * hk + hv: 2 * hk + 2 * hv].reshape(-1, heads, dv)
    a = p[:, 2 * hk + 2 * hv: 2 * hk + 2 * hv + heads]
    b = p[:, 2 * hk + 2 * hv + heads:]
    return q, k, v, z, a, b


def _starts_fresh(cu, positions, fresh: bool) -> np.ndarray:
    """[segments] bool: which segments start from a zero state (the kernel's `zero`): with
    fresh, the non-empty ones whose first token is at position 0."""
    cu, positions = np.asarray(cu), np.asarray(positions)
    first = cu[:-1]
    nonempty = first < cu[1:]
    at0 = np.zeros(len(first), bool)
    at0[nonempty] = positions[first[nonempty]] == 0
    return at0 & bool(fresh)


def _vec_mat(u, S):
    """[s, h, dk] x [s, h, dk, dv] -> [s, h, dv], one [1, dk] x [dk, dv] product per (s, h):
    the same call for every segment, so a segment's bits do not depend on the others (an
    einsum may reorder its loops, and with them the sums, as the batch shape changes)."""
    return np.matmul(u[..., None, :], S, dtype=np.float32)[..., 0, :]


class GDN:
    """Recurrent update + gated output norm; writes out [T, heads*dv] and the final states."""

    name = "gdn"

    def run_numpy(self, proj, A_log, dt_bias, norm_w, states, state_idx, cu, positions, out, *,
                  heads, dk, dv, fresh, eps):
        q, k, v, z, a, b = (f32(x) for x in _split(proj, heads, dk, dv))
        lens = np.diff(cu)
        idx = np.asarray(state_idx)
        S = states[idx].copy()
        S[_starts_fresh(cu, positions, fresh)] = 0
        res = np.empty((proj.shape[0], heads, dv), np.float32)
        for t in range(int(lens.max(initial=0))):
            act = np.nonzero(lens > t)[0]
            r = cu[act] + t
            qh = q[r] / np.sqrt((q[r] ** 2).sum(-1, keepdims=True) + np.float32(1e-6)) / np.sqrt(np.float32(dk))
            kh = k[r] / np.sqrt((k[r] ** 2).sum(-1, keepdims=True) + np.float32(1e-6))
            x = a[r] + dt_bias
            sp = np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))
            alpha = np.exp(-np.exp(A_log) * sp)[..., None, None]
            beta = (1 / (1 + np.exp(-b[r])))[..., None]
            St = S[act] * alpha
            delta = beta * (v[r] - _vec_mat(kh, St))
            St += kh[..., :, None] * delta[..., None, :]
            S[act] = St
            o = _vec_mat(qh, St)
            inv = 1 / np.sqrt((o * o).mean(-1, keepdims=True) + np.float32(eps))
            res[r] = o * inv * f32(norm_w) * (z[r] / (1 + np.exp(-z[r])))
        states[idx] = S
        store(out, res.reshape(out.shape))

    def run_cupy(self, stream_handle, proj, A_log, dt_bias, norm_w, states, state_idx, cu,
                 positions, out, *, heads, dk, dv, fresh, eps):
        fn = cuda_function(_CODE, "gdn", proj.dtype, DK=dk, DV=dv)
        nseg = cu.shape[0] - 1
        if nseg:
            fn((nseg, heads), (4 * dv,), (proj, A_log, dt_bias, norm_w, states, state_idx, cu,
                                      positions, out, i32(heads), i32(int(fresh)), f32s(eps)))


def reference(proj, A_log, dt_bias, norm_w, states, state_idx, cu, positions, heads, dk, dv,
              fresh, eps):
    """float64, token by token and head by head, in the a S (I - b k k^T) + b v k^T form on
    M = S^T [dv, dk]. Returns (out [T, heads*dv], new states)."""
    q, k, v, z, a, b = (f64(x) for x in _split(np.asarray(proj), heads, dk, dv))
    states = np.array(states, np.float64)
    out = np.zeros((q.shape[0], heads, dv))
    for seg, sidx in enumerate(np.asarray(state_idx)):
        # Written out here, not through _starts_fresh: the reference checks the twin's rule too.
        zero = fresh and cu[seg] < cu[seg + 1] and positions[cu[seg]] == 0
        for h in range(heads):
            M = np.zeros((dv, dk)) if zero else states[sidx, h].T.copy()
            for t in range(cu[seg], cu[seg + 1]):
                qh = q[t, h] / np.sqrt(q[t, h] @ q[t, h] + 1e-6) / np.sqrt(dk)
                kh = k[t, h] / np.sqrt(k[t, h] @ k[t, h] + 1e-6)
                g = -np.exp(np.float64(A_log[h])) * np.logaddexp(0.0, a[t, h] + dt_bias[h])
                al, be = np.exp(g), 1 / (1 + np.exp(-b[t, h]))
                M = al * M @ (np.eye(dk) - be * np.outer(kh, kh)) + be * np.outer(v[t, h], kh)
                o = M @ qh
                out[t, h] = o / np.sqrt((o * o).mean() + eps) * f64(norm_w) * z[t, h] / (1 + np.exp(-z[t, h]))
            states[sidx, h] = M.T
    return out.reshape(q.shape[0], heads * dv), states
