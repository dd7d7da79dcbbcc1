"""The process group's two calls outside a step: warm it before any capture, abort it when a
rank is gone."""
from __future__ import annotations

from vt.parallel.errors import TensorParallelError


def warm_communicator(backend) -> None:
    """One all-reduce before anything is captured: NCCL sets its communicator up at the first
    collective, which a capture cannot hold."""
    import torch
    import torch.distributed as dist
    device = torch.device("cuda", backend.device.ordinal) if backend.name == "cuda" else None
    x = torch.ones(1, device=device)
    dist.all_reduce(x)
    if float(x.item()) != dist.get_world_size():
        raise TensorParallelError(f"the tensor-parallel group's first all-reduce gave "
                                  f"{float(x.item())}, not {dist.get_world_size()}")


def abort_communicators() -> None:
    """End NCCL collectives that wait for a rank that is gone (the only way to unblock a
    captured one). torch exposes this as _abort_process_group; without it the collective
    timeout bounds the wait instead."""
    try:
        import torch.distributed.distributed_c10d as c10d
        abort = getattr(c10d, "_abort_process_group", None)
        if abort is not None:
            abort()
    except Exception:   # noqa: BLE001 (best effort: the timeout still bounds the wait)
        pass
