"""What only the cuda backend can show: real pinned memory, CuPy temporaries served by vt's
pool inside a capture, the inputs-read event firing before a long replay ends, graph upload,
and the pool's debug mode. Run on a GPU (marked gpu; skipped with a reason elsewhere)."""
import gc
import time
import weakref

import numpy as np
import pytest

from vt import env
from vt.backend import ClosedError

from ._kernels import Axpb

pytestmark = pytest.mark.gpu


@pytest.fixture
def be():
    """A CudaBackend; VT_POOL_DEBUG=1 (tools/sanitize.sh memcheck) gives every buffer its own cudaMalloc."""
    from vt.backend.cuda import CudaBackend
    backend = CudaBackend(pool_debug=env.get("VT_POOL_DEBUG"))
    yield backend
    backend.close()


class Temporaries:
    """out = (2x + 1) * x through CuPy expressions: every intermediate is a CuPy allocation."""

    name = "temporaries"

    def run_numpy(self, out, x):
        out[...] = (2 * x + 1) * x

    def run_cupy(self, stream_handle, out, x):
        out[...] = (2 * x + 1) * x


def test_pinned_host_array_is_page_locked_and_freed_with_its_last_view(be):
    """pinned_empty memory is cudaMemoryTypeHost; its allocation lives as long as any view."""
    from vt.backend.cuda._memory import memory_type
    h = be.pinned_empty((1000,), np.int32)
    assert memory_type(h.ctypes.data).name == "cudaMemoryTypeHost"
    assert memory_type(h[500:].ctypes.data).name == "cudaMemoryTypeHost"
    owner = weakref.ref(h.base)
    view = h[10:20]
    del h
    gc.collect()
    assert owner() is not None and not owner().closed
    view[:] = 7  # still valid memory
    del view
    gc.collect()
    assert owner() is None


def test_pinned_buffer_close_is_idempotent_and_refuses_new_views(be):
    """close() frees the pinned allocation once; exporting it again raises ClosedError."""
    h = be.pinned_empty((16,), np.float32)
    buf = h.base
    del h
    buf.close()
    buf.close()
    with pytest.raises(ClosedError, match="pinned buffer"):
        np.asarray(buf)


def test_device_array_is_a_cupy_array_over_a_pool_block(be):
    """be.empty returns cupy.ndarray at the pool block's address; the block returns when it dies."""
    cupy = be.xp
    before = be.pool.stats().bytes_in_use
    d = be.empty((256, 4), np.float16)
    assert isinstance(d, cupy.ndarray) and d.shape == (256, 4) and d.dtype == np.float16
    assert be.pool.stats().bytes_in_use >= before + d.nbytes
    owner = weakref.ref(d.data.mem._owner)   # the pool's DeviceBuffer under the array
    del d
    gc.collect()
    assert owner() is None, f"the DeviceBuffer outlived its array; held by {_holders(owner())}"
    assert be.pool.stats().bytes_in_use == before


def _holders(obj, depth=3) -> list[str]:
    """Who keeps `obj` alive, a few levels up (for a failure message)."""
    if depth == 0:
        return []
    out = []
    for ref in gc.get_referrers(obj):
        if isinstance(ref, list) and len(ref) > 100:   # gc.get_objects()-style lists
            continue
        where = f" {ref.f_code.co_filename}:{ref.f_lineno}" if type(ref).__name__ == "frame" else ""
        out.append(f"{type(ref).__name__}{where} <- {_holders(ref, depth - 1)}")
    return out


def test_cupy_temporaries_in_capture_come_from_the_vt_pool(be):
    """CuPy intermediates inside a capture are scratch blocks of vt's pool: no driver malloc."""
    cupy = be.xp
    rng = np.random.default_rng(3)
    n = 1 << 16
    s = be.stream()
    x_h, y_h = be.pinned_empty((n,), np.float32), be.pinned_empty((n,), np.float32)
    x_d, y_d = be.empty((n,), np.float32), be.empty((n,), np.float32, retained=True)

    def step():
        be.copy_h2d(x_d, x_h, s)
        be.launch(s, Temporaries(), y_d, x_d)
        be.copy_d2h(y_h, y_d, s)

    x_h[:] = rng.standard_normal(n)
    with be.pool.scratch_warmup("temporaries"):  # eager: compiles kernels, sizes the arena
        step()
    s.synchronize()
    cupy_pool_bytes = cupy.get_default_memory_pool().total_bytes()
    mallocs = be.pool.stats().driver_mallocs
    with be.capture(s, name="temporaries") as cap:
        step()
    assert be.pool.stats().driver_mallocs == mallocs
    assert be.pool.stats().mallocs_during_capture == 0
    assert cupy.get_default_memory_pool().total_bytes() == cupy_pool_bytes
    for _ in range(3):
        x_h[:] = rng.standard_normal(n)
        y_h[:] = np.nan
        cap.graph.launch(s)
        s.synchronize()
        np.testing.assert_allclose(y_h, (2 * x_h + 1) * x_h, rtol=1e-6)


def test_inputs_read_event_completes_before_a_long_replay_ends(be):
    """An external event recorded after the H2D node fires while the replay still runs, and
    overwriting the host input after waiting on it cannot change that replay's output."""
    n = 4096
    s = be.stream()
    x_h, y_h = be.pinned_empty((n,), np.float32), be.pinned_empty((n,), np.float32)
    x_d, y_d = be.empty((n,), np.float32), be.empty((n,), np.float32)
    inputs_read, done = be.event(blocking_sync=True), be.event(blocking_sync=True)
    be.busy_wait(s, 0.0)  # loads both kernels before the capture
    be.launch(s, Axpb(), y_d, x_d, a=2.0, b=1.0)
    s.synchronize()
    with be.capture(s, name="inputs-read") as cap:
        be.copy_h2d(x_d, x_h, s)
        inputs_read.record(s, external=True)
        be.busy_wait(s, 0.25)
        be.launch(s, Axpb(), y_d, x_d, a=2.0, b=1.0)
        be.copy_d2h(y_h, y_d, s)
    for step in range(3):
        x_h[:] = np.random.default_rng(step).standard_normal(n)
        want = 2.0 * x_h + 1.0
        y_h[:] = np.nan
        t0 = time.perf_counter()
        cap.graph.launch(s)
        done.record(s)
        inputs_read.synchronize()
        waited = time.perf_counter() - t0
        assert not done.query(), "the replay ended before its inputs-read event was observed"
        x_h[:] = -1e30  # the replay already copied its input: this must not reach y_h
        done.synchronize()
        assert waited < 0.15, f"inputs-read wait took {waited * 1e3:.1f} ms of a 250 ms replay"
        np.testing.assert_allclose(y_h, want, rtol=1e-6)


def test_busy_wait_queues_about_the_requested_device_time(be):
    """busy_wait(s, 50 ms) between two timing events measures 50 ms (+ launch slack)."""
    s = be.stream()
    start, end = be.event(timing_enabled=True), be.event(timing_enabled=True)
    be.busy_wait(s, 0.0)
    start.record(s)
    be.busy_wait(s, 0.05)
    end.record(s)
    end.synchronize()
    assert 49.0 <= end.elapsed_ms(start) < 80.0


def test_uploaded_graph_replays_correctly(be):
    """cudaGraphUpload before the first launch; the replay computes the reference values."""
    n = 2048
    s = be.stream()
    x_h, y_h = be.pinned_empty((n,), np.float32), be.pinned_empty((n,), np.float32)
    x_d, y_d = be.empty((n,), np.float32), be.empty((n,), np.float32)
    be.launch(s, Axpb(), y_d, x_d, a=1.0, b=0.0)  # compile outside the capture
    with be.capture(s, name="upload") as cap:
        be.copy_h2d(x_d, x_h, s)
        be.launch(s, Axpb(), y_d, x_d, a=-3.0, b=0.25)
        be.copy_d2h(y_h, y_d, s)
    assert cap.graph.num_nodes == 3
    cap.graph.upload(s)
    x_h[:] = np.random.default_rng(5).standard_normal(n)
    y_h[:] = np.nan
    cap.graph.launch(s)
    s.synchronize()
    np.testing.assert_allclose(y_h, Axpb.reference(x_h, -3.0, 0.25), rtol=1e-6)


def test_pool_debug_mode_gives_each_buffer_its_own_cudamalloc():
    """pool_debug=True: one driver allocation of the exact size per buffer (caching by exact
    size); the normal pool rounds to 512 bytes, so 400 and 404 bytes share a block."""
    from vt.backend.cuda import CudaBackend
    with CudaBackend(pool_debug=True) as be:
        before = be.pool.stats().driver_mallocs
        arrays = [be.empty((100,), np.float32) for _ in range(3)]
        assert be.pool.stats().driver_mallocs == before + 3
        assert len({a.data.ptr for a in arrays}) == 3
        assert be.pool.stats().bytes_in_use == 3 * 400
        del arrays
        gc.collect()
        be.empty((101,), np.float32)              # another exact size: its own allocation
        assert be.pool.stats().driver_mallocs == before + 4
        be.empty((100,), np.float32)              # a cached 400-byte block serves it
        assert be.pool.stats().driver_mallocs == before + 4
    with CudaBackend(pool_debug=False) as be:
        a = be.empty((100,), np.float32)
        mallocs = be.pool.stats().driver_mallocs
        del a
        gc.collect()
        be.empty((101,), np.float32)
        assert be.pool.stats().driver_mallocs == mallocs


def test_orphaned_capture_is_ended_by_its_finalizer(be):
    """A capture entered and dropped without exit is ended when collected; the stream works."""
    s = be.stream()
    cap = be.capture(s, name="orphan")
    cap.__enter__()
    assert be.is_capturing(s) and be.pool.capture_name == "orphan"
    del cap
    gc.collect()
    assert not be.is_capturing(s)
    assert be.pool.capture_name is None
    d = be.empty((8,), np.float32)
    be.launch(s, Axpb(), d, d, a=1.0, b=0.0)
    s.synchronize()


def test_closed_handles_raise_closed_error_and_close_is_idempotent(be):
    """Streams, events, graphs and the backend refuse use after close(); close() twice is fine."""
    s, ev = be.stream(name="closing"), be.event()
    be.busy_wait(s, 0.0)  # loads the spin kernel before the capture
    with be.capture(s, name="tiny") as cap:
        be.busy_wait(s, 0.0)
    for obj in (cap.graph, ev, s):
        obj.close()
        obj.close()
    with pytest.raises(ClosedError, match="stream 'closing'"):
        s.synchronize()
    with pytest.raises(ClosedError, match="event"):
        ev.query()
    with pytest.raises(ClosedError, match="graph 'tiny'"):
        cap.graph.launch(be.stream())
    be.close()
    be.close()
    with pytest.raises(ClosedError, match="backend"):
        be.stream()


def test_legacy_stream_is_borrowed(be):
    """The legacy stream wraps handle 0, works eagerly, and closing the wrapper destroys nothing."""
    legacy = be.legacy_stream()
    assert legacy.handle == 0 and legacy.borrowed
    d = be.empty((8,), np.float32)
    be.launch(legacy, Axpb(), d, d, a=1.0, b=0.0)
    legacy.synchronize()
    assert legacy.query()


def test_info_reports_device_and_versions(be):
    """info() names the device, its compute capability and memory, and CUDA/package versions."""
    info = be.info()
    assert info["backend"] == "cuda"
    for key in ("device", "compute capability", "total memory", "driver (CUDA)", "runtime (CUDA)",
                "cuda-bindings", "cupy", "numpy", "nvmath-python"):
        assert info[key], key
    assert info["runtime (CUDA)"].startswith("13.")


def test_selfcheck_passes_on_cuda(be):
    """The `vt info` self-check (capture H2D + kernel + D2H, 3 replays with new input) passes."""
    from vt.backend.selfcheck import run_selfcheck
    ok, message = run_selfcheck(be)
    assert ok, message
