"""vt's own decode GEMM for few rows: out[M, N] (+)= x[M, K] @ w[N, K]^T with M <= 32, fp16 /
bf16 inputs on tensor cores (mma.sync m16n8k16, fp32 accumulation), weights streamed once.

Selected by VT_GEMM=vt (default: cuBLAS, see gemm.py) so the two can be A/B-ed on the GPU;
the numpy semantics are Gemm.run_numpy's. Layout: mma's M axis is the weight rows (16 per
A tile, RT tiles per warp), its N axis the token rows (8 per tile, MT tiles). The sum over K
does not care which k each lane holds, as long as A and B agree, so a lane loads 16
contiguous bytes of a weight row (coalesced 64-byte row segments per warp) and of an x row,
and the two mma k-steps of a 32-wide chunk take its words (0, 1) and (2, 3).
A block's NWK warps split its K range; blocks along grid.y split K further (split-K) for
shapes with few weight rows. Split-K partials go to a per-stream fp32 workspace; the last
block of a row tile (a counter it resets) sums them in ks order: deterministic, so a replay
is bit-identical to eager.
"""
from __future__ import annotations

import numpy as np

from ._common import cuda_function, i32, sm_count

MAX_M = 32
PART_FLOATS = 4 << 20        # split-K workspace per stream (16 MB)
COUNTERS = 1 << 14

_CODE = r"""
#define NWK 4
#define UK (RT == 4 ? 1 : 2)  // chunks unrolled: loads of 2 chunks in flight unless RT = 4 (registers)
#if VT_BF16
#define MMA_T "bf16"
#else
#define MMA_T "f16"
#endif
#if OUT_F32
typedef float out_t;
#define OUT_LD(x) (x)
#define OUT_ST(x) (x)
#else
typedef u16 out_t;
#define OUT_LD(x) LD(x)
#define OUT_ST(x) ST(x)
#endif
#define WORD(v, i) ((i) == 0 ? (v).x : (i) == 1 ? (v).y : (i) == 2 ? (v).z : (v).w)

__device__ __forceinline__ void mma16816(float* c, unsigned a0, unsigned a1, unsigned a2,
                                         unsigned a3, unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32." MMA_T "." MMA_T ".f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void store_out(out_t* out, long idx, float v, int accumulate) {
  out[idx] = OUT_ST(accumulate ? v + OUT_LD(out[idx]) : v);
}

// grid (ceil(N / (16 RT)), KS), block NWK warps. Needs K % (32 NWK KS) == 0, 16-byte
// aligned rows of x and w. Rows past N / M are clamped on load and dropped on store.
extern "C" __global__ void __launch_bounds__(NWK * 32) skinny_gemm(
    const u16* __restrict__ x, const u16* __restrict__ w, out_t* __restrict__ out,
    float* __restrict__ part, int* __restrict__ counters, int M, int N, int K, int ldx,
    int ldo, int accumulate) {
  __shared__ float red[NWK][RT * MT * 4][32];
  __shared__ int last;
  int lane = threadIdx.x & 31, wp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  int r0 = blockIdx.x * 16 * RT, KS = gridDim.y;
  int kw = K / KS / NWK, k0 = blockIdx.y * (K / KS) + wp * kw + 8 * t;
  long wo[RT][2], xo[MT];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) wo[rt][hh] = (long)min(r0 + rt * 16 + hh * 8 + g, N - 1) * K + k0;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) xo[mt] = (long)min(mt * 8 + g, M - 1) * ldx + k0;
  float acc[RT][MT][4];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[rt][mt][e] = 0.f;
#pragma unroll UK
  for (int k = 0; k < kw; k += 32) {
    uint4 a[RT][2], b[MT];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) a[rt][hh] = *reinterpret_cast<const uint4*>(w + wo[rt][hh] + k);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) b[mt] = *reinterpret_cast<const uint4*>(x + xo[mt] + k);
#pragma unroll
    for (int s = 0; s < 2; ++s)
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          mma16816(acc[rt][mt], WORD(a[rt][0], 2 * s), WORD(a[rt][1], 2 * s),
                   WORD(a[rt][0], 2 * s + 1), WORD(a[rt][1], 2 * s + 1),
                   WORD(b[mt], 2 * s), WORD(b[mt], 2 * s + 1));
  }
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) red[wp][(rt * MT + mt) * 4 + e][lane] = acc[rt][mt][e];
  __syncthreads();
  // Element (q, ln) of a warp's fragments: C row (weight row) g(ln) + 8 (e >= 2), C column
  // (token row) 2 t(ln) + (e & 1), in tile (rt, mt) = q / 4.
  for (int i = threadIdx.x; i < RT * MT * 4 * 32; i += NWK * 32) {
    int q = i >> 5, ln = i & 31, rt = q / (MT * 4), mt = (q >> 2) % MT, e = q & 3;
    int row = r0 + rt * 16 + (ln >> 2) + (e >> 1) * 8, tok = mt * 8 + (ln & 3) * 2 + (e & 1);
    if (row >= N || tok >= M) continue;
    float v = 0.f;
#pragma unroll
    for (int k = 0; k < NWK; ++k) v += red[k][q][ln];
    if (KS == 1) store_out(out, (long)tok * ldo + row, v, accumulate);
    else part[((long)blockIdx.y * M + tok) * N + row] = v;
  }
  if (KS == 1) return;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&counters[blockIdx.x], 1) == KS - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  const volatile float* vp = part;  // other blocks' partials: read through L2, not L1
  for (int i = threadIdx.x; i < 16 * RT * M; i += NWK * 32) {
    int row = r0 + i % (16 * RT), tok = i / (16 * RT);
    if (row >= N) continue;
    float v = 0.f;
    for (int ks = 0; ks < KS; ++ks) v += vp[((long)ks * M + tok) * N + row];
    store_out(out, (long)tok * ldo + row, v, accumulate);
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0;  // ready for the next launch
}
"""


def tiles(M: int) -> tuple[int, int]:
    """(RT, MT): weight-row tiles of 16 per warp and token tiles of 8. More weight rows per
    block for more tokens keep the x re-reads from L2 at <= half the weight bytes."""
    MT = -(-M // 8)
    return {1: 1, 2: 2}.get(MT, 4), MT


def split_k(N: int, K: int, RT: int) -> int:
    """Blocks along K: about 4 blocks per SM in all, a divisor of K / (32 NWK)."""
    bx = -(-N // (16 * RT))
    chunks = K // 128
    want = 4 * sm_count() / bx
    divs = [d for d in range(1, min(chunks, 16) + 1) if chunks % d == 0]
    return min(divs, key=lambda d: abs(np.log(d / want)))


def supports(x, w, out) -> bool:
    M, K = x.shape
    return (w.ndim == 2 and x.ndim == 2 and out.ndim == 2 and 0 < M <= MAX_M and K % 128 == 0
            and x.dtype == w.dtype and x.dtype.itemsize == 2 and out.dtype in (np.float32, w.dtype)
            and x.strides[1] == 2 and w.strides == (2 * K, 2) and out.strides[1] == out.itemsize
            and x.strides[0] % 16 == 0 and x.data.ptr % 16 == 0 and w.data.ptr % 16 == 0)


def launch(x, w, out, part, counters, accumulate: bool) -> None:
    """out (+)= x @ w^T on the current CuPy stream; part/counters: this stream's workspace."""
    M, K = x.shape
    N = w.shape[0]
    RT, MT = tiles(M)
    KS = split_k(N, K, RT)
    bx = -(-N // (16 * RT))
    if KS > 1 and (KS * M * N > part.size or bx > counters.size):
        KS = 1
    fn = cuda_function(_CODE, "skinny_gemm", w.dtype, RT=RT, MT=MT,
                       OUT_F32=int(out.dtype == np.float32))
    fn((bx, KS), (128,), (x, w, out, part, counters, i32(M), i32(N), i32(K),
                          i32(x.strides[0] // 2), i32(out.strides[0] // out.itemsize),
                          i32(int(accumulate))))
