"""TorchForwardModel: a PyTorch decode forward as a vt step model.

The forward is `forward(inputs, logits_out)`: `inputs` a vt.torch.TorchInputs (torch views of
the step's device buffers), `logits_out` a [S, vocab] float32 tensor it must fill. It may be a
plain function or an nn.Module. vt runs it on its own stream, captures it into the decode
step's graph like any forward, and around it:

- on cuda, torch's current stream is vt's (torch.cuda.ExternalStream), so every kernel the
  forward launches is in vt's stream order, and in its capture;
- while vt captures, every torch allocation goes to a private torch.cuda.MemPool per vt stream
  (vt/torch/capture.py says why that matters). One pool serves every size and ring slot of
  an engine: their replays run one after another on that stream. It is dropped, and its memory
  freed, by release_stream: at Engine.close(), after the graphs that use it are destroyed;
- the first eager step of each batch size first runs the forward once on a side stream, as
  torch asks before a capture (lazy initialisation, workspaces); vt's own warm-up step then
  runs it on vt's stream before capturing that size;
- a call that cannot be captured (host sync, .item(), a copy from host memory) is refused with
  TorchCaptureError naming the call; any other exception propagates as it is;
- the forward must write logits_out in place: one that returns another value is refused at every
  call, and the first eager call of each batch size fills logits_out with NaN first and
  refuses a forward that left it so (vt/torch/checks.py).

On the sim backend the forward runs on CPU tensors (views of the sim's numpy buffers) inside a
sim kernel, so the sim's stream order applies to it. A sim capture records the forward once
and refuses what a CUDA capture refuses; its graph replays the record (vt/torch/simcapture.py).
No memory pool there: the sim's graphs hold no torch memory.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vt.backend.zeros import zeros
from vt.forward.user import ForwardModel, KVGeometry
from vt.torch.capture import TorchCaptureError, capturing_into
from vt.torch.checks import check_returned, check_written, poison, resolve_shape
from vt.torch.simcapture import SimCapturedTorchKernel, record
from vt.torch.views import ViewCache, flat_fields, torch_inputs


# The sim's prompt-path warm-up stops at steps of this many tokens (warm_up_prefill).
SIM_PREFILL_WARM_UP_TOKENS = 16


def declared_prefill(forward) -> str:
    """The forward's own `prefill` when it is a string (a module that takes the flattened
    batch says "flat"; ForwardModel checks the value), else "positions". A `prefill` that is
    not a string (a method of that name) declares nothing."""
    own = getattr(forward, "prefill", None)
    return own if isinstance(own, str) else "positions"


def torch_device(be) -> torch.device:
    """The torch device whose memory a backend's buffers are in: cuda:N, or cpu for the sim."""
    return torch.device("cuda", be.device.ordinal) if be.name == "cuda" else torch.device("cpu")


class TorchForwardModel(ForwardModel):
    """ForwardModel of a torch forward(inputs, logits_out) (module docstring). token_table: the
    backend's [max_seqs + 1] int32 array the sampler writes the tokens into; one is made when
    None. The model's tensors (weights, KV cache) must be on torch_device(be). vocab and
    geometry may be left out for a forward that has them as attributes (LlamaDecoder), and
    must equal them where it does. prefill: "positions" (a decode-only forward: prompts one
    position per call) or "flat" (the forward takes the flattened batch: a prompt chunk, or a
    whole mixed step, in one call); None (the default) takes the forward's own `prefill`
    string where it has one (LlamaDecoder's is "flat"), else "positions", which is correct
    for any causal forward."""

    def __init__(self, be, forward, *, vocab: int | None = None, geometry: KVGeometry | None = None,
                 token_table=None, prefill: str | None = None):
        if not callable(forward):
            raise TypeError(f"forward must be a callable forward(inputs, logits_out) or an "
                            f"nn.Module, got {type(forward).__name__}")
        vocab, geometry = resolve_shape(forward, vocab, geometry)
        if prefill is None:
            prefill = declared_prefill(forward)
        if isinstance(forward, torch.nn.Module):
            forward.eval()
        if token_table is None:
            token_table = zeros(be, (geometry.max_seqs + 1,), np.int32)
        super().__init__(be, TorchForwardCall(be, forward, token_table), vocab=vocab,
                         token_table=token_table, geometry=geometry, prefill=prefill,
                         prefix_cacheable=bool(getattr(forward, "prefix_cacheable", False)))

    def warm_up_prefill(self, stream, max_prefill_tokens: int, logits_out) -> None:
        """The prompt path's warm-up. vt's pool needs no prefill shape of a torch forward: its
        staging is allocated at construction and the forward's temporaries are torch's. On
        cuda the whole ladder runs (ForwardModel.warm_up_prefill, up to max_prefill_tokens),
        which grows torch's caching allocator to the largest step and compiles the kernels'
        shapes: a GPU runs it in about a second. On the sim, steps of at most
        SIM_PREFILL_WARM_UP_TOKENS: CPU torch has no allocator to grow, and a full-context
        prefill there takes minutes and makes Ctrl-C wait for it; the short steps still run
        the prompt path once, so its errors come at start-up."""
        if self.be.name != "cuda":
            max_prefill_tokens = min(max_prefill_tokens, SIM_PREFILL_WARM_UP_TOKENS)
        super().warm_up_prefill(stream, max_prefill_tokens, logits_out)

    def release_stream(self, stream) -> None:
        """Drop the stream's torch memory pool and views (the runner's graphs are gone)."""
        self.forward.release(stream)

    def torch_memory_pools(self) -> int:
        """Private pools alive (one per stream that captured): 0 once every engine is closed."""
        return sum(st.pool is not None for st in self.forward.streams.values())


@dataclass
class _StreamState:
    """What the adapter keeps per vt stream."""
    external: object                      # torch.cuda.ExternalStream of vt's stream
    views: ViewCache
    pool: object = None   # torch.cuda.MemPool, made at the first capture (no CUDA call)
    warmed: set = field(default_factory=set)   # batch sizes warmed on a side stream


class TorchForwardCall:
    """A call of the torch forward on a vt stream: what ForwardModel drives as its forward
    (stream, inputs, logits_out) with vt's arrays. On cuda it runs the forward on the stream
    (torch's ExternalStream) over torch views of the arrays, into the stream's private pool
    while vt captures; on the sim it is a sim kernel, or the record a sim capture replays."""

    def __init__(self, be, fn, token_table):
        self.be, self.fn, self.token_table = be, fn, token_table
        self.device = torch_device(be)
        self.streams: dict[int, _StreamState] = {}
        self.sim_checked: set = set()   # batch sizes whose logits_out writing the sim checked

    def __call__(self, stream, inputs, logits_out) -> None:
        if self.be.name != "cuda":
            self._sim_call(stream, inputs, logits_out)
            return
        st = self._state(stream)
        t_out = st.views.view(logits_out)
        # The inputs are made on vt's stream (a decode step's input_ids is a gather): inside
        # the capture too, so that the gather is part of the graph.
        with torch.cuda.stream(st.external), torch.inference_mode():
            if stream.is_capturing():
                if st.pool is None:
                    st.pool = torch.cuda.MemPool()
                with capturing_into(st.pool, stream):
                    check_returned(self.fn(st.views.inputs(self.token_table, inputs), t_out), t_out)
                return
            t_in = st.views.inputs(self.token_table, inputs)
            if t_in.is_decode and t_in.batch not in st.warmed:   # the sizes vt captures
                self._warm_up_on_side_stream(st.external, t_in, t_out)
                st.warmed.add(t_in.batch)
            check_returned(self.fn(t_in, t_out), t_out)

    def _warm_up_on_side_stream(self, external, t_in, t_out) -> None:
        """The forward once on a side stream (torch's advice before a capture), into a
        poisoned logits_out: refused if it wrote nothing there."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(external)
        with torch.cuda.stream(side):
            poison(t_out)
            check_returned(self.fn(t_in, t_out), t_out)
            check_written(t_out)   # a host read, eager: once per batch size
        external.wait_stream(side)

    def _sim_call(self, stream, inputs, logits_out) -> None:
        arrays = (*(getattr(inputs, f) for f in flat_fields(inputs)), logits_out)
        if not self.be.is_capturing(stream):
            self.be.launch(stream, _SimTorchKernel(self.fn, inputs, self.sim_checked),
                           self.token_table, *arrays)
            return
        try:
            recording = record(self.fn, self.token_table, arrays)
        except TorchCaptureError as exc:
            # As on cuda, the refused call invalidates the capture: the capture then fails
            # with a CaptureError caused by this one.
            stream.capture.invalidate(exc)
            raise
        self.be.launch(stream, SimCapturedTorchKernel(recording), self.token_table, *arrays)

    def _state(self, stream) -> _StreamState:
        st = self.streams.get(stream.handle)
        if st is None:
            st = self.streams[stream.handle] = _StreamState(
                torch.cuda.ExternalStream(stream.handle, device=self.device), ViewCache(self.device))
        return st

    def release(self, stream) -> None:
        st = self.streams.pop(getattr(stream, "handle", None), None)
        if st is not None:
            st.views.clear()
            st.pool = None   # the last reference: torch frees the pool's memory


class _SimTorchKernel:
    """The sim's kernel around an eager torch forward: runs it on CPU views of the sim's
    buffers when the sim's stream reaches it. The first run of each batch size goes into a
    poisoned logits_out, as on cuda (`checked`: the sizes done, shared by the model's kernels)."""

    name = "torch_forward"

    def __init__(self, fn, inputs, checked: set):
        self.fn, self.checked = fn, checked
        self.inputs = inputs   # the step's kind and host copies

    def run_numpy(self, table, *arrays):
        table, *fields, logits = [torch.from_numpy(np.asarray(a)) for a in (table, *arrays)]
        first = logits.shape[0] not in self.checked
        with torch.inference_mode():
            if first:
                poison(logits)
            check_returned(self.fn(torch_inputs(table, self.inputs, fields), logits), logits)
            if first:
                check_written(logits)
                self.checked.add(logits.shape[0])
