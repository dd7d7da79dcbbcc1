"""CUDA side of the sampler, part 3: the compact end of a top_k row (kernels.py says when a row
takes it). Sorting at most NB candidate keys in one block's shared memory replaces the radix
select's last two digits and the race's sweep over the whole row, which dominate a top_k row's
time once its rows are long or many.

Exactness: the candidates are every token whose first digit is at or above the digit that holds
the k-th largest key, so the first k of them in key order are the top_k set; top_p's prefix is
found by the same fixed-point masses, summed as integers in key order, and the race gives each
token the same key as the sweep does. So a row's token does not depend on the path it took.
"""

COMPACT = r"""
// Sort the n <= NB keys in s descending (bitonic; padding keys 0 sort last: real keys are > 0).
__device__ void sort_desc(u64* s, int n) {
  int n2 = 2;
  while (n2 < n) n2 <<= 1;
  for (int j = n + threadIdx.x; j < n2; j += NT) s[j] = 0;
  __syncthreads();
  for (int size = 2; size <= n2; size <<= 1)
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int t = threadIdx.x; t < n2 / 2; t += NT) {
        const int lo = 2 * t - (t & (stride - 1)), hi = lo + stride;
        const u64 a = s[lo], b = s[hi];
        if ((a < b) == ((lo & size) == 0)) { s[lo] = b; s[hi] = a; }
      }
      __syncthreads();
    }
}

// The compact end of a top_k row (R.ncand candidates: first digit >= R.d0): every block appends
// its candidates' keys to the row's list; the row's first block sorts them and keeps the first
// k, then top_p's shortest prefix by fixed-point mass, then min_p, and runs the race on them.
__device__ void compact_finish(Row& R, const Work& w, u64* s, int k, bool p_on, double top_p,
                               double lmp, u64 base, int* out, const int* rows, int* table) {
  u64* cand = w.cand + (size_t)R.row * NB;
  const int lane = threadIdx.x & 31;
  each(R.x, R.c0, R.c1, [&](float v, int i) {
    if ((okey(v) >> 21) < R.d0) return;
    const u32 act = __activemask();  // warp-aggregated append: one atomic per warp
    const int lead = __ffs(act) - 1;
    u32 at = 0;
    if (lane == lead) at = atomicAdd(&w.ncand[R.row], (u32)__popc(act));
    at = __shfl_sync(act, at, lead) + __popc(act & ((1u << lane) - 1));
    cand[at] = skey(v, i);
  });
  row_sync(&w.ctr[R.row], ++R.gen * R.B);
  if (R.b != 0) {
    if (last_block(&w.tick[R.row], R.B) && threadIdx.x == 0) reset_row(w, R.row);
    return;
  }
  const int n = (int)R.ncand;
  for (int j = threadIdx.x; j < n; j += NT) s[j] = __ldcg(&cand[j]);
  sort_desc(s, n);
  int kept = k;                       // n >= k: the first digit was chosen so
  if (p_on) {                         // shortest prefix of the first k whose mass reaches top_p
    __shared__ int s_cut;
    const int per = (k + NT - 1) / NT, j0 = min(k, (int)threadIdx.x * per), j1 = min(k, j0 + per);
    u64 own = 0, ex, zero = 0, tot, tz;
    for (int j = j0; j < j1; ++j) own += weight(__fmul_rn(unokey((u32)(s[j] >> 32)), R.inv_t), R.zmax);
    ex = own;
    block_exscan2(ex, zero, tot, tz);
    const double want = ceil(top_p * (double)tot);
    const u64 target = want >= (double)tot ? tot : want < 1.0 ? 1ull : (u64)want;
    if (ex < target && target <= ex + own) {  // exactly one thread: the prefix ends in its part
      u64 cum = ex; int j = j0;
      for (; j < j1; ++j) {
        cum += weight(__fmul_rn(unokey((u32)(s[j] >> 32)), R.inv_t), R.zmax);
        if (cum >= target) break;
      }
      s_cut = j + 1;
    }
    __syncthreads();
    kept = s_cut;
  }
  Race r = {-INFINITY, 0x7fffffff, -INFINITY};
  for (int j = threadIdx.x; j < kept; j += NT) {
    const float z = __fmul_rn(unokey((u32)(s[j] >> 32)), R.inv_t);
    if ((double)z - R.zmax >= lmp) race_add(r, z, (int)(0xffffffffu - (u32)s[j]), base);
  }
  r = block_race(race_done(r, base));
  if (threadIdx.x == 0) finish(R.row, r.i, out, rows, table);
  if (last_block(&w.tick[R.row], R.B) && threadIdx.x == 0) reset_row(w, R.row);
}

"""
