"""CUDA side of the sampler, part 2: the kernels. One launch sequence per step, every kernel a
grid of S rows x B blocks (each block a contiguous chunk of its row's vocabulary):

  scan        max logit (greedy), NaN/+inf check, and the whole race of plain-temperature rows;
              its last block per row finishes greedy, plain and error rows
  select x8   top_k (by count), then top_p (by fixed-point mass within the top_k set): radix
              select over the ordered float bits in digits of 11, 11 and 10 bits, then one index
              pass only when the threshold falls inside a run of equal logits
  race        exponential race over the kept prefix (and min_p) of the remaining rows

Per-row work that a row does not need returns at once, so mixed batches share one graph.
"""
from .device_code import PRELUDE

_KERNELS = r"""
#define ROW_SETUP                                                        \
  const int row = blockIdx.x / B, b = blockIdx.x - row * B;             \
  const Work w = layout(wsp, S, B);                                      \
  const float* __restrict__ x = logits + (size_t)row * V;                \
  const int c0 = b * C, c1 = min(V, c0 + C);

__device__ void finish(int row, int tok, int* out, const int* rows, int* table) {
  out[row] = tok;
  table[rows[row]] = tok < 0 ? 0 : tok;  // an error row (-1) feeds a valid embedding row
}

extern "C" __global__ void __launch_bounds__(NT) sample_scan(
    const float* __restrict__ logits, const int* __restrict__ rows, const int* __restrict__ pos,
    const float* __restrict__ temp, const int* __restrict__ topk, const float* __restrict__ topp,
    const float* __restrict__ minp, const u64* __restrict__ seed, int* __restrict__ out,
    int* __restrict__ table, unsigned char* __restrict__ wsp, int S, int V, int B, int C) {
  ROW_SETUP
  const float t = temp[row];
  const bool greedy = !(t > 0.f);
  const float inv_t = greedy ? 1.f : __frcp_rn(t);
  const int k = topk[row];
  const bool k_on = !greedy && k > 0 && k < V, p_on = !greedy && topp[row] < 1.f, m_on = !greedy && minp[row] > 0.f;
  const bool plain = !greedy && !k_on && !p_on && !m_on;
  const u64 base = mix64(seed[row] * GAMMA + (u64)(u32)pos[row]);
  u64 best = 0; bool bad = false; Race r = {-INFINITY, 0x7fffffff};
  each(x, c0, c1, [&](float v, int i) {
    bad |= (v != v) || (v == INFINITY);
    const u64 s = skey(v, i); best = s > best ? s : best;
    if (plain) race_add(r, __fmul_rn(v, inv_t), i, base);
  });
  best = block_max_u64(best);
  bad = __syncthreads_or(bad);
  if (plain) r = block_race(r);
  if (threadIdx.x == 0) {
    atomicMax(&w.maxk[row], best);
    if (bad) atomicOr(&w.bad[row], 1u);
    w.pk[row * B + b] = r.k; w.pi[row * B + b] = r.i;
  }
  if (!last_block(&w.tick[row], B) || threadIdx.x != 0) return;
  const u64 m = __ldcg(&w.maxk[row]);
  const float xmax = unokey((u32)(m >> 32)), zmax = __fmul_rn(xmax, inv_t);
  RowState& s = w.st[row];
  s.mode = 0;
  int tok = (int)(0xffffffffu - (u32)m);
  if (__ldcg(&w.bad[row]) || xmax == -INFINITY || !isfinite(zmax)) {
    tok = -1;
  } else if (plain) {
    Race q = {-INFINITY, 0x7fffffff};
    for (int j = 0; j < B; ++j) race_merge(q, __ldcg(&w.pk[row * B + j]), __ldcg(&w.pi[row * B + j]));
    tok = q.i;
  } else if (!greedy) {
    s.mode = 1; s.zmax = zmax; s.inv_t = inv_t; s.top_p = topp[row];
    s.log_min_p = m_on ? log((double)minp[row]) : -INFINITY;
    for (int q = 0; q < 2; ++q) {
      SelState& e = s.sel[q];
      e.status = q == 0 ? k_on : p_on; e.prefix = 0; e.above_cnt = 0; e.above_mass = 0;
      e.target = q == 0 ? (u64)k : 0; e.need = 0; e.thr = 0;
    }
    return;
  }
  finish(row, tok, out, rows, table);
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

// The last block of the index pass: the need-th element (in token order) of the tied run of
// the threshold value, found in the chunk holding it.
__device__ void find_tied(const float* __restrict__ x, SelState* q, const Work& w, int row, int B, int C,
                          int V, u32 v, u64 dom) {
  __shared__ int sb, found, wc[NT / 32];
  __shared__ u32 rem;
  if (threadIdx.x == 0) {
    u64 cum = 0; sb = B - 1; rem = 1; found = -1;
    for (int j = 0; j < B; ++j) {
      const u32 c = __ldcg(&w.tcnt[row * B + j]);
      if (cum + c >= q->need) { sb = j; rem = (u32)(q->need - cum); break; }
      cum += c;
    }
  }
  __syncthreads();
  const int c0 = sb * C, c1 = min(V, c0 + C);
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  u32 run = 0;
  for (int base = c0; base < c1; base += NT) {
    const int i = base + threadIdx.x;
    const bool hit = i < c1 && okey(x[i]) == v && skey(x[i], i) >= dom;
    const u32 bal = __ballot_sync(0xffffffffu, hit);
    if (lane == 0) wc[wid] = __popc(bal);
    __syncthreads();
    u32 before = run, tot = 0;
    for (int j = 0; j < NT / 32; ++j) { before += j < wid ? wc[j] : 0; tot += wc[j]; }
    if (hit && before + __popc(bal & ((1u << lane) - 1)) + 1 == rem) found = i;
    run += tot;
    __syncthreads();
    if (found >= 0) break;
  }
  if (threadIdx.x == 0) { q->thr = ((u64)v << 32) | (u64)(0xffffffffu - (u32)found); q->status = 0; }
}

// One pass of select `which` (0 top_k, 1 top_p) at `level` (0..2 value digits, 3 index pass).
extern "C" __global__ void __launch_bounds__(NT) sample_select(
    const float* __restrict__ logits, unsigned char* __restrict__ wsp, int S, int V, int B, int C,
    int which, int level) {
  ROW_SETUP
  RowState* st = &w.st[row];
  if (st->mode == 0) return;
  SelState* q = &st->sel[which];
  if (q->status != (level < 3 ? 1 : 2)) return;
  const u64 dom = which == 1 ? st->sel[0].thr : 0;  // top_p works inside the top_k set
  const u32 prefix = (u32)q->prefix;
  const float inv_t = (float)st->inv_t;
  const double zmax = st->zmax;
  if (level == 3) {
    u32 n = 0;
    each(x, c0, c1, [&](float v, int i) { n += okey(v) == prefix && skey(v, i) >= dom; });
    n = block_sum_u32(n);
    if (threadIdx.x == 0) w.tcnt[row * B + b] = n;
    if (last_block(&w.tick[row], B)) find_tied(x, q, w, row, B, C, V, prefix, dom);
    return;
  }
  const int shift = level == 0 ? 21 : level == 1 ? 10 : 0, nb = level == 2 ? 1024 : 2048;
  const int hs = level == 1 ? 21 : 10;  // bits above the digit, already resolved
  __shared__ u32 hc[NB];
  __shared__ u64 hm[NB];
  for (int d = threadIdx.x; d < nb; d += NT) { hc[d] = 0; hm[d] = 0; }
  __syncthreads();
  each(x, c0, c1, [&](float v, int i) {
    const u32 o = okey(v);
    if (level > 0 && (o >> hs) != (prefix >> hs)) return;
    if (which == 1 && skey(v, i) < dom) return;
    const u32 d = (o >> shift) & (nb - 1);
    atomicAdd(&hc[d], 1u);
    if (which == 1) { const u64 wt = weight(__fmul_rn(v, inv_t), zmax); if (wt) atomicAdd(&hm[d], wt); }
  });
  __syncthreads();
  u32* gc = w.hcnt + (size_t)row * NB;
  u64* gm = w.hmass + (size_t)row * NB;
  for (int d = threadIdx.x; d < nb; d += NT) {
    if (hc[d]) atomicAdd(&gc[d], hc[d]);
    if (hm[d]) atomicAdd(&gm[d], hm[d]);
  }
  if (!last_block(&w.tick[row], B)) return;
  const u64 above_c0 = q->above_cnt, above_m0 = q->above_mass;
  u64 target = q->target;
  for (int d = threadIdx.x; d < nb; d += NT) {  // the row's histogram; zeroed for the next pass
    hc[d] = __ldcg(&gc[d]); hm[d] = __ldcg(&gm[d]); gc[d] = 0; gm[d] = 0;
  }
  __syncthreads();
  const int per = nb / NT, hi = nb - 1 - threadIdx.x * per;  // this thread's buckets, descending
  u64 sc = 0, sm = 0;
  for (int j = 0; j < per; ++j) { sc += hc[hi - j]; sm += hm[hi - j]; }
  u64 ec = sc, em = sm, tc, tm;
  block_exscan2(ec, em, tc, tm);
  if (which == 1 && level == 0) {  // the mass of the top_k set is known now: top_p's target
    const double want = ceil(st->top_p * (double)tm);
    target = want >= (double)tm ? tm : want < 1.0 ? 1ull : (u64)want;
  }
  u64 ac = above_c0 + ec, am = above_m0 + em;
  u64 before = which == 0 ? ac : am;
  const u64 mine = which == 0 ? sc : sm;
  if (!(before < target && target <= before + mine)) return;
  int d = hi;
  for (int j = 0; j < per; ++j, --d) {
    const u64 u = which == 0 ? hc[d] : hm[d];
    if (before + u >= target) break;
    before += u; ac += hc[d]; am += hm[d];
  }
  const u32 np = prefix | ((u32)d << shift);
  q->prefix = np; q->above_cnt = ac; q->above_mass = am; q->target = target;
  if (level < 2) return;
  const u64 tie_c = hc[d], need = target - before;
  const u64 keep = which == 0 ? need : (need + hm[d] / tie_c - 1) / (hm[d] / tie_c);
  if (keep >= tie_c) { q->thr = (u64)np << 32; q->status = 0; }
  else { q->need = keep; q->status = 2; }
}

extern "C" __global__ void __launch_bounds__(NT) sample_race(
    const float* __restrict__ logits, const int* __restrict__ rows, const int* __restrict__ pos,
    const u64* __restrict__ seed, int* __restrict__ out, int* __restrict__ table,
    unsigned char* __restrict__ wsp, int S, int V, int B, int C) {
  ROW_SETUP
  const RowState* st = &w.st[row];
  if (st->mode == 0) return;
  const u64 tk = st->sel[0].thr, tp = st->sel[1].thr, t = tk > tp ? tk : tp;
  const float inv_t = (float)st->inv_t;
  const double zmax = st->zmax, lmp = st->log_min_p;
  const u64 base = mix64(seed[row] * GAMMA + (u64)(u32)pos[row]);
  Race r = {-INFINITY, 0x7fffffff};
  each(x, c0, c1, [&](float v, int i) {
    const float z = __fmul_rn(v, inv_t);
    if (skey(v, i) >= t && (double)z - zmax >= lmp) race_add(r, z, i, base);
  });
  r = block_race(r);
  if (threadIdx.x == 0) { w.pk[row * B + b] = r.k; w.pi[row * B + b] = r.i; }
  if (!last_block(&w.tick[row], B) || threadIdx.x != 0) return;
  Race q = {-INFINITY, 0x7fffffff};
  for (int j = 0; j < B; ++j) race_merge(q, __ldcg(&w.pk[row * B + j]), __ldcg(&w.pi[row * B + j]));
  finish(row, q.i, out, rows, table);
}
"""

CODE = PRELUDE + _KERNELS
KERNELS = ("sample_scan", "sample_select", "sample_race")
