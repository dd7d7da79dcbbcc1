"""A small user-style decode forward: not the bundled model, written only against the forward
contract (ForwardModel's `forward(stream, inputs, logits_out)`, vt/forward/user.py; the step
contract it is part of is vt/step/contract.py), used by the tests and the hazard reproducer.

Per row it embeds the input token (a hash of token and position), writes it to its paged KV
slot, sums the sequence's KV entries (a stand-in for attention), updates a recurrent state
(reset at position 0) and emits logits that depend on both. Every output depends on every
per-step input, so a replay that reads the wrong host vectors produces the wrong tokens.
"""
from __future__ import annotations

import numpy as np

from vt.backend.zeros import zeros
from vt.forward.user import ForwardModel, KVGeometry, kv_slot
from vt.validate import INT32_MAX, integer


class ToyForward:
    """forward(stream, inputs, logits_out): launches two kernels, allocates one temporary.
    (vt.hooks.with_device_work adds device time per decode, so that the host runs ahead
    of the device: the regime where the host-overwrite hazard shows.)"""

    DEFAULT_VOCAB = 64

    def __init__(self, be, *, vocab: int = DEFAULT_VOCAB, geometry: KVGeometry | None = None):
        self.be, self.vocab = be, integer("ToyForward.vocab", vocab, 2, INT32_MAX)
        self.geometry = geometry or KVGeometry(max_seqs=64, num_kv_blocks=512, block_size=4,
                                               max_context=64)
        g = self.geometry
        self.token_table = zeros(be, (g.max_seqs + 1,), np.int32)   # [rows + scratch]
        self.kv = zeros(be, (g.num_kv_blocks * g.block_size,), np.float32)
        self.state = zeros(be, (g.max_seqs + 1,), np.float32)

    def __call__(self, stream, inputs, logits_out) -> None:
        rows = len(inputs.token_rows)
        tmp = self.be.empty((rows, 2), np.float32)   # [S, (acc, state)]: scratch under capture
        self.be.launch(stream, _ATTEND, self.token_table, inputs.token_rows, inputs.positions,
                       inputs.seq_lens, inputs.slot_mapping, inputs.block_tables,
                       inputs.state_idx, self.kv, self.state, tmp,
                       block_size=self.geometry.block_size)
        self.be.launch(stream, LOGITS, tmp, logits_out)

    def step_model(self) -> ForwardModel:
        return ForwardModel(self.be, self, vocab=self.vocab, token_table=self.token_table,
                            geometry=self.geometry)


class _Attend:
    name = "toy_attend"

    def run_numpy(self, table, rows, pos, lens, slots, bt, sidx, kv, state, tmp, *, block_size):
        for r in range(len(rows)):
            v = _embed(np.float32(table[rows[r]]), np.float32(pos[r]))
            kv[slots[r]] = v
            q = np.arange(lens[r])
            acc = kv[kv_slot(bt[r], q, block_size)].sum(dtype=np.float32)
            st = v if pos[r] == 0 else np.float32(state[sidx[r]] * np.float32(0.5) + v)
            state[sidx[r]] = st
            tmp[r, 0], tmp[r, 1] = acc, st

    def run_cupy(self, stream_handle, table, rows, pos, lens, slots, bt, sidx, kv, state, tmp, *,
                 block_size):
        _cupy_kernels()["attend"](table, rows, pos, lens, slots, bt, sidx, np.int32(bt.shape[1]),
                                  np.int32(block_size), kv, state, tmp, size=len(rows))


class _Logits:
    name = "toy_logits"

    def run_numpy(self, tmp, logits):
        j = np.arange(logits.shape[1], dtype=np.float32)
        logits[...] = np.sin(tmp[:, :1] * (j + 1) * np.float32(0.37) + tmp[:, 1:] * np.float32(1.3) + j)

    def run_cupy(self, stream_handle, tmp, logits):
        _cupy_kernels()["logits"](tmp, np.int32(logits.shape[1]), logits)


def _embed(tok, pos):
    x = np.sin(tok * np.float32(12.9898) + pos * np.float32(78.233)) * np.float32(43758.547)
    return np.float32(x - np.floor(x))


_KERNELS = {}


def _cupy_kernels():
    """CuPy ElementwiseKernels, built on first use (cupy is imported only on the cuda path)."""
    if not _KERNELS:
        import cupy as cp
        _KERNELS["attend"] = cp.ElementwiseKernel(
            "raw int32 table, raw int32 rows, raw int32 pos, raw int32 lens, raw int32 slots, "
            "raw int32 bt, raw int32 sidx, int32 max_blocks, int32 bs",
            "raw float32 kv, raw float32 state, raw float32 tmp",
            """
            float x = sinf((float)table[rows[i]] * 12.9898f + (float)pos[i] * 78.233f) * 43758.547f;
            float v = x - floorf(x);
            kv[slots[i]] = v;
            float acc = 0.f;
            for (int q = 0; q < lens[i]; ++q)
                acc += kv[bt[i * max_blocks + q / bs] * bs + q % bs];
            float st = pos[i] == 0 ? v : state[sidx[i]] * 0.5f + v;
            state[sidx[i]] = st;
            tmp[2 * i] = acc;
            tmp[2 * i + 1] = st;
            """, "vt_toy_attend")
        _KERNELS["logits"] = cp.ElementwiseKernel(
            "raw float32 tmp, int32 V", "float32 logits",
            "int r = i / V, j = i % V;"
            "logits = sinf(tmp[2 * r] * (j + 1) * 0.37f + tmp[2 * r + 1] * 1.3f + j);",
            "vt_toy_logits")
    return _KERNELS


_ATTEND = _Attend()
# The logits step (tmp [S, 2] -> logits [S, V]), shared by tools/positional_toy.py's toy.
LOGITS = _Logits()
