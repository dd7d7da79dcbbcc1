"""Grammar-constrained decoding inside the captured step: the token bitmask a row's grammar
allows (structured output: JSON by schema, a regex, a choice, a forced tool call) applied to
its logits before it samples, and the per-row state on the device it reads (TokenMaskState).

Per sequence row r (a token-table row) the device keeps:
  on [R] i32: 1 while the row's request is constrained, 0 otherwise;
  bits [R, ceil(V / 32)] i32: token t is allowed iff bit (t & 31) of word t >> 5 is set (the
  layout xgrammar's fill_next_token_bitmask writes).
The host writes a constrained row's bits (from pinned staging, one H2D copy in the step's
stream, before the sampler that uses them) each time it knows the row's previous token;
the step itself carries no mask and no extra per-row vector. A row whose `on` is 0 is left
alone: the kernel's block returns at once for it, so rows without a grammar pay one flag read.

The mask is applied last, after penalties and logit bias: a disallowed token's logit becomes
-inf, which nothing after can undo, so it is never drawn (and its logprob is -inf).
"""
from __future__ import annotations

import numpy as np

from vt.backend.zeros import zeros


def mask_words(vocab: int) -> int:
    """int32 words of one row's bitmask."""
    return -(-vocab // 32)


class TokenMaskState:
    """The device tables of `rows` sequence rows of a `vocab`-token model and the pinned
    staging a row's next mask is written into (staging(row), then write(stream, rows)).

    The staging guard: a copy from staging reads it when the stream reaches the copy, which
    may be after the host has moved on (the serving loop queues a step's mask copies behind
    that step's forward, vt/engine/serving.py). So write() records an event after its copies,
    and staging(row) for a row copied since the host last saw that event complete waits for
    it: the host never rewrites a staging row a queued copy has yet to read.
    (vt.hooks.MaskPoison is its detector: a writer that takes staging unfenced.)
    The on/off flags are copied from two pinned constants that never change: a flag's copy
    still in flight reads the value it was enqueued with."""

    def __init__(self, be, rows: int, vocab: int):
        self.be, self.rows, self.vocab = be, rows, vocab
        self.words = mask_words(vocab)
        self.on = zeros(be, (rows,), np.int32)                    # [R]
        self.bits = zeros(be, (rows, self.words), np.int32)       # [R, ceil(V / 32)]
        self._staging = be.pinned_empty((rows, self.words), np.int32)
        self._one = be.pinned_empty((1,), np.int32)
        self._one[0] = 1
        self._zero = be.pinned_empty((1,), np.int32)
        self._zero[0] = 0
        self._flagged: set[int] = set()     # rows whose device flag is 1 (the host's view)
        self._copied = be.event(blocking_sync=True)   # recorded after write()'s copies
        self._unseen: set[int] = set()      # rows copied since the host saw _copied complete

    def args(self) -> tuple:
        return self.on, self.bits

    def staging(self, row: int, *, fenced: bool = True) -> np.ndarray:
        """The pinned [ceil(V / 32)] int32 row to fill with `row`'s next mask, once no queued
        copy still reads it (the guard: class docstring). fenced=False skips the guard: only
        the detector's unsafe arm asks for that."""
        if not 0 <= row < self.rows:
            raise IndexError(f"TokenMaskState: row {row} outside [0, {self.rows})")
        if fenced and row in self._unseen:
            self._copied.synchronize()
            self._unseen.clear()
        return self._staging[row]

    def write(self, stream, rows) -> None:
        """Each of `rows` samples with its staging's mask from the next sampler launched on
        `stream` on."""
        if not rows:
            return
        be = self.be
        for row in rows:
            be.copy_h2d(self.bits[row], self._staging[row], stream)
            if row not in self._flagged:
                be.copy_h2d(self.on[row:row + 1], self._one, stream)
                self._flagged.add(row)
        self._copied.record(stream)
        self._unseen.update(rows)

    def clear(self, stream, row: int) -> None:
        """`row` samples unconstrained from the next step on `stream` on (nothing if it does)."""
        if row in self._flagged:
            self.be.copy_h2d(self.on[row:row + 1], self._zero, stream)
            self._flagged.discard(row)

    def begin_rows(self, stream, seqs) -> None:
        """Rows of newly prefilled requests (PrefillSeq: row, sampling): a constrained one's
        first mask, its grammar's initial state (written for every prompt chunk: each chunk
        samples, and the grammar has accepted nothing yet); any other's flag cleared."""
        constrained = []
        for s in seqs:
            grammar = s.sampling.grammar
            if grammar is None:
                self.clear(stream, s.row)
            else:
                grammar.fill_mask(self.staging(s.row))
                constrained.append(s.row)
        self.write(stream, constrained)


def apply_mask(logits, token_rows, on, bits) -> None:
    """The numpy twin of the mask kernel: each constrained row's disallowed logits -> -inf."""
    V = logits.shape[1]
    ids = np.arange(V)
    for i in range(logits.shape[0]):
        r = int(token_rows[i])
        if not on[r]:
            continue
        allowed = (bits[r].view(np.uint32)[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1
        logits[i][allowed == 0] = -np.inf


CODE = r"""
// One block per row; a row whose flag is 0 returns at once (module doc).
extern "C" __global__ void __launch_bounds__(256) mask_logits(
    float* __restrict__ logits, const int* __restrict__ rows, const int* __restrict__ on,
    const unsigned int* __restrict__ bits, int V, int W) {
  const int row = blockIdx.x;
  const int r = rows[row];
  if (!on[r]) return;
  float* x = logits + (size_t)row * V;
  const unsigned int* b = bits + (size_t)r * W;
  for (int i = threadIdx.x; i < V; i += blockDim.x)
    if (!((b[i >> 5] >> (i & 31)) & 1u)) x[i] = __int_as_float(0xff800000);   // -inf (NVRTC has no math.h)
}
"""

KERNELS = ("mask_logits",)


def launch_mask(logits, token_rows, on, bits) -> None:
    from vt.backend.nvrtc import cuda_function
    S, V = logits.shape
    cuda_function(CODE, "mask_logits")((S,), (256,), (logits, token_rows, on, bits, np.int32(V),
                                                       np.int32(bits.shape[1])))
