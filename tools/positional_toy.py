"""A position-addressed toy forward (the fuzzers' and the prefix-caching tests'), and its
poison writer.

Per row it embeds the input token (a hash of token and position), writes it to its paged KV
slot and reads back every slot of the sequence, weighted by position (a stand-in for
attention with no recurrent state): the KV of a position depends only on the tokens up to
it, so a sequence may start from another's cached blocks (prefix_cacheable), and a step
that reads a poisoned (NaN) slot produces NaN logits: an error row. vt.forward.toy's forward
keeps a recurrent state per row instead, so prefix caching cannot be on for it."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not
from vt.backend.zeros import zeros  # noqa: E402
from vt.forward.toy import LOGITS  # noqa: E402
from vt.forward.user import ForwardModel, KVGeometry, kv_slot  # noqa: E402
from vt.hooks import with_device_work  # noqa: E402

VOCAB = 64


class PositionalToy:
    """forward(stream, inputs, logits_out) of the module docstring, on any backend."""

    prefix_cacheable = True
    vocab = VOCAB

    def __init__(self, be, geometry: KVGeometry):
        self.be, self.geometry = be, geometry
        g = geometry
        self.token_table = zeros(be, (g.max_seqs + 1,), np.int32)
        self.kv = zeros(be, (g.num_kv_blocks * g.block_size,), np.float32)

    def __call__(self, stream, inputs, logits_out) -> None:
        tmp = self.be.empty((len(inputs.token_rows), 2), np.float32)
        self.be.launch(stream, _ATTEND, self.token_table, inputs.token_rows, inputs.positions,
                       inputs.seq_lens, inputs.slot_mapping, inputs.block_tables, self.kv, tmp,
                       block_size=self.geometry.block_size)
        self.be.launch(stream, LOGITS, tmp, logits_out)

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
        for r in range(len(rows)):
            v = _embed(table[rows[r]], pos[r])
            kv[slots[r]] = v
            q = np.arange(lens[r])
            w = np.sin(q.astype(np.float32) + np.float32(1)).astype(np.float32)
            tmp[r, 0] = (kv[kv_slot(bt[r], q, block_size)] * w).sum(dtype=np.float32)
            tmp[r, 1] = v

    def run_cupy(self, stream_handle, table, rows, pos, lens, slots, bt, kv, tmp, *, block_size):
        _cupy()["attend"](table, rows, pos, lens, slots, bt, np.int32(bt.shape[1]),
                          np.int32(block_size), kv, tmp, size=len(rows))


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
        _KERNELS["attend"] = cp.ElementwiseKernel(
            "raw int32 table, raw int32 rows, raw int32 pos, raw int32 lens, raw int32 slots, "
            "raw int32 bt, int32 max_blocks, int32 bs", "raw float32 kv, raw float32 tmp",
            """
            float x = sinf((float)table[rows[i]] * 12.9898f + (float)pos[i] * 78.233f) * 43758.547f;
            float v = x - floorf(x);
            kv[slots[i]] = v;
            float acc = 0.f;
            for (int q = 0; q < lens[i]; ++q)
                acc += kv[bt[i * max_blocks + q / bs] * bs + q % bs] * sinf((float)q + 1.f);
            tmp[2 * i] = acc;
            tmp[2 * i + 1] = v;
            """, "vt_positional_toy_attend")
        _KERNELS["poison"] = cp.ElementwiseKernel(
            "raw int32 slots", "raw float32 kv", "kv[slots[i]] = __int_as_float(0x7fc00000);",
            "vt_kv_poison")
    return _KERNELS


_ATTEND, _POISON = _Attend(), _Poison()
