"""A one-thread kernel that spins for a given time: queues device work ahead of a replay."""
from __future__ import annotations

import numpy as np

# %globaltimer is the GPU's nanosecond wall clock: the wait does not depend on the SM clock
# (which changes with boost and power state) the way a clock64() loop would.
_SOURCE = r"""
extern "C" __global__ void vt_busy_wait(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
"""


class BusyWait:
    """Compiled and loaded on first use; launch() queues it on CuPy's current stream."""

    def __init__(self):
        self._kernel = None

    def launch(self, seconds: float) -> None:
        if not seconds >= 0:
            raise ValueError(f"busy_wait: seconds must be >= 0, got {seconds!r}")
        self._load()
        self._kernel((1,), (1,), (np.uint64(round(seconds * 1e9)),))

    def _load(self) -> None:
        if self._kernel is None:
            import cupy
            kernel = cupy.RawKernel(_SOURCE, "vt_busy_wait")
            # Compile and load the module now, so that a first use inside a capture does not
            # load a module while the stream captures.
            kernel.kernel  # noqa: B018 (attribute access compiles and loads)
            self._kernel = kernel
