"""A captured graph replays the eager computation, re-reading its host inputs at every replay."""
import numpy as np

from ._kernels import Axpb

N = 4096
A, B = 3.0, -2.0


def _fresh(rng, host):
    host[:] = rng.standard_normal(host.shape).astype(host.dtype)


def _graph_io(be, s, mapped=False):
    """Pinned input/output vectors, device twins, and the captured H2D -> axpb -> D2H graph
    (mapped: the copies are be.copy_h2d_mapped / copy_d2h_mapped kernels, not memcpys)."""
    x_h, y_h = be.pinned_empty((N,), np.float32), be.pinned_empty((N,), np.float32)
    x_d, y_d = be.empty((N,), np.float32), be.empty((N,), np.float32)
    h2d, d2h = (be.copy_h2d_mapped, be.copy_d2h_mapped) if mapped else (be.copy_h2d, be.copy_d2h)
    with be.capture(s, name="axpb") as cap:
        h2d(x_d, x_h, s)
        be.launch(s, Axpb(), y_d, x_d, a=A, b=B)
        d2h(y_h, y_d, s)
    return x_h, y_h, x_d, y_d, cap.graph


def test_replay_matches_eager_every_time(backend):
    """Five replays, each with fresh inputs, equal the eager run and the numpy reference."""
    rng = np.random.default_rng(0)
    s = backend.stream()
    x_h, y_h, x_d, y_d, graph = _graph_io(backend, s)
    eager_out = backend.pinned_empty((N,), np.float32)
    for _ in range(5):
        _fresh(rng, x_h)
        eager_out[:] = np.nan
        backend.copy_h2d(x_d, x_h, s)
        backend.launch(s, Axpb(), y_d, x_d, a=A, b=B)
        backend.copy_d2h(eager_out, y_d, s)
        s.synchronize()
        y_h[:] = np.nan  # poison: a replay that does not write shows up
        graph.launch(s)
        s.synchronize()
        np.testing.assert_array_equal(y_h, eager_out)
        np.testing.assert_allclose(y_h, Axpb.reference(x_h, A, B), rtol=1e-5, atol=1e-6)


def test_host_input_written_between_replays_is_read_by_the_baked_copy(backend):
    """The H2D node re-reads the pinned vector at replay time, not at capture time."""
    s = backend.stream()
    x_h, y_h, *_, graph = _graph_io(backend, s)
    for step in range(3):
        x_h[:] = step
        y_h[:] = np.nan
        graph.launch(s)
        s.synchronize()
        np.testing.assert_array_equal(y_h, np.full(N, A * step + B, np.float32))


def test_graph_replays_on_a_different_stream(backend):
    """A graph captured on one stream launches on another and computes the same result."""
    rng = np.random.default_rng(1)
    s, other = backend.stream(name="capture"), backend.stream(name="replay")
    x_h, y_h, *_, graph = _graph_io(backend, s)
    graph.upload(other)
    _fresh(rng, x_h)
    y_h[:] = np.nan
    graph.launch(other)
    other.synchronize()
    np.testing.assert_allclose(y_h, Axpb.reference(x_h, A, B), rtol=1e-5, atol=1e-6)
    assert s.query()


def test_scratch_allocated_in_capture_is_used_by_every_replay(backend):
    """A temporary from the capture scratch arena carries data between the graph's nodes."""
    rng = np.random.default_rng(2)
    s = backend.stream()
    backend.pool.reserve_scratch(N * 4)
    x_h, y_h = backend.pinned_empty((N,), np.float32), backend.pinned_empty((N,), np.float32)
    x_d, y_d = backend.empty((N,), np.float32), backend.empty((N,), np.float32, retained=True)
    with backend.capture(s, name="two-step") as cap:
        backend.copy_h2d(x_d, x_h, s)
        tmp = backend.empty((N,), np.float32)
        backend.launch(s, Axpb(), tmp, x_d, a=2.0, b=1.0)
        backend.launch(s, Axpb(), y_d, tmp, a=A, b=B)
        backend.copy_d2h(y_h, y_d, s)
    for _ in range(3):
        _fresh(rng, x_h)
        y_h[:] = np.nan
        cap.graph.launch(s)
        s.synchronize()
        np.testing.assert_allclose(y_h, A * (2.0 * x_h + 1.0) + B, rtol=1e-5, atol=1e-5)
    assert backend.pool.stats().mallocs_during_capture == 0
