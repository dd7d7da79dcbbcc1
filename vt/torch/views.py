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

from vt.step import FORWARD_FIELDS


@dataclass
class TorchInputs:
    """One decode step of S rows as torch tensors (views of vt's device buffers, int32).

    token_table[max_seqs + 1]: the last sampled token of each row; the input token of row r is
    token_table[token_rows[r]] (`input_ids`). The other fields are vt.DecodeInputs's.
    """
    token_table: torch.Tensor
    token_rows: torch.Tensor      # [S]
    positions: torch.Tensor       # [S]
    seq_lens: torch.Tensor        # [S]: position + 1, the tokens in the cache after this step
    slot_mapping: torch.Tensor    # [S]: the KV-cache slot this step writes
    block_tables: torch.Tensor    # [S, max_blocks]
    state_idx: torch.Tensor       # [S]

    @property
    def input_ids(self) -> torch.Tensor:
        """[S] the input token of each row (a gather from the token table)."""
        return self.token_table[self.token_rows]

    @property
    def batch(self) -> int:
        return int(self.token_rows.shape[0])


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
        """TorchInputs of a vt.DecodeInputs (device arrays) and the token table."""
        return TorchInputs(self.view(token_table),
                           *(self.view(getattr(inputs, f)) for f in FORWARD_FIELDS))

    def clear(self) -> None:
        self._views.clear()
