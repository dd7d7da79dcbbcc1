"""Mapped copies (a kernel reading/writing pinned host memory): a copy's semantics, eager and
baked into a graph, on every backend."""
import numpy as np
import pytest

from ._kernels import Axpb
from .test_graph_replay import A, B, _graph_io


@pytest.mark.parametrize("n", [1, 3, 4, 4096, 4099])   # 4-byte and 16-byte word paths
def test_mapped_round_trip_equals_the_input(backend, n):
    rng = np.random.default_rng(n)
    s = backend.stream()
    src, back = backend.pinned_empty((n,), np.int32), backend.pinned_empty((n,), np.int32)
    src[:] = rng.integers(-2**31, 2**31 - 1, n, dtype=np.int64).astype(np.int32)
    back[:] = 7
    dev = backend.empty((n,), np.int32)
    backend.copy_h2d_mapped(dev, src, s)
    backend.copy_d2h_mapped(back, dev, s)
    s.synchronize()
    np.testing.assert_array_equal(back, src)


def test_baked_mapped_copies_read_and_write_at_every_replay(backend):
    """The graph's kernel copies re-read the pinned input and re-write the pinned output at
    each replay, as memcpy nodes would (what the host-overwrite hazard and its guards are
    about)."""
    s = backend.stream()
    x_h, y_h, *_, graph = _graph_io(backend, s, mapped=True)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x_h[:] = rng.standard_normal(x_h.shape).astype(np.float32)
        y_h[:] = np.nan
        graph.launch(s)
        s.synchronize()
        np.testing.assert_allclose(y_h, Axpb.reference(x_h, A, B), rtol=1e-5, atol=1e-6)


def test_mapped_copy_refuses_pageable_host_memory(backend):
    s = backend.stream()
    dev = backend.empty((8,), np.int32)
    with pytest.raises((ValueError, TypeError), match="pinned"):
        backend.copy_h2d_mapped(dev, np.zeros(8, np.int32), s)
    with pytest.raises((ValueError, TypeError), match="pinned"):
        backend.copy_d2h_mapped(np.zeros(8, np.int32), dev, s)


@pytest.mark.gpu
def test_mapped_copy_refuses_partial_words():
    from vt.backend import available_backends, get_backend
    if "cuda" not in available_backends():
        pytest.skip("no CUDA GPU")
    with get_backend("cuda") as be:
        s = be.stream()
        with pytest.raises(ValueError, match="4-byte words"):
            be.copy_h2d_mapped(be.empty((3,), np.uint8), be.pinned_empty((3,), np.uint8), s)
