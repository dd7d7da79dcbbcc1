"""vt.torch's views of backend buffers: zero-copy both ways, bounded cache."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install \".[torch]\")")

from vt.torch import torch_device  # noqa: E402
from vt.torch.views import ViewCache  # noqa: E402

pytestmark = pytest.mark.torch_allocator


def _fill(be, arr, values):
    host = be.pinned_empty(arr.shape, arr.dtype)
    host[...] = values
    s = be.stream()
    be.copy_h2d(arr, host, s)
    s.synchronize()
    s.close()


def _read(be, arr):
    host = be.pinned_empty(arr.shape, arr.dtype)
    s = be.stream()
    be.copy_d2h(host, arr, s)
    s.synchronize()
    s.close()
    return host.copy()


def test_a_view_shares_the_buffers_memory(backend):
    """Writes through the torch view land in vt's buffer and the other way round, for a 2-D
    array and a row slice of it (offset pointer, strides)."""
    rng = np.random.default_rng(0)
    arr = backend.empty((6, 5), np.int32)
    values = rng.integers(-1000, 1000, size=(6, 5), dtype=np.int32)
    _fill(backend, arr, values)
    views = ViewCache(torch_device(backend))
    t = views.view(arr[2:5])
    if backend.name == "cuda":
        torch.cuda.synchronize()
    assert t.shape == (3, 5) and t.dtype == torch.int32
    np.testing.assert_array_equal(t.cpu().numpy(), values[2:5])
    t.mul_(-3)
    if backend.name == "cuda":
        torch.cuda.synchronize()
    values[2:5] *= -3
    np.testing.assert_array_equal(_read(backend, arr), values)


def test_the_view_cache_reuses_views_and_stays_bounded(sim_backend):
    views = ViewCache(torch.device("cpu"), capacity=4)
    arr = sim_backend.empty((16,), np.float32)
    first = views.view(arr[0:2])
    assert views.view(arr[0:2]) is first
    for i in range(1, 8):
        views.view(arr[i:i + 2])
    assert len(views._views) == 4
    assert views.view(arr[0:2]) is not first   # evicted, made again
