"""Helpers of the model tests: host<->device copies, poison values, tolerance checks."""
import numpy as np
import pytest


class DeviceIO:
    """Eager host<->device copies through pinned buffers on one stream (synchronous)."""

    def __init__(self, be):
        self.be = be
        self.s = be.stream(name="test")

    def put(self, a):
        a = np.ascontiguousarray(a)
        h = self.be.pinned_empty(a.shape, a.dtype)
        h[...] = a
        d = self.be.empty(a.shape, a.dtype)
        self.be.copy_h2d(d, h, self.s)
        self.s.synchronize()
        return d

    def set(self, d, a):
        h = self.be.pinned_empty(d.shape, d.dtype)
        h[...] = a
        self.be.copy_h2d(d, h, self.s)
        self.s.synchronize()

    def get(self, d):
        h = self.be.pinned_empty(d.shape, d.dtype)
        self.be.copy_d2h(h, d, self.s)
        self.s.synchronize()
        return np.array(h)


def poison(dtype):
    """NaN for float outputs, a large sentinel for ints: a kernel that skips an element fails."""
    dtype = np.dtype(dtype)
    if dtype == np.uint16:
        return np.uint16(0x7FC0)          # bf16 NaN bits
    return np.nan if dtype.kind == "f" else -12345


def assert_close(got, want, rtol, what=""):
    """max |got - want| / max |want| < rtol, and no NaN anywhere in got."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert not np.isnan(got).any(), f"{what}: {np.isnan(got).sum()} NaN in the output (poison left?)"
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
    assert err < rtol, f"{what}: relative error {err:.3g} >= {rtol}"
