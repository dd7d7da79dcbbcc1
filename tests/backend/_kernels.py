"""Tiny kernels for backend tests: the same computation on numpy (sim) and CuPy (cuda)."""
import numpy as np

_cupy_axpb = None


class Axpb:
    """y = a * x + b elementwise (a, b are scalars baked at capture)."""

    name = "axpb"

    def run_numpy(self, y, x, *, a, b):
        np.multiply(x, y.dtype.type(a), out=y)
        y += y.dtype.type(b)

    def run_cupy(self, stream_handle, y, x, *, a, b):
        global _cupy_axpb
        import cupy
        if _cupy_axpb is None:
            _cupy_axpb = cupy.ElementwiseKernel("T x, T a, T b", "T y", "y = a * x + b", "vt_test_axpb")
        _cupy_axpb(x, y.dtype.type(a), y.dtype.type(b), y)

    @staticmethod
    def reference(x, a, b):
        return (a * x.astype(np.float64) + b).astype(x.dtype)


class Fail:
    """A kernel whose numpy path raises (to test that worker failures are reported)."""

    name = "fail"

    def run_numpy(self, *args):
        raise ZeroDivisionError("kernel failed on purpose")

    def run_cupy(self, stream_handle, *args):
        raise ZeroDivisionError("kernel failed on purpose")
