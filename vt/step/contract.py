"""The step contract: what a model gives vt, and what one decode or prefill step is made of.
The graphs, the models, the runner and the engine all import it; it imports none of them.
docs/contract.md is its page, with a runnable example.

A step model (`StepModel`, the class the runner and the engine drive) provides:
- `vocab`, `geometry` (a `KVGeometry`: sequence rows, KV blocks, context), `pad` (the
  `PadRow` scratch locations padded rows point at) and `token_table` (each row's last sampled
  token on the device: the next decode step's input);
- `decode(stream, inputs, logits_out)`: one token per row, captured into the step's graph, so
  it only launches work; its per-row vectors are a `DecodeInputs` of device arrays, which the
  host builds from `DecodeRows` (numpy, the real rows before padding);
- `prefill(stream, seqs, logits_out)`: prompts (`PrefillSeq`), eagerly, each one's last-token
  logits;
- `sample(stream, logits, inputs, out_tokens)`: the tokens, into out_tokens and the token table.

Which one to write:
- a PyTorch module or function, `forward(inputs, logits_out)` over torch tensors:
  `vt.torch.TorchForwardModel` (vt runs it on its stream, captures it with a private memory
  pool, runs prompts and samples);
- kernels launched on vt's stream (CuPy, or numpy kernels on the sim), `forward(stream,
  inputs, logits_out)` over `DecodeInputs`: `vt.ForwardModel` (vt runs prompts through the
  same forward and samples with its own sampler);
- your own prefill, sampler or graphs: subclass `StepModel` and write all three methods
  (the bundled model's adapter, vt/forward/hybrid.py, does: it captures its prefill too).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np

from vt.sampling.logprobs import RECORD_WORDS  # noqa: F401  (part of the contract)
from vt.sampling.params import GREEDY, SamplingParams, row_vectors  # noqa: F401  (part of the contract)
from vt.validate import integer

LOGITS_DTYPE = np.float32   # [S, vocab] logits of every step, graph or eager


def kv_slot(block_table, position, block_size: int, rows=None):
    """The KV-cache slot of `position` in a sequence with `block_table` [max_blocks]; or, for
    block tables [n, max_blocks] and positions [n], each row's slot [n] (`rows`: the rows of
    the table the positions belong to, default 0..n-1). With context_slots, the one place
    this formula is written; both take numpy arrays or torch tensors."""
    if getattr(block_table, "ndim", 1) == 2:
        block = block_table[np.arange(len(position)) if rows is None else rows,
                            position // block_size]
    else:
        block = block_table[position // block_size]
    return block * block_size + position % block_size


def context_slots(block_tables, positions, block_size: int):
    """The KV-cache slots of every position in `positions` [T] for each row of `block_tables`
    [n, max_blocks]: [n, T] (what an attention over each row's context gathers)."""
    return block_tables[:, positions // block_size] * block_size + positions % block_size


@dataclass(frozen=True)
class PadRow:
    """What a padded (or poisoned) row points at: scratch locations owned by the model, so a
    padded row computes garbage where nobody reads it instead of faulting or clobbering."""
    token_row: int
    state_idx: int
    slot: int = 0
    block: int = 0
    position: int = 0
    seq_len: int = 1


@dataclass(frozen=True)
class KVGeometry:
    """Sequence rows and the paged KV cache. Row `max_seqs` of the token table and of the
    recurrent state, and KV block `scratch_block`, are scratch: padded rows point there."""
    max_seqs: int
    num_kv_blocks: int        # all blocks, the scratch block included
    block_size: int
    max_context: int
    scratch_block: int = 0

    def __post_init__(self):
        for name in ("max_seqs", "num_kv_blocks", "block_size", "max_context"):
            object.__setattr__(self, name, integer(f"KVGeometry.{name}", getattr(self, name), 1))
        object.__setattr__(self, "scratch_block",
                           integer("KVGeometry.scratch_block", self.scratch_block, 0))
        if self.num_kv_blocks < 2 or not 0 <= self.scratch_block < self.num_kv_blocks:
            raise ValueError(f"KVGeometry: num_kv_blocks={self.num_kv_blocks} must hold the scratch "
                             f"block {self.scratch_block} and at least one more")

    @property
    def max_blocks(self) -> int:
        return -(-self.max_context // self.block_size)

    @property
    def pad(self) -> PadRow:
        return PadRow(token_row=self.max_seqs, state_idx=self.max_seqs,
                      slot=self.scratch_block * self.block_size, block=self.scratch_block)


# The per-row vectors of a decode step, in the order of the contiguous input block
# (vt/step/inputblock.py). The first six are what a forward reads; the last three the sampler.
FORWARD_FIELDS = ("token_rows", "positions", "seq_lens", "slot_mapping", "block_tables", "state_idx")
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "logprobs", "penalized",
                   "presence_penalty", "frequency_penalty", "repetition_penalty")   # vt.sampling.ROW_VECTORS
FIELDS = FORWARD_FIELDS + SAMPLING_FIELDS


@dataclass(kw_only=True)
class RowSampling:
    """Each row's sampling as per-row vectors (SAMPLING_FIELDS), the fields DecodeRows (numpy),
    DecodeInputs and the bundled PrefillInputs (device arrays) share. Keyword-only, so each
    class's own fields stay first and positional. None: the field is unused (temperature None:
    every row greedy; logprobs or penalized None: none for any row)."""
    temperature: object = None          # [n] f32
    top_k: object = None                # [n] int32, 0: all
    top_p: object = None                # [n] f32
    min_p: object = None                # [n] f32
    seed: object = None                 # [n] uint64
    logprobs: object = None             # [n] int32, -1: none
    penalized: object = None            # [n] int32 bits (PENALIZE, MIN_TOKENS), 0: none
    presence_penalty: object = None     # [n] f32
    frequency_penalty: object = None    # [n] f32
    repetition_penalty: object = None   # [n] f32


@dataclass
class DecodeInputs(RowSampling):
    """One decode step of S rows, as a forward and the sampler read it (device arrays).

    token_rows[S]: row of the token table (= the sequence slot) holding the input token;
    positions[S]: position of that token; seq_lens[S]: tokens in the cache after this step's
    write (position + 1); slot_mapping[S]: KV cache slot written; block_tables[S, max_blocks];
    state_idx[S]: recurrent (GDN) state slot; temperature[S] f32, top_k[S] i32 (0: all),
    top_p[S] f32, min_p[S] f32, seed[S] u64, logprobs[S] i32 (-1: none), penalized[S] i32
    (bits: penalties/bias, min_tokens; 0: none), presence_penalty[S], frequency_penalty[S],
    repetition_penalty[S] f32: each row's sampling (vt.sampling.SamplingParams). Padded rows
    point at the model's scratch row and sample greedily.
    """
    token_rows: object
    positions: object
    seq_lens: object
    slot_mapping: object
    block_tables: object
    state_idx: object

    @property
    def batch(self) -> int:
        return int(self.token_rows.shape[0])

    @property
    def sample_positions(self):
        """The position the sampler keys its random stream on: the input token's."""
        return self.positions

    def rows(self, start: int, stop: int) -> "DecodeInputs":
        """A view of rows [start, stop) (a forward may treat it like a whole batch)."""
        return DecodeInputs(**{f: None if getattr(self, f) is None else getattr(self, f)[start:stop]
                               for f in FIELDS})


@dataclass
class DecodeRows(RowSampling):
    """The real rows of one step, on the host (numpy), before padding: views into the
    engine's persistent batch, so building one copies nothing."""
    token_rows: np.ndarray    # [n] int32
    positions: np.ndarray     # [n] int32
    seq_lens: np.ndarray      # [n] int32
    slot_mapping: np.ndarray  # [n] int32
    block_tables: np.ndarray  # [n, max_blocks] int32
    state_idx: np.ndarray     # [n] int32

    def __len__(self):
        return len(self.token_rows)

    def write_into(self, block, pad: PadRow) -> None:
        """Write these rows into an InputBlock's host twin, the tail padded (the runner's one
        call for any step's rows; the engine's BatchStep has a faster one)."""
        block.fill(self, pad)


@dataclass
class PrefillSeq:
    """One newly admitted sequence: its row (token-table row = state slot), prompt, sampling.
    start > 0: a chunk; positions [0, start) are already in its KV cache and state, the step
    prefills tokens[start:] (only step models with `chunked_prefill = True` get one)."""
    row: int
    tokens: np.ndarray        # [L] int32
    block_table: np.ndarray   # [max_blocks] int32
    state_idx: int
    sampling: SamplingParams = GREEDY
    start: int = 0
    # the ids that end the request: banned until it has sampling.min_tokens tokens
    stop_tokens: tuple[int, ...] = ()


def prefill_last_rows(seqs: list[PrefillSeq], block_size: int) -> DecodeRows:
    """Each sequence at its last prompt position, as a decode row: what samples its first token."""
    pos = np.array([len(s.tokens) - 1 for s in seqs], np.int32)
    bt = np.stack([s.block_table for s in seqs]).astype(np.int32, copy=False)
    return DecodeRows(
        token_rows=np.array([s.row for s in seqs], np.int32), positions=pos, seq_lens=pos + 1,
        slot_mapping=kv_slot(bt, pos, block_size).astype(np.int32),
        block_tables=bt, state_idx=np.array([s.state_idx for s in seqs], np.int32),
        **row_vectors([s.sampling for s in seqs]))


class StepModel(abc.ABC):
    """What the runner and the engine drive: the whole step contract, in one class. Every step
    model derives from it (vt.ForwardModel, vt.torch.TorchForwardModel, the bundled model's
    adapter); the members with a body are defaults a model may override.

    Required: `vocab`, `geometry`, `pad` (geometry.pad unless the model's scratch differs),
    `token_table` (device [max_seqs + 1] int32: each row's last sampled token, the next decode
    step's input; its address names the model's device state, vt/engine/model_lease.py), and
    - `decode(stream, inputs, logits_out)`: one token per row, [S, vocab]; capturable (launches
      only: no host sync, no allocation outside the backend's pool);
    - `prefill(stream, seqs, logits_out)`: the prompts (or chunks) of `seqs`, eagerly; each
      sequence's last-token logits into logits_out [len(seqs), vocab];
    - `sample(stream, logits, inputs, out_tokens)`: each row's sampling read from `inputs`;
      writes out_tokens [S] (or token records [S, RECORD_WORDS] with the logprobs the rows ask
      for: vt/sampling/logprobs.py) and the token table.
    """
    vocab: int
    geometry: KVGeometry
    pad: PadRow
    token_table: object

    # prefill() starts at PrefillSeq.start: the engine may split a prompt over steps
    chunked_prefill: bool = False
    # The sampler's grammar masks (vt.sampling.token_mask.TokenMaskState), or None: a model
    # without them serves no constrained request (SamplingParams.grammar is refused).
    token_masks = None
    # the KV of a position depends only on the tokens up to it, and the model keeps no other
    # per-sequence state (no recurrent state): with chunked_prefill, a sequence may start
    # from the cached KV blocks of another with the same prefix (the engine's prefix
    # caching, on by default for such a model: vt/engine/kv_blocks.py)
    prefix_cacheable: bool = False
    # prepare_mixed() runs a step's decode rows and prompt chunks in ONE call (a flattened
    # batch); otherwise the runner runs the decode rows (their graph when one fits) and then
    # the prefill
    mixed_in_one_call: bool = False
    # decode() writes every row's KV before any row reads the cache, each row attends over
    # its seq_len slots only, and the model keeps no per-sequence state besides the KV cache:
    # a row's k + 1 speculative tokens may then be verified as k + 1 decode rows
    # (vt/forward/speculative.py; a rejected token's KV is overwritten before it is read)
    verifies_by_decode: bool = False

    @abc.abstractmethod
    def decode(self, stream, inputs: DecodeInputs, logits_out) -> None: ...

    @abc.abstractmethod
    def prefill(self, stream, seqs: list[PrefillSeq], logits_out) -> None: ...

    @abc.abstractmethod
    def sample(self, stream, logits, inputs: DecodeInputs, out_tokens) -> None: ...

    def begin_requests(self, stream, seqs: list[PrefillSeq]) -> None:
        """Before the sampling of a prefill step: the sampler's per-row state of the rows of
        `seqs` (each chunk's) set for their requests, in `stream`'s order (vt's sampler keeps
        each row's penalty counts, prompt and logit bias: vt/sampling/penalties.py). Default:
        nothing (a sampler without per-row state)."""

    def prepare_prefill(self, seqs: list[PrefillSeq]):
        """Prefill's host work, done now; returns its device half, launch(stream, logits_out).
        The runner prepares a mixed step's prefill before it launches the step's decode rows,
        so that the device does not wait for the host's part. Default: all of it at launch."""
        return lambda stream, logits_out: self.prefill(stream, seqs, logits_out)

    def prepare_mixed(self, decode: DecodeInputs, seqs: list[PrefillSeq]):
        """With mixed_in_one_call: the host work of one forward over `decode`'s rows (host
        arrays, one token each) and the prompt chunks of `seqs`; returns launch(stream,
        logits_out [len(decode) + len(seqs), vocab]), the decode rows' logits first."""
        raise NotImplementedError(f"{type(self).__name__} runs a mixed step's decode rows and "
                                  f"prompts apart (mixed_in_one_call is False)")

    def warm_up_prefill(self, stream, max_prefill_tokens: int, logits_out) -> None:
        """Run every prefill shape a step of up to max_prefill_tokens prompt tokens can hit, on
        scratch sequences only, so that serving makes no new allocation (Runner.warm_up).
        Default: nothing to warm."""

    def sampler_workspaces(self, be, rows: int) -> list[int]:
        """Bytes of each pool block `sample` may ask for with up to `rows` rows: the runner
        reserves them before serving, since a prefill step samples as many rows as it admits.
        Default: vt's sampler's (vt/sampling/sampler.py workspace_sizes) on cuda; none on the
        sim, whose pool does not count."""
        if be.name != "cuda":
            return []
        from vt.backend.nvrtc import sm_count
        from vt.sampling.sampler import workspace_sizes
        return workspace_sizes(rows, self.vocab, sm_count())

    def release_stream(self, stream) -> None:
        """Free what the model holds for `stream`, once the runner's graphs are gone.
        Default: nothing."""
