"""The device half of speculative decoding (vt/forward/speculative.py): the verify step's
prologue, the proposers and acceptance, each a kernel with its numpy twin beside it
(run_numpy on the sim, run_cupy on cuda, one CUDA source for all of them). The target's
token at each verify position is vt's sampler's (vt/sampling), launched between verify and
accept.

Per sequence row the device keeps `pos[row]`, the position of the row's last token (the next
step's input), and `hist[row, :]`, every token of the row by position (prompt, then output).
The host writes neither once the row decodes: each verify step reads them and writes them
back advanced by what it accepted, so the next step, already launched, starts from there.
"""
from __future__ import annotations

import numpy as np

from vt.sampling.logprobs import UNASKED
from vt.step.contract import kv_slot

# A row's record after a verify step (the sampler's record, vt/sampling/logprobs.py, with
# the logprobs words reused): [0] its first token, [1] UNASKED, [COUNT] how many tokens it
# emits (1 .. k + 1), [TOKENS, TOKENS + count) the tokens.
COUNT = 2
TOKENS = 3


# A step row's sampling knobs (vt/sampling/params.py ROW_VECTORS) that its k + 1 verify rows
# take, in the prologue's argument order: each is passed as the step's [S] vector, then the
# verify rows' [S * (k + 1)] one.
SAMPLING = ("temperature", "top_k", "top_p", "min_p", "seed")


class Prologue:
    """The verify step's rows: row r's k + 1 tokens (its last token, then its k drafts) become
    the decode rows r * (k + 1) + j of the target, at positions pos[row] + j, each with its
    own entry of the token table (`base` + that index) holding its input token, and row r's
    sampling knobs (SAMPLING: the sampler then draws each verify position as it would draw
    that position decoding one token a step). A position past max_context writes the pad slot
    (such a row's request has ended: nothing reads it); padded rows write the pad slot only."""

    name = "spec_prologue"

    def run_numpy(self, token_rows, block_tables, pos, drafts, token_table, v_rows, v_pos, v_lens,
                  v_slots, v_tables, v_state, temperature, v_temperature, top_k, v_top_k, top_p,
                  v_top_p, min_p, v_min_p, seed, v_seed, *, k, base, pad_row, pad_slot,
                  pad_state, block_size, max_context):
        S, w = len(token_rows), k + 1
        for step, verify in ((temperature, v_temperature), (top_k, v_top_k), (top_p, v_top_p),
                             (min_p, v_min_p), (seed, v_seed)):
            verify[:S * w] = np.repeat(step[:S], w)
        for r in range(S):
            row = int(token_rows[r])
            for j in range(w):
                v, p = r * w + j, int(pos[row]) + j
                q = min(p, max_context - 1)
                live = row != pad_row and p < max_context
                v_rows[v], v_pos[v], v_lens[v], v_state[v] = base + v, q, q + 1, pad_state
                v_slots[v] = kv_slot(block_tables[r], q, block_size) if live else pad_slot
                v_tables[v] = block_tables[r]
                token_table[base + v] = token_table[row] if j == 0 else drafts[r, j - 1]

    def run_cupy(self, stream_handle, token_rows, block_tables, pos, drafts, token_table, v_rows,
                 v_pos, v_lens, v_slots, v_tables, v_state, temperature, v_temperature, top_k,
                 v_top_k, top_p, v_top_p, min_p, v_min_p, seed, v_seed, *, k, base, pad_row,
                 pad_slot, pad_state, block_size, max_context):
        from vt.backend.nvrtc import cuda_function
        n = len(token_rows) * (k + 1)
        mb = block_tables.shape[1]
        cuda_function(CODE, "spec_prologue")(
            (-(-n // 128),), (128,),
            (token_rows, block_tables, pos, drafts, token_table, v_rows, v_pos, v_lens, v_slots,
             v_tables, v_state, temperature, v_temperature, top_k, v_top_k, top_p, v_top_p,
             min_p, v_min_p, seed, v_seed, np.int32(n), np.int32(k), np.int32(mb), np.int32(base),
             np.int32(pad_row), np.int32(pad_slot), np.int32(pad_state), np.int32(block_size),
             np.int32(max_context)))


class OracleDrafts:
    """drafts[r, j] = ref[row, pos + 1 + j]: the tokens an earlier run produced. The first
    `right` of the k are those; the rest are made wrong ((token + 1) % vocab), so that a set
    fraction of the drafts is accepted."""

    name = "spec_oracle"

    def run_numpy(self, token_rows, pos, ref, drafts, *, right, vocab):
        S, k = drafts.shape
        width = ref.shape[1]
        for r in range(S):
            row = int(token_rows[r])
            for j in range(k):
                t = int(ref[row, min(int(pos[row]) + 1 + j, width - 1)])
                drafts[r, j] = t if j < right else (t + 1) % vocab

    def run_cupy(self, stream_handle, token_rows, pos, ref, drafts, *, right, vocab):
        from vt.backend.nvrtc import cuda_function
        S, k = drafts.shape
        cuda_function(CODE, "spec_oracle")(
            (-(-(S * k) // 128),), (128,),
            (token_rows, pos, ref, drafts, np.int32(S), np.int32(k), np.int32(ref.shape[1]),
             np.int32(right), np.int32(vocab)))


class NgramDrafts:
    """Prompt lookup: the row's last n tokens (n from n_max down to n_min) are looked for
    earlier in its history (prompt and output); at the latest match the k tokens that
    followed it are the drafts (past the row's last token: that token again). No match: the
    last token k times (cheap to reject)."""

    name = "spec_ngram"

    def run_numpy(self, token_rows, pos, hist, drafts, *, n_min, n_max):
        S, k = drafts.shape
        for r in range(S):
            row = int(token_rows[r])
            p = min(int(pos[row]), hist.shape[1] - 1)
            h = hist[row]
            follow = _ngram_match(h, p, n_min, n_max)
            for j in range(k):
                drafts[r, j] = h[min(follow + j, p)] if follow >= 0 else h[p]

    def run_cupy(self, stream_handle, token_rows, pos, hist, drafts, *, n_min, n_max):
        from vt.backend.nvrtc import cuda_function
        S, k = drafts.shape
        cuda_function(CODE, "spec_ngram")(
            (-(-S // 64),), (64,),
            (token_rows, pos, hist, drafts, np.int32(S), np.int32(k), np.int32(hist.shape[1]),
             np.int32(n_min), np.int32(n_max)))


def _ngram_match(h, p: int, n_min: int, n_max: int) -> int:
    """Where the tokens after the latest earlier occurrence of h[p - n + 1 .. p] start, for
    the longest n in [n_min, n_max] that has one; -1: none."""
    for n in range(min(n_max, p + 1), n_min - 1, -1):
        tail = h[p - n + 1:p + 1]
        for s in range(p - n, -1, -1):     # latest first; s + n - 1 < p
            if np.array_equal(h[s:s + n], tail):
                return s + n
    return -1


class Accept:
    """Acceptance, after the verify and the sampler: `targets` [S * (k + 1)] holds the token
    vt's sampler drew at every verify position (each row's own knobs, keyed on its seed and
    the position, as decoding one token a step draws it; a greedy row's is the argmax). Row r
    accepts its drafts while draft j == targets[r, j] and emits targets[r, 0 .. a] (the
    accepted drafts, then the target's own token: the correction, or the bonus after k
    accepted). An error token (-1) ends the run there. Writes the row's record, advances
    pos[row] and hist[row] by what it emits, puts its last token in the token table (the next
    step's input) and copies each row's first position's logits into logits_out [S, vocab].
    hist and the token table get an error token as 0: the step in flight after it still
    carries the row, and its proposer reads hist for drafts, the target's input tokens, which
    must be in range (the request has ended: what that step emits is dropped).

    Why a sampled row's tokens have the target's distribution: each emitted token is some t_j
    whose prefix is the emitted tokens before it (a draft is kept only where it equals t_j),
    so it is drawn from the target's p_j at that prefix, keyed as decoding without speculation
    keys it (the same seed gives the same tokens, whenever the verify logits are the one-token
    step's). As rejection sampling with a point-mass draft that does not see t_j's draw: d_j
    is kept with probability P(t_j = d_j) = p_j(d_j), and a rejected d_j leaves t_j ~ p_j
    with d_j's mass removed, renormalized (the residual max(0, p_j - q_j)); all k kept, the
    bonus is t_k ~ p_k.
    """

    name = "spec_accept"

    def run_numpy(self, targets, v_logits, drafts, token_rows, pos, hist, token_table, records,
                  logits_out, *, k, pad_row):
        S, w = len(token_rows), k + 1
        g = np.asarray(targets[:S * w]).reshape(S, w)
        width = hist.shape[1]
        for r in range(S):
            a = 0
            while a < k and g[r, a] >= 0 and drafts[r, a] == g[r, a]:
                a += 1
            emitted = g[r, :a + 1]
            rec = records[r]
            rec[0], rec[1], rec[COUNT] = emitted[0], UNASKED, a + 1
            rec[TOKENS:TOKENS + a + 1] = emitted
            row = int(token_rows[r])
            if row != pad_row:
                p = int(pos[row])
                for j in range(a + 1):   # an error token (-1) becomes 0, as in the token table
                    hist[row, min(p + 1 + j, width - 1)] = max(int(emitted[j]), 0)
                pos[row] = p + a + 1
                token_table[row] = max(int(emitted[-1]), 0)
        logits_out[:S] = v_logits[:S * w:w]

    def run_cupy(self, stream_handle, targets, v_logits, drafts, token_rows, pos, hist, token_table,
                 records, logits_out, *, k, pad_row):
        from vt.backend.nvrtc import cuda_function
        S, w = len(token_rows), k + 1
        V = v_logits.shape[1]
        cuda_function(CODE, "spec_accept")(
            (-(-S // 64),), (64,),
            (targets, drafts, token_rows, pos, hist, token_table, records, np.int32(S),
             np.int32(k), np.int32(hist.shape[1]), np.int32(records.shape[1]),
             np.int32(pad_row), np.int32(UNASKED)))
        logits_out[:S] = v_logits[:S * w:w].reshape(S, V)


class Seed:
    """After a prefill step's sampling: each prefilled row's first token (the token table's)
    goes into hist at the position after its prompt chunk, which becomes pos[row]."""

    name = "spec_seed"

    def run_numpy(self, token_rows, positions, token_table, pos, hist):
        for i in range(len(token_rows)):
            row, p = int(token_rows[i]), int(positions[i]) + 1
            pos[row] = p
            hist[row, min(p, hist.shape[1] - 1)] = token_table[row]

    def run_cupy(self, stream_handle, token_rows, positions, token_table, pos, hist):
        from vt.backend.nvrtc import cuda_function
        n = len(token_rows)
        cuda_function(CODE, "spec_seed")(
            (-(-n // 64),), (64,),
            (token_rows, positions, token_table, pos, hist, np.int32(n), np.int32(hist.shape[1])))


class DraftPrologue:
    """The draft model's rows of a verify step (vt/forward/spec_proposers.py DraftProposer):
    its k greedy passes over S step rows, as (k + 1) * S decode rows of the draft, laid out
    by pass. Row v serves step row r = v % S at position pos[row] + v // S - 1:

        pass 0      v in [0, 2S): positions p - 1 (rows [0, S)) and p (rows [S, 2S))
        pass j >= 1 v in [(j + 1) S, (j + 2) S): position p + j

    p - 1 is in pass 0 because the step before may have accepted all its drafts, the last of
    which the draft never ran on; every other draft position it rewrites holds the token it
    held. Each row gets its own entry of the draft's token table (`base` + v); pass 0's two
    input tokens are the row's hist[p - 1] and hist[p] (its last token); a pass j >= 1 reads
    the token the draft's greedy sampling of pass j - 1 writes into its entries. The sampling
    knobs are greedy's (temperature 0). Positions and slots follow Prologue's rules: past
    max_context, before 0, or a padded row: the pad slot."""

    name = "spec_draft_prologue"

    def run_numpy(self, token_rows, block_tables, pos, hist, d_table, d_rows, d_pos, d_lens,
                  d_slots, d_tables, d_state, d_temperature, d_top_k, d_top_p, d_min_p, d_seed,
                  *, k, base, pad_row, pad_slot, pad_state, block_size, max_context):
        S, width = len(token_rows), hist.shape[1]
        n = S * (k + 1)
        d_temperature[:n], d_top_k[:n], d_top_p[:n], d_min_p[:n], d_seed[:n] = 0, 0, 1, 0, 0
        for v in range(n):
            r, shift = v % S, v // S - 1
            row = int(token_rows[r])
            p = int(pos[row]) + shift
            q = min(max(p, 0), max_context - 1)
            live = row != pad_row and 0 <= p < max_context
            d_rows[v], d_pos[v], d_lens[v], d_state[v] = base + v, q, q + 1, pad_state
            d_slots[v] = kv_slot(block_tables[r], q, block_size) if live else pad_slot
            d_tables[v] = block_tables[r]
            if v < 2 * S:
                d_table[base + v] = max(int(hist[row, min(p, width - 1)]), 0) if p >= 0 else 0

    def run_cupy(self, stream_handle, token_rows, block_tables, pos, hist, d_table, d_rows, d_pos,
                 d_lens, d_slots, d_tables, d_state, d_temperature, d_top_k, d_top_p, d_min_p,
                 d_seed, *, k, base, pad_row, pad_slot, pad_state, block_size, max_context):
        from vt.backend.nvrtc import cuda_function
        S = len(token_rows)
        n = S * (k + 1)
        cuda_function(CODE, "spec_draft_prologue")(
            (-(-n // 128),), (128,),
            (token_rows, block_tables, pos, hist, d_table, d_rows, d_pos, d_lens, d_slots,
             d_tables, d_state, d_temperature, d_top_k, d_top_p, d_min_p, d_seed, np.int32(S),
             np.int32(k), np.int32(block_tables.shape[1]), np.int32(hist.shape[1]),
             np.int32(base), np.int32(pad_row), np.int32(pad_slot), np.int32(pad_state),
             np.int32(block_size), np.int32(max_context)))


class DraftCollect:
    """drafts[r, j] = passes[j, r], the draft's greedy token of pass j for step row r (the
    sampler writes a pass's tokens contiguously), with an error token (-1: the draft's
    logits were NaN or all -inf) made 0: a draft is an input token of the target's verify
    row, which must be in range, and a wrong draft only costs its acceptance."""

    name = "spec_draft_collect"

    def run_numpy(self, passes, drafts):
        S, k = drafts.shape
        drafts[...] = np.maximum(passes[:k, :S].T, 0)

    def run_cupy(self, stream_handle, passes, drafts):
        from vt.backend.nvrtc import cuda_function
        S, k = drafts.shape
        cuda_function(CODE, "spec_draft_collect")(
            (-(-(S * k) // 128),), (128,),
            (passes, drafts, np.int32(S), np.int32(k), np.int32(passes.shape[1])))


PROLOGUE, ORACLE, NGRAM, ACCEPT, SEED = Prologue(), OracleDrafts(), NgramDrafts(), Accept(), Seed()
DRAFT_PROLOGUE, DRAFT_COLLECT = DraftPrologue(), DraftCollect()


CODE = r"""
extern "C" __global__ void spec_prologue(
    const int* token_rows, const int* block_tables, const int* pos, const int* drafts,
    int* token_table, int* v_rows, int* v_pos, int* v_lens, int* v_slots, int* v_tables,
    int* v_state, const float* temperature, float* v_temperature, const int* top_k,
    int* v_top_k, const float* top_p, float* v_top_p, const float* min_p, float* v_min_p,
    const unsigned long long* seed, unsigned long long* v_seed, int n, int k, int mb, int base,
    int pad_row, int pad_slot, int pad_state, int block_size, int max_context) {
  int v = blockIdx.x * blockDim.x + threadIdx.x;
  if (v >= n) return;
  int w = k + 1, r = v / w, j = v % w;
  int row = token_rows[r];
  int p = pos[row] + j;
  int q = p < max_context ? p : max_context - 1;
  bool live = row != pad_row && p < max_context;
  v_rows[v] = base + v; v_pos[v] = q; v_lens[v] = q + 1; v_state[v] = pad_state;
  const int* bt = block_tables + (long long)r * mb;
  v_slots[v] = live ? bt[q / block_size] * block_size + q % block_size : pad_slot;
  for (int b = 0; b < mb; ++b) v_tables[(long long)v * mb + b] = bt[b];
  token_table[base + v] = j == 0 ? token_table[row] : drafts[r * k + j - 1];
  v_temperature[v] = temperature[r]; v_top_k[v] = top_k[r]; v_top_p[v] = top_p[r];
  v_min_p[v] = min_p[r]; v_seed[v] = seed[r];
}

extern "C" __global__ void spec_oracle(const int* token_rows, const int* pos, const int* ref,
                                       int* drafts, int S, int k, int width, int right, int vocab) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= S * k) return;
  int r = i / k, j = i % k, row = token_rows[r];
  int at = pos[row] + 1 + j;
  int t = ref[(long long)row * width + (at < width ? at : width - 1)];
  drafts[i] = j < right ? t : (t + 1) % vocab;
}

extern "C" __global__ void spec_ngram(const int* token_rows, const int* pos, const int* hist,
                                      int* drafts, int S, int k, int width, int n_min, int n_max) {
  int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= S) return;
  int row = token_rows[r];
  int p = pos[row] < width ? pos[row] : width - 1;
  const int* h = hist + (long long)row * width;
  int follow = -1;
  for (int n = (n_max < p + 1 ? n_max : p + 1); n >= n_min && follow < 0; --n) {
    for (int s = p - n; s >= 0; --s) {
      bool same = true;
      for (int i = 0; i < n && same; ++i) same = h[s + i] == h[p - n + 1 + i];
      if (same) { follow = s + n; break; }
    }
  }
  for (int j = 0; j < k; ++j) {
    int at = follow >= 0 ? (follow + j < p ? follow + j : p) : p;
    drafts[r * k + j] = h[at];
  }
}

extern "C" __global__ void spec_accept(const int* g, const int* drafts, const int* token_rows,
                                       int* pos, int* hist, int* token_table, int* records,
                                       int S, int k, int width, int words, int pad_row,
                                       int unasked) {
  int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= S) return;
  int w = k + 1;
  const int* gr = g + r * w;
  int a = 0;
  while (a < k && gr[a] >= 0 && drafts[r * k + a] == gr[a]) ++a;
  int* rec = records + (long long)r * words;
  rec[0] = gr[0]; rec[1] = unasked; rec[2] = a + 1;
  for (int j = 0; j <= a; ++j) rec[3 + j] = gr[j];
  int row = token_rows[r];
  if (row == pad_row) return;
  int p = pos[row];
  for (int j = 0; j <= a; ++j) {
    int at = p + 1 + j;
    hist[(long long)row * width + (at < width ? at : width - 1)] = gr[j] > 0 ? gr[j] : 0;
  }
  pos[row] = p + a + 1;
  token_table[row] = gr[a] > 0 ? gr[a] : 0;
}

extern "C" __global__ void spec_seed(const int* token_rows, const int* positions,
                                     const int* token_table, int* pos, int* hist, int n,
                                     int width) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  int row = token_rows[i], p = positions[i] + 1;
  pos[row] = p;
  hist[(long long)row * width + (p < width ? p : width - 1)] = token_table[row];
}

extern "C" __global__ void spec_draft_prologue(
    const int* token_rows, const int* block_tables, const int* pos, const int* hist,
    int* d_table, int* d_rows, int* d_pos, int* d_lens, int* d_slots, int* d_tables,
    int* d_state, float* d_temperature, int* d_top_k, float* d_top_p, float* d_min_p,
    unsigned long long* d_seed, int S, int k, int mb, int width, int base, int pad_row,
    int pad_slot, int pad_state, int block_size, int max_context) {
  int v = blockIdx.x * blockDim.x + threadIdx.x;
  if (v >= S * (k + 1)) return;
  int r = v % S, shift = v / S - 1;
  int row = token_rows[r];
  int p = pos[row] + shift;
  int q = p < 0 ? 0 : (p < max_context ? p : max_context - 1);
  bool live = row != pad_row && p >= 0 && p < max_context;
  d_rows[v] = base + v; d_pos[v] = q; d_lens[v] = q + 1; d_state[v] = pad_state;
  const int* bt = block_tables + (long long)r * mb;
  d_slots[v] = live ? bt[q / block_size] * block_size + q % block_size : pad_slot;
  for (int b = 0; b < mb; ++b) d_tables[(long long)v * mb + b] = bt[b];
  d_temperature[v] = 0.0f; d_top_k[v] = 0; d_top_p[v] = 1.0f; d_min_p[v] = 0.0f; d_seed[v] = 0ull;
  if (v < 2 * S) {
    int t = p >= 0 ? hist[(long long)row * width + (p < width ? p : width - 1)] : 0;
    d_table[base + v] = t > 0 ? t : 0;
  }
}

extern "C" __global__ void spec_draft_collect(const int* passes, int* drafts, int S, int k,
                                              int stride) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= S * k) return;
  int r = i / k, j = i % k;
  int t = passes[(long long)j * stride + r];
  drafts[i] = t > 0 ? t : 0;
}
"""
