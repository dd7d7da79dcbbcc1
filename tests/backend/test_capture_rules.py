"""One negative test per capture rule: the capture is ended, the error is named, the stream works."""
import warnings

import numpy as np
import pytest

from vt.backend import CaptureAllocationError, CaptureError, CudaError

from ._kernels import Axpb


def _assert_stream_works(be, s, n=256):
    """Run an eager H2D -> axpb -> D2H on `s` and check the values."""
    x_h, y_h = be.pinned_empty((n,), np.float32), be.pinned_empty((n,), np.float32)
    x_h[:] = np.random.default_rng(7).standard_normal(n)
    y_h[:] = np.nan
    x_d, y_d = be.empty((n,), np.float32), be.empty((n,), np.float32)
    be.copy_h2d(x_d, x_h, s)
    be.launch(s, Axpb(), y_d, x_d, a=2.0, b=0.5)
    be.copy_d2h(y_h, y_d, s)
    s.synchronize()
    np.testing.assert_allclose(y_h, 2.0 * x_h + 0.5, rtol=1e-5, atol=1e-6)
    assert not be.is_capturing(s)


def test_retained_allocation_beyond_pre_grown_raises_and_ends_the_capture(backend):
    """A retained block the pool cannot serve in capture: CaptureAllocationError, stream usable."""
    s = backend.stream()
    with pytest.raises(CaptureAllocationError, match=r"capture 'S=32 slot=0' needs a retained "
                                                     r"block of 4194304 bytes") as info:
        with backend.capture(s, name="S=32 slot=0"):
            backend.empty((1 << 20,), np.float32, retained=True)
    assert info.value.requested == 4 << 20 and info.value.capture == "S=32 slot=0"
    assert backend.pool.stats().mallocs_during_capture == 0
    _assert_stream_works(backend, s)


def test_scratch_allocation_beyond_the_arena_raises_and_ends_the_capture(backend):
    """A temporary larger than the scratch arena: CaptureAllocationError, stream usable."""
    s = backend.stream()
    backend.pool.reserve_scratch(4096)
    with pytest.raises(CaptureAllocationError, match=r"needs a scratch block of 40000 bytes"):
        with backend.capture(s, name="scratch"):
            backend.empty((10000,), np.float32)
    assert backend.pool.stats().mallocs_during_capture == 0
    _assert_stream_works(backend, s)


@pytest.mark.api_errors
def test_stream_synchronize_in_capture_fails_the_capture_naming_the_call(backend):
    """s.synchronize() while capturing: CaptureError naming cudaStreamSynchronize; stream usable."""
    s = backend.stream()
    d = backend.empty((256,), np.float32)
    with pytest.raises(CaptureError, match=r"capture 'sync'.*cudaErrorStreamCaptureUnsupported: "
                                           r"cudaStreamSynchronize"):
        with backend.capture(s, name="sync"):
            backend.launch(s, Axpb(), d, d, a=1.0, b=0.0)
            s.synchronize()
    _assert_stream_works(backend, s)


@pytest.mark.api_errors
def test_caught_query_error_still_fails_the_capture_at_its_end(backend):
    """A s.query() error caught inside the block still makes the capture raise CaptureError."""
    s = backend.stream()
    d = backend.empty((256,), np.float32)
    with pytest.raises(CaptureError, match=r"capture 'query'.*cudaErrorStreamCaptureUnsupported: "
                                           r"cudaStreamQuery") as info:
        with backend.capture(s, name="query"):
            backend.launch(s, Axpb(), d, d, a=1.0, b=0.0)
            with pytest.raises(CudaError, match="cudaErrorStreamCaptureUnsupported"):
                s.query()
    assert isinstance(info.value.first_error, CudaError)
    assert info.value.first_error.call == "cudaStreamQuery"
    _assert_stream_works(backend, s)


@pytest.mark.api_errors
def test_device_synchronize_in_capture_fails_the_capture(backend):
    """be.synchronize() while capturing (global mode): CaptureError naming cudaDeviceSynchronize."""
    s = backend.stream()
    d = backend.empty((256,), np.float32)
    with pytest.raises(CaptureError, match=r"cudaErrorStreamCaptureUnsupported: cudaDeviceSynchronize"):
        with backend.capture(s, name="device-sync"):
            backend.launch(s, Axpb(), d, d, a=1.0, b=0.0)
            backend.synchronize()
    _assert_stream_works(backend, s)


@pytest.mark.api_errors
def test_raw_malloc_in_capture_fails_the_capture_in_global_mode(backend):
    """A driver allocation that bypasses the pool during capture invalidates it (global mode)."""
    s = backend.stream()
    d = backend.empty((256,), np.float32)
    with pytest.raises(CaptureError, match=r"cudaErrorStreamCaptureUnsupported: cudaMalloc"):
        with backend.capture(s, name="malloc"):
            backend.launch(s, Axpb(), d, d, a=1.0, b=0.0)
            backend.pool.raw.malloc(1 << 20)
    _assert_stream_works(backend, s)


@pytest.mark.api_errors
def test_event_recorded_in_an_open_capture_refuses_query_and_synchronize(backend):
    """ev.query()/ev.synchronize() on an event last recorded in an open capture: cudaErrorCapturedEvent."""
    s = backend.stream()
    ev = backend.event()
    d = backend.empty((256,), np.float32)
    with pytest.raises(CaptureError, match=r"capture 'captured-event'.*cudaErrorCapturedEvent"):
        with backend.capture(s, name="captured-event"):
            backend.launch(s, Axpb(), d, d, a=1.0, b=0.0)
            ev.record(s)
            with pytest.raises(CudaError, match="cudaErrorCapturedEvent: cudaEventQuery"):
                ev.query()
            ev.synchronize()
    _assert_stream_works(backend, s)


def test_legacy_stream_is_refused_for_capture(backend):
    """Capturing the legacy default stream raises ValueError before anything starts."""
    with pytest.raises(ValueError, match="legacy"):
        with backend.capture(backend.legacy_stream(), name="legacy"):
            pass
    assert backend.pool.capture_name is None


def test_stream_cannot_be_captured_twice_at_once(backend):
    """A second capture on a capturing stream is refused; the first one still works."""
    s = backend.stream()
    d = backend.empty((256,), np.float32)
    with backend.capture(s, name="outer") as cap:
        backend.launch(s, Axpb(), d, d, a=1.0, b=0.0)
        with pytest.raises(RuntimeError, match="already capturing 'outer'"):
            with backend.capture(s, name="inner"):
                pass
    cap.graph.launch(s)
    s.synchronize()


def test_empty_capture_warns_and_still_launches(backend):
    """A capture that records nothing warns RuntimeWarning; its graph launches harmlessly."""
    s = backend.stream()
    with pytest.warns(RuntimeWarning, match="recorded no work"):
        with backend.capture(s, name="empty") as cap:
            pass
    cap.graph.launch(s)
    s.synchronize()


def test_non_empty_capture_does_not_warn(backend):
    """Only an empty capture warns."""
    s = backend.stream()
    d = backend.empty((256,), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with backend.capture(s, name="busy"):
            backend.launch(s, Axpb(), d, d, a=1.0, b=0.0)


def test_captured_copy_needs_pinned_host_memory(backend):
    """A pageable (plain numpy) host array in a captured copy is refused: ValueError."""
    s = backend.stream()
    d = backend.empty((16,), np.float32)
    with pytest.raises(ValueError, match="not pinned memory from be.pinned_empty"):
        with backend.capture(s, name="pageable"):
            backend.copy_h2d(d, np.zeros(16, np.float32), s)
    _assert_stream_works(backend, s)


def test_other_exceptions_propagate_unchanged_and_end_the_capture(backend):
    """A caller's own exception inside the block propagates as it is; the capture is ended."""
    s = backend.stream()
    with pytest.raises(KeyError, match="caller's bug"):
        with backend.capture(s, name="raises"):
            raise KeyError("caller's bug")
    _assert_stream_works(backend, s)
