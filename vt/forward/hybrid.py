"""The bundled vt.bundled.HybridModel as a step model (vt.forward.user).

decode and sample are the model's own. Prefill inputs are built here from a staging area
allocated once, instead of PrefillInputs.build (which allocates pinned memory and
synchronizes the stream per call): prefill steps own their logits and drain, so the next
prefill's Refresh always comes after the device has read this one's copy.

Prefill comes in chunks (chunked_prefill): a PrefillSeq with start > 0 prefills
tokens[start:] at positions start..len(tokens)-1; its attention reads the earlier positions'
K/V from the paged cache (ctx_lens = position + 1) and its GDN state goes on from the slot
(only a segment starting at position 0 starts from zero). The Engine keeps the chunk tokens
of a step within max_prefill_tokens.

Prefill shapes are bucketed so that warming each bucket once (warm_up_prefill) covers every
later prefill's temporaries: the batch is padded with scratch sequences to a fixed
max_seqs + 1 sequences, and the step's tokens (the chunks' tokens, not the prompts') to the
next power of two (the padding sequences share the extra tokens evenly). The cost is up to 2x the
prefill tokens and a last-token logits GEMM over max_seqs + 1 rows per prefill step (about
one decode step's logits GEMM); prefill steps are few next to decode steps.

With prefill graphs on (the default; VT_PREFILL_GRAPHS=0 or capture_prefill=False turns them
off), warm_up_prefill also captures each bucket, its input uploads included, as a graph on the
engine's stream, and a prefill then writes the pinned staging area and launches the bucket's graph: one launch
instead of one per kernel per layer plus one per upload. A bucket's shapes, buffers and kernel
parameters are all fixed (the sequences differ only in the values uploaded), so one graph
serves every prefill of its bucket. The graph reads the staging area when it runs, which is
safe for the same reason the eager uploads are: a prefill step drains before the next one
writes it. On the H200 a step that prefills took 0.68-0.83 ms of device time captured against
1.97-2.18 ms eager, whose launches bound it (docs/benchmarks.md, section 7).
"""
from __future__ import annotations

import numpy as np

from vt import env
from vt.graphs import capture_warmed
from vt.step.contract import KVGeometry, PrefillSeq, StepModel, kv_slot

_PER_TOKEN = ("token_ids", "positions", "slot_mapping", "ctx_lens", "token_seq")
_PER_SEQ = ("last_idx", "last_positions", "token_rows", "state_idx")


def padded_lengths(chunk_lens: list[int], seqs: int, total: int) -> np.ndarray:
    """Token counts of a padded prefill's `seqs` sequences: the chunks', then scratch sequences
    of at least one token that share the rest of `total` evenly. Evenly, because the GDN
    kernel walks each sequence's tokens in order: one scratch sequence holding all the padding
    (up to half the bucket) would set the step's critical path instead of the longest chunk."""
    q = seqs - len(chunk_lens)
    extra = total - sum(chunk_lens) - q
    if q < 1 or extra < 0:
        raise ValueError(f"padded_lengths: {len(chunk_lens)} chunks of {sum(chunk_lens)} tokens "
                         f"do not fit {seqs} sequences of {total} tokens with a scratch sequence")
    scratch = np.full(q, 1 + extra // q, np.int64)
    scratch[:extra % q] += 1
    return np.concatenate([np.asarray(chunk_lens, np.int64), scratch])


class HybridStepModel(StepModel):
    """The bundled HybridModel as a step model."""

    chunked_prefill = True   # prefill() starts at PrefillSeq.start: a prompt may come in chunks

    def __init__(self, be, model, *, capture_prefill: bool | None = None):
        from vt.bundled import PrefillInputs
        self._PrefillInputs = PrefillInputs
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
        self._seqs = model.max_seqs + 1            # every prefill runs this many sequences
        tokens = self.token_bucket(model.max_seqs * cfg.max_context + model.max_seqs)
        seqs, mb = self._seqs, cfg.max_blocks_per_seq
        shapes = {**{f: (tokens,) for f in _PER_TOKEN}, **{f: (seqs,) for f in _PER_SEQ},
                  "cu_seqlens": (seqs + 1,), "block_tables": (seqs, mb)}
        self._host = {f: be.pinned_empty(s, np.int32) for f, s in shapes.items()}
        self._dev = {f: be.empty(s, np.int32) for f, s in shapes.items()}
        self._logits = be.empty((seqs, cfg.vocab), np.float32)   # [max_seqs + 1, vocab]
        self.capture_prefill = prefill_graphs_default() if capture_prefill is None else capture_prefill
        self._graphs: dict[tuple[int, int], object] = {}   # (stream handle, token bucket) -> graph

    @property
    def token_table(self):
        return self.m.token_table

    def decode(self, stream, inputs, logits_out) -> None:
        self.m.decode(stream, inputs, logits_out)

    def prefill(self, stream, seqs: list[PrefillSeq], logits_out) -> None:
        """Prefill `seqs` (padded, see the module docstring); logits_out [len(seqs), vocab]."""
        self.prepare_prefill(seqs)(stream, logits_out)

    def prepare_prefill(self, seqs: list[PrefillSeq]):
        """prefill's host half, done now: the padded inputs written to the staging area.
        Returns its device half, launch(stream, logits_out). The runner prepares a mixed
        step's prefill before it launches the step's decode rows, so that the device does not
        wait for the host's part."""
        q = self._seqs - len(seqs)
        total = self.token_bucket(sum(len(s.tokens) - s.start for s in seqs) + q)
        values = self._stage_padded(seqs, total)

        def launch(stream, logits_out) -> None:
            self._launch_padded(stream, total, values)
            self.be.copy_d2d(logits_out, self._logits[:len(seqs)], stream)
        return launch

    @staticmethod
    def token_bucket(n: int) -> int:
        return 1 << max(0, n - 1).bit_length()

    def warm_up_prefill(self, stream, max_prefill_tokens: int, logits_out=None) -> None:
        """Run every token bucket a prefill of up to max_prefill_tokens prompt tokens can hit,
        on scratch sequences only (Runner.warm_up): about log2(max_prefill_tokens) prefills."""
        lo = self.token_bucket(self._seqs)                       # >= 1 real token + padding
        hi = self.token_bucket(max_prefill_tokens + self._seqs - 1)
        total = lo
        while total <= hi:
            if self.capture_prefill:
                self._capture_bucket(stream, total)
            else:
                self._prefill_padded(stream, [], total)
            stream.synchronize()   # the staging area is reused by the next bucket
            total *= 2

    def _capture_bucket(self, stream, total: int) -> None:
        """The bucket's graph (vt.graphs.capture_warmed: an eager warm-up, then the capture)."""
        key = (stream.handle, total)
        graph = capture_warmed(self.be, stream,
                               lambda: self._prefill_padded(stream, [], total, eager=True),
                               f"prefill {total} tokens")
        old = self._graphs.pop(key, None)
        if old is not None:
            old.close()
        self._graphs[key] = graph

    def _prefill_padded(self, stream, seqs: list[PrefillSeq], total: int, *,
                        eager: bool = False) -> None:
        """Prefill seqs plus scratch sequences: max_seqs + 1 sequences, `total` tokens: the
        bucket's graph when there is one and not `eager` (a warm-up or a capture)."""
        self._launch_padded(stream, total, self._stage_padded(seqs, total), eager=eager)

    def _stage_padded(self, seqs: list[PrefillSeq], total: int) -> dict:
        """The padded prefill's input vectors, written to the staging area; returned by field."""
        g = self.geometry
        q = self._seqs - len(seqs)
        lens = padded_lengths([len(s.tokens) - s.start for s in seqs], self._seqs, total)
        # Each sequence's chunk is at positions start..len(tokens)-1. Scratch positions start
        # at 0 and wrap at max_context: their block table (all scratch) stays in range.
        # (Vectorized: a loop over the max_seqs + 1 sequences was most of a prefill's host time.)
        starts = np.array([s.start for s in seqs] + [0] * q)
        cu = np.concatenate([[0], np.cumsum(lens)])
        seq = np.repeat(np.arange(self._seqs), lens)
        pos = (np.arange(total) - cu[seq] + starts[seq]) % g.max_context
        bt = np.full((self._seqs, g.max_blocks), g.scratch_block, np.int32)
        for i, s in enumerate(seqs):
            bt[i] = s.block_table
        pad = self.pad
        values = dict(token_ids=np.concatenate([s.tokens[s.start:] for s in seqs] +
                                               [np.zeros(lens[len(seqs):].sum(), np.int32)]),
                      positions=pos, slot_mapping=kv_slot(bt[seq], pos, g.block_size),
                      ctx_lens=pos + 1, token_seq=seq, cu_seqlens=cu, last_idx=cu[1:] - 1,
                      last_positions=pos[cu[1:] - 1],
                      token_rows=[s.row for s in seqs] + [pad.token_row] * q,
                      state_idx=[s.state_idx for s in seqs] + [pad.state_idx] * q,
                      block_tables=bt)
        for f, v in values.items():
            self._host[f][:len(v)] = v
        return values

    def _launch_padded(self, stream, total: int, values: dict, *, eager: bool = False) -> None:
        graph = None if eager else self._graphs.get((stream.handle, total))
        if graph is not None:
            graph.launch(stream)   # its uploads read the staging area written above
            return
        self.m.prefill(stream, self._PrefillInputs(**self._upload(stream, values)), self._logits)

    def _upload(self, stream, values: dict) -> dict:
        """The staging area's first len(values[f]) entries of each field on to the device; the
        device views by field. Copied by a kernel reading the pinned staging area, not a
        memcpy (be.copy_h2d_mapped): a bucket's graph holds one node per field, and with
        memcpy nodes its launch cost the host 33-38 µs instead of 8-11 on the H200."""
        views = {}
        for f, v in values.items():
            n = len(v)
            self.be.copy_h2d_mapped(self._dev[f][:n], self._host[f][:n], stream)
            views[f] = self._dev[f][:n]
        return views

    def release_stream(self, stream) -> None:
        """Close the prefill graphs captured on `stream` (their GEMMs use the stream's cuBLAS
        workspace), then let the model free what it holds for it."""
        for key in [k for k in self._graphs if k[0] == stream.handle]:
            self._graphs.pop(key).close()
        self.m.release_stream(stream)

    def sample(self, stream, logits, inputs, out_tokens) -> None:
        self.m.sample(stream, logits, inputs, out_tokens)

    def begin_requests(self, stream, seqs) -> None:
        self.m.begin_requests(stream, seqs)

    @property
    def token_masks(self):
        return self.m.token_masks


def prefill_graphs_default() -> bool:
    """VT_PREFILL_GRAPHS: "1" (the default) captures the bundled model's prefill buckets, "0"
    runs them eagerly."""
    return env.get("VT_PREFILL_GRAPHS")
