"""What the runner needs from a model, and the adapter that turns a user-written decode
forward into one.

A step model has `vocab`, `geometry` (KVGeometry), `pad` (PadRow) and three launch-only
methods: `decode(stream, inputs, logits_out)` (capturable), `prefill(stream, seqs,
logits_out)` (eager; logits of each sequence's last prompt token) and `sample(stream,
logits, inputs, out_tokens, sampling)` (writes out_tokens and the device token table); and
`release_stream(stream)`, called by the runner's close() once the graphs captured on its
stream are destroyed, to free per-stream resources (the bundled model's cuBLAS handle), so
that many engines can run one after another on one model.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vt.graphs.inputs import DecodeRows, PadRow, allocate_inputs, copy_inputs_h2d, fill_host
from vt.graphs.capture import LOGITS_DTYPE


@dataclass(frozen=True)
class KVGeometry:
    """Sequence rows and the paged KV cache. Row `max_seqs` of the token table and of the
    recurrent state, and KV block `scratch_block`, are scratch: padded rows point there."""
    max_seqs: int
    num_kv_blocks: int        # all blocks, the scratch block included
    block_size: int
    max_context: int
    scratch_block: int = 0

    def __post_init__(self):
        for name in ("max_seqs", "num_kv_blocks", "block_size", "max_context"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"KVGeometry.{name} must be a positive int, got {v!r}")
        if self.num_kv_blocks < 2 or not 0 <= self.scratch_block < self.num_kv_blocks:
            raise ValueError(f"KVGeometry: num_kv_blocks={self.num_kv_blocks} must hold the scratch "
                             f"block {self.scratch_block} and at least one more")

    @property
    def max_blocks(self) -> int:
        return -(-self.max_context // self.block_size)

    @property
    def pad(self) -> PadRow:
        return PadRow(token_row=self.max_seqs, state_idx=self.max_seqs,
                      slot=self.scratch_block * self.block_size, block=self.scratch_block)


@dataclass
class PrefillSeq:
    """One newly admitted sequence: its row (token-table row = state slot) and prompt."""
    row: int
    tokens: np.ndarray        # [L] int32
    block_table: np.ndarray   # [max_blocks] int32
    state_idx: int

    def slot(self, position: int, block_size: int) -> int:
        return int(self.block_table[position // block_size]) * block_size + position % block_size


def decode_rows(seqs: list[PrefillSeq], block_size: int, positions) -> DecodeRows:
    """Rows of `seqs` at `positions` (one per seq), as a decode step would see them."""
    pos = np.asarray(positions, np.int32)
    return DecodeRows(
        token_rows=np.array([s.row for s in seqs], np.int32), positions=pos,
        seq_lens=pos + 1,
        slot_mapping=np.array([s.slot(int(p), block_size) for s, p in zip(seqs, pos)], np.int32),
        block_tables=np.stack([s.block_table for s in seqs]).astype(np.int32, copy=False),
        state_idx=np.array([s.state_idx for s in seqs], np.int32))


class ForwardModel:
    """A user-written decode forward as a step model.

    forward(stream, inputs, logits_out) reads the input token of row r from
    token_table[inputs.token_rows[r]] and writes logits_out [S, vocab] f32. Prefill steps the
    same forward over the prompt one position at a time (eager), which is correct for any
    causal forward; sampling is vt's greedy / temperature+top-k kernel.
    """

    def __init__(self, be, forward, *, vocab: int, token_table, geometry: KVGeometry):
        if len(token_table) < geometry.max_seqs + 1:
            raise ValueError(f"token_table has {len(token_table)} rows; it needs max_seqs + 1 = "
                             f"{geometry.max_seqs + 1} (the last one is the scratch row)")
        self.be, self.forward, self.vocab = be, forward, vocab
        self.token_table, self.geometry, self.pad = token_table, geometry, geometry.pad
        # Prefill staging for every prompt position of a full batch, allocated once so that
        # serving never grows memory. Safe to reuse: prefill steps own their logits and drain.
        cap = geometry.max_seqs * geometry.max_context
        self._host = allocate_inputs(be.pinned_empty, cap, geometry.max_blocks)
        self._dev = allocate_inputs(be.empty, cap, geometry.max_blocks)
        self._host_tokens = be.pinned_empty((cap,), np.int32)
        self._dev_tokens = be.empty((cap,), np.int32)
        self._tmp_logits = be.empty((geometry.max_seqs, vocab), LOGITS_DTYPE)
        from vt.model.kernels.sampling import Sample
        self._sample = Sample()

    def decode(self, stream, inputs, logits_out) -> None:
        self.forward(stream, inputs, logits_out)

    def prefill(self, stream, seqs: list[PrefillSeq], logits_out) -> None:
        """Substep p runs the forward over every sequence with a token at position p, padded
        to row_bucket rows (scratch rows), so the forward only ever sees those few shapes."""
        bs = self.geometry.block_size
        steps, at = [], 0
        for p in range(max(len(s.tokens) for s in seqs)):
            live = [i for i, s in enumerate(seqs) if p < len(s.tokens)]
            size = self.row_bucket(len(live))
            rows = decode_rows([seqs[i] for i in live], bs, [p] * len(live))
            fill_host(self._host.rows(at, at + size), rows, self.pad)
            self._host_tokens[at:at + size] = 0
            self._host_tokens[at:at + len(live)] = [seqs[i].tokens[p] for i in live]
            steps.append((at, size, live, p))
            at += size
        copy_inputs_h2d(self.be, self._dev, self._host, stream, at)
        self.be.copy_h2d(self._dev_tokens[:at], self._host_tokens[:at], stream)
        for start, size, live, p in steps:
            inp = self._dev.rows(start, start + size)
            self.be.launch(stream, _SCATTER, self.token_table, inp.token_rows,
                           self._dev_tokens[start:start + size])
            tmp = self._tmp_logits[:size]
            self.forward(stream, inp, tmp)
            for j, i in enumerate(live):
                if p == len(seqs[i].tokens) - 1:
                    self.be.copy_d2d(logits_out[i:i + 1], tmp[j:j + 1], stream)

    def row_bucket(self, n: int) -> int:
        """Rows a prefill substep of n live sequences runs at: the next power of two, at most
        max_seqs (a few shapes, each warmed once by warm_up_prefill)."""
        return min(1 << max(0, n - 1).bit_length(), self.geometry.max_seqs)

    def warm_up_prefill(self, stream, max_prefill_tokens: int, logits_out) -> None:
        """One prefill substep at every row bucket, on scratch rows only (Runner.warm_up).
        A substep's shape depends on its live rows only, not on the prompt lengths."""
        g = self.geometry
        sizes = sorted({self.row_bucket(n) for n in range(1, g.max_seqs + 1)})
        scratch = PrefillSeq(g.max_seqs, np.zeros(1, np.int32),
                             np.full(g.max_blocks, g.scratch_block, np.int32), g.max_seqs)
        for size in sizes:
            self.prefill(stream, [scratch] * size, logits_out[:size])
            stream.synchronize()   # the staging area is reused by the next bucket

    def release_stream(self, stream) -> None:
        """Nothing to free: a user forward keeps no per-stream state vt knows of."""

    def sample(self, stream, logits, inputs, out_tokens, sampling) -> None:
        temperature = 0.0 if sampling is None else float(sampling.temperature)
        k = 1 if sampling is None else int(sampling.k)
        seed = 0 if sampling is None else int(sampling.seed)
        self.be.launch(stream, self._sample, logits, inputs.token_rows, inputs.positions,
                       out_tokens, self.token_table, k=k, temperature=temperature, seed=seed)


class _ScatterRows:
    """table[rows] = values (a prompt token into its sequence's token-table row)."""

    def run_numpy(self, table, rows, values):
        table[rows] = values

    def run_cupy(self, stream_handle, table, rows, values):
        table[rows] = values


_SCATTER = _ScatterRows()


def as_step_model(be, model_or_forward):
    """The step model the runner drives: one already (ForwardModel, an adapter) as is, a
    vt.model.HybridModel adapted."""
    if all(hasattr(model_or_forward, a) for a in ("geometry", "pad", "vocab", "decode", "prefill", "sample")):
        return model_or_forward
    if all(hasattr(model_or_forward, a) for a in ("decode", "prefill", "sample", "token_table")):
        from vt.hybrid_adapter import HybridStepModel
        return HybridStepModel(be, model_or_forward)
    raise TypeError(f"Engine needs a vt.model.HybridModel or a vt.ForwardModel wrapping a "
                    f"user-written forward, got {type(model_or_forward).__name__}; wrap a bare "
                    f"forward as ForwardModel(be, forward, vocab=..., token_table=..., geometry=...)")
