"""What a torch forward needs while vt captures it: a private memory pool, and a refusal that
names the call a CUDA graph cannot hold.

Why the pool: torch's caching allocator does not see vt's capture. Without it, the
intermediates a forward allocates during the capture go back to torch's cache when the forward
returns, a later torch allocation on the same stream can be handed the same block, and every
replay of the graph then writes into that tensor. Inside `torch.cuda.use_mem_pool(pool)` every
allocation of this thread comes from `pool` and returns to it, and nothing outside the pool's
context is ever served from it: the blocks stay the graphs' own until the pool is dropped,
after the graphs that use it are destroyed.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from vt.errors import VtError


class TorchCaptureError(VtError, RuntimeError):
    """A torch forward did something a CUDA graph cannot capture (a host sync, a copy from
    host memory, an allocation outside the stream); the message names the torch call."""


@contextlib.contextmanager
def capturing_into(pool: "torch.cuda.MemPool", stream):
    """Run a torch forward inside vt's capture on `stream`: its allocations go to `pool`, and a
    capture-breaking call is reported as TorchCaptureError naming that call. Any other
    exception of the forward propagates as it is."""
    tracker = LastCall()
    with torch.cuda.use_mem_pool(pool), tracker:
        try:
            yield
        except Exception as exc:
            if not _breaks_capture(exc, stream):
                raise
            raise TorchCaptureError(refusal(
                tracker.name, f"{type(exc).__name__}: {_first_line(exc)}")) from exc


def refusal(call: str, failure: str) -> str:
    """The one-line message of a TorchCaptureError: the call, how it failed, what is allowed."""
    return (f"vt.torch: the torch forward cannot be captured into a CUDA graph: {call} failed "
            f"with {failure}. A captured forward may only queue work on its stream: no .item(), "
            f".tolist(), .cpu() or print of a tensor, no torch.cuda.synchronize(), no tensor made "
            f"from host data (torch.tensor(...) or a CPU tensor moved to the GPU), no "
            f"data-dependent shape (nonzero, masked_select), no random op (docs/torch.md)")


class LastCall(TorchFunctionMode):
    """Records the last torch function or tensor method the forward called (user level: the
    calls torch makes inside it are not seen), to name it when the capture breaks."""

    def __init__(self):
        super().__init__()
        self.last = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.last = func
        return func(*args, **(kwargs or {}))

    @property
    def name(self) -> str:
        """e.g. torch.Tensor.item, torch.tensor, torch.nn.functional.linear."""
        if self.last is None:
            return "a call before any torch function (e.g. torch.cuda.synchronize())"
        qual = getattr(self.last, "__qualname__", None) or repr(self.last)
        for prefix in ("_TensorBase.", "TensorBase."):   # tensor methods live on the C base
            if qual.startswith(prefix):
                return "torch.Tensor." + qual[len(prefix):]
        if qual.startswith("Tensor."):
            return "torch." + qual
        if qual.startswith("_VariableFunctionsClass."):   # torch.tensor, torch.zeros, ...
            return "torch." + qual.split(".", 1)[1]
        module = getattr(self.last, "__module__", None) or "torch"
        return f"{module}.{qual}"


def _breaks_capture(exc: BaseException, stream) -> bool:
    """Whether `exc` comes from the capture: the stream's capture was invalidated, or CUDA or
    torch said so (torch refuses some calls on a capturing stream before any CUDA call)."""
    text = str(exc).lower()
    if "captur" in text:
        return True
    try:
        return stream.is_capturing() and stream.capture_status().name.endswith("Invalidated")
    except Exception:   # the status query itself failed: the capture is broken
        return True


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""
