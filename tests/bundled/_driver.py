"""A minimal host-side driver of HybridModel for tests: block tables, padding, eager steps."""
import numpy as np

from vt.bundled import PrefillInputs, SamplingParams, upload_decode_inputs
from vt.step.contract import kv_slot


class Driver:
    """Sequences live in token-table rows; each gets random (non-contiguous) KV blocks."""

    def __init__(self, model, io, seed=0):
        self.m, self.io, self.cfg = model, io, model.cfg
        mb = self.cfg.max_blocks_per_seq
        self.bt = np.full((model.max_seqs, mb), model.scratch_block, np.int32)
        perm = np.random.default_rng(seed).permutation(model.num_kv_blocks)
        per = model.num_kv_blocks // model.max_seqs
        for r in range(model.max_seqs):
            self.bt[r, : min(per, mb)] = perm[r * per: r * per + min(per, mb)]
        self.state = {r: (model.max_seqs - 1 - r) for r in range(model.max_seqs)}  # shuffled slots
        self.lens = {}

    def prefill(self, prompts, rows, sampling=SamplingParams()):
        """Prefill and sample (writing the token table); returns (logits, tokens) on the host."""
        be, s = self.io.be, self.io.s
        pin = PrefillInputs.build(be, s, prompts, token_rows=rows, state_idx=[self.state[r] for r in rows],
                                  block_tables=self.bt[rows], block_size=self.cfg.kv_block_size,
                                  sampling=sampling)
        logits = be.empty((len(rows), self.cfg.vocab), np.float32)
        toks = be.empty((len(rows),), np.int32)
        self.m.prefill(s, pin, logits)
        self.m.sample(s, logits, pin, toks)
        for r, p in zip(rows, prompts):
            self.lens[r] = len(p)
        return self.io.get(logits), self.io.get(toks)

    def decode_host(self, rows, S):
        """Host arrays of one decode step for `rows`, padded to S with scratch rows."""
        bs = self.cfg.kv_block_size
        pad = dict(token_rows=self.m.scratch_row, positions=0, seq_lens=1,   # a scratch row
                   slot_mapping=self.m.scratch_block * bs, block_tables=self.m.scratch_block,
                   state_idx=self.m.scratch_state)
        h = {k: np.full((S, self.bt.shape[1]) if k == "block_tables" else S, v, np.int32)
             for k, v in pad.items()}
        for i, r in enumerate(rows):
            p = self.lens[r]
            h["token_rows"][i], h["positions"][i], h["seq_lens"][i] = r, p, p + 1
            h["slot_mapping"][i] = kv_slot(self.bt[r], p, bs)
            h["block_tables"][i], h["state_idx"][i] = self.bt[r], self.state[r]
        return h

    def advance(self, rows):
        for r in rows:
            self.lens[r] += 1

    def decode(self, rows, S, sampling=SamplingParams()):
        """One eager step: returns (logits [S, V], sampled tokens [S]) on the host."""
        be, s = self.io.be, self.io.s
        inp = upload_decode_inputs(be, s, sampling=sampling, **self.decode_host(rows, S))
        logits = be.empty((S, self.cfg.vocab), np.float32)
        toks = be.empty((S,), np.int32)
        self.m.decode(s, inp, logits)
        self.m.sample(s, logits, inp, toks)
        self.advance(rows)
        return self.io.get(logits), self.io.get(toks)
