"""The CUDA device a backend runs on: selection, properties, versions, whole-device sync."""
from __future__ import annotations

from cuda.bindings import runtime as cudart

from ._check import check


class Device:
    """One CUDA device (the runtime's primary context on it). Not an owner: nothing to close."""

    def __init__(self, ordinal: int = 0):
        count = check(cudart.cudaGetDeviceCount(), "cudaGetDeviceCount")
        if not 0 <= ordinal < count:
            raise ValueError(f"device ordinal {ordinal} out of range: {count} CUDA device(s)")
        self.ordinal = ordinal
        self.set_current()
        # cudaFree(0) creates the primary context now, so that later calls (and CuPy, which
        # shares it) do not pay for it inside a timed region or a capture.
        check(cudart.cudaFree(0), "cudaFree(0)")
        self._props = check(cudart.cudaGetDeviceProperties(ordinal), "cudaGetDeviceProperties")

    def set_current(self) -> None:
        check(cudart.cudaSetDevice(self.ordinal), "cudaSetDevice")

    def synchronize(self) -> None:
        check(cudart.cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    @property
    def name(self) -> str:
        raw = self._props.name
        return (raw.split(b"\0", 1)[0].decode() if isinstance(raw, bytes) else str(raw)).strip()

    @property
    def compute_capability(self) -> tuple[int, int]:
        return self._props.major, self._props.minor

    @property
    def total_memory(self) -> int:
        return int(self._props.totalGlobalMem)

    def info(self) -> dict:
        driver = check(cudart.cudaDriverGetVersion(), "cudaDriverGetVersion")
        runtime = check(cudart.cudaRuntimeGetVersion(), "cudaRuntimeGetVersion")
        major, minor = self.compute_capability
        return {
            "device": f"{self.ordinal}: {self.name}",
            "compute capability": f"{major}.{minor}",
            "total memory": f"{self.total_memory / 2**30:.1f} GiB",
            "driver (CUDA)": _version(driver),
            "runtime (CUDA)": _version(runtime),
        }


def device_count() -> int:
    """Number of CUDA devices; 0 when there is no driver or no device (never raises CudaError)."""
    err, count = cudart.cudaGetDeviceCount()
    return int(count) if err == cudart.cudaError_t.cudaSuccess else 0


def _version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"
