"""The proposers of speculative decoding (vt/forward/speculative.py): what writes a verify
step's drafts [S, k], inside its captured graph, before the target verifies them. One small
interface, three proposers:

- NgramProposer: prompt lookup over the row's own tokens (the device's `hist`);
- OracleProposer: a test and bench proposer, the tokens of an earlier run without
  speculation, a set fraction of them kept right;
- DraftProposer: a smaller step model of the same vocabulary, with its own KV cache, running
  k greedy passes.

A proposer's drafts are point masses (one token each, not a distribution), which is what the
verify step's acceptance takes: a sampled row keeps a draft with the target's probability of
it, so any proposer leaves the tokens the target's (spec_kernels.Accept).
"""
from __future__ import annotations

import numpy as np

from vt.backend.zeros import full, zeros
from vt.forward.spec_kernels import DRAFT_COLLECT, DRAFT_PROLOGUE, NGRAM, ORACLE
from vt.sampling.sampler import Sampler
from vt.step.contract import LOGITS_DTYPE, StepModel
from vt.step.inputblock import InputBlock


class Proposer:
    """propose(stream, inputs, drafts): drafts [S, k] for the step's rows (inputs: the step's
    DecodeInputs, token_rows and block_tables only; everything else from the device state),
    launches only: it runs inside the captured decode step. The prompt hooks are for a
    proposer that keeps per-row state of its own; by default it keeps none."""

    def propose(self, stream, inputs, drafts) -> None:
        raise NotImplementedError

    def begin_requests(self, stream, seqs) -> None:
        """The rows of `seqs` start (or continue) their prompts: their per-row state."""

    def prepare_prefill(self, seqs):
        """Host work for the prompt chunks of `seqs`, done now; None, or launch(stream), run
        after the target's prefill of them."""
        return None

    def warm_up_prefill(self, stream, max_prefill_tokens: int) -> None:
        """The prompt path's shapes, as StepModel.warm_up_prefill."""

    def sampler_workspaces(self, be, rows: int) -> list[int]:
        """Pool blocks a decode step of up to `rows` rows asks for (StepModel's)."""
        return []

    def release_stream(self, stream) -> None:
        """What the proposer holds for `stream` (StepModel.release_stream)."""


class NgramProposer(Proposer):
    """spec_kernels.NgramDrafts over the row's history `hist` and position `pos`."""

    def __init__(self, be, pos, hist, *, n_min: int, n_max: int):
        self.be, self.pos, self.hist = be, pos, hist
        self.n_min, self.n_max = n_min, n_max

    def propose(self, stream, inputs, drafts) -> None:
        self.be.launch(stream, NGRAM, inputs.token_rows, self.pos, self.hist, drafts,
                       n_min=self.n_min, n_max=self.n_max)


class OracleProposer(Proposer):
    """spec_kernels.OracleDrafts: `references` (prompt tuple -> the tokens a run without
    speculation made) are copied to the device per row when its prompt's last chunk starts;
    the first `right` drafts of each step are those tokens, the rest made wrong."""

    def __init__(self, be, pos, *, references: dict, right: int, vocab: int, rows: int, width: int):
        self.be, self.pos, self.references = be, pos, references
        self.right, self.vocab, self.width = right, vocab, width
        self.ref = zeros(be, (rows, width), np.int32)
        self._stage = be.pinned_empty((rows, width), np.int32)   # one staging row per row

    def propose(self, stream, inputs, drafts) -> None:
        self.be.launch(stream, ORACLE, inputs.token_rows, self.pos, self.ref, drafts,
                       right=self.right, vocab=self.vocab)

    def begin_requests(self, stream, seqs) -> None:
        for s in seqs:
            ref = self.references.get(tuple(int(t) for t in s.tokens))
            if ref is None:   # a non-final chunk has none: its last chunk writes it
                continue
            row = np.concatenate([np.asarray(s.tokens, np.int32),
                                  np.asarray(ref, np.int32)])[:self.width]
            stage = self._stage[s.row]
            stage[:len(row)] = row
            self.be.copy_h2d(self.ref[s.row, :len(row)], stage[:len(row)], stream)


class DraftProposer(Proposer):
    """A draft step model's k greedy steps, inside the verify step (docs/speculative.md).

    The draft has the target's geometry and its own KV cache, so the verify step's block
    tables and slot rules serve it: every draft KV write goes to the slot the target's write
    of that position goes to, in the draft's cache. Its KV then holds, for each row, every
    position before the row's last but one token (an invariant each step keeps): pass 0 runs
    positions p - 1 and p (p: the row's last token's position) as one decode of 2S rows,
    re-writing p - 1, which no pass of the step before wrote when it accepted all k drafts;
    pass j = 1 .. k - 1 runs position p + j on the token pass j - 1 proposed. A rejected
    draft's KV sits past the next step's p - 1, which that step writes before any pass reads
    it. The draft prefills every prompt chunk the target prefills (into its own logits, never
    read), so a prefix-cache hit finds the draft's KV of the cached blocks at the same block
    ids. Each pass's drafts are the argmax of its logits (vt's sampler at temperature 0,
    writing each token into the next pass's token-table entry)."""

    def __init__(self, be, draft: StepModel, target: StepModel, pos, hist, *, k: int,
                 max_rows: int, table_rows: int):
        _check_draft(draft, target, table_rows)
        g = target.geometry
        self.be, self.draft, self.pos, self.hist, self.k = be, draft, pos, hist, k
        self.max_rows, self.base = max_rows, g.max_seqs + 1
        self.pad_row = target.pad.token_row
        self._in = InputBlock(be.empty, max_rows * (k + 1), g.max_blocks)
        self._logits = be.empty((2 * max_rows, draft.vocab), LOGITS_DTYPE)   # [2S, vocab] pass 0
        self._passes = zeros(be, (k, max_rows), np.int32)                    # pass j's tokens
        # the last pass's sampler writes its tokens into the draft's scratch row: no pass reads them
        self._scratch_rows = full(be, (max_rows,), np.int32, draft.pad.token_row)
        self._prefill_logits = be.empty((g.max_seqs, draft.vocab), LOGITS_DTYPE)
        self._sampler = Sampler()

    def propose(self, stream, inputs, drafts) -> None:
        S, k, g, pad = inputs.batch, self.k, self.draft.geometry, self.draft.pad
        d = self._in.inputs.rows(0, S * (k + 1))
        self.be.launch(stream, DRAFT_PROLOGUE, inputs.token_rows, inputs.block_tables, self.pos,
                       self.hist, self.draft.token_table, d.token_rows, d.positions, d.seq_lens,
                       d.slot_mapping, d.block_tables, d.state_idx, d.temperature, d.top_k,
                       d.top_p, d.min_p, d.seed, k=k, base=self.base, pad_row=self.pad_row,
                       pad_slot=pad.slot, pad_state=pad.state_idx, block_size=g.block_size,
                       max_context=g.max_context)
        for j in range(k):
            lo, hi = (0, 2 * S) if j == 0 else ((j + 1) * S, (j + 2) * S)
            logits = self._logits[:hi - lo]
            self.draft.decode(stream, d.rows(lo, hi), logits)
            last = d.rows(hi - S, hi)   # the rows at the pass's newest position sample
            into = d.token_rows[hi:hi + S] if j < k - 1 else self._scratch_rows[:S]
            self.be.launch(stream, self._sampler, logits[hi - lo - S:], into, last.positions,
                           last.temperature, last.top_k, last.top_p, last.min_p, last.seed,
                           self._passes[j, :S], self.draft.token_table)
        self.be.launch(stream, DRAFT_COLLECT, self._passes, drafts)

    def prepare_prefill(self, seqs):
        launch = self.draft.prepare_prefill(seqs)
        logits = self._prefill_logits[:len(seqs)]
        return lambda stream: launch(stream, logits)

    def warm_up_prefill(self, stream, max_prefill_tokens: int) -> None:
        self.draft.warm_up_prefill(stream, max_prefill_tokens, self._prefill_logits)

    def sampler_workspaces(self, be, rows: int) -> list[int]:
        """The draft's own sampler's, one pass's rows at a time (its forward's temporaries are
        the warm-up's, as the target's)."""
        return StepModel.sampler_workspaces(self.draft, be, min(rows, self.max_rows))

    def release_stream(self, stream) -> None:
        self.draft.release_stream(stream)


def _check_draft(draft, target, table_rows: int) -> None:
    """The draft must be a StepModel of its own (its own KV cache and token table), of the
    target's vocabulary and geometry, prefilling from a position wherever the target does.
    (That it verifies by decode, as pass 0's two positions of a row need, SpeculativeModel
    checks with the target's.)"""
    if not isinstance(draft, StepModel):
        raise TypeError(f"SpeculativeModel: the draft must be a vt StepModel, got "
                        f"{type(draft).__name__}")
    if draft.vocab != target.vocab:
        raise ValueError(f"SpeculativeModel: the draft's vocab {draft.vocab} differs from the "
                         f"target's {target.vocab}: the two must share the tokenizer")
    if draft.geometry != target.geometry:
        raise ValueError(f"SpeculativeModel: the draft's geometry {draft.geometry} differs from "
                         f"the target's {target.geometry}: its KV cache is addressed by the "
                         f"target's block tables")
    shared = [name for name, a, b in _parts(draft, target) if a is b]
    if shared:
        raise ValueError(f"SpeculativeModel: the draft shares the target's {shared[0]}: a draft "
                         f"needs its own KV cache and token table (build a second model, "
                         f"with the same weights if it is to draft for itself)")
    if target.chunked_prefill and not draft.chunked_prefill:
        raise ValueError(f"SpeculativeModel: the target prefills prompts in chunks and the draft "
                         f"{type(draft).__name__} cannot (chunked_prefill)")
    if len(draft.token_table) < table_rows:
        raise ValueError(f"SpeculativeModel: the draft's token table has {len(draft.token_table)} "
                         f"entries; its passes need {table_rows} (verify_table_rows)")


def _parts(draft, target):
    """(what, the draft's, the target's) of the objects that hold a model's device state."""
    yield "step model", draft, target
    yield "token table", draft.token_table, target.token_table
    df, tf = getattr(draft, "forward", None), getattr(target, "forward", None)
    if df is not None:
        yield "forward", df, tf
        fn = getattr(df, "fn", None)
        if fn is not None:
            yield "module", fn, getattr(tf, "fn", None)
