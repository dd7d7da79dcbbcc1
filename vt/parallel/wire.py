"""The runner calls rank 0 sends its other ranks, as bytes: what a step plan is on the wire.

Every rank runs the same Runner over its shard of the model; rank 0's engine decides, and
each of its runner calls is replayed on the other ranks in the same order (vt/parallel/rank.py):

    CAPTURE                     Runner.capture()
    WARM_UP  max_prefill        Runner.warm_up(max_prefill)
    LAUNCH   rows, prompts      Runner.launch(StepPlan(rows, prompts))
    COLLECT  tokens             Runner.collect(oldest); its tokens must equal rank 0's
    CEILING  n, replays         Runner.ceiling_us(n, replays)
    STOP                        a step failed on rank 0: abort and exit
    CLOSE                       Runner.close() and exit

A LAUNCH carries a decode step's rows in the input block's own layout (vt/step/inputblock.py):
the per-row vectors that move every step (positions, sequence lengths, KV slots: [3, n]
int32) always, the rest (token rows, state slots, sampling, block tables) only when they
changed since the last LAUNCH, which for the engine's batch is when a request joined or left
(InputBlock.filled says so). A steady decode step of 64 rows is 784 bytes. Prompts to
prefill, rarer and larger, go as a pickle.
"""
from __future__ import annotations

import pickle
import struct

import numpy as np

from vt.executor.plan import StepPlan
from vt.step.contract import SAMPLING_FIELDS
from vt.step.inputblock import InputBlock

CAPTURE, WARM_UP, LAUNCH, COLLECT, CEILING, STOP, CLOSE = range(1, 8)
OP_NAMES = {CAPTURE: "capture", WARM_UP: "warm_up", LAUNCH: "launch", COLLECT: "collect",
            CEILING: "ceiling", STOP: "stop", CLOSE: "close"}

_HEAD = struct.Struct("<BBHIQ")          # op, flags, pad, n, value (an int argument)
_HAS_ROWS, STATIC, _HAS_PROMPTS = 1, 2, 4   # LAUNCH's flags (STATIC: the rows changed)
# The block's vectors that change only with the batch, in the order they travel.
_STATIC_FIELDS = ("token_rows", "state_idx", *SAMPLING_FIELDS, "block_tables")


def simple(op: int, value: int = 0) -> bytes:
    """A message with at most one int argument (CAPTURE, WARM_UP, STOP, CLOSE)."""
    return _HEAD.pack(op, 0, 0, 0, value)


def ceiling(n: int, replays: int) -> bytes:
    return _HEAD.pack(CEILING, 0, 0, n, replays)


def collect(tokens: np.ndarray) -> bytes:
    tokens = np.ascontiguousarray(tokens, np.int32)
    return _HEAD.pack(COLLECT, 0, 0, len(tokens), 0) + tokens.tobytes()


def header(message: bytes) -> tuple[int, int, int, int]:
    """(op, flags, n, value) of a message."""
    op, flags, _, n, value = _HEAD.unpack_from(message)
    return op, flags, n, value


def body(message: bytes) -> memoryview:
    return memoryview(message)[_HEAD.size:]


class PlanEncoder:
    """Rank 0's side of LAUNCH: the rows written into a host block of the runner's capacity
    (the same write the runner does into its slots), sent as the block's [:n] bytes."""

    def __init__(self, capacity: int, max_blocks: int, pad):
        self.block = InputBlock(np.zeros, capacity, max_blocks)
        self.pad = pad
        self._sent = None     # the block's `filled` at the last LAUNCH that sent the statics

    def launch(self, plan: StepPlan) -> bytes:
        flags, n, parts = 0, 0, []
        if plan.decode is not None and len(plan.decode):
            block = self.block
            plan.decode.write_into(block, self.pad)
            n = len(plan.decode)
            flags |= _HAS_ROWS
            filled = block.filled
            if filled is None or filled != self._sent:
                flags |= STATIC
                inp = block.inputs
                parts += [getattr(inp, f)[:n].tobytes() for f in _STATIC_FIELDS]
                self._sent = filled
            parts.append(block.advancing[:, :n].tobytes())
        if plan.prefill:
            flags |= _HAS_PROMPTS
            parts.append(pickle.dumps(plan.prefill, protocol=5))
        return _HEAD.pack(LAUNCH, flags, 0, n, 0) + b"".join(parts)


class MirrorRows:
    """A rank's copy of rank 0's decode rows, kept up to date by each LAUNCH, and written into
    the runner's blocks like the engine's batch writes itself: everything when the rows
    changed since that block's last fill, else the three moving vectors."""

    def __init__(self, capacity: int, max_blocks: int):
        self.block = InputBlock(np.zeros, capacity, max_blocks)
        self.n = 0
        self.version = 0

    def __len__(self) -> int:
        return self.n

    def apply(self, flags: int, n: int, payload: memoryview) -> memoryview:
        """Take a LAUNCH's rows; returns the rest of the payload (the prompts)."""
        inp, at = self.block.inputs, 0
        self.n = n
        if flags & STATIC:
            for f in _STATIC_FIELDS:
                dst = getattr(inp, f)[:n]
                size = dst.nbytes
                dst[...] = np.frombuffer(payload[at:at + size], dst.dtype).reshape(dst.shape)
                at += size
            self.version += 1
        adv = self.block.advancing[:, :n]
        adv[...] = np.frombuffer(payload[at:at + adv.nbytes], np.int32).reshape(adv.shape)
        return payload[at + adv.nbytes:]

    def write_into(self, block, pad) -> None:
        n, src = self.n, self.block
        if block.filled != (self, self.version, n):
            dst = block.inputs
            for f in _STATIC_FIELDS:
                getattr(dst, f)[:n] = getattr(src.inputs, f)[:n]
            block.pad_from(n, pad)
            block.filled = (self, self.version, n)
        block.advancing[:, :n] = src.advancing[:, :n]


def decode_launch(message: bytes, rows: MirrorRows) -> StepPlan:
    """The StepPlan of a LAUNCH (its decode rows: `rows`, updated in place)."""
    _, flags, n, _ = header(message)
    rest = body(message)
    decode = None
    if flags & _HAS_ROWS:
        rest = rows.apply(flags, n, rest)
        decode = rows
    prefill = pickle.loads(rest) if flags & _HAS_PROMPTS else None
    return StepPlan(decode=decode, prefill=prefill)
