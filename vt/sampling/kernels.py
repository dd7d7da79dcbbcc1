"""CUDA side of the sampler, part 2: one kernel, a grid of S rows x B blocks (each block a
contiguous chunk of its row's vocabulary), in phases separated by per-row barriers:

  scan    max logit (greedy), the NaN/+inf check, and the whole race of plain-temperature rows
          (greedy, plain and error rows end here: the row's last block writes the token)
  select  top_k by count, then top_p by fixed-point mass inside the top_k set: radix select
          over the ordered float bits in digits of 11, 11 and 10 bits (every block reads the
          row's merged histogram and takes the same decision), then one index pass only when the
          threshold falls inside a run of equal logits
  race    exponential race over the kept prefix (and min_p)

A top_k row whose first digit leaves at most NB candidates (the usual case: k in the tens or
hundreds) skips the last two digits and the race sweep: one sweep gathers the candidates, and
the row's first block sorts them in shared memory and does top_k, top_p, min_p and the race on
them alone (compact_finish). Its kept set is the same prefix of the same order, so its token is
the same.

A phase a row does not need costs it nothing, so any mix of modes shares one graph node.
"""
from .compact import COMPACT
from .device_code import PRELUDE

_KERNELS = r"""
// The scan counts a top_k row's first digits only from SPAN below the running max (8 digits: two
// octaves of the float's magnitude): elements far below it rarely reach the top k, and counting
// every element (a warp match and a shared atomic each) dominated a top_k row's first sweep.
#define SPAN 8u
__device__ Race merge_partials(const double* pk, const int* pi, int B) {
  Race q = {-INFINITY, 0x7fffffff, -INFINITY};
  for (int j = threadIdx.x; j < B; j += NT) race_merge(q, __ldcg(&pk[j]), __ldcg(&pi[j]));
  return block_race(q);
}

__device__ void finish(int row, int tok, int* out, const int* rows, int* table) {
  out[row] = tok;
  table[rows[row]] = tok < 0 ? 0 : tok;  // an error row (-1) feeds a valid embedding row
}

// Zero this block's slice of histogram buffer `buf` of its row.
__device__ void zero_hist(const Work& w, int row, int buf, int b, int B) {
  const size_t o = ((size_t)row * 3 + buf) * NB;
  for (int d = b * NT + threadIdx.x; d < NB; d += B * NT) { w.hcnt[o + d] = 0; w.hmass[o + d] = 0; }
}

// A plain-temperature row's race over its chunk, the row's largest logit first (that key and
// share_lo prune the rest). Out of line (inline, the kernel spilled); not unrolled (faster).
__device__ __noinline__ Race plain_race(const float* __restrict__ x, int c0, int c1, float inv_t, u64 best, u64 base) {
  Race r = {-INFINITY, 0x7fffffff, -INFINITY};
  race_add(r, __fmul_rn(unokey((u32)(best >> 32)), inv_t), (int)(0xffffffffu - (u32)best), base);
  each_then<1>(x, c0, c1, [&](float v, int i) { race_add(r, __fmul_rn(v, inv_t), i, base); },
            [&] { share_lo(r); });
  return block_race(race_done(r, base));
}

// The race over the kept prefix (skey >= th, and min_p) of the block's chunk, the row's largest
// logit (zm, token imax: always kept) first. Out of line for the same reason as plain_race.
__device__ __noinline__ Race kept_race(const float* __restrict__ x, int c0, int c1, float inv_t,
                                       double zmax, u64 th, double lmp, float zm, int imax, u64 base) {
  Race r = {-INFINITY, 0x7fffffff, -INFINITY};
  race_add(r, zm, imax, base);
  each_then(x, c0, c1, [&](float v, int i) {
    const float z = __fmul_rn(v, inv_t);
    if (skey(v, i) >= th && (double)z - zmax >= lmp) race_add(r, z, i, base);
  }, [&] { share_lo(r); });
  return block_race(race_done(r, base));
}

struct Row {  // what every block of a row knows alike
  const float* x; int row, b, B, C, V, c0, c1;
  float inv_t; double zmax;
  u32 gen; int pass;
  u32 ncand, d0;  // ncand > 0: the row goes compact, its candidates' first digit >= d0
};

// count_digit: one element into a shared count histogram, one atomic per distinct digit of the warp
__device__ __forceinline__ void count_digit(u32* hc, u32 d) {
  const u32 peers = __match_any_sync(__activemask(), d);
  if ((threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hc[d], (u32)__popc(peers));
}

// Threshold of select `which` (0: the first `target` elements; 1: the shortest prefix of the
// domain skey >= dom whose mass reaches top_p): kept iff skey >= the returned value. `counted`:
// the scan already built level 0's counts in hc (top_k only), exact for the digits >= exact_from
// (the scan skips digits far below the row's max); when those hold fewer than `target`
// elements, level 0 is counted again over every element.
__device__ u64 select_thr(Row& R, const Work& w, u32* hc, u64* hm, int which, u64 target, u64 dom,
                          double top_p, bool counted, u32 exact_from = 0) {
  __shared__ u64 s_ac, s_am, s_keep; __shared__ u32 s_prefix, s_tie; __shared__ int s_hit;
  u32 prefix = 0; u64 ac = 0, am = 0;
  for (int level = 0; level < 3; ++level) {
    const int shift = level == 0 ? 21 : level == 1 ? 10 : 0, nb = level == 2 ? 1024 : 2048;
    const int hs = level == 1 ? 21 : 10;  // bits above the digit, already resolved
    const int buf = R.pass % 3;
    zero_hist(w, R.row, (R.pass + 1) % 3, R.b, R.B);  // the next pass's buffer (read 2 passes ago)
    if (!(counted && level == 0)) {
      for (int d = threadIdx.x; d < nb; d += NT) { hc[d] = 0; hm[d] = 0; }
      __syncthreads();
      each(R.x, R.c0, R.c1, [&](float v, int i) {
        const u32 o = okey(v);
        if (level > 0 && (o >> hs) != (prefix >> hs)) return;
        if (which == 1 && skey(v, i) < dom) return;
        const u32 d = (o >> shift) & (nb - 1);
        if (which == 0) {
          count_digit(hc, d);
        } else {
          atomicAdd(&hc[d], 1u);
          const u64 wt = weight(__fmul_rn(v, R.inv_t), R.zmax);
          if (wt) atomicAdd(&hm[d], wt);
        }
      });
    }
    __syncthreads();
    u32* gc = w.hcnt + ((size_t)R.row * 3 + buf) * NB;
    u64* gm = w.hmass + ((size_t)R.row * 3 + buf) * NB;
    for (int d = threadIdx.x; d < nb; d += NT) {
      if (hc[d]) atomicAdd(&gc[d], hc[d]);
      if (hm[d]) atomicAdd(&gm[d], hm[d]);
    }
    row_sync(&w.ctr[R.row], ++R.gen * R.B);
    ++R.pass;
    const bool partial = counted && level == 0;
    for (int d = threadIdx.x; d < nb; d += NT) {
      hc[d] = partial && (u32)d < exact_from ? 0u : __ldcg(&gc[d]);
      hm[d] = __ldcg(&gm[d]);
    }
    __syncthreads();
    const int per = nb / NT, hi = nb - 1 - threadIdx.x * per;  // this thread's buckets, descending
    u64 sc = 0, sm = 0;
    for (int j = 0; j < per; ++j) { sc += hc[hi - j]; sm += hm[hi - j]; }
    u64 ec = sc, em = sm, tc, tm;
    block_exscan2(ec, em, tc, tm);
    if (partial && tc < target) {  // the k-th largest is below the exact digits: count them all
      counted = false;
      level = -1;
      continue;
    }
    if (which == 1 && level == 0) {  // the mass of the domain is known now: top_p's target
      const double want = ceil(top_p * (double)tm);
      target = want >= (double)tm ? tm : want < 1.0 ? 1ull : (u64)want;
    }
    u64 tac = ac + ec, tam = am + em;
    u64 before = which == 0 ? tac : tam;
    if (before < target && target <= before + (which == 0 ? sc : sm)) {  // exactly one thread
      int d = hi;
      for (int j = 0; j < per; ++j, --d) {
        const u64 u = which == 0 ? hc[d] : hm[d];
        if (before + u >= target) break;
        before += u; tac += hc[d]; tam += hm[d];
      }
      s_prefix = prefix | ((u32)d << shift); s_ac = tac; s_am = tam;
      const u64 need = target - before;
      s_tie = hc[d];
      s_keep = which == 0 ? need : (need + hm[d] / hc[d] - 1) / (hm[d] / hc[d]);
    }
    __syncthreads();
    prefix = s_prefix; ac = s_ac; am = s_am;
    if (which == 0 && level == 0 && target <= NB && ac + s_tie <= NB) {  // few candidates: compact
      R.ncand = (u32)(ac + s_tie); R.d0 = prefix >> 21;
      return 0;
    }
  }
  const u64 keep = s_keep;
  if (keep >= s_tie) return (u64)prefix << 32;  // the whole run of the threshold value is kept
  // Index pass: the keep-th element, in token order, of the run of equal logits.
  u32 n = 0;
  each(R.x, R.c0, R.c1, [&](float v, int i) { n += okey(v) == prefix && skey(v, i) >= dom; });
  n = block_sum_u32(n);
  if (threadIdx.x == 0) w.tcnt[R.row * R.B + R.b] = n;
  row_sync(&w.ctr[R.row], ++R.gen * R.B);
  if (threadIdx.x == 0) {
    u64 cum = 0; s_hit = R.B - 1; s_keep = 1;
    for (int j = 0; j < R.B; ++j) {
      const u32 c = __ldcg(&w.tcnt[R.row * R.B + j]);
      if (cum + c >= keep) { s_hit = j; s_keep = keep - cum; break; }
      cum += c;
    }
  }
  __syncthreads();
  if (s_hit == R.b) {  // the block holding it finds it in its own chunk
    __shared__ int wc[NT / 32], found;
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    u32 run = 0;
    if (threadIdx.x == 0) found = -1;
    __syncthreads();
    for (int base = R.c0; base < R.c1; base += NT) {
      const int i = base + threadIdx.x;
      const bool hit = i < R.c1 && okey(R.x[i]) == prefix && skey(R.x[i], i) >= dom;
      const u32 bal = __ballot_sync(0xffffffffu, hit);
      if (lane == 0) wc[wid] = __popc(bal);
      __syncthreads();
      u32 before = run, tot = 0;
      for (int j = 0; j < NT / 32; ++j) { before += j < wid ? wc[j] : 0; tot += wc[j]; }
      if (hit && before + __popc(bal & ((1u << lane) - 1)) + 1 == s_keep) found = i;
      run += tot;
      __syncthreads();
      if (found >= 0) break;
    }
    if (threadIdx.x == 0) w.thr[R.row] = ((u64)prefix << 32) | (u64)(0xffffffffu - (u32)found);
  }
  row_sync(&w.ctr[R.row], ++R.gen * R.B);
  return __ldcg(&w.thr[R.row]);
}

"""

_SAMPLE = r"""
extern "C" __global__ void __launch_bounds__(NT, 4) sample(
    const float* __restrict__ logits, const int* __restrict__ rows, const int* __restrict__ pos,
    const float* __restrict__ temp, const int* __restrict__ topk, const float* __restrict__ topp,
    const float* __restrict__ minp, const u64* __restrict__ seed, int* __restrict__ out,
    int* __restrict__ table, unsigned char* __restrict__ cnt, unsigned char* __restrict__ wsp, int S,
    int V, int B, int C) {
  Row R;
  R.row = blockIdx.x / B; R.b = blockIdx.x - R.row * B; R.B = B; R.C = C; R.V = V;
  R.x = logits + (size_t)R.row * V; R.c0 = R.b * C; R.c1 = min(V, R.c0 + C);
  R.gen = 0; R.pass = 0; R.ncand = 0; R.d0 = 0;
  const int row = R.row, b = R.b;
  const float t = temp[row];
  const bool greedy = !(t > 0.f);
  R.inv_t = greedy ? 1.f : __frcp_rn(t);
  const int k = topk[row];
  const bool k_on = !greedy && k > 0 && k < V, p_on = !greedy && topp[row] < 1.f, m_on = !greedy && minp[row] > 0.f;
  const bool plain = !greedy && !k_on && !p_on && !m_on;
  const u64 base = row_key(seed[row], (u32)pos[row]);
  __shared__ u32 hc[NB];
  __shared__ u64 hm[NB];
  if (k_on || p_on) zero_hist(layout(cnt, wsp, S, B), row, 0, b, B);
  if (k_on) {  // top_k's first digit needs no scan result: counted in the same sweep
    for (int d = threadIdx.x; d < NB; d += NT) { hc[d] = 0; hm[d] = 0; }
    __syncthreads();
  }
  u64 best = 0; bool bad = false;
  if (k_on) {  // count first digits from SPAN below this thread's running max (select_thr)
    each(R.x, R.c0, R.c1, [&](float v, int i) {
      bad |= (v != v) || (v == INFINITY);
      const u64 s = skey(v, i); best = s > best ? s : best;
      if ((u32)(s >> 53) + SPAN >= (u32)(best >> 53)) count_digit(hc, s >> 53);
    });
  } else {  // a separate loop: the warp-synchronous count would slow every greedy row's sweep
    each(R.x, R.c0, R.c1, [&](float v, int i) {
      bad |= (v != v) || (v == INFINITY);
      const u64 s = skey(v, i); best = s > best ? s : best;
    });
  }
  best = block_max_u64(best);
  bad = __syncthreads_or(bad);
  Race r = {-INFINITY, 0x7fffffff, -INFINITY};
  if (plain) r = plain_race(R.x, R.c0, R.c1, R.inv_t, best, base);
  // The workspace's pointers are computed here, after the sweeps: live across them they
  // took registers the sweeps' loops then spilled for.
  const Work w = layout(cnt, wsp, S, B);
  if (threadIdx.x == 0) {
    atomicMax(&w.maxk[row], best);
    if (bad) atomicOr(&w.bad[row], 1u);
    w.pk[row * B + b] = r.k; w.pi[row * B + b] = r.i;
  }
  if (greedy || plain) {
    if (!last_block(&w.tick[row], B)) return;
    const int won = plain ? merge_partials(w.pk + row * B, w.pi + row * B, B).i : 0;
    if (threadIdx.x != 0) return;
    const u64 m = __ldcg(&w.maxk[row]);
    const float xmax = unokey((u32)(m >> 32));
    // A finite max whose scaled value overflows (a tiny temperature): the T -> 0 limit, the argmax.
    const bool raced = plain && isfinite(__fmul_rn(xmax, R.inv_t));
    const int tok = __ldcg(&w.bad[row]) || xmax == -INFINITY ? -1 : raced ? won : (int)(0xffffffffu - (u32)m);
    finish(row, tok, out, rows, table);
    reset_row(w, row);
    return;
  }
  row_sync(&w.ctr[row], ++R.gen * B);
  const u64 m = __ldcg(&w.maxk[row]);
  const int imax = (int)(0xffffffffu - (u32)m);
  const float zm = __fmul_rn(unokey((u32)(m >> 32)), R.inv_t);
  if (__ldcg(&w.bad[row]) || !isfinite(zm)) {  // an error row (also all -inf), or an overflow (above)
    if (last_block(&w.tick[row], B) && threadIdx.x == 0) {
      const bool error = __ldcg(&w.bad[row]) || unokey((u32)(m >> 32)) == -INFINITY;
      finish(row, error ? -1 : imax, out, rows, table);
      reset_row(w, row);
    }
    return;
  }
  R.zmax = zm;
  const double lmp = m_on ? log((double)minp[row]) : -INFINITY;
  // Every thread counted the digits from SPAN below its own max, so all from SPAN below the
  // row's max: level 0 is exact there.
  const u32 exact_from = (u32)(m >> 53) > SPAN ? (u32)(m >> 53) - SPAN : 0u;
  const u64 tk = k_on ? select_thr(R, w, hc, hm, 0, (u64)k, 0, 0.0, true, exact_from) : 0;
  if (R.ncand) {
    compact_finish(R, w, hm, k, p_on, (double)topp[row], lmp, base, out, rows, table);
    return;
  }
  const u64 tp = p_on ? select_thr(R, w, hc, hm, 1, 0, tk, (double)topp[row], false) : 0;
  const u64 th = tk > tp ? tk : tp;
  r = kept_race(R.x, R.c0, R.c1, R.inv_t, R.zmax, th, lmp, zm, imax, base);
  if (threadIdx.x == 0) { w.pk[row * B + b] = r.k; w.pi[row * B + b] = r.i; }
  if (!last_block(&w.tick[row], B)) return;
  const int won = merge_partials(w.pk + row * B, w.pi + row * B, B).i;
  if (threadIdx.x == 0) {
    finish(row, won, out, rows, table);
    reset_row(w, row);
  }
}
"""

CODE = PRELUDE + _KERNELS + COMPACT + _SAMPLE
KERNELS = ("sample",)
BLOCKS_PER_SM = 4  # __launch_bounds__(NT, 4): a row's blocks fit on the GPU together
