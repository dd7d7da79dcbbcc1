"""What TorchForwardModel checks about a torch forward before serving it: that the model is
served under the geometry and vocabulary its tensors were built for, and that the forward
writes its logits into `logits_out` (in place) rather than returning or rebinding them.

Either mistake would otherwise be served as it is: a KV cache of another block size, or a
logits block nobody wrote, gives wrong tokens without an error.
"""
from __future__ import annotations

import torch

from vt.step import KVGeometry

_WRITE_INTO = ("write the logits into logits_out in place (logits_out.copy_(...)) and return "
               "None or logits_out")


def resolve_shape(forward, vocab, geometry) -> tuple[int, KVGeometry]:
    """(vocab, geometry) to serve `forward` with. A forward that declares its own (a `vocab`
    int, a `geometry` KVGeometry, as vt.torch.llama.LlamaDecoder does) provides what is left
    out and refuses what differs, naming both."""
    own_geometry = getattr(forward, "geometry", None)
    own_vocab = getattr(forward, "vocab", None)
    if isinstance(own_geometry, KVGeometry):
        if geometry is None:
            geometry = own_geometry
        elif geometry != own_geometry:
            raise ValueError(f"TorchForwardModel: geometry={geometry} differs from the geometry "
                             f"the module was built for ({own_geometry}: its KV cache and RoPE "
                             f"tables have that shape); pass the module's or leave geometry out")
    if isinstance(own_vocab, int) and not isinstance(own_vocab, bool):
        if vocab is None:
            vocab = own_vocab
        elif vocab != own_vocab:
            raise ValueError(f"TorchForwardModel: vocab={vocab} differs from the module's "
                             f"vocab={own_vocab} (its logits' width); pass {own_vocab} or leave "
                             f"vocab out")
    if geometry is None:
        raise TypeError("TorchForwardModel: geometry is required (the forward has no "
                        "`geometry` attribute to take it from)")
    if vocab is None:
        raise TypeError("TorchForwardModel: vocab is required (the forward has no `vocab` "
                        "attribute to take it from)")
    return vocab, geometry


def check_returned(result, logits_out) -> None:
    """Refuse a forward that returned something other than None or logits_out itself (an
    in-place op's result, e.g. `return logits_out.copy_(x)`): vt reads only logits_out."""
    if result is not None and result is not logits_out:
        what = (f"a Tensor of shape {list(result.shape)}" if isinstance(result, torch.Tensor)
                else f"a {type(result).__name__}")
        raise ValueError(f"vt.torch: the forward returned {what}, which vt never reads: "
                         f"{_WRITE_INTO}")


def poison(logits_out: torch.Tensor) -> None:
    """Fill logits_out with NaN, so that check_written can tell whether the forward wrote it."""
    logits_out.fill_(float("nan"))


def check_written(logits_out: torch.Tensor) -> None:
    """After poison() and one forward: refuse when no value of logits_out changed (a host
    read: call only outside a capture)."""
    if bool(torch.isnan(logits_out).all()):
        raise ValueError(f"vt.torch: the forward left logits_out unwritten (every value still "
                         f"the NaN vt filled it with; assigning to the name logits_out writes "
                         f"nothing): {_WRITE_INTO}")
