"""The bundled vt.model.HybridModel as a step model (vt.stepmodel).

decode and sample are the model's own. Prefill inputs are built here from a staging area
allocated once, instead of PrefillInputs.build (which allocates pinned memory and
synchronizes the stream per call): prefill steps own their logits and drain, so the next
prefill's Refresh always comes after the device has read this one's copy.
"""
from __future__ import annotations

import numpy as np

from vt.stepmodel import KVGeometry, PrefillSeq

_PER_TOKEN = ("token_ids", "positions", "slot_mapping", "ctx_lens", "token_seq")
_PER_SEQ = ("last_idx", "last_positions", "token_rows", "state_idx")


class HybridStepModel:
    def __init__(self, be, model):
        from vt.model import PrefillInputs, SamplingParams
        self._PrefillInputs, self._greedy = PrefillInputs, SamplingParams()
        cfg = model.cfg
        self.be, self.m, self.vocab = be, model, cfg.vocab
        # The model's scratch block sits past its num_kv_blocks real ones.
        self.geometry = KVGeometry(max_seqs=model.max_seqs, num_kv_blocks=model.num_kv_blocks + 1,
                                   block_size=cfg.kv_block_size, max_context=cfg.max_context,
                                   scratch_block=model.scratch_block)
        self.pad = self.geometry.pad
        if (self.pad.token_row, self.pad.state_idx) != (model.scratch_row, model.scratch_state):
            raise ValueError(f"HybridModel scratch row/state ({model.scratch_row}, "
                             f"{model.scratch_state}) are not max_seqs={model.max_seqs}")
        tokens, seqs, mb = model.max_seqs * cfg.max_context, model.max_seqs, cfg.max_blocks_per_seq
        shapes = {**{f: (tokens,) for f in _PER_TOKEN}, **{f: (seqs,) for f in _PER_SEQ},
                  "cu_seqlens": (seqs + 1,), "block_tables": (seqs, mb)}
        self._host = {f: be.pinned_empty(s, np.int32) for f, s in shapes.items()}
        self._dev = {f: be.empty(s, np.int32) for f, s in shapes.items()}

    @property
    def token_table(self):
        return self.m.token_table

    def decode(self, stream, inputs, logits_out) -> None:
        self.m.decode(stream, inputs, logits_out)

    def prefill(self, stream, seqs: list[PrefillSeq], logits_out) -> None:
        bs = self.geometry.block_size
        lens = np.array([len(s.tokens) for s in seqs])
        T, B = int(lens.sum()), len(seqs)
        pos = np.concatenate([np.arange(n) for n in lens])
        seq = np.repeat(np.arange(B), lens)
        cu = np.concatenate([[0], np.cumsum(lens)])
        bt = np.stack([s.block_table for s in seqs])
        values = dict(token_ids=np.concatenate([s.tokens for s in seqs]), positions=pos,
                      slot_mapping=bt[seq, pos // bs] * bs + pos % bs, ctx_lens=pos + 1,
                      token_seq=seq, cu_seqlens=cu, last_idx=cu[1:] - 1, last_positions=lens - 1,
                      token_rows=[s.row for s in seqs], state_idx=[s.state_idx for s in seqs],
                      block_tables=bt)
        views = {}
        for f, v in values.items():
            n = T if f in _PER_TOKEN else B + 1 if f == "cu_seqlens" else B
            self._host[f][:n] = v
            self.be.copy_h2d(self._dev[f][:n], self._host[f][:n], stream)
            views[f] = self._dev[f][:n]
        pinp = self._PrefillInputs(**views, max_len=int(lens.max()))
        self.m.prefill(stream, pinp, logits_out)

    def sample(self, stream, logits, inputs, out_tokens, sampling) -> None:
        self.m.sample(stream, logits, inputs, out_tokens, sampling if sampling is not None else self._greedy)
