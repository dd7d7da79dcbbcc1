"""cuda-python backend: the only package in vt that imports cuda.bindings.

`import vt.backend.cuda` works without a GPU, without a driver and without cuda.bindings or
CuPy installed: CudaBackend is imported on first use, and cuda_available() says whether it
can run here.
"""
from __future__ import annotations

__all__ = ["CudaBackend", "cuda_available"]


def cuda_available() -> bool:
    """True when cuda.bindings and CuPy import and the runtime sees at least one device. Never raises."""
    try:
        import cupy  # noqa: F401

        from ._device import device_count
        return device_count() > 0
    except Exception:  # noqa: BLE001 (any failure to load or query means "not available")
        return False


def __getattr__(name: str):
    if name == "CudaBackend":
        from .backend import CudaBackend
        return CudaBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
