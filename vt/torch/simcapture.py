"""The sim's capture of a torch forward: record it once, refuse what CUDA would, replay the record.

On cuda, vt's capture runs the forward's Python once and the graph replays the kernels it
queued; a call that needs the host (`.item()`, `torch.tensor(...)`, `.cpu()`), a shape that
depends on values (`nonzero`, boolean indexing) or a random op cannot be captured, and Python
state (a step counter) stays at its captured value. The sim does the same: at capture it
runs the forward once over fake tensors (torch's FakeTensorMode: shapes and dtypes only, no
data is read or written, so the sim's queued work may still be running), records each aten
op it dispatches with its arguments, and refuses the calls above with the TorchCaptureError
that cuda gives. The sim's graph node then replays the recorded ops on the real tensors: the
forward's Python does not run again.

The record holds the tensors the forward closes over (weights, KV cache) by reference, as a
CUDA graph holds their addresses; the step's inputs and logits_out are its arguments.
"""
from __future__ import annotations

import numpy as np
import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                           DynamicOutputShapeException, FakeTensorMode)
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from vt.torch.capture import LastCall, TorchCaptureError, refusal
from vt.torch.checks import check_returned
from vt.torch.views import TorchInputs
from vt.errors import VtError

# aten ops that draw random numbers (by overload packet name): vt samples, a forward may not.
RANDOM_OPS = frozenset({
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm",
    "normal", "normal_", "uniform", "uniform_", "bernoulli", "bernoulli_", "multinomial",
    "exponential", "exponential_", "geometric_", "cauchy_", "log_normal_", "random_",
    "native_dropout", "poisson", "binomial", "_standard_gamma", "_sample_dirichlet",
    "rrelu_with_noise"})
# What CUDA says to a call that needs the host while a stream captures.
CUDA_REFUSAL = ("cudaErrorStreamCaptureUnsupported: operation not permitted when stream is "
                "capturing")
# Tensor methods that read a tensor on the host without an aten op the sim would see (on CPU
# tensors .cpu() and .numpy() are free; on cuda they copy to the host and synchronize).
_HOST_METHODS = ("cpu", "numpy", "__repr__", "__str__", "__format__")


class Recording:
    """A forward's aten ops, replayable on real tensors: `replay(*tensors)`."""

    def __init__(self, steps: list, num_inputs: int):
        self.steps, self.num_inputs = steps, num_inputs
        self._values = num_inputs + sum(len(outs) for _, _, _, outs in steps)
        # Each op's arguments are bound here, once: a replay then only indexes its values (a
        # pytree walk of every op's arguments at every replay cost about as much as the ops
        # of a 30-layer step of hidden 576 on the CPU).
        self._plan = [(func, _binder(args), _binder(kwargs), outs)
                      for func, args, kwargs, outs in steps]

    def replay(self, *tensors: torch.Tensor) -> None:
        values = list(tensors) + [None] * (self._values - len(tensors))
        for func, args, kwargs, outs in self._plan:
            result = func(*args(values), **kwargs(values))
            if isinstance(result, torch.Tensor):
                values[outs[0]] = result
                continue
            leaves = result if isinstance(result, (list, tuple)) else pytree.tree_leaves(result)
            for index, leaf in zip(outs, leaves):
                if index is not None:
                    values[index] = leaf


def record(fn, table, arrays) -> Recording:
    """Run fn(TorchInputs, logits_out) once over fake tensors shaped like the token table and
    `arrays` (the step's forward fields, then logits_out); TorchCaptureError for what CUDA
    cannot capture; any other exception of the forward propagates as it is."""
    real = [torch.from_numpy(np.asarray(a)) for a in (table, *arrays)]
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [fake_mode.from_tensor(t) for t in real]
    recorder = _Recorder(fakes)
    calls = _HostCalls()
    with torch.inference_mode(), fake_mode, recorder, calls:
        try:
            result = fn(TorchInputs.decode(fakes[0], *fakes[1:-1]), fakes[-1])
        except _Refused as exc:
            raise TorchCaptureError(refusal(calls.name, CUDA_REFUSAL + f" ({exc})")) from None
        except (DataDependentOutputException, DynamicOutputShapeException) as exc:
            raise TorchCaptureError(refusal(
                calls.name, CUDA_REFUSAL + f" ({getattr(exc, 'func', 'an op')}'s output depends "
                f"on tensor values)")) from None
    check_returned(result, fakes[-1])
    return Recording(recorder.steps, len(real))


class SimCapturedTorchKernel:
    """The sim graph node of a recorded forward: replays the record when the stream reaches it."""

    name = "torch_forward(captured)"

    def __init__(self, recording: Recording):
        self.recording = recording

    def run_numpy(self, table, *arrays):
        with torch.inference_mode():
            self.recording.replay(*(torch.from_numpy(np.asarray(a)) for a in (table, *arrays)))


class _Ref:
    """An input of the recorded forward, or an output of an earlier recorded op."""
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _binder(template):
    """values -> `template` with each _Ref in it replaced by values[ref.index] (a tuple, list
    or dict of arguments, nested or not): the structure is walked here, once."""
    if isinstance(template, _Ref):
        index = template.index
        return lambda values: values[index]
    if isinstance(template, dict):
        keys = list(template)
        inner = _binder([template[k] for k in keys])
        return lambda values: dict(zip(keys, inner(values)))
    if not isinstance(template, (list, tuple)) or not any(
            isinstance(leaf, _Ref) for leaf in pytree.tree_leaves(template)):
        return lambda values: template
    parts = [_binder(t) for t in template]
    kind = type(template) if type(template) in (list, tuple) else tuple
    return lambda values: kind(part(values) for part in parts)


class _Refused(VtError):
    """Raised inside the forward by the sim's capture checks (the message says which rule)."""


class _Recorder(TorchDispatchMode):
    """Above FakeTensorMode: records every aten op with its tensor arguments as _Refs (real
    tensors the forward closes over stay themselves), and refuses host reads, random ops and
    value-dependent shapes."""

    def __init__(self, inputs: list):
        super().__init__()
        self.steps: list = []
        self._refs = {id(t): _Ref(i) for i, t in enumerate(inputs)}
        self._alive = list(inputs)   # keeps ids unique while recording
        self._next = len(inputs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if func is torch.ops.aten._local_scalar_dense.default:
            raise _Refused("it reads a tensor's value on the host")
        if name in ("lift_fresh", "lift_fresh_copy"):
            raise _Refused("it copies host data into a tensor")
        if name in RANDOM_OPS:
            raise _Refused(f"aten.{name} draws random numbers")
        template = pytree.tree_map_only(torch.Tensor, self._ref, (args, kwargs))
        result = func(*args, **kwargs)
        if _pure(func) and _returns_nothing_new(result, args, kwargs):
            return result   # a query (a device) or an input as it is (.float() of a float)
        outs = []
        for leaf in pytree.tree_leaves(result):
            if not isinstance(leaf, torch.Tensor):
                outs.append(None)
                continue
            if any(isinstance(s, torch.SymInt) for s in leaf.shape):
                raise _Refused(f"aten.{name}'s output shape depends on tensor values")
            outs.append(self._next)
            self._refs[id(leaf)] = _Ref(self._next)
            self._alive.append(leaf)
            self._next += 1
        self.steps.append((func, *template, outs))
        return result

    def _ref(self, t: torch.Tensor):
        ref = self._refs.get(id(t))
        if ref is not None:
            return ref
        if isinstance(t, torch._subclasses.FakeTensor):
            raise RuntimeError(f"vt.torch (sim capture): a fake tensor of shape {list(t.shape)} "
                               f"came from outside the recorded forward")
        return t   # a tensor the forward closes over: the record holds it


def _pure(func) -> bool:
    """An aten or prim op that writes none of its arguments: its outputs are all it does. (An
    op of another library may act beyond its schema: a collective's wait_tensor returns its
    argument once the collective has finished, so it is always recorded.)"""
    return func.namespace in ("aten", "prim") and not func._schema.is_mutable


def _returns_nothing_new(result, args, kwargs) -> bool:
    """No tensor among result's leaves but the argument tensors themselves: replaying the op
    would change nothing that a later op reads."""
    inputs = {id(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    return all(not isinstance(leaf, torch.Tensor) or id(leaf) in inputs
               for leaf in pytree.tree_leaves(result))


class _HostCalls(LastCall):
    """LastCall that also refuses the tensor methods that read a tensor on the host."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in _HOST_METHODS:
            self.last = func
            raise _Refused("it reads a tensor on the host")
        return super().__torch_function__(func, types, args, kwargs)
