"""ForwardModel: a user-written decode forward as a step model (vt.step.contract.StepModel).

The contract's types are re-exported here, where the README's examples import them from.
"""
from __future__ import annotations

import numpy as np

from vt.forward.flat import FlatStaging
from vt.step.flat import flatten
from vt.step.inputblock import InputBlock
from vt.sampling import Sampler
from vt.step.contract import (LOGITS_DTYPE, DecodeInputs, DecodeRows, KVGeometry, PadRow,  # noqa: F401
                     PrefillSeq, SamplingParams, StepModel, kv_slot)
from vt.validate import INT32_MAX, integer


PREFILL_MODES = ("positions", "flat")


class ForwardModel(StepModel):
    """forward(stream, inputs, logits_out) reads the input token of row r from
    token_table[inputs.token_rows[r]] and writes logits_out [S, vocab] f32; sampling is vt's
    per-row greedy / temperature + top-k kernel. How prompts run, by `prefill`:

    - "positions" (the default): the same forward over the prompt one position at a time
      (eager), which is correct for any causal forward: a prompt of P tokens costs P calls;
    - "flat": one call per step over the flattened batch (vt/step/flat.py): `inputs` is then
      a vt.step.FlatInputs of every token the step runs (prompt chunks, and in a mixed step
      the decode rows, first) and logits_out [B, vocab] one row per sequence. The forward
      must then attend causally within each sequence over its cached prefix.

    prefix_cacheable: the forward's KV of a position depends only on the tokens up to it
    and it keeps no other per-sequence state (StepModel.prefix_cacheable); None (the
    default) takes the forward's own `prefix_cacheable` attribute, else False.
    """

    chunked_prefill = True   # prefill() starts at PrefillSeq.start: a prompt may come in chunks

    def __init__(self, be, forward, *, vocab: int, token_table, geometry: KVGeometry,
                 prefill: str = "positions", prefix_cacheable: bool | None = None):
        _check_args(forward, vocab, token_table, geometry)
        if prefix_cacheable is None:
            prefix_cacheable = getattr(forward, "prefix_cacheable", False)
        if not isinstance(prefix_cacheable, bool):
            raise TypeError(f"ForwardModel: prefix_cacheable must be a bool or None, got "
                            f"{prefix_cacheable!r}")
        self.prefix_cacheable = prefix_cacheable
        if prefill not in PREFILL_MODES:
            raise ValueError(f"ForwardModel: prefill={prefill!r}; expected one of {PREFILL_MODES}")
        if len(token_table) < geometry.max_seqs + 1:
            raise ValueError(f"token_table has {len(token_table)} rows; it needs max_seqs + 1 = "
                             f"{geometry.max_seqs + 1} (the last one is the scratch row)")
        self.be, self.forward, self.vocab = be, forward, int(vocab)
        self.token_table, self.geometry, self.pad = token_table, geometry, geometry.pad
        self.prefill_mode = prefill
        self.mixed_in_one_call = prefill == "flat"
        # Prefill staging for every prompt position of a full batch, allocated once so that
        # serving never grows memory. Safe to reuse: prefill steps own their logits and drain.
        cap = geometry.max_seqs * geometry.max_context
        if prefill == "flat":
            self._flat = FlatStaging(be, geometry)
        else:
            self._host = InputBlock(be.pinned_empty, cap, geometry.max_blocks)
            self._dev = InputBlock(be.empty, cap, geometry.max_blocks)
            self._host_tokens = be.pinned_empty((cap,), np.int32)
            self._dev_tokens = be.empty((cap,), np.int32)
            self._tmp_logits = be.empty((geometry.max_seqs, vocab), LOGITS_DTYPE)
        self._sample = Sampler()
        self._sample.bind(be, geometry.max_seqs + 1, vocab)
        self.token_masks = self._sample.masks

    def decode(self, stream, inputs, logits_out) -> None:
        self.forward(stream, inputs, logits_out)

    def prefill(self, stream, seqs: list[PrefillSeq], logits_out) -> None:
        self.prepare_prefill(seqs)(stream, logits_out)

    def prepare_prefill(self, seqs: list[PrefillSeq]):
        if self.prefill_mode == "flat":
            return self.prepare_mixed(None, seqs)
        return lambda stream, logits_out: self._prefill_by_position(stream, seqs, logits_out)

    def prepare_mixed(self, decode, seqs: list[PrefillSeq]):
        """The flattened batch of `decode`'s rows (host arrays; None: none) and `seqs`'
        chunks, staged now; launch(stream, logits_out) uploads it and runs the forward once."""
        if self.prefill_mode != "flat":
            return super().prepare_mixed(decode, seqs)
        staged = self._flat.stage(flatten(decode, seqs, self.geometry.block_size))

        def launch(stream, logits_out) -> None:
            self._flat.upload(stream, staged, self.token_table)
            self.forward(stream, staged, logits_out[:staged.batch])
        return launch

    def _prefill_by_position(self, stream, seqs: list[PrefillSeq], logits_out) -> None:
        """Substep p runs the forward over every sequence with a token at position p, padded
        to row_bucket rows (scratch rows), so the forward only ever sees those few shapes."""
        bs = self.geometry.block_size
        steps, at = [], 0
        for p in range(min(s.start for s in seqs), max(len(s.tokens) for s in seqs)):
            live = [i for i, s in enumerate(seqs) if s.start <= p < len(s.tokens)]
            if not live:     # between one sequence's end and another's chunk start
                continue
            size = self.row_bucket(len(live))
            self._host.fill_range(at, _rows_at([seqs[i] for i in live], p, bs), at + size, self.pad)
            self._host_tokens[at:at + size] = 0
            self._host_tokens[at:at + len(live)] = [seqs[i].tokens[p] for i in live]
            steps.append((at, size, live, p))
            at += size
        self._host.copy_rows_to(self.be, self._dev, stream, at)
        self.be.copy_h2d(self._dev_tokens[:at], self._host_tokens[:at], stream)
        for start, size, live, p in steps:
            inp = self._dev.inputs.rows(start, start + size)
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
        """Prefill shapes once each, on scratch sequences only (the eager warm-up). "positions":
        one substep at every row bucket (a substep's shape depends on its live rows only).
        "flat": a step of every power of two tokens up to max_prefill_tokens, and one of
        max_prefill_tokens itself (the largest a step can be, so the forward's allocator has
        grown to it), in sequences of at most max_context tokens."""
        g = self.geometry
        scratch = lambda n: PrefillSeq(g.max_seqs, np.zeros(n, np.int32),   # noqa: E731
                                       np.full(g.max_blocks, g.scratch_block, np.int32), g.max_seqs)
        if self.prefill_mode == "flat":
            top = min(max_prefill_tokens, self._flat.max_tokens)
            sizes = sorted({1 << k for k in range(top.bit_length())} | {top})
            steps = []
            for T in sizes:
                full, rest = divmod(T, g.max_context)
                steps.append([scratch(g.max_context)] * full + [scratch(rest)] * bool(rest))
        else:
            sizes = sorted({self.row_bucket(n) for n in range(1, g.max_seqs + 1)})
            steps = [[scratch(1)] * size for size in sizes]
        for seqs in steps:
            self.prefill(stream, seqs, logits_out[:len(seqs)])
            stream.synchronize()   # the staging area is reused by the next bucket

    def release_stream(self, stream) -> None:
        """Nothing to free: a user forward keeps no per-stream state vt knows of."""

    def sample(self, stream, logits, inputs, out_tokens) -> None:
        self.be.launch(stream, self._sample, logits, inputs.token_rows, inputs.sample_positions,
                       inputs.temperature, inputs.top_k, inputs.top_p, inputs.min_p, inputs.seed,
                       out_tokens, self.token_table, *self._sample.extra_args(inputs))

    def begin_requests(self, stream, seqs) -> None:
        self._sample.begin_rows(stream, seqs)


def _check_args(forward, vocab, token_table, geometry) -> None:
    """TypeError/ValueError naming the argument: a wrong one fails here, not in a kernel."""
    if not callable(forward):
        raise TypeError(f"ForwardModel: forward must be callable as forward(stream, inputs, "
                        f"logits_out), got {type(forward).__name__}")
    integer("ForwardModel: vocab", vocab, 2, INT32_MAX)   # token ids are int32
    if not isinstance(geometry, KVGeometry):
        raise TypeError(f"ForwardModel: geometry must be a vt.KVGeometry, got {type(geometry).__name__}")
    shape, dtype = getattr(token_table, "shape", None), getattr(token_table, "dtype", None)
    if shape is None or dtype is None or len(shape) != 1 or np.dtype(dtype) != np.int32:
        raise TypeError(f"ForwardModel: token_table must be a 1-D int32 device array "
                        f"(be.empty((max_seqs + 1,), np.int32)), got shape {shape} dtype {dtype}")


def _rows_at(seqs: list[PrefillSeq], p: int, block_size: int) -> DecodeRows:
    """`seqs` at prompt position p, as decode rows (the forward's inputs of a prefill substep)."""
    pos = np.full(len(seqs), p, np.int32)
    bt = np.stack([s.block_table for s in seqs]).astype(np.int32, copy=False)
    rows = np.array([s.row for s in seqs], np.int32)
    return DecodeRows(rows, pos, pos + 1, kv_slot(bt, pos, block_size).astype(np.int32), bt,
                      np.array([s.state_idx for s in seqs], np.int32))


class _ScatterRows:
    """table[rows] = values (a prompt token into its sequence's token-table row)."""

    def run_numpy(self, table, rows, values):
        table[rows] = values

    def run_cupy(self, stream_handle, table, rows, values):
        table[rows] = values


_SCATTER = _ScatterRows()
