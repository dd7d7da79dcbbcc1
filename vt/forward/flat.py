"""FlatStaging: a flattened batch (vt/step/flat.py) on its way to the device.

One pinned block and its device twin, allocated once for the largest step (every token of a
full batch: max_seqs * max_context), hold every vector of a flattened step one after another,
so a step's inputs travel in ONE host-to-device copy of the used prefix. Safe to reuse from
step to step: a step with prompt tokens owns its logits and drains, so the next step's write
comes after the device has read this one's copy.

Every vector starts on a 16-byte boundary (ALIGN_WORDS), whatever the step's token and
sequence counts. Triton compiles a kernel once per pattern of which pointer arguments are
16-byte aligned: were the vectors packed end to end, that pattern would change with the
counts, and the first step of new counts would compile another variant of the prompt kernels
(vt.torch's varlen attention, RoPE and KV write) in the middle of serving, hundreds of
milliseconds that every request in that step would wait for. Aligned, every step has the one
pattern the start-up warm-up compiles. (The device block starts aligned: the pool hands out
512-byte aligned blocks, and the sim's numpy arrays are 16-byte aligned.)
"""
from __future__ import annotations

import numpy as np

from vt.step.contract import KVGeometry
from vt.step.flat import SEQ_FIELDS, TOKEN_FIELDS, FlatInputs

ALIGN_WORDS = 4   # int32 words in 16 bytes: each vector starts at a multiple of this


def _padded(n: int) -> int:
    """n words rounded up to whole ALIGN_WORDS (where the next vector starts)."""
    return -(-n // ALIGN_WORDS) * ALIGN_WORDS


class FlatStaging:
    def __init__(self, be, geometry: KVGeometry):
        self.be, self.max_blocks = be, geometry.max_blocks
        self.max_tokens = geometry.max_seqs * geometry.max_context
        self.max_seqs = geometry.max_seqs
        words = self._words(self.max_tokens, self.max_seqs)
        self._host = be.pinned_empty((words,), np.int32)
        self._dev = be.empty((words,), np.int32)

    def _words(self, T: int, B: int) -> int:
        return sum(_padded(n) for _, n, _ in self._layout(T, B))

    def stage(self, flat: FlatInputs) -> FlatInputs:
        """Write the host batch `flat` into the pinned block; returns the device FlatInputs its
        upload() fills (the views, with flat's host copies and num_decode)."""
        T, B = flat.num_tokens, flat.batch
        if T > self.max_tokens or B > self.max_seqs:
            raise ValueError(f"a flattened step of {T} tokens and {B} sequences exceeds the "
                             f"staging for max_seqs * max_context = {self.max_tokens} tokens and "
                             f"max_seqs = {self.max_seqs} sequences")
        views, at = {}, 0
        for f, n, shape in self._layout(T, B):
            self._host[at:at + n].reshape(shape)[...] = getattr(flat, f)
            views[f] = self._dev[at:at + n].reshape(shape)
            at += _padded(n)
        self._used = at
        return FlatInputs(**views, query_start_loc_cpu=flat.query_start_loc_cpu,
                          seq_lens_cpu=flat.seq_lens_cpu, num_decode=flat.num_decode)

    def upload(self, stream, staged: FlatInputs, token_table) -> None:
        """The staged block to the device (one copy), then the decode rows' input ids gathered
        from the token table: their tokens were sampled by a step the host has not read yet."""
        self.be.copy_h2d(self._dev[:self._used], self._host[:self._used], stream)
        n = staged.num_decode
        if n:
            self.be.launch(stream, _GATHER, staged.input_ids[:n], token_table, staged.token_rows[:n])

    def _layout(self, T: int, B: int):
        for f in TOKEN_FIELDS:
            yield f, T, (T,)
        yield "query_start_loc", B + 1, (B + 1,)
        for f in SEQ_FIELDS:
            yield f, B, (B,)
        yield "block_tables", B * self.max_blocks, (B, self.max_blocks)


class _GatherRows:
    """out = table[rows] (a decode row's input token, from the device token table)."""

    name = "gather_rows"

    def run_numpy(self, out, table, rows):
        out[...] = table[rows]

    def run_cupy(self, stream_handle, out, table, rows):
        out[...] = table[rows]


_GATHER = _GatherRows()
