"""Streams, events, copies and handle lifetimes, on every backend."""
import gc

import numpy as np
import pytest

from vt.backend import ClosedError, CudaError

from ._kernels import Axpb

N = 512


def test_wait_event_orders_work_across_streams(backend):
    """A stream waiting on another stream's event sees that stream's results."""
    producer, consumer = backend.stream(name="producer"), backend.stream(name="consumer")
    x_h, out = backend.pinned_empty((N,), np.float32), backend.pinned_empty((N,), np.float32)
    x_h[:] = np.arange(N)
    out[:] = np.nan
    x_d, y_d = backend.empty((N,), np.float32), backend.empty((N,), np.float32)
    ready = backend.event()
    backend.busy_wait(producer, 0.05)
    backend.copy_h2d(x_d, x_h, producer)
    backend.launch(producer, Axpb(), y_d, x_d, a=2.0, b=1.0)
    ready.record(producer)
    consumer.wait_event(ready)
    backend.copy_d2h(out, y_d, consumer)
    consumer.synchronize()
    np.testing.assert_array_equal(out, 2.0 * np.arange(N, dtype=np.float32) + 1.0)


def test_event_query_reports_completion(backend):
    """query() is False while queued work is pending and True after it ran."""
    s = backend.stream()
    ev = backend.event()
    assert ev.query(), "a never-recorded event counts as complete"
    backend.busy_wait(s, 0.1)
    ev.record(s)
    assert not ev.query() and not s.query()
    ev.synchronize()
    assert ev.query() and s.query()


def test_elapsed_ms_times_device_work(backend):
    """elapsed_ms between timing events brackets ~50 ms of queued device work."""
    s = backend.stream()
    start, end = backend.event(timing_enabled=True), backend.event(timing_enabled=True)
    start.record(s)
    backend.busy_wait(s, 0.05)
    end.record(s)
    end.synchronize()
    assert 40.0 < end.elapsed_ms(start) < 500.0


def test_elapsed_ms_refuses_events_without_timing(backend):
    """An event created with timing_enabled=False cannot be timed: ValueError."""
    s = backend.stream()
    start, end = backend.event(timing_enabled=False), backend.event(timing_enabled=True)
    start.record(s)
    end.record(s)
    s.synchronize()
    with pytest.raises(ValueError, match="timing_enabled=False"):
        end.elapsed_ms(start)


@pytest.mark.api_errors
def test_elapsed_ms_before_completion_is_not_ready(backend):
    """elapsed_ms while the end event is still pending: cudaErrorNotReady."""
    s = backend.stream()
    start, end = backend.event(timing_enabled=True), backend.event(timing_enabled=True)
    start.record(s)
    backend.busy_wait(s, 0.1)
    end.record(s)
    with pytest.raises(CudaError, match="cudaErrorNotReady"):
        end.elapsed_ms(start)
    s.synchronize()


def test_external_event_in_a_graph_completes_before_the_replay_ends(backend):
    """ev.record(s, external=True) in a capture fires on every replay, right after the H2D."""
    s = backend.stream()
    h, d = backend.pinned_empty((N,), np.int32), backend.empty((N,), np.int32)
    inputs_read = backend.event(blocking_sync=True)
    with backend.capture(s, name="inputs-read") as cap:
        backend.copy_h2d(d, h, s)
        inputs_read.record(s, external=True)
        backend.busy_wait(s, 0.2)
    for _ in range(2):
        cap.graph.launch(s)
        inputs_read.synchronize()
        assert not s.query(), "the inputs-read event must not wait for the whole replay"
        s.synchronize()


def test_copies_check_their_arguments(backend):
    """Wrong sides, shapes or layouts are refused with the offending values."""
    s = backend.stream()
    h, d = backend.pinned_empty((8,), np.float32), backend.empty((8,), np.float32)
    with pytest.raises(TypeError, match="copy_h2d: dst"):
        backend.copy_h2d(h, h, s)
    with pytest.raises(TypeError, match="copy_d2h: src"):
        backend.copy_d2h(h, h, s)
    with pytest.raises(ValueError, match="copy_h2d: .*mismatch|copy_h2d: dst has"):
        backend.copy_h2d(d, backend.pinned_empty((4,), np.float32), s)
    with pytest.raises(ValueError, match="C-contiguous"):
        backend.copy_h2d(d[::2], h[::2], s)


def test_pinned_host_array_round_trips_through_the_device(backend):
    """H2D then D2H reproduces the data, for a 2-D shape and several dtypes."""
    s = backend.stream()
    rng = np.random.default_rng(3)
    for dtype in (np.float16, np.float32, np.int32, np.int64):
        h = backend.pinned_empty((3, 50), dtype)
        back = backend.pinned_empty((3, 50), dtype)
        h[:] = rng.integers(-100, 100, h.shape).astype(dtype)
        back[:] = 0
        d = backend.empty((3, 50), dtype)
        assert d.shape == (3, 50) and d.dtype == dtype
        backend.copy_h2d(d, h, s)
        backend.copy_d2h(back, d, s)
        s.synchronize()
        np.testing.assert_array_equal(back, h)


def test_closed_objects_refuse_use(backend):
    """Streams, events and graphs raise ClosedError after close(); close is idempotent."""
    s = backend.stream()
    d = backend.empty((N,), np.float32)
    with backend.capture(s, name="closing") as cap:
        backend.launch(s, Axpb(), d, d, a=1.0, b=0.0)
    graph, ev = cap.graph, backend.event()
    for obj in (graph, ev):
        obj.close()
        obj.close()
    with pytest.raises(ClosedError):
        graph.launch(s)
    with pytest.raises(ClosedError):
        ev.record(s)
    with s:
        pass
    s.close()
    with pytest.raises(ClosedError):
        s.synchronize()


def test_closed_backend_refuses_use(backend):
    """After be.close() (idempotent) the backend raises ClosedError."""
    backend.close()
    backend.close()
    with pytest.raises(ClosedError):
        backend.stream()
    with pytest.raises(ClosedError):
        backend.empty((4,), np.float32)


def test_dropped_handles_are_collected(backend):
    """Streams, events and graphs nobody closed are collected once dropped (the backend keeps
    no reference to them), so their finalizers release the handles; the backend still works."""
    import weakref
    s = backend.stream()
    d = backend.empty((N,), np.float32)
    with backend.capture(s, name="dropped") as cap:
        backend.launch(s, Axpb(), d, d, a=1.0, b=0.0)
    cap.graph.launch(s)
    s.synchronize()
    ev = backend.event()
    ev.record(s)
    ev.synchronize()
    refs = {"stream": weakref.ref(s), "graph": weakref.ref(cap.graph), "event": weakref.ref(ev)}
    del cap, s, ev
    gc.collect()
    assert [name for name, r in refs.items() if r() is not None] == []
    backend.synchronize()
    s2 = backend.stream()   # new handles after the releases compute what they should
    x, out = backend.pinned_empty((N,), np.float32), backend.pinned_empty((N,), np.float32)
    x[:] = np.arange(N)
    backend.copy_h2d(d, x, s2)
    backend.launch(s2, Axpb(), d, d, a=2.0, b=1.0)
    backend.copy_d2h(out, d, s2)
    s2.synchronize()
    s2.close()
    np.testing.assert_array_equal(out, 2.0 * np.arange(N, dtype=np.float32) + 1.0)


def test_info_names_the_backend(backend):
    """info() is a dict with the backend, the device and versions."""
    info = backend.info()
    assert info["backend"] == backend.name
    for key in ("device", "total memory", "driver (CUDA)", "runtime (CUDA)"):
        assert key in info
