"""Speculative decoding as a step model: SpeculativeModel wraps a target step model so that
each decode step verifies k draft tokens per row and emits 1 to k + 1 tokens, everything on
the device inside the step's captured graph (docs/speculative.md draws the step).

One verify step of S rows, all in the graph of size S (one per ring slot, as any step):

    prologue   pos[row] -> the rows' k + 1 positions, KV slots, lengths (device state, not
               the host's vectors), input tokens (the last token, then the drafts) and the
               row's sampling knobs
    propose    drafts [S, k]: the proposer's (vt/forward/spec_proposers.py: n-gram over
               the device's history of the row, an oracle's reference, or a draft model's
               k greedy passes)
    verify     the target's decode over S * (k + 1) rows: row r's j-th token attends over
               its cached prefix and its own tokens 0 .. j
    sample     vt's sampler draws the target's token at every verify position, with the
               row's knobs, keyed on its seed and the position (greedy rows: the argmax)
    accept     drafts kept while they equal the target's token; the row's record (count,
               tokens), pos[row] and hist[row] advanced, its last token in the table

A sampled row's tokens have the target's distribution, and are the ones decoding without
speculation draws with the same seed wherever the verify logits are the one-token step's
(spec_kernels.Accept says why).

The host never plans a position: it sends each row's token-table row, block table (the
request's blocks, reserved for every token it may reach plus k) and sampling knobs, so step N + 1 can be
launched before step N's accepted counts are known; it reads them with the tokens, one step
late, for bookkeeping only.

What a target must be (`verifies_by_decode`): its decode writes every row's KV before any
row's attention reads it, and it keeps no per-sequence state besides the KV cache (a
rejected draft's KV is overwritten before anything reads it; a recurrent state would keep
it). Its token table holds `verify_table_rows(...)` entries: the verify rows' input tokens
live after the sequence rows and the scratch row.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vt.backend.zeros import zeros
from vt.forward.spec_kernels import ACCEPT, COUNT, PROLOGUE, SAMPLING, SEED, TOKENS
from vt.forward.spec_proposers import DraftProposer, NgramProposer, OracleProposer, Proposer
from vt.sampling.sampler import Sampler
from vt.step.contract import LOGITS_DTYPE, StepModel
from vt.step.inputblock import InputBlock
from vt.validate import integer

METHODS = ("ngram", "oracle", "draft")
MAX_K = 16   # the record holds TOKENS + k + 1 words (vt/sampling/logprobs.py: 42)


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: "ngram" (prompt lookup over the row's own tokens), "oracle" (a test and
    bench proposer: the tokens of an earlier run without speculation, `references`, of
    which the first round(accept * k) drafts of each step are kept right and the rest made
    wrong) or "draft" (`draft`, a smaller step model of the target's vocabulary and
    geometry with its own KV cache and token table, proposes its k greedy tokens). k: drafts
    per step. ngram_min, ngram_max: the n-gram lengths looked up. references: for "oracle",
    prompt (a tuple of ints) -> the tokens that run generated. draft: for "draft", a vt
    StepModel (e.g. a vt.torch.TorchForwardModel) holding verify_table_rows(...) token-table
    entries, as the target does."""
    method: str
    k: int = 4
    accept: float = 1.0
    ngram_min: int = 1
    ngram_max: int = 3
    references: dict = field(default=None, compare=False, repr=False)
    draft: StepModel = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"SpeculativeConfig.method must be one of {', '.join(METHODS)}, "
                             f"got {self.method!r}")
        integer("SpeculativeConfig.k", self.k, 1, MAX_K)
        if isinstance(self.accept, bool) or not isinstance(self.accept, (int, float)) or \
                not 0.0 <= self.accept <= 1.0:
            raise ValueError(f"SpeculativeConfig.accept must be a fraction in [0, 1], got "
                             f"{self.accept!r}")
        integer("SpeculativeConfig.ngram_min", self.ngram_min, 1)
        integer("SpeculativeConfig.ngram_max", self.ngram_max, self.ngram_min)
        if self.method == "oracle" and not isinstance(self.references, dict):
            raise ValueError("SpeculativeConfig: method 'oracle' needs references, a dict of "
                             "prompt (tuple of ints) -> the tokens a run without speculation made")
        if self.method == "draft" and not isinstance(self.draft, StepModel):
            raise TypeError(f"SpeculativeConfig: method 'draft' needs draft, a vt StepModel of "
                            f"the target's vocabulary, got {type(self.draft).__name__}")
        if self.method != "draft" and self.draft is not None:
            raise ValueError(f"SpeculativeConfig: draft is for method 'draft', got method "
                             f"{self.method!r} with a draft")

    @property
    def right(self) -> int:
        """The oracle's right drafts per step."""
        return int(round(self.accept * self.k))


def verify_table_rows(max_seqs: int, max_rows: int, k: int) -> int:
    """Token-table entries a target needs: the sequence rows, the scratch row, and one per
    verify row (max_rows rows of k + 1 tokens)."""
    return max_seqs + 1 + max_rows * (k + 1)


def verifies_by_decode(target) -> bool:
    """Whether `target` declares verifies_by_decode (module docstring): the step model itself,
    or the forward a ForwardModel (`forward`) or a TorchForwardModel (`forward.fn`) drives."""
    forward = getattr(target, "forward", None)
    return any(getattr(o, "verifies_by_decode", False) is True
               for o in (target, forward, getattr(forward, "fn", None)) if o is not None)


def read_record(record: np.ndarray) -> np.ndarray:
    """The tokens [count] a row emitted in a verify step, from its record."""
    return record[TOKENS:TOKENS + int(record[COUNT])]


class SpeculativeModel(StepModel):
    """`target` (a StepModel with verifies_by_decode) decoding with `config`'s drafts; at most
    `max_rows` rows per step (default: the geometry's max_seqs; the runner's capture sizes
    must not exceed it). Prompts are the target's (and a draft model's, which prefills
    every chunk the target does); a prefill step's sampling is the target's, followed by
    the row's device state. A verify step samples with vt's sampler
    (its own instance: no penalties, logit bias, grammar masks or logprobs, which speculation
    does not serve), the draws vt's step models make."""

    chunked_prefill = property(lambda self: self.target.chunked_prefill)
    # a draft's KV must be position-addressed too: a prefix-cache hit reuses its blocks as well
    prefix_cacheable = property(lambda self: bool(self.target.prefix_cacheable) and (
        self.config.draft is None or bool(self.config.draft.prefix_cacheable)))
    mixed_in_one_call = False   # the decode rows verify; prompts go through prefill()

    def __init__(self, be, target: StepModel, config: SpeculativeConfig, *,
                 max_rows: int | None = None):
        if not isinstance(target, StepModel):
            raise TypeError(f"SpeculativeModel: target must be a vt StepModel, got "
                            f"{type(target).__name__}")
        if not isinstance(config, SpeculativeConfig):
            raise TypeError(f"SpeculativeModel: config must be a SpeculativeConfig, got "
                            f"{type(config).__name__}")
        for who, model in (("", target), ("the draft ", config.draft)):
            if model is not None and not verifies_by_decode(model):
                raise ValueError(f"SpeculativeModel: {who}{type(model).__name__} does not declare "
                                 f"verifies_by_decode (its decode must write every row's KV "
                                 f"before any row reads it, with no per-sequence state but the "
                                 f"KV cache)")
        g = target.geometry
        self.be, self.target, self.config = be, target, config
        self.vocab, self.geometry, self.pad = target.vocab, g, target.pad
        self.token_table = target.token_table
        self.max_rows = integer("SpeculativeModel.max_rows", max_rows or g.max_seqs, 1)
        k = config.k
        need = verify_table_rows(g.max_seqs, self.max_rows, k)
        if len(target.token_table) < need:
            raise ValueError(f"SpeculativeModel: the target's token table has "
                             f"{len(target.token_table)} entries; k={k} verify rows for "
                             f"{self.max_rows} rows need {need} (verify_table_rows)")
        rows, self.width = g.max_seqs + 1, g.max_context + k + 1
        # Device state per sequence row (module docstring); all of it is scratch the verify
        # step owns: one step at a time reads and writes it, in stream order.
        self.pos = zeros(be, (rows,), np.int32)
        self.hist = zeros(be, (rows, self.width), np.int32)
        # per row, for begin_requests: the prompt's staging
        self._stage = be.pinned_empty((rows, self.width), np.int32)
        self.drafts = zeros(be, (self.max_rows, k), np.int32)
        self.proposer = self._proposer(need)
        self._verify_in = InputBlock(be.empty, self.max_rows * (k + 1), g.max_blocks)
        self._verify_logits = be.empty((self.max_rows * (k + 1), self.vocab), LOGITS_DTYPE)
        self._targets = zeros(be, (self.max_rows * (k + 1),), np.int32)   # the sampler's tokens
        self._sampler = Sampler()
        self._verified: int | None = None   # rows decode() verified, for the sample() after it

    # -- the decode step: prologue, propose, verify (sample() accepts) -------------------
    def decode(self, stream, inputs, logits_out) -> None:
        S, k, g, pad = inputs.batch, self.config.k, self.geometry, self.pad
        if S > self.max_rows:
            raise ValueError(f"SpeculativeModel: a step of {S} rows exceeds max_rows="
                             f"{self.max_rows}")
        self.proposer.propose(stream, inputs, self.drafts[:S])
        v = self._verify_in.inputs.rows(0, S * (k + 1))
        knobs = [a for f in SAMPLING for a in (getattr(inputs, f), getattr(v, f))]
        self.be.launch(stream, PROLOGUE, inputs.token_rows, inputs.block_tables, self.pos,
                       self.drafts[:S], self.token_table, v.token_rows, v.positions, v.seq_lens,
                       v.slot_mapping, v.block_tables, v.state_idx, *knobs, k=k, base=g.max_seqs + 1,
                       pad_row=pad.token_row, pad_slot=pad.slot, pad_state=pad.state_idx,
                       block_size=g.block_size, max_context=g.max_context)
        self.target.decode(stream, v, self._verify_logits[:S * (k + 1)])
        self._verified = S

    def _proposer(self, table_rows: int) -> Proposer:
        c, be, rows = self.config, self.be, self.geometry.max_seqs + 1
        if c.method == "oracle":
            return OracleProposer(be, self.pos, references=c.references, right=c.right,
                                  vocab=self.vocab, rows=rows, width=self.width)
        if c.method == "draft":
            return DraftProposer(be, c.draft, self.target, self.pos, self.hist, k=c.k,
                                 max_rows=self.max_rows, table_rows=table_rows)
        return NgramProposer(be, self.pos, self.hist, n_min=c.ngram_min, n_max=c.ngram_max)

    def sample(self, stream, logits, inputs, out_tokens) -> None:
        """After decode(): the sampler's token at every verify position, then acceptance
        into records [S, RECORD_WORDS]. After a prefill: the target's sampler, then each row's
        first token into its device state."""
        S, self._verified = self._verified, None
        if S is not None:
            k = self.config.k
            n = S * (k + 1)
            v = self._verify_in.inputs.rows(0, n)
            # The verify rows' token-table entries take the drafts' draws: scratch, rewritten
            # by the next prologue before anything reads them.
            self.be.launch(stream, self._sampler, self._verify_logits[:n], v.token_rows,
                           v.positions, v.temperature, v.top_k, v.top_p, v.min_p, v.seed,
                           self._targets[:n], self.token_table)
            self.be.launch(stream, ACCEPT, self._targets[:n], self._verify_logits,
                           self.drafts[:S], inputs.token_rows, self.pos, self.hist,
                           self.token_table, out_tokens, logits, k=k, pad_row=self.pad.token_row)
            return
        self.target.sample(stream, logits, inputs, out_tokens)
        self.be.launch(stream, SEED, inputs.token_rows, inputs.positions, self.token_table,
                       self.pos, self.hist)

    # -- prompts: the target's, plus the rows' history and the proposer's ----------------
    def begin_requests(self, stream, seqs) -> None:
        """The rows' history (and the proposer's per-row state) from their prompt so far, in
        stream order. Each row has its own staging row: a row's next request is prefilled
        after a drain that waited for this copy (prefill steps always drain)."""
        self.target.begin_requests(stream, seqs)
        for s in seqs:
            toks = np.asarray(s.tokens, np.int32)[:self.width]
            stage = self._stage[s.row]
            stage[:len(toks)] = toks
            self.be.copy_h2d(self.hist[s.row, :len(toks)], stage[:len(toks)], stream)
        self.proposer.begin_requests(stream, seqs)

    def prefill(self, stream, seqs, logits_out) -> None:
        self.prepare_prefill(seqs)(stream, logits_out)

    def prepare_prefill(self, seqs):
        """The target's prefill of `seqs`, then the proposer's (a draft model's own)."""
        target, proposer = self.target.prepare_prefill(seqs), self.proposer.prepare_prefill(seqs)
        if proposer is None:
            return target

        def launch(stream, logits_out) -> None:
            target(stream, logits_out)
            proposer(stream)
        return launch

    def warm_up_prefill(self, stream, max_prefill_tokens: int, logits_out) -> None:
        self.target.warm_up_prefill(stream, max_prefill_tokens, logits_out)
        self.proposer.warm_up_prefill(stream, max_prefill_tokens)

    def sampler_workspaces(self, be, rows: int) -> list[int]:
        """The target's, and those of this model's own sampler, which a verify step runs over
        k + 1 rows a row (a list, not a set: each sampler keeps its own counter buffer)."""
        verify = StepModel.sampler_workspaces(self, be, min(rows, self.max_rows) * (self.config.k + 1))
        return (self.target.sampler_workspaces(be, rows) + verify +
                self.proposer.sampler_workspaces(be, rows))

    def release_stream(self, stream) -> None:
        self.target.release_stream(stream)
        self.proposer.release_stream(stream)
