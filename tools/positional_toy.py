"""A position-addressed toy forward (the fuzzers' and the prefix-caching tests'), and its
poison writer.

Per row it embeds the input token (a hash of token and position), writes it to its paged KV
slot and, once every row of the step has written, reads back every slot of the sequence,
weighted by position (a stand-in for attention with no recurrent state): the KV of a
position depends only on the tokens up to it, so a sequence may start from another's cached
blocks (prefix_cacheable), a step that reads a poisoned (NaN) slot produces NaN logits (an
error row), and a speculative verify step is a decode over its rows (verifies_by_decode,
vt/forward/speculative.py: the rows of one sequence's k + 1 positions read each other's
KV). vt.forward.toy's forward keeps a recurrent state per row instead, so neither prefix
caching nor speculation can be on for it.

A speculative engine's draft is a second PositionalToy of the same geometry: with noise 0
the target's own function (every draft accepted), with noise > 0 another model whose
logits are the target's plus noise * sin(3.1 j + 7 e) (e: the row's embedding), so that it
agrees with the target's argmax sometimes, not always."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not
from vt.backend.zeros import zeros  # noqa: E402
from vt.forward.speculative import verify_table_rows  # noqa: E402
from vt.forward.toy import LOGITS  # noqa: E402
from vt.forward.user import ForwardModel, KVGeometry, kv_slot  # noqa: E402
from vt.hooks import with_device_work  # noqa: E402

VOCAB = 64


class PositionalToy:
    """forward(stream, inputs, logits_out) of the module docstring, on any backend."""

    prefix_cacheable = True
    verifies_by_decode = True
    vocab = VOCAB

    def __init__(self, be, geometry: KVGeometry, *, max_k: int = 0, noise: float = 0.0):
        """max_k: the most drafts a speculative engine verifies per row (the token table then
        holds verify_table_rows(...) entries); noise: see the module docstring (a draft)."""
        if not noise >= 0:
            raise ValueError(f"PositionalToy: noise must be >= 0, got {noise!r}")
        self.be, self.geometry, self.noise = be, geometry, float(noise)
        g = geometry
        entries = verify_table_rows(g.max_seqs, g.max_seqs, max_k) if max_k else g.max_seqs + 1
        self.token_table = zeros(be, (entries,), np.int32)
        self.kv = zeros(be, (g.num_kv_blocks * g.block_size,), np.float32)

    def __call__(self, stream, inputs, logits_out) -> None:
        tmp = self.be.empty((len(inputs.token_rows), 2), np.float32)
        self.be.launch(stream, _ATTEND, self.token_table, inputs.token_rows, inputs.positions,
                       inputs.seq_lens, inputs.slot_mapping, inputs.block_tables, self.kv, tmp,
                       block_size=self.geometry.block_size)
        self.be.launch(stream, LOGITS, tmp, logits_out)
        if self.noise:
            self.be.launch(stream, _NOISE, tmp, logits_out, noise=self.noise)

    def step_model(self, device_work_s: float = 0.0):
        return with_device_work(ForwardModel(self.be, self, vocab=VOCAB, token_table=self.token_table,
                                             geometry=self.geometry), device_work_s)

    def poison_writer(self):
        """write(blocks): NaN into those KV blocks now, on a stream of its own, not ordered
        after the decode stream (what vt.hooks.KVPoison calls)."""
        side = self.be.stream(name="kv-poison")
        bs = self.geometry.block_size

        def write(blocks) -> None:
            slots = (np.repeat(np.asarray(blocks, np.int32) * bs, bs) +
                     np.tile(np.arange(bs, dtype=np.int32), len(blocks))).astype(np.int32)
            self.be.launch(side, _POISON, self.kv, slots)
            side.synchronize()
        return write


def _embed(tok, pos):
    x = np.sin(np.float32(tok) * np.float32(12.9898) + np.float32(pos) * np.float32(78.233)) * np.float32(43758.547)
    return np.float32(x - np.floor(x))


class _Attend:
    name = "positional_toy_attend"

    def run_numpy(self, table, rows, pos, lens, slots, bt, kv, tmp, *, block_size):
        for r in range(len(rows)):      # every row's KV first (verifies_by_decode) ...
            tmp[r, 1] = _embed(table[rows[r]], pos[r])
            kv[slots[r]] = tmp[r, 1]
        for r in range(len(rows)):      # ... then every row reads its sequence's
            q = np.arange(lens[r])
            w = np.sin(q.astype(np.float32) + np.float32(1)).astype(np.float32)
            tmp[r, 0] = (kv[kv_slot(bt[r], q, block_size)] * w).sum(dtype=np.float32)

    def run_cupy(self, stream_handle, table, rows, pos, lens, slots, bt, kv, tmp, *, block_size):
        # two kernels, in stream order: a row reads slots other rows of its sequence write
        _cupy()["write"](table, rows, pos, slots, kv, tmp, size=len(rows))
        _cupy()["attend"](lens, bt, np.int32(bt.shape[1]), np.int32(block_size), kv, tmp,
                          size=len(rows))


class _Noise:
    name = "positional_toy_noise"

    def run_numpy(self, tmp, logits, *, noise):
        j = np.arange(logits.shape[1], dtype=np.float32)
        logits += np.float32(noise) * np.sin(np.float32(3.1) * j + np.float32(7) * tmp[:, 1:])

    def run_cupy(self, stream_handle, tmp, logits, *, noise):
        _cupy()["noise"](tmp, np.int32(logits.shape[1]), np.float32(noise), logits)


class _Poison:
    name = "kv_poison"

    def run_numpy(self, kv, slots):
        kv[slots] = np.float32("nan")

    def run_cupy(self, stream_handle, kv, slots):
        import cupy as cp
        _cupy()["poison"](cp.asarray(slots), kv, size=len(slots))


_KERNELS = {}


def _cupy():
    if not _KERNELS:
        import cupy as cp
        _KERNELS["write"] = cp.ElementwiseKernel(
            "raw int32 table, raw int32 rows, raw int32 pos, raw int32 slots",
            "raw float32 kv, raw float32 tmp",
            """
            float x = sinf((float)table[rows[i]] * 12.9898f + (float)pos[i] * 78.233f) * 43758.547f;
            float v = x - floorf(x);
            kv[slots[i]] = v;
            tmp[2 * i + 1] = v;
            """, "vt_positional_toy_write")
        _KERNELS["attend"] = cp.ElementwiseKernel(
            "raw int32 lens, raw int32 bt, int32 max_blocks, int32 bs",
            "raw float32 kv, raw float32 tmp",
            """
            float acc = 0.f;
            for (int q = 0; q < lens[i]; ++q)
                acc += kv[bt[i * max_blocks + q / bs] * bs + q % bs] * sinf((float)q + 1.f);
            tmp[2 * i] = acc;
            """, "vt_positional_toy_attend")
        _KERNELS["noise"] = cp.ElementwiseKernel(
            "raw float32 tmp, int32 V, float32 noise", "float32 logits",
            "logits += noise * sinf(3.1f * (float)(i % V) + 7.f * tmp[2 * (i / V) + 1]);",
            "vt_positional_toy_noise")
        _KERNELS["poison"] = cp.ElementwiseKernel(
            "raw int32 slots", "raw float32 kv", "kv[slots[i]] = __int_as_float(0x7fc00000);",
            "vt_kv_poison")
    return _KERNELS


_ATTEND, _POISON, _NOISE = _Attend(), _Poison(), _Noise()
