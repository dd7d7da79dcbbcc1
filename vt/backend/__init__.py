"""vt's backends: the only package that talks to CUDA. Pick one with get_backend()."""
from __future__ import annotations

import functools
import importlib

from vt import env

from .errors import CaptureAllocationError, CaptureError, ClosedError, CudaError
from .pool import DeviceBuffer, DevicePool, PoolStats

BACKENDS = ("cuda", "sim")

__all__ = ["get_backend", "available_backends", "BACKENDS", "CudaError", "CaptureError",
           "CaptureAllocationError", "ClosedError", "DevicePool", "DeviceBuffer", "PoolStats"]


def available_backends() -> list[str]:
    """["cuda", "sim"] when a CUDA GPU is usable here, else ["sim"]."""
    return ["cuda", "sim"] if _cuda_unavailable_reason() is None else ["sim"]


def get_backend(name: str = "auto", *, device_delay_s: float = 0.0, pool_debug: bool | None = None):
    """A new backend: "cuda", "sim", or "auto" (cuda when a GPU is usable, else sim).

    `device_delay_s` (sim only) sleeps before each device op so the host runs ahead of the
    device deterministically; `pool_debug` gives every pool buffer its own driver allocation
    (default: VT_POOL_DEBUG=1 in the environment, which `tools/sanitize.sh memcheck` sets).
    """
    if pool_debug is None:
        pool_debug = _pool_debug_from_env()
    if name not in ("auto", *BACKENDS):
        raise ValueError(f"unknown backend {name!r}; valid names: 'auto', "
                         + ", ".join(repr(b) for b in BACKENDS))
    if name == "auto":
        name = "cuda" if _cuda_unavailable_reason() is None else "sim"
    if name == "sim":
        from .sim import SimBackend
        return SimBackend(device_delay_s=device_delay_s, pool_debug=pool_debug)
    if device_delay_s:
        raise ValueError(f"device_delay_s={device_delay_s!r} is a sim-only option; the cuda "
                         f"backend runs on a real device")
    reason = _cuda_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"the cuda backend is unavailable: {reason}")
    from .cuda import CudaBackend
    return CudaBackend(pool_debug=pool_debug)


@functools.lru_cache(maxsize=None)  # whether a GPU is usable does not change within a process
def _cuda_unavailable_reason() -> str | None:
    """None when the cuda backend can run here, else why not (import failure, no device)."""
    try:
        cuda = importlib.import_module("vt.backend.cuda")
    except Exception as exc:  # not installed, or broken: sim-only use must keep working
        return f"vt.backend.cuda cannot be imported ({type(exc).__name__}: {exc})"
    available = getattr(cuda, "cuda_available", None)
    if available is None:
        return "vt.backend.cuda has no cuda_available()"
    try:
        ok = available()
    except Exception as exc:  # a broken driver install must not break sim-only use
        return f"cuda_available() raised {type(exc).__name__}: {exc}"
    return None if ok else "no usable CUDA device (cuda_available() is False)"


def _pool_debug_from_env() -> bool:
    return env.get("VT_POOL_DEBUG")
