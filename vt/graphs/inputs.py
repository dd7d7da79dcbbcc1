"""Per-step decode inputs: the host rows a step is built from, their pinned host vectors and
the device buffers a forward reads.

Field names follow docs/architecture.md (DecodeInputs), so the bundled model and a user
forward read the same attributes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FIELDS = ("token_rows", "positions", "seq_lens", "slot_mapping", "block_tables", "state_idx")


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


@dataclass
class DecodeInputs:
    """One decode step of S rows, what a forward reads (device arrays; pinned twins on the host).

    token_rows[S]: row of the token table (= the sequence slot) holding the input token;
    positions[S]: position of that token; seq_lens[S]: tokens in the cache after this step's
    write (position + 1); slot_mapping[S]: KV cache slot written; block_tables[S, max_blocks];
    state_idx[S]: recurrent (GDN) state slot. Padded rows point at the model's scratch row.
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
        """The position a sampler keys its RNG on: the input token's (as vt.model's)."""
        return self.positions

    def rows(self, start: int, stop: int) -> "DecodeInputs":
        """A view of rows [start, stop) (contiguous: a forward may treat it like a whole batch)."""
        return DecodeInputs(*(getattr(self, f)[start:stop] for f in FIELDS))

    def arrays(self):
        return [getattr(self, f) for f in FIELDS]


@dataclass
class DecodeRows:
    """The real rows of one step, on the host (numpy), before padding."""
    token_rows: np.ndarray    # [n] int32
    positions: np.ndarray     # [n] int32
    seq_lens: np.ndarray      # [n] int32
    slot_mapping: np.ndarray  # [n] int32
    block_tables: np.ndarray  # [n, max_blocks] int32
    state_idx: np.ndarray     # [n] int32

    def __len__(self):
        return len(self.token_rows)

    @staticmethod
    def concat(parts: list["DecodeRows"]) -> "DecodeRows":
        return DecodeRows(*(np.concatenate([getattr(p, f) for p in parts]) for f in FIELDS))


def allocate_inputs(alloc, size: int, max_blocks: int):
    """Six int32 buffers of `size` rows from `alloc(shape, dtype)` (pinned or device)."""
    return DecodeInputs(*(alloc((size, max_blocks) if f == "block_tables" else (size,), np.int32)
                          for f in FIELDS))


def fill_host(host: DecodeInputs, rows: DecodeRows, pad: PadRow) -> None:
    """Write the step's rows into the pinned vectors and pad the tail with the scratch row."""
    n, size = len(rows), len(host.token_rows)
    if n > size:
        raise ValueError(f"{n} rows do not fit a slot of size {size}")
    for f in FIELDS:
        getattr(host, f)[:n] = getattr(rows, f)
    _fill_pad(host, n, pad)


def poison_host(host: DecodeInputs, pad: PadRow) -> None:
    """Redirect every row to the scratch row. In range on purpose: a replay that reads the
    poison computes wrong rows (detectable) instead of faulting the device."""
    _fill_pad(host, 0, pad)


def _fill_pad(host: DecodeInputs, start: int, pad: PadRow) -> None:
    host.token_rows[start:] = pad.token_row
    host.positions[start:] = pad.position
    host.seq_lens[start:] = pad.seq_len
    host.slot_mapping[start:] = pad.slot
    host.block_tables[start:] = pad.block
    host.state_idx[start:] = pad.state_idx


def copy_inputs_h2d(be, dst: DecodeInputs, src: DecodeInputs, stream, n: int | None = None) -> None:
    """Async H2D of every field (rows [:n] when given); captured when the stream captures."""
    for f in FIELDS:
        d, s = getattr(dst, f), getattr(src, f)
        if n is not None:
            d, s = d[:n], s[:n]
        be.copy_h2d(d, s, stream)
