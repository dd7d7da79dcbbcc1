"""CUDA side of the sampler, part 1: the keys, the row's random key and the keyed draws, the
exponential race, the block reductions and scans, and the workspace layout that every sampler
kernel shares (kernels.py holds the kernels).

Order: elements are ranked by the 64-bit key skey = (ordered float bits of the logit) << 32 |
(0xffffffff - token id): larger logit first, lower token id first among equal logits (-0.0 is
read as +0.0). A kept set is always a prefix of that order, so "kept" is skey >= a threshold.
"""

# A row's 64-bit random key, in plain C++ behind ROW_KEY_FN so that a host compiler builds the
# very text the kernel runs (a test compiles it with g++ and compares it with reference.row_key).
ROW_KEY = r"""
// Philox4x32-10 (Salmon et al., SC'11) with the seed as its key and the position as its counter:
// a keyed bijection of the counter, so no two seeds' streams are shifts of each other (as they
// are when the key hashes seed * c + position: seed s + c^-1 mod 2^64 then draws seed s's
// tokens one position later). Once per thread: 20 32-bit multiplies, in a loop (unrolled, the
// scalar build of the kernel spilled more).
ROW_KEY_FN u64 row_key(u64 seed, u32 position) {
  u32 c0 = position, c1 = 0u, c2 = 0u, c3 = 0u, k0 = (u32)seed, k1 = (u32)(seed >> 32);
#pragma unroll 1
  for (int r = 0; r < 10; ++r) {
    const u64 p0 = (u64)0xD2511F53u * c0, p2 = (u64)0xCD9E8D57u * c2;
    c0 = (u32)(p2 >> 32) ^ c1 ^ k0; c1 = (u32)p2;
    c2 = (u32)(p0 >> 32) ^ c3 ^ k1; c3 = (u32)p0;
    k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
  }
  return ((u64)c1 << 32) | c0;
}
"""

PRELUDE = r"""
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
typedef unsigned long long u64;
typedef unsigned int u32;
#define NT 256
#define NB 2048
#define ROW_KEY_FN __device__ __forceinline__
""" + ROW_KEY + r"""
__device__ __forceinline__ u32 okey(float x) {
  u32 b = __float_as_uint(x == 0.f ? 0.f : x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float unokey(u32 k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
__device__ __forceinline__ u64 skey(float x, int i) {
  return ((u64)okey(x) << 32) | (u64)(0xffffffffu - (u32)i);
}
// Probability weight of a scaled logit in fixed point (40 fraction bits): integer sums are
// exact and independent of the order of the atomics. Weights below 2^-40 of the largest are 0.
__device__ __forceinline__ u64 weight(float z, double zmax) {
  double d = (double)z - zmax;
  return d < -28.0 ? 0ull : (u64)(exp(d) * 0x1p40);
}

// Exponential race (Gumbel-max): the kept token with the largest z + g wins, g = -log(-log(u)),
// u = (w + 1/2) 2^-52 with 52 bits w keyed on the row key (hash of seed, position) and the
// token id: the top 32 bits h1 = H(H(i ^ k1) + k2), the low 20 from H(h1 ^ k1 ^ c). Exact keys
// are doubles; two cheap bounds skip the tokens that provably cannot beat the best so far (the
// first needs only h1 and float adds; most tokens stop there), then a float estimate of the
// key; the exact key is computed only for a close call and for each lane's final best.
__device__ __forceinline__ u32 lowbias32(u32 x) {
  x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
  return x;
}
// A lane's race. k: the best token's key, exact unless `est`, then an estimate within 1e-5 of
// it (race_est); z and i: that token; lo <= its exact key, or <= another lane's (share_lo).
// Zero-initialized fields beyond {k, i, lo} give est = false: -inf with no token is exact.
struct Race { double k; int i; float lo; float z; bool est; };
__device__ __forceinline__ u32 race_h1(int i, u64 key) {
  return lowbias32(lowbias32((u32)i ^ (u32)key) + (u32)(key >> 32));
}
__device__ __forceinline__ u64 race_w(u32 h1, u32 k1) {
  return ((u64)h1 << 20) | (lowbias32(h1 ^ k1 ^ 0x85ebca6bu) >> 12);
}
// z + g with a float g within 1e-5 of the exact one (log1pf keeps 1-u's precision when u is
// near 1). Out of line, as race_exact: the unrolled hot loops stay small.
__device__ __noinline__ double race_est(float z, u32 h1, u32 k1) {
  const u64 w = race_w(h1, k1), m = (1ull << 52) - w;
  const float e = h1 < 0x80000000u ? -logf((float)(((double)w + 0.5) * 0x1p-52)) : -log1pf(-(float)(((double)m - 0.5) * 0x1p-52));
  return (double)z + (double)(-logf(e));
}
__device__ __noinline__ double race_exact(float z, u32 h1, u32 k1) {
  return (double)z - log(-log(((double)race_w(h1, k1) + 0.5) * 0x1p-52));
}
// An upper bound of g = -log(-log(u)) from h1 alone (close to g unless u is tiny): u < uh =
// ((h1 >> 8) + 1) 2^-24 (exact in float). -log(u) > L = max(1 - uh, fast -log(uh) less its error),
// then g < -log(L) plus the fast log's error. __logf errs by at most 2^-21.41 absolute on [0.5, 2]
// and 3 ulp elsewhere; the margins below (1e-5 relative and absolute) cover both. uh = 1 gives
// L = 0 and an infinite bound: that token always takes the exact key.
__device__ __forceinline__ float race_bound(u32 h1) {
  const float uh = (float)((h1 >> 8) + 1u) * 0x1p-24f;
  const float r = -__logf(uh);
  const float L = fmaxf(1.f - uh, r - 1e-5f * r - 1e-5f);
  const float g = -__logf(L);
  return g + 1e-5f * fabsf(g) + 1e-5f;
}
__device__ __forceinline__ void race_add(Race& r, float z, int i, u64 key) {
  const u32 k1 = (u32)key;
  const u32 h1 = race_h1(i, key);
  // g <= -log(log 2) when u < 1/2; else g <= -log(1 - u), and 1 - u >= 2^-4 / 2^-12 by h1's top bits
  const float ub = h1 < 0x80000000u ? 0.36652f : h1 < 0xf0000000u ? 2.7736f : h1 < 0xfff00000u ? 8.3188f : 37.0f;
  if (__fadd_ru(z, ub) < r.lo) return;
  // A finer bound for the few that pass, before the out-of-line estimate: the crude one lets
  // about 1 token in 100 through, which is a call in nearly every warp's iteration.
  if (__fadd_ru(z, race_bound(h1)) < r.lo) return;
  const double ke = race_est(z, h1, k1);
  if (ke + 1e-4 < fmax(r.k, (double)r.lo)) return;   // below the best: errors 1e-5 each way
  if (ke > r.k + 1e-4) {   // above it: the exact key can wait (race_done), most such tokens lose later
    r.k = ke; r.i = i; r.z = z; r.est = true; r.lo = fmaxf(r.lo, __double2float_rd(ke - 1e-4));
    return;
  }
  if (r.est) { r.k = race_exact(r.z, race_h1(r.i, key), k1); r.est = false; }   // a close call
  const double k = race_exact(z, h1, k1);
  if (k > r.k || (k == r.k && i < r.i)) { r.k = k; r.i = i; r.z = z; r.lo = fmaxf(r.lo, __double2float_rd(k)); }
}
// The lane's race with its best key exact, for merging with other lanes' and blocks'.
__device__ __forceinline__ Race race_done(Race r, u64 key) {
  if (r.est) { r.k = race_exact(r.z, race_h1(r.i, key), (u32)key); r.est = false; }
  return r;
}
// Every lane's lo becomes its warp's largest: still at most a key some lane holds, so a token
// below it cannot win the row. A lane sees a few dozen tokens of a row; the warp's best of
// 32 times as many prunes most of the tokens that its own best lets through to the bounds.
__device__ __forceinline__ void share_lo(Race& r) {
  r.lo = unokey(__reduce_max_sync(__activemask(), okey(r.lo)));
}
__device__ __forceinline__ void race_merge(Race& r, double k, int i) {
  if (k > r.k || (k == r.k && i < r.i)) { r.k = k; r.i = i; r.lo = __double2float_rd(k); }
}
// Merge B partial races of a row (the last block, all threads).
__device__ Race merge_partials(const double* pk, const int* pi, int B);
__device__ Race block_race(Race r) {
  __shared__ double sk[NT / 32]; __shared__ int si[NT / 32];
  for (int o = 16; o > 0; o >>= 1)
    race_merge(r, __shfl_xor_sync(0xffffffffu, r.k, o), __shfl_xor_sync(0xffffffffu, r.i, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) { sk[threadIdx.x >> 5] = r.k; si[threadIdx.x >> 5] = r.i; }
  __syncthreads();
  for (int j = 0; j < NT / 32; ++j) race_merge(r, sk[j], si[j]);
  return r;
}
__device__ u64 block_max_u64(u64 v) {
  __shared__ u64 sm[NT / 32];
  for (int o = 16; o > 0; o >>= 1) { u64 t = __shfl_xor_sync(0xffffffffu, v, o); v = t > v ? t : v; }
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sm[threadIdx.x >> 5] = v;
  __syncthreads();
  for (int j = 0; j < NT / 32; ++j) v = sm[j] > v ? sm[j] : v;
  return v;
}
__device__ u32 block_sum_u32(u32 v) {
  __shared__ u32 sm[NT / 32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sm[threadIdx.x >> 5] = v;
  __syncthreads();
  v = 0;
  for (int j = 0; j < NT / 32; ++j) v += sm[j];
  return v;
}

// Exclusive prefix sums of two u64 per thread over the block, in thread order; totals too.
__device__ void block_exscan2(u64& a, u64& c, u64& ta, u64& tc) {
  __shared__ u64 sa[NT], sc[NT];
  sa[threadIdx.x] = a; sc[threadIdx.x] = c;
  __syncthreads();
  for (int o = 1; o < NT; o <<= 1) {
    u64 va = threadIdx.x >= o ? sa[threadIdx.x - o] : 0, vc = threadIdx.x >= o ? sc[threadIdx.x - o] : 0;
    __syncthreads();
    sa[threadIdx.x] += va; sc[threadIdx.x] += vc;
    __syncthreads();
  }
  ta = sa[NT - 1]; tc = sc[NT - 1];
  a = sa[threadIdx.x] - a; c = sc[threadIdx.x] - c;
  __syncthreads();
}

// Counters (cnt): ctr, tick, ncand, maxk, bad. All zero at launch, and the row's last block
// sets its row's back to zero (reset_row), so a buffer that only this kernel uses stays zero
// from one call to the next and needs no zeroing node (the Sampler keeps one per instance).
// Workspace (wsp): written before read: thr, tcnt, pk, pi, cand; the three histogram buffers of
// a row are zeroed inside the kernel, each one pass before it is used (see zero_hist).
struct Work { u32* ctr; u32* tick; u32* ncand; u64* maxk; u32* bad; u64* thr; u32* tcnt; double* pk; int* pi;
              u32* hcnt; u64* hmass; u64* cand; };
__device__ __forceinline__ size_t al8(size_t n) { return (n + 7) & ~(size_t)7; }
__device__ Work layout(unsigned char* c, unsigned char* p, int S, int B) {
  Work w; size_t o = 0;
  w.ctr = (u32*)(c + o); o += al8(4ull * S);
  w.tick = (u32*)(c + o); o += al8(4ull * S);
  w.ncand = (u32*)(c + o); o += al8(4ull * S);
  w.maxk = (u64*)(c + o); o += 8ull * S;
  w.bad = (u32*)(c + o);
  o = 0;
  w.thr = (u64*)(p + o); o += 8ull * S;
  w.tcnt = (u32*)(p + o); o += al8(4ull * S * B);
  w.pk = (double*)(p + o); o += 8ull * S * B;
  w.pi = (int*)(p + o); o += al8(4ull * S * B);
  w.hcnt = (u32*)(p + o); o += 4ull * S * 3 * NB;
  w.hmass = (u64*)(p + o); o += 8ull * S * 3 * NB;
  w.cand = (u64*)(p + o);
  return w;
}
// Called once per row by its last block, after every counter read: the row's counters are zero
// again for the next call.
__device__ void reset_row(const Work& w, int row) {
  w.ctr[row] = 0; w.tick[row] = 0; w.ncand[row] = 0; w.maxk[row] = 0; w.bad[row] = 0;
}
// The last block of a row to finish (threadfence reduction): it alone merges the row's partials.
__device__ bool last_block(u32* tick, int B) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(tick, 1u) == (u32)(B - 1);
  __syncthreads();
  if (last) __threadfence();
  return last;
}
// Barrier of the B blocks of one row (generation gen: every block has arrived gen times). The
// grid is sized so that a row's blocks are resident together whenever B > 1.
__device__ void row_sync(u32* ctr, u32 target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(ctr, 1u);
    while (*(volatile u32*)ctr < target) __nanosleep(64);
    __threadfence();
  }
  __syncthreads();
}
// Each element of the block's chunk [c0, c1) of row x: f(value, token id), then after() once
// per vector of 4 (per element without VEC4). U: the loop's unroll (measured per loop).
template <int U = 4, class F, class G>
__device__ __forceinline__ void each_then(const float* __restrict__ x, int c0, int c1, F f, G after) {
#if VEC4
  const float4* x4 = reinterpret_cast<const float4*>(x);
#pragma unroll (U)
  for (int j = (c0 >> 2) + threadIdx.x; j < (c1 >> 2); j += NT) {
    const float4 v = x4[j]; const int i = j << 2;
    f(v.x, i); f(v.y, i + 1); f(v.z, i + 2); f(v.w, i + 3);
    after();
  }
#else
  for (int i = c0 + threadIdx.x; i < c1; i += NT) { f(x[i], i); after(); }
#endif
}
template <class F> __device__ __forceinline__ void each(const float* __restrict__ x, int c0, int c1, F f) {
  each_then(x, c0, c1, f, [] {});
}
"""


def counter_bytes(S: int) -> int:
    """Bytes of the counters for S rows (ctr, tick, ncand, maxk, bad: layout() above); they
    must be zero at launch, and the kernel leaves them zero."""
    return 3 * _al8(4 * S) + 8 * S + _al8(4 * S)


def workspace_bytes(S: int, B: int) -> int:
    """Bytes of the sampler's workspace for S rows split in B blocks each (layout() above)."""
    return (8 * S + _al8(4 * S * B) + 8 * S * B + _al8(4 * S * B)
            + 3 * (4 + 8) * 2048 * S + 8 * 2048 * S)


def _al8(n: int) -> int:
    return (n + 7) // 8 * 8
