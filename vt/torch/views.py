"""Torch tensors over vt's device buffers: zero-copy views, and the inputs a torch forward reads.

A view is a pointer, a shape and strides, made without any CUDA call: the CUDA array interface
below has no `stream` entry (version 2), so torch does not synchronize anything when it imports
it, and a view may be made while vt captures. A view does not own its memory; vt's buffers
outlive every view the adapter makes of them (the slot's buffers live as long as its graph).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from vt.step import FORWARD_FIELDS, FlatInputs


@dataclass
class TorchInputs:
    """One step as a flattened batch of torch tensors (int32; views of vt's device buffers):
    T tokens of B sequences, the fields of vt.step.FlatInputs (vt/step/flat.py draws a mixed
    step). A decode step is the case of one token per sequence (T = B), built by `decode`.

    query_start_loc_cpu / seq_lens_cpu: host copies (tuples) on eager steps with prompt
    tokens, so that the forward sizes its per-sequence work without reading the device; None
    on decode steps, whose shapes are fixed by B alone and which vt captures into a graph.
    """
    input_ids: torch.Tensor        # [T]
    positions: torch.Tensor        # [T]
    slot_mapping: torch.Tensor     # [T]: the KV-cache slot each token writes
    query_start_loc: torch.Tensor  # [B + 1]: sequence i's tokens are [qsl[i], qsl[i + 1])
    seq_lens: torch.Tensor         # [B]: tokens in the cache after this step
    block_tables: torch.Tensor     # [B, max_blocks]
    logits_indices: torch.Tensor   # [B]: the token whose logits sequence i wants
    token_rows: torch.Tensor       # [B]: each sequence's row of the token table
    state_idx: torch.Tensor        # [B]: each sequence's recurrent-state slot
    token_table: torch.Tensor      # [max_seqs + 1]: the last sampled token of each row
    query_start_loc_cpu: tuple | None = None
    seq_lens_cpu: tuple | None = None

    @classmethod
    def decode(cls, token_table, token_rows, positions, seq_lens, slot_mapping, block_tables,
               state_idx) -> "TorchInputs":
        """A decode step of S rows (vt.DecodeInputs's fields): input_ids =
        token_table[token_rows], one token per sequence. Only queues work (capturable)."""
        S = token_rows.shape[0]
        steps = torch.arange(S + 1, dtype=torch.int32, device=token_rows.device)
        return cls(token_table[token_rows], positions, slot_mapping, steps, seq_lens,
                   block_tables, steps[:S], token_rows, state_idx, token_table)

    @property
    def is_decode(self) -> bool:
        """One token per sequence, shapes fixed by B (no host copies): the captured case."""
        return self.query_start_loc_cpu is None

    @property
    def batch(self) -> int:
        """B, the sequences (rows of logits_out)."""
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        """T, the tokens of the step."""
        return int(self.input_ids.shape[0])


def flat_fields(inputs) -> tuple[str, ...]:
    """The array fields of a vt.DecodeInputs or vt.step.FlatInputs a torch forward reads."""
    return FLAT_ARRAYS if isinstance(inputs, FlatInputs) else FORWARD_FIELDS


FLAT_ARRAYS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens",
               "block_tables", "logits_indices", "token_rows", "state_idx")


def torch_inputs(table: torch.Tensor, inputs, arrays) -> TorchInputs:
    """TorchInputs of the token table's tensor and `arrays`, the tensors of flat_fields(inputs)
    in that order (`inputs` gives the kind and a flat step's host copies)."""
    if isinstance(inputs, FlatInputs):
        return TorchInputs(*arrays, table, inputs.query_start_loc_cpu, inputs.seq_lens_cpu)
    return TorchInputs.decode(table, *arrays)


class _CudaArray:
    """A CuPy array's memory as CUDA array interface version 2 (no stream: no sync on import)."""

    def __init__(self, arr):
        self.__cuda_array_interface__ = dict(
            shape=tuple(arr.shape), typestr=arr.dtype.str, data=(int(arr.data.ptr), False),
            strides=tuple(arr.strides), version=2)


def as_tensor(arr, device: torch.device) -> torch.Tensor:
    """A torch view of a backend array: numpy (the sim) or CuPy (cuda). No copy, no CUDA call."""
    if isinstance(arr, np.ndarray):
        return torch.from_numpy(arr)
    if arr.size == 0:   # a null pointer: torch needs no memory for it
        return torch.empty(arr.shape, dtype=getattr(torch, arr.dtype.name), device=device)
    return torch.as_tensor(_CudaArray(arr), device=device)


def _key(arr) -> tuple:
    ptr = arr.ctypes.data if isinstance(arr, np.ndarray) else int(arr.data.ptr)
    return ptr, arr.shape, arr.strides, arr.dtype.str


class ViewCache:
    """Views keyed by (pointer, shape, strides, dtype), so a step that reuses buffers (every
    eager step of a size) reuses their views. Bounded (least recently used out): the prefill
    stages its substeps at many offsets of one block, and serving must not grow host memory."""

    def __init__(self, device: torch.device, capacity: int = 512):
        self.device, self.capacity = device, capacity
        self._views: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def view(self, arr) -> torch.Tensor:
        key = _key(arr)
        t = self._views.get(key)
        if t is None:
            t = self._views[key] = as_tensor(arr, self.device)
            if len(self._views) > self.capacity:
                self._views.popitem(last=False)
        else:
            self._views.move_to_end(key)
        return t

    def inputs(self, token_table, inputs) -> TorchInputs:
        """TorchInputs of a vt.DecodeInputs or vt.step.FlatInputs (device arrays) and the
        token table."""
        return torch_inputs(self.view(token_table), inputs,
                            [self.view(getattr(inputs, f)) for f in flat_fields(inputs)])

    def clear(self) -> None:
        self._views.clear()
