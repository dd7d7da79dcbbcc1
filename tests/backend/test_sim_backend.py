"""Sim-only behaviour: real asynchrony, device delay, worker failures, backend selection."""
import time

import numpy as np
import pytest

from vt.backend import available_backends, get_backend
from vt.backend.sim import SimBackend

from ._kernels import Axpb, Fail


@pytest.fixture
def slow_sim():
    be = get_backend("sim", device_delay_s=0.02)
    yield be
    be.close()


def test_device_delay_lets_the_host_run_ahead(slow_sim):
    """Enqueueing returns at once; the worker executes later, in order."""
    s = slow_sim.stream()
    x_h, out = slow_sim.pinned_empty((4,), np.float32), slow_sim.pinned_empty((4,), np.float32)
    x_h[:] = 1.0
    out[:] = np.nan
    x_d = slow_sim.empty((4,), np.float32)
    t0 = time.perf_counter()
    slow_sim.copy_h2d(x_d, x_h, s)
    for _ in range(4):
        slow_sim.launch(s, Axpb(), x_d, x_d, a=2.0, b=0.0)
    slow_sim.copy_d2h(out, x_d, s)
    enqueue_s = time.perf_counter() - t0
    assert enqueue_s < 0.02 and not s.query() and np.isnan(out).all()
    s.synchronize()
    assert time.perf_counter() - t0 >= 6 * 0.02
    np.testing.assert_array_equal(out, np.full(4, 16.0, np.float32))


def test_h2d_reads_host_memory_when_it_executes_not_when_enqueued(slow_sim):
    """An eager H2D copies whatever the host vector holds when the worker reaches it."""
    s = slow_sim.stream()
    h, out = slow_sim.pinned_empty((4,), np.int32), slow_sim.pinned_empty((4,), np.int32)
    d = slow_sim.empty((4,), np.int32)
    h[:] = 1
    slow_sim.copy_h2d(d, h, s)
    h[:] = 2
    slow_sim.copy_d2h(out, d, s)
    s.synchronize()
    np.testing.assert_array_equal(out, [2, 2, 2, 2])


def test_event_synchronize_waits_for_the_latest_record_before_the_call(sim_backend):
    """Two records: synchronize waits for the second, issued before the call."""
    s = sim_backend.stream()
    ev = sim_backend.event()
    ev.record(s)
    sim_backend.busy_wait(s, 0.1)
    ev.record(s)
    t0 = time.perf_counter()
    ev.synchronize()
    assert time.perf_counter() - t0 >= 0.09


def test_worker_failure_is_raised_by_the_next_synchronize(sim_backend):
    """An op that raises in the worker is reported once, chained, naming the op; work goes on."""
    s = sim_backend.stream(name="fails")
    sim_backend.launch(s, Fail())
    with pytest.raises(RuntimeError, match=r"sim op 'launch\(fail\)' on stream 'fails' failed: "
                                           r"ZeroDivisionError") as info:
        s.synchronize()
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    s.synchronize()  # reported once
    d = sim_backend.empty((4,), np.float32)
    sim_backend.launch(s, Fail())
    ev = sim_backend.event()
    ev.record(s)
    with pytest.raises(RuntimeError, match="launch\\(fail\\)"):
        ev.synchronize()
    sim_backend.launch(s, Fail())
    with pytest.raises(RuntimeError, match="launch\\(fail\\)"):
        sim_backend.synchronize()
    sim_backend.launch(s, Axpb(), d, d, a=1.0, b=0.0)
    s.synchronize()


def test_replayed_graph_failure_is_reported(sim_backend):
    """A recorded op that fails at replay surfaces at the stream's synchronize."""
    s = sim_backend.stream()
    with sim_backend.capture(s, name="fails-on-replay") as cap:
        sim_backend.launch(s, Fail())
    cap.graph.launch(s)
    with pytest.raises(RuntimeError, match="launch\\(fail\\)"):
        s.synchronize()


def test_captured_ops_do_not_run_until_replayed(sim_backend):
    """Capture records; only a launch executes."""
    s = sim_backend.stream()
    h, d = sim_backend.pinned_empty((4,), np.int32), sim_backend.empty((4,), np.int32)
    out = sim_backend.pinned_empty((4,), np.int32)
    h[:] = 5
    out[:] = 0
    with sim_backend.capture(s, name="recorded") as cap:
        sim_backend.copy_h2d(d, h, s)
        sim_backend.copy_d2h(out, d, s)
    s.synchronize()
    assert (out == 0).all() and cap.graph.num_nodes == 2
    cap.graph.launch(s)
    s.synchronize()
    assert (out == 5).all()


def test_device_arrays_are_views_over_pool_memory(sim_backend):
    """A sim device array lives in a pool block; its base chain ends at the buffer's owner."""
    d = sim_backend.empty((8,), np.float32)
    owner = d.base
    assert owner.keep.nbytes == 32 and not owner.keep.scratch
    assert np.isnan(d).all(), "fresh device memory is poisoned, not zeroed"


def test_launch_refuses_objects_without_run_numpy(sim_backend):
    """A kernel must implement run_numpy."""
    with pytest.raises(TypeError, match="has no run_numpy"):
        sim_backend.launch(sim_backend.stream(), object())


def test_negative_device_delay_is_refused():
    """device_delay_s must be >= 0."""
    with pytest.raises(ValueError, match=r"device_delay_s must be a finite number of seconds in \[0"):
        SimBackend(device_delay_s=-1.0)


def test_get_backend_picks_and_validates_names():
    """Unknown names list the valid ones; auto picks cuda only where it is available."""
    with pytest.raises(ValueError, match="unknown backend 'gpu'; valid names: 'auto', 'cuda', 'sim'"):
        get_backend("gpu")
    assert "sim" in available_backends()
    with get_backend("auto") as be:
        assert be.name == ("cuda" if "cuda" in available_backends() else "sim")
    with get_backend("sim", pool_debug=True) as be:
        assert be.pool.debug and be.xp is np


def test_device_delay_is_sim_only():
    """device_delay_s on the cuda backend is refused."""
    with pytest.raises(ValueError, match="device_delay_s=0.5 is a sim-only option"):
        get_backend("cuda", device_delay_s=0.5)


def test_explicit_cuda_without_a_gpu_says_why(monkeypatch):
    """get_backend('cuda') on a machine without a GPU raises a clear RuntimeError naming why;
    'auto' falls back to the sim. The probe is replaced, so this runs on GPU machines too."""
    import vt.backend as backend_pkg
    monkeypatch.setattr(backend_pkg, "_cuda_unavailable_reason",
                        lambda: "no usable CUDA device (cuda_available() is False)")
    with pytest.raises(RuntimeError, match=r"the cuda backend is unavailable: no usable CUDA device"):
        get_backend("cuda")
    assert available_backends() == ["sim"]
    with get_backend("auto") as be:
        assert be.name == "sim"


def test_pool_debug_backend_runs_a_capture(sim_backend):
    """With pool_debug the warm-up sizes per-request scratch blocks and the capture replays."""
    with get_backend("sim", pool_debug=True) as be:
        s = be.stream()
        h, out = be.pinned_empty((64,), np.float32), be.pinned_empty((64,), np.float32)
        x_d = be.empty((64,), np.float32)

        def forward():
            be.copy_h2d(x_d, h, s)
            tmp = be.empty((64,), np.float32)
            be.launch(s, Axpb(), tmp, x_d, a=3.0, b=1.0)
            be.copy_d2h(out, tmp, s)

        with be.pool.scratch_warmup("debug"):
            forward()
            s.synchronize()
        with be.capture(s, name="debug") as cap:
            forward()
        h[:] = 2.0
        out[:] = np.nan
        cap.graph.launch(s)
        s.synchronize()
        np.testing.assert_array_equal(out, np.full(64, 7.0, np.float32))
        assert be.pool.stats().mallocs_during_capture == 0
