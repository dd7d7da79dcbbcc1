"""Penalties, logit bias and min_tokens inside the captured step: what the sampler does to a
row's logits before it samples, for rows whose request asks (SamplingParams.penalize_stages,
the step's per-row `penalized` bits), and the per-row state on the device it reads
(PenaltyState).

Per sequence row r (a token-table row) the device keeps:
  counts [R, V] u16: how many times each token was sampled in r's output so far (saturating);
  prompt_bits [R, ceil(V / 32)] u32: the tokens of r's prompt, one bit each;
  bias_ids [R, MAX_LOGIT_BIAS] i32 (-1: none) and bias_vals [R, MAX_LOGIT_BIAS] f32;
  min_left [R] i32: how many more tokens r must sample before its stop tokens may come;
  stop_ids [R, MAX_MIN_TOKENS_STOPS] i32 (-1: none): those stop tokens.
A request's rows are set when its prompt is prefilled (begin_rows: counts zeroed, its prompt's
bits and its bias written, min_left set to min_tokens and its stop tokens written, from pinned
staging through one H2D copy each); after each sampling call the row's sampled token is
counted and its min_left decremented (count kernel). So the step itself carries only four
per-row values (penalized, presence, frequency, repetition) and never a token list, and the
host never needs to know how many tokens a row has sampled: the device counts them.

What a penalized row's logits become, in vLLM's order (each float32 op rounded on its own,
the kernel with __f*_rn so that no FMA contraction separates it from the numpy twin):
  x[t] += bias[t]                                   for each logit_bias entry;
  x[t] = x[t] > 0 ? x[t] / rep : x[t] * rep          if t is in the prompt or counts[t] > 0;
  x[t] -= freq * counts[t] + pres                   if counts[t] > 0;
  x[t] = -inf                                       for each stop token, while min_left > 0
(last, so nothing undoes it: vLLM's MinTokensLogitsProcessor). The first three run for rows
with the PENALIZE bit, the ban for rows with the MIN_TOKENS bit; a row with neither is left
alone: the kernel returns at once for it, and one whose min_tokens are out reads one int.
"""
from __future__ import annotations

import numpy as np

from vt.backend.zeros import zeros

from .params import MAX_LOGIT_BIAS, MAX_MIN_TOKENS_STOPS, MIN_TOKENS, PENALIZE

COUNT_MAX = 65535   # counts saturate here: a penalty times 65535 already dominates any logit


class PenaltyState:
    """The device tables of `rows` sequence rows of a `vocab`-token model, and the pinned
    staging begin_rows writes them from (a row's staging is rewritten only at its next
    admission, after the step that copied it has run: prefill steps drain)."""

    def __init__(self, be, rows: int, vocab: int):
        self.be, self.rows, self.vocab = be, rows, vocab
        self.words = -(-vocab // 32)
        # zeroed once: a row is read only after begin_rows wrote it, but a sanitizer's initcheck
        # and a reader of the tables see defined memory
        self.counts = zeros(be, (rows, vocab), np.uint16)              # [R, V]
        self.prompt_bits = zeros(be, (rows, self.words), np.uint32)    # [R, ceil(V / 32)]
        self.bias_ids = zeros(be, (rows, MAX_LOGIT_BIAS), np.int32)    # [R, MAX_LOGIT_BIAS]
        self.bias_vals = zeros(be, (rows, MAX_LOGIT_BIAS), np.float32)
        self.min_left = zeros(be, (rows,), np.int32)                   # [R]
        self.stop_ids = zeros(be, (rows, MAX_MIN_TOKENS_STOPS), np.int32)   # [R, MAX_MIN_TOKENS_STOPS]
        self._bits = be.pinned_empty((rows, self.words), np.uint32)
        self._ids = be.pinned_empty((rows, MAX_LOGIT_BIAS), np.int32)
        self._vals = be.pinned_empty((rows, MAX_LOGIT_BIAS), np.float32)
        self._min_left = be.pinned_empty((rows,), np.int32)
        self._stop_ids = be.pinned_empty((rows, MAX_MIN_TOKENS_STOPS), np.int32)

    def args(self) -> tuple:
        return (self.counts, self.prompt_bits, self.bias_ids, self.bias_vals, self.min_left,
                self.stop_ids)

    def begin_rows(self, stream, seqs) -> None:
        """Rows of newly prefilled requests (PrefillSeq: row, tokens, sampling, stop_tokens),
        in `stream`'s order: for penalties or a bias, counts zeroed, prompt and bias written;
        for min_tokens, min_left and the stop tokens written. Called for every prompt chunk:
        the last one's writes also drop what the earlier chunks' samples (never returned)
        counted."""
        for s in seqs:
            if s.sampling.penalized:
                self._begin_penalties(stream, s)
            if s.sampling.min_tokens:
                self._begin_min_tokens(stream, s)

    def _begin_min_tokens(self, stream, s) -> None:
        stops = tuple(s.stop_tokens)
        if len(stops) > MAX_MIN_TOKENS_STOPS:
            raise ValueError(f"min_tokens={s.sampling.min_tokens} with {len(stops)} stop tokens; "
                             f"at most {MAX_MIN_TOKENS_STOPS} can be banned")
        r = s.row
        ids = self._stop_ids[r]
        ids[...] = -1
        ids[:len(stops)] = stops
        self._min_left[r] = s.sampling.min_tokens
        self.be.copy_h2d(self.stop_ids[r], ids, stream)
        self.be.copy_h2d(self.min_left[r:r + 1], self._min_left[r:r + 1], stream)

    def _begin_penalties(self, stream, s) -> None:
        be, sp = self.be, s.sampling
        r = s.row
        bits = self._bits[r]
        bits[...] = 0
        toks = np.asarray(s.tokens, np.int64)
        np.bitwise_or.at(bits, toks >> 5, (np.uint32(1) << (toks & 31).astype(np.uint32)))
        ids, vals = self._ids[r], self._vals[r]
        ids[...] = -1
        vals[...] = 0
        n = len(sp.logit_bias)
        if n:
            ids[:n], vals[:n] = zip(*sp.logit_bias)
        be.copy_h2d(self.prompt_bits[r], bits, stream)
        be.copy_h2d(self.bias_ids[r], ids, stream)
        be.copy_h2d(self.bias_vals[r], vals, stream)
        be.launch(stream, _ZERO_ROW, self.counts[r])


class _ZeroRow:
    """counts[r] = 0: one row of the counts table."""

    name = "penalty_zero_row"

    def run_numpy(self, row):
        row[...] = 0

    def run_cupy(self, stream_handle, row):
        from vt.backend.nvrtc import cuda_function
        n = row.size
        cuda_function(CODE, "zero_u16")((max(1, -(-n // 256)),), (256,), (row, np.int32(n)))


_ZERO_ROW = _ZeroRow()


def penalize(logits, token_rows, penalized, presence, frequency, repetition, counts, prompt_bits,
             bias_ids, bias_vals, min_left, stop_ids) -> None:
    """The numpy twin of the penalize kernel: logits [S, V] f32 changed in place (module doc)."""
    for i in np.flatnonzero(np.asarray(penalized)):
        stages = int(penalized[i])
        r = int(token_rows[i])
        x = logits[i]
        if stages & PENALIZE:
            _penalize_row(x, bias_ids[r], bias_vals[r], counts[r], prompt_bits[r], presence[i],
                          frequency[i], repetition[i])
        if stages & MIN_TOKENS and min_left[r] > 0:
            ids = stop_ids[r]
            x[ids[(ids >= 0) & (ids < x.size)]] = -np.inf


def _penalize_row(x, ids, vals, c, prompt_bits, presence, frequency, repetition) -> None:
    keep = ids >= 0
    x[ids[keep]] = x[ids[keep]] + vals[keep]
    V = x.size
    bits = (prompt_bits[np.arange(V) >> 5] >> (np.arange(V) & 31).astype(np.uint32)) & 1
    seen = (c > 0) | (bits == 1)
    rep = np.float32(repetition)
    if rep != 1:
        with np.errstate(invalid="ignore", over="ignore"):
            x[seen] = np.where(x[seen] > 0, x[seen] / rep, x[seen] * rep)
    out = c > 0
    x[out] = x[out] - (np.float32(frequency) * c[out].astype(np.float32) + np.float32(presence))


def count(tokens, token_rows, penalized, counts, min_left) -> None:
    """The numpy twin of the count kernel: each PENALIZE row's sampled token counted, each
    MIN_TOKENS row's min_left brought one nearer 0."""
    for i in np.flatnonzero(np.asarray(penalized)):
        t = int(tokens[i])
        if t < 0:
            continue
        r = int(token_rows[i])
        if penalized[i] & PENALIZE:
            counts[r, t] = min(int(counts[r, t]) + 1, COUNT_MAX)
        if penalized[i] & MIN_TOKENS and min_left[r] > 0:
            min_left[r] -= 1


CODE = r"""
typedef unsigned int u32;
typedef unsigned short u16;

// penalized's bits (vt/sampling/params.py)
#define PENALIZE 1
#define MIN_TOKENS 2

// One block per row; a row that asks for nothing returns at once (module doc).
extern "C" __global__ void __launch_bounds__(256) penalize(
    float* __restrict__ logits, const int* __restrict__ rows, const int* __restrict__ pen,
    const float* __restrict__ presence, const float* __restrict__ frequency,
    const float* __restrict__ repetition, const u16* __restrict__ counts,
    const u32* __restrict__ prompt_bits, const int* __restrict__ bias_ids,
    const float* __restrict__ bias_vals, const int* __restrict__ min_left,
    const int* __restrict__ stop_ids, int V, int W, int MB, int MS) {
  const int row = blockIdx.x;
  const int stages = pen[row];
  if (!stages) return;
  const int r = rows[row];
  float* x = logits + (size_t)row * V;
  if (stages & PENALIZE) {
    const int* ids = bias_ids + (size_t)r * MB;
    const float* bv = bias_vals + (size_t)r * MB;
    for (int j = threadIdx.x; j < MB; j += blockDim.x) {   // ids are distinct: no two threads meet
      const int t = ids[j];
      if (t >= 0 && t < V) x[t] = __fadd_rn(x[t], bv[j]);
    }
    __syncthreads();   // the bias lands before the penalties read the same logits
    const float pp = presence[row], fp = frequency[row], rp = repetition[row];
    const u16* c = counts + (size_t)r * V;
    const u32* bits = prompt_bits + (size_t)r * W;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
      const u32 n = c[i];
      float v = x[i];
      if (rp != 1.f && (n > 0u || ((bits[i >> 5] >> (i & 31)) & 1u)))
        v = v > 0.f ? __fdiv_rn(v, rp) : __fmul_rn(v, rp);
      if (n > 0u) v = __fsub_rn(v, __fadd_rn(__fmul_rn(fp, (float)n), pp));
      x[i] = v;
    }
  }
  // stages and min_left[r] are the same for the whole block: the barrier is reached by all
  if ((stages & MIN_TOKENS) && min_left[r] > 0) {
    __syncthreads();   // the penalties' writes land before the ban overwrites the same logits
    const int* ids = stop_ids + (size_t)r * MS;
    for (int j = threadIdx.x; j < MS; j += blockDim.x) {
      const int t = ids[j];
      if (t >= 0 && t < V) x[t] = __int_as_float(0xff800000);   // -inf (NVRTC has no math.h)
    }
  }
}

// After sampling: each PENALIZE row's token counted (saturating), each MIN_TOKENS row's
// min_left brought one nearer 0 (one thread per row).
extern "C" __global__ void count_tokens(const int* __restrict__ tokens, const int* __restrict__ rows,
                                        const int* __restrict__ pen, u16* __restrict__ counts,
                                        int* __restrict__ min_left, int S, int V) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= S) return;
  const int stages = pen[row];
  if (!stages) return;
  const int t = tokens[row];
  if (t < 0) return;
  if (stages & PENALIZE) {
    u16* c = counts + (size_t)rows[row] * V + t;
    if (*c < 65535) *c = (u16)(*c + 1);
  }
  if (stages & MIN_TOKENS) {
    int* m = min_left + rows[row];
    if (*m > 0) *m -= 1;
  }
}

extern "C" __global__ void zero_u16(u16* __restrict__ x, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = 0;
}
"""

KERNELS = ("penalize", "count_tokens", "zero_u16")


def launch_penalize(logits, token_rows, penalized, presence, frequency, repetition, counts,
                    prompt_bits, bias_ids, bias_vals, min_left, stop_ids) -> None:
    from vt.backend.nvrtc import cuda_function
    S, V = logits.shape
    cuda_function(CODE, "penalize")(
        (S,), (256,), (logits, token_rows, penalized, presence, frequency, repetition, counts,
                       prompt_bits, bias_ids, bias_vals, min_left, stop_ids, np.int32(V),
                       np.int32(prompt_bits.shape[1]), np.int32(bias_ids.shape[1]),
                       np.int32(stop_ids.shape[1])))


def launch_count(tokens, token_rows, penalized, counts, min_left) -> None:
    from vt.backend.nvrtc import cuda_function
    S, V = len(tokens), counts.shape[1]
    cuda_function(CODE, "count_tokens")((-(-S // 256),), (256,), (tokens, token_rows, penalized, counts,
                                                                 min_left, np.int32(S), np.int32(V)))
