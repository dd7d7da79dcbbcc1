"""The executor's hooks: what the graph driver, the runner and the engine's KV block pool call
at fixed points. NULL_HOOKS is production's (the graph pool pre-grow before a size's captures,
the KV pool's fence, nothing after a launch); the test arms are subclasses, plus a step model
wrapper that adds device work.

The production classes take a hooks object and call its methods unconditionally, so no test
flag is tested on the hot path and a test arm overrides only the hook it needs:

- Poison: after each graph launch, overwrite the input block the next step of that size
  will use, as early as the mode lets the host write it (ring: after that slot's guard;
  drain: once the step just launched is done, as the next launch's drain would wait; the
  unguarded arm: at once). A sound mode never lets a replay read the poison;
  VT_ASYNC_EXECUTOR_POISON=1 selects it (hooks_from_env).
- NoPoolPreGrow: capture without pre-growing the pool: the second slot of a size then
  finds no free logits block and the capture is refused (the test of the pre-grow).
- KVPoison(write, fence=...): the KV-reuse hazard's arm and detector. The moment the
  engine's block pool hands out KV blocks for a new owner (vt/engine/kv_blocks.py),
  write(blocks) overwrites their KV with poison without waiting for the decode stream (a
  writer that is not stream-ordered: the host, another stream). With the pool's fence
  (fence=True, production's) a block is handed out only once the last step that may read
  it is seen complete, so no step reads the poison; fence=False removes the fence (a block
  is reusable the moment it is released, while the step that reads it may still run), and
  a step in flight reads the poison: wrong tokens or an error row.
- MaskPoison(write, fence=...): the grammar-mask staging hazard's arm and detector. Right
  after the serving loop queued a step's mask copies (behind that step's forward), write(
  masks, rows) overwrites those rows' pinned staging (vt/sampling/token_mask.py). With the
  staging guard (fence=True, what every production writer gets) it first waits until the
  queued copies have read staging, so no sampler sees the poison; fence=False takes staging
  unfenced, the copies read the poison: a constrained row samples with the wrong mask.
- with_device_work(step_model, seconds): every decode queues that much device time first,
  so the host runs ahead of the device on any backend (the regime where the host-overwrite
  hazard shows).

The unsafe mode itself, skipping the drain without the ring, is ExecutorConfig's mode
"unguarded": it is selected like the other modes and runs the same code, with no guard.
"""
from __future__ import annotations

from vt import env
from vt.step.contract import StepModel


class ExecutorHooks:
    """The null hooks: what production runs. A test arm overrides the hook it needs."""

    label = ""   # appended to the mode's name in stats and logs ("ring+poison")
    # The KV block pool fences released blocks until the last step that may read them is
    # seen complete (vt/engine/kv_blocks.py); only a test arm turns it off.
    kv_fence = True
    # A callable(blocks) the pool calls with the KV blocks it hands to a new owner; None:
    # nothing (production).
    kv_blocks_reused = None

    def after_mask_write(self, masks, rows) -> None:
        """After the serving loop queued the mask copies of `rows` (masks: the model's
        vt.sampling.token_mask.TokenMaskState)."""

    def pre_grow_pool(self, pool, nbytes: int, count: int) -> None:
        """Before a size's captures: reserve `count` pool blocks of `nbytes`, one retained
        logits block per graph (vt/graphs/capture.py)."""
        pool.reserve(nbytes, count=count)

    def after_graph_launch(self, ring, handle, skips_drain: bool, stats) -> None:
        """After a graph step was launched from `ring` (vt.graphs.SlotRing): `handle` is its
        StepHandle, `skips_drain` whether the next step after it skips the drain, `stats` the
        runner's RunnerStats."""


NULL_HOOKS = ExecutorHooks()


class Poison(ExecutorHooks):
    """VT_ASYNC_EXECUTOR_POISON (module docstring). A guard that blocked before the poison
    could be written counts in the runner's ring_waits, as an acquire's would."""

    label = "+poison"

    def after_graph_launch(self, ring, handle, skips_drain: bool, stats) -> None:
        nxt = ring.peek()
        if ring.guarded:
            stats.ring_waits += nxt.wait_reusable() > 0
        elif not skips_drain:
            handle.done.synchronize()   # what the next launch's drain waits for
        nxt.write_padding()             # every row redirected to the scratch row


class KVPoison(ExecutorHooks):
    """The KV-reuse hazard's arm (module docstring). write(blocks): overwrite those KV blocks
    with poison now, not ordered after the decode stream's work. `reused` counts the blocks
    poisoned."""

    def __init__(self, write, *, fence: bool = True):
        if not callable(write):
            raise TypeError(f"KVPoison: write must be a callable(blocks), got {type(write).__name__}")
        self._write, self.kv_fence, self.reused = write, bool(fence), 0
        self.label = "+kv-poison" if fence else "+kv-poison-no-fence"

    def kv_blocks_reused(self, blocks) -> None:
        self.reused += len(blocks)
        self._write(blocks)


class MaskPoison(ExecutorHooks):
    """The grammar-mask staging hazard's arm (module docstring). write(staging, row): poison
    one row's staging array; `poisoned` counts the rows written."""

    def __init__(self, write, *, fence: bool = True):
        if not callable(write):
            raise TypeError(f"MaskPoison: write must be a callable(staging, row), got "
                            f"{type(write).__name__}")
        self._write, self.fence, self.poisoned = write, bool(fence), 0
        self.label = "+mask-poison" if fence else "+mask-poison-no-fence"

    def after_mask_write(self, masks, rows) -> None:
        for row in rows:
            self._write(masks.staging(row, fenced=self.fence), row)
            self.poisoned += 1


class NoPoolPreGrow(ExecutorHooks):
    """Capture without the pool pre-grow (module docstring)."""

    label = "+no-pre-grow"

    def pre_grow_pool(self, pool, nbytes: int, count: int) -> None:
        pass


def hooks_from_env(environ=None) -> ExecutorHooks:
    """The hooks the environment asks for: Poison with VT_ASYNC_EXECUTOR_POISON=1, else none."""
    return Poison() if env.get("VT_ASYNC_EXECUTOR_POISON", environ) else NULL_HOOKS


def with_device_work(step_model: StepModel, seconds: float) -> StepModel:
    """`step_model` with `seconds` of device work (be.busy_wait) queued before each decode,
    captured into its graphs like the decode itself; 0 returns it unchanged."""
    return _DeviceWork(step_model, seconds) if seconds else step_model


class _DeviceWork(StepModel):
    """A step model that delegates everything to `inner` but queues device work first in
    decode. StepModel's own defaults are delegated by name (its class attributes would
    otherwise answer before __getattr__ does)."""

    def __init__(self, inner: StepModel, seconds: float):
        if not isinstance(inner, StepModel):
            raise TypeError(f"with_device_work needs a vt StepModel, got {type(inner).__name__}")
        self._inner, self.seconds = inner, float(seconds)
        self._be = getattr(inner, "be")

    def __getattr__(self, name):
        return getattr(self._inner, name)

    @property
    def chunked_prefill(self):
        return self._inner.chunked_prefill

    @property
    def token_masks(self):
        return self._inner.token_masks

    @property
    def mixed_in_one_call(self):
        return self._inner.mixed_in_one_call

    @property
    def prefix_cacheable(self):
        return self._inner.prefix_cacheable

    def decode(self, stream, inputs, logits_out) -> None:
        self._be.busy_wait(stream, self.seconds)
        self._inner.decode(stream, inputs, logits_out)

    def prefill(self, stream, seqs, logits_out) -> None:
        self._inner.prefill(stream, seqs, logits_out)

    def sample(self, stream, logits, inputs, out_tokens) -> None:
        self._inner.sample(stream, logits, inputs, out_tokens)

    def begin_requests(self, stream, seqs) -> None:
        self._inner.begin_requests(stream, seqs)

    def prepare_prefill(self, seqs):
        return self._inner.prepare_prefill(seqs)

    def prepare_mixed(self, decode, seqs):
        return self._inner.prepare_mixed(decode, seqs)

    def warm_up_prefill(self, stream, max_prefill_tokens: int, logits_out) -> None:
        self._inner.warm_up_prefill(stream, max_prefill_tokens, logits_out)

    def sampler_workspaces(self, be, rows: int) -> list[int]:
        return self._inner.sampler_workspaces(be, rows)

    def release_stream(self, stream) -> None:
        self._inner.release_stream(stream)
