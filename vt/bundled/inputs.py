"""Per-step metadata of the model, as DEVICE arrays (a captured graph re-reads them at every
replay). The host fills pinned twins of the same shapes and copies them in (vt/graphs owns
those for decode); `upload` is the simple eager way, used by tests and prefill."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# One definition of the decode inputs for the driver and every forward (the bundled model is one).
from vt.step.contract import (FIELDS, GREEDY, DecodeInputs, RowSampling, SamplingParams, kv_slot,
                              row_vectors)


def _sampling_vectors(sampling: SamplingParams, n: int) -> dict:
    """Per-row sampling vectors of n rows that all sample with `sampling`."""
    return row_vectors([sampling] * n)


_KEEP_DTYPE = ("temperature", "top_p", "min_p", "seed", "presence_penalty", "frequency_penalty",
               "repetition_penalty")


def _upload(be, stream, host: dict) -> dict:
    out = {}
    for name, a in host.items():
        a = np.ascontiguousarray(a, a.dtype if name in _KEEP_DTYPE else np.int32)
        pinned = be.pinned_empty(a.shape, a.dtype)
        pinned[...] = a
        out[name] = be.empty(a.shape, a.dtype)
        be.copy_h2d(out[name], pinned, stream)
        out.setdefault("_keep", []).append(pinned)  # pinned sources live until the copy ran
    return out


def upload_decode_inputs(be, stream, *, sampling: SamplingParams = GREEDY, **host) -> DecodeInputs:
    """Eager, synchronous upload of host arrays (tests, bench); vt/graphs does it per step.
    Rows sample with `sampling` unless `host` gives the sampling vectors itself."""
    host = {**_sampling_vectors(sampling, len(host["token_rows"])), **host}
    d = _upload(be, stream, {f: host[f] for f in FIELDS})
    stream.synchronize()
    return DecodeInputs(**{f: d[f] for f in FIELDS})


@dataclass
class PrefillInputs(RowSampling):
    """Segments of B sequences, concatenated into T tokens: a whole prompt from position 0, or
    a chunk from a later position (the positions before it already in the KV cache and GDN
    state; build() makes whole prompts only).

    Per token: token_ids, positions, slot_mapping, ctx_lens (= position + 1: the prefix it
    attends to, read from the cache, earlier chunks and this step's writes alike), token_seq
    (its sequence b). Per sequence: cu_seqlens[B+1], last_idx[B] (its last token),
    last_positions[B], token_rows[B], state_idx[B], block_tables[B, max_blocks], and each
    sequence's sampling (the RowSampling vectors, [B]). Every bound
    the kernels use is read per token on the device (ctx_lens), none from the host.
    """

    token_ids: object
    positions: object
    slot_mapping: object
    ctx_lens: object
    token_seq: object
    cu_seqlens: object
    last_idx: object
    last_positions: object
    token_rows: object
    state_idx: object
    block_tables: object

    @property
    def batch(self) -> int:
        return int(self.token_rows.shape[0])

    @property
    def tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def sample_positions(self):
        return self.last_positions

    @classmethod
    def build(cls, be, stream, prompts, token_rows, state_idx, block_tables, block_size,
              sampling: SamplingParams = GREEDY):
        """From host lists: prompts (list of token lists), and per sequence its token-table
        row, state slot and block table row ([B, max_blocks] numpy); all sample with `sampling`."""
        lens = np.array([len(p) for p in prompts], np.int64)
        if len(prompts) == 0 or lens.min() == 0:
            raise ValueError(f"PrefillInputs: every prompt needs >= 1 token, got lengths {lens.tolist()}")
        bt = np.asarray(block_tables, np.int64)
        need = -(-lens.max() // block_size)
        if bt.shape[1] < need:
            raise ValueError(f"PrefillInputs: block_tables has {bt.shape[1]} columns but the "
                             f"longest prompt ({lens.max()} tokens) needs {need}")
        pos = np.concatenate([np.arange(n) for n in lens])
        seq = np.repeat(np.arange(len(lens)), lens)
        cu = np.concatenate([[0], np.cumsum(lens)])
        host = dict(token_ids=np.concatenate([np.asarray(p) for p in prompts]), positions=pos,
                    slot_mapping=kv_slot(bt[seq], pos, block_size),
                    ctx_lens=pos + 1, token_seq=seq, cu_seqlens=cu, last_idx=cu[1:] - 1,
                    last_positions=lens - 1, token_rows=token_rows, state_idx=state_idx,
                    block_tables=bt, **_sampling_vectors(sampling, len(prompts)))
        d = _upload(be, stream, host)
        stream.synchronize()
        return cls(**{k: v for k, v in d.items() if k != "_keep"})
