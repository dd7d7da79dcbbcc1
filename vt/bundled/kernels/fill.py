"""Fill a device array with a constant (zeroing recurrent states and the token table)."""
from __future__ import annotations


class Fill:
    name = "fill"

    def run_numpy(self, a, *, value):
        a[...] = value

    def run_cupy(self, stream_handle, a, *, value):
        a.fill(value)  # a CuPy elementwise kernel on the current (= launch) stream
