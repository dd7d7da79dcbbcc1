"""The eager path: prefill, mixed (prefill + decode) and oversize decode steps, launched
directly into logits the step owns (a mixed step is one forward over the flattened batch when
the model runs it in one call, else its decode rows replay their captured graph when one fits:
see launch). Such steps always drain, so one staging block
per purpose is enough: the next eager refresh comes after the drain that waited for this one.

Shapes are bucketed so that warming each bucket once (warm_up) covers every later eager
step's temporaries and serving never grows the pool: decode rows run padded to the captured
size that fits, else to the eager capacity; prefill is bucketed by the step model.
"""
from __future__ import annotations

import numpy as np

from vt.graphs import ForwardLogits
from vt.step.inputblock import InputBlock
from vt.step.contract import LOGITS_DTYPE, RECORD_WORDS, DecodeRows, prefill_last_rows


class EagerPath:
    """Staging blocks, owned logits blocks and the pinned token buffers of eager steps."""

    def __init__(self, be, stream, model, *, capacity: int, graph_size):
        self.be, self.stream, self.model = be, stream, model
        self.capacity, self._graph_size = capacity, graph_size   # graph_size(n): size or None
        mb = model.geometry.max_blocks
        # Decode rows and the prefill rows' sampling inputs of one (mixed) step, host + device.
        self._decode = (InputBlock(be.pinned_empty, capacity, mb), InputBlock(be.empty, capacity, mb))
        self._prefill = (InputBlock(be.pinned_empty, capacity, mb), InputBlock(be.empty, capacity, mb))
        # Three [capacity, vocab] logits blocks used in turn: at most depth + 1 are alive (the
        # steps in flight and the one being launched); later users are stream-ordered after.
        self._logits = [be.empty((capacity, model.vocab), LOGITS_DTYPE) for _ in range(3)]
        self._turn = 0
        # token records [capacity, RECORD_WORDS] (vt/sampling/logprobs.py)
        self.out_device = be.empty((capacity, RECORD_WORDS), np.int32)
        self.out_host = [be.pinned_empty((capacity, RECORD_WORDS), np.int32) for _ in range(2)]   # per parity
        self.done = [be.event(blocking_sync=True) for _ in range(2)]

    def bucket(self, n: int) -> int:
        """Rows an eager decode of n rows runs at: the captured size that fits, else capacity."""
        size = self._graph_size(n)
        return self.capacity if size is None else size

    def buckets(self, graph_sizes) -> list[int]:
        return sorted(set(graph_sizes) | {self.capacity})

    def launch(self, decode, prefill: list, parity: int, *, slot=None, index: int = -1,
               keep_logits: bool = False):
        """Launch the step; returns (ForwardLogits [n rows], kind). `decode`: step rows
        (DecodeRows, or the engine's BatchStep), sampled first. The prefill writes its logits
        after the decode rows (rows [n_dec, n)). A mixed step of a model with
        mixed_in_one_call is one forward over the flattened batch; otherwise its decode rows
        run first: `slot`, a captured graph slot that fits them, replays its graph (one launch
        instead of one per kernel per layer; `index` is the runner's step count for it). With
        a slot, the decode rows' logits stay in the graph's block and are copied into the
        step's only when `keep_logits` (recorded logits): nothing else reads an owning step's
        logits."""
        n_dec = len(decode) if decode is not None else 0
        n = n_dec + len(prefill)
        block = self._logits[self._turn % 3]   # [capacity, vocab]
        self._turn += 1
        model, out = self.model, self.out_device
        one_call = bool(prefill) and n_dec > 0 and model.mixed_in_one_call
        if prefill:   # the host's part first: the device runs the decode rows meanwhile
            self._fill(self._prefill, prefill_last_rows(prefill, model.geometry.block_size),
                       len(prefill))
            if one_call:
                self._fill(self._decode, decode, n_dec)
                launch_prefill = model.prepare_mixed(self._decode[0].inputs.rows(0, n_dec), prefill)
            else:
                launch_prefill = model.prepare_prefill(prefill)
        if one_call:
            launch_prefill(self.stream, block[:n])
            inputs = self._upload(self._decode, n_dec)
            model.sample(self.stream, block[:n_dec], inputs, out[:n_dec])
        elif n_dec and slot is not None:   # a graph step's write and launch (vt/graphs/slot.py)
            slot.write(decode)
            view = slot.launch(self.stream, n_dec, index)
            slot.copy_tokens(out[:n_dec], self.stream)
            if keep_logits:
                self.be.copy_d2d(block[:n_dec], view.rows, self.stream)
        elif n_dec:
            size = self.bucket(n_dec)
            inputs = self._stage(self._decode, decode, size)
            model.decode(self.stream, inputs, block[:size])
            model.sample(self.stream, block[:size], inputs, out[:size])
        if prefill:
            inputs = self._upload(self._prefill, len(prefill))
            if not one_call:
                launch_prefill(self.stream, block[n_dec:n])
            model.begin_requests(self.stream, prefill)   # their rows' penalty state, before they sample
            model.sample(self.stream, block[n_dec:n], inputs, out[n_dec:n])
        self.be.copy_d2h(self.out_host[parity][:n], out[:n], self.stream)
        kind = "eager" if not prefill else ("mixed" if n_dec else "prefill")
        return ForwardLogits(block[:n], n), kind

    def warm_up(self, graph_sizes, max_prefill_tokens: int, progress=None) -> None:
        """Run every eager shape once (all padding: writes only scratch), so that serving never
        calls the driver afterwards. Every temporary dies when its launch returns and goes back
        to the pool, so once each shape ran, the pool's free blocks cover any later step.
        What the prompt path warms is the step model's choice (StepModel.warm_up_prefill).
        progress(done, total, detail): before the first shape and after each decode size and
        the prompt path, or None."""
        report = progress or _silent
        block = self._logits[0]
        none = np.zeros(0, np.int32)
        empty = DecodeRows(none, none, none, none, np.zeros((0, self.model.geometry.max_blocks),
                                                            np.int32), none)
        buckets = self.buckets(graph_sizes)
        total = len(buckets) + 1
        report(0, total)
        for done, size in enumerate(buckets, 1):
            inputs = self._stage(self._decode, empty, size)
            self.model.decode(self.stream, inputs, block[:size])
            self.model.sample(self.stream, block[:size], inputs, self.out_device[:size])
            self.stream.synchronize()   # the staging block is reused by the next bucket
            report(done, total, f"decode, {size} rows")
        for nbytes in self.model.sampler_workspaces(self.be, self.capacity):
            self.be.pool.reserve(nbytes)
        self.model.warm_up_prefill(self.stream, max_prefill_tokens, block)
        self.stream.synchronize()
        report(total, total, "the prompt path")

    def close(self) -> None:
        for ev in self.done:
            ev.close()

    def _stage(self, blocks, rows, size: int):
        """Fill the host block (tail padded), copy it to the device; the [size] device views."""
        self._fill(blocks, rows, size)
        return self._upload(blocks, size)

    def _fill(self, blocks, rows, size: int) -> None:
        if not len(rows) <= size <= self.capacity:
            raise ValueError(f"an eager step of {len(rows)} rows padded to {size} exceeds the "
                             f"eager capacity {self.capacity} (max_seqs)")
        rows.write_into(blocks[0], self.model.pad)

    def _upload(self, blocks, size: int):
        host, dev = blocks
        host.copy_to(self.be, dev, self.stream)
        return dev.inputs.rows(0, size)


def _silent(done: int, total: int, detail: str = "") -> None:
    """The progress of a warm-up nobody watches."""
