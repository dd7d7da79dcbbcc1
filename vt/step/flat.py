"""The flattened batch: every token one step runs, prompt chunks and decode tokens alike, in
one forward call (the layout of vLLM V1's model runner).

A mixed step of two decode rows (a, b) and two prompt chunks (c: 3 new tokens after 2 cached,
d: a whole 4-token prompt), T = 9 tokens, B = 4 sequences:

    token            a0 b0 c2 c3 c4 d0 d1 d2 d3
    input_ids   [T]  .  .  x  x  x  x  x  x  x      (decode rows: gathered from the token table)
    positions   [T]  7  3  2  3  4  0  1  2  3
    slot_mapping[T]  the KV-cache slot each token's K and V go to
    query_start_loc [B + 1]  0  1  2  5  9          (sequence i's tokens: [qsl[i], qsl[i + 1]))
    seq_lens        [B]      8  4  5  4             (context after the step, new tokens included)
    logits_indices  [B]      0  1  4  8             (the token whose logits each sequence wants)
    block_tables    [B, max_blocks], token_rows [B], state_idx [B]

Decode rows come first, one token each; a decode step is the case where every sequence has
one token (T = B, query_start_loc = 0..B, logits_indices = 0..B-1). Logits are [B, vocab]:
one row per sequence, not one per token.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vt.step.contract import DecodeInputs, PrefillSeq, kv_slot

TOKEN_FIELDS = ("input_ids", "positions", "slot_mapping")                    # [T] each
SEQ_FIELDS = ("seq_lens", "logits_indices", "token_rows", "state_idx")       # [B] each


@dataclass
class FlatInputs:
    """One step as a flattened batch (module docstring): int32 arrays, device or host.

    The host copies `query_start_loc_cpu` and `seq_lens_cpu` (tuples of B + 1 and B ints) let
    an eager forward size its per-sequence work without reading the device. `num_decode`: the
    first num_decode sequences are decode rows whose input id the step gathers from the token
    table (token_table[token_rows[i]]) before the forward runs."""
    input_ids: object        # [T]
    positions: object        # [T]
    slot_mapping: object     # [T]
    query_start_loc: object  # [B + 1]
    seq_lens: object         # [B]
    block_tables: object     # [B, max_blocks]
    logits_indices: object   # [B]
    token_rows: object       # [B]: each sequence's row of the token table
    state_idx: object        # [B]: each sequence's recurrent-state slot
    query_start_loc_cpu: tuple = ()
    seq_lens_cpu: tuple = ()
    num_decode: int = 0

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    @property
    def batch(self) -> int:
        return len(self.seq_lens_cpu)


def flatten(decode: DecodeInputs | None, seqs: list[PrefillSeq], block_size: int) -> FlatInputs:
    """The flattened batch (host numpy arrays) of `decode`'s rows (host arrays, one token
    each; None: none) followed by the chunks tokens[start:] of `seqs`. The decode rows'
    input_ids are 0 here: the device gathers them from the token table."""
    n_dec = 0 if decode is None else len(decode.token_rows)
    if n_dec + len(seqs) == 0:
        raise ValueError("flatten: a step without sequences")
    chunks = [np.asarray(s.tokens[s.start:], np.int32) for s in seqs]
    if any(len(c) == 0 for c in chunks):
        raise ValueError(f"flatten: a prompt chunk without tokens (starts "
                         f"{[s.start for s in seqs]}, lengths {[len(s.tokens) for s in seqs]})")
    lens = np.array([1] * n_dec + [len(c) for c in chunks], np.int64)
    qsl = np.concatenate([[0], np.cumsum(lens)])
    # Prompt token k of the step belongs to chunk seq_of[k], at its start + its offset there.
    seq_of = np.repeat(np.arange(len(seqs)), lens[n_dec:])
    first = qsl[n_dec:-1] - n_dec                       # each chunk's first prompt token
    starts = np.array([s.start for s in seqs], np.int64)
    pre_pos = (np.arange(len(seq_of)) - first[seq_of] + starts[seq_of]).astype(np.int32)
    mb = decode.block_tables.shape[1] if n_dec else len(seqs[0].block_table)
    pre_bt = np.array([s.block_table for s in seqs], np.int32).reshape(len(seqs), mb)
    dec = _decode_part(decode, n_dec, mb)
    cat = np.concatenate
    flat = FlatInputs(
        input_ids=cat([np.zeros(n_dec, np.int32)] + chunks),
        positions=cat([dec["positions"], pre_pos]),
        slot_mapping=cat([dec["slot_mapping"],
                          kv_slot(pre_bt, pre_pos, block_size, rows=seq_of).astype(np.int32)]),
        query_start_loc=qsl.astype(np.int32),
        seq_lens=cat([dec["seq_lens"], np.array([len(s.tokens) for s in seqs], np.int32)]),
        block_tables=cat([dec["block_tables"], pre_bt]),
        logits_indices=(qsl[1:] - 1).astype(np.int32),
        token_rows=cat([dec["token_rows"], np.array([s.row for s in seqs], np.int32)]),
        state_idx=cat([dec["state_idx"], np.array([s.state_idx for s in seqs], np.int32)]),
        num_decode=n_dec)
    flat.query_start_loc_cpu = tuple(int(v) for v in qsl)
    flat.seq_lens_cpu = tuple(int(v) for v in flat.seq_lens)
    return flat


def _decode_part(decode, n: int, max_blocks: int) -> dict:
    """The decode rows' per-token and per-sequence vectors, int32 (empty without rows)."""
    fields = ("positions", "slot_mapping", "seq_lens", "token_rows", "state_idx")
    if not n:
        return {**{f: np.zeros(0, np.int32) for f in fields},
                "block_tables": np.zeros((0, max_blocks), np.int32)}
    return {f: np.asarray(getattr(decode, f)[:n], np.int32)
            for f in fields + ("block_tables",)}
