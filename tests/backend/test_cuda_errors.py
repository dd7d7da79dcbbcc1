"""CUDA errors raised on purpose: names from the runtime, and the global-mode capture rule.

Marked api_errors: tools/sanitize.sh runs these with --report-api-errors no, because
compute-sanitizer counts every failing CUDA call, deliberate ones included."""

import numpy as np
import pytest

from vt import env
from vt.backend import CaptureError, CudaError

from ._kernels import Axpb

pytestmark = [pytest.mark.gpu, pytest.mark.api_errors]


@pytest.fixture
def be():
    from vt.backend.cuda import CudaBackend
    backend = CudaBackend(pool_debug=env.get("VT_POOL_DEBUG"))
    yield backend
    backend.close()


def test_failed_call_raises_cuda_error_named_after_the_error(be):
    """An impossible cudaMalloc raises CudaError whose message starts with the runtime's name."""
    with pytest.raises(CudaError, match=r"^cudaErrorMemoryAllocation: cudaMalloc\(\d+\) failed") as info:
        be.raw_memory.malloc(1 << 60)
    assert info.value.name == "cudaErrorMemoryAllocation"
    assert info.value.call.startswith("cudaMalloc")


def test_cuda_error_does_not_leave_a_stale_last_error(be):
    """After a failed call the runtime's last-error state is clear, so later calls are unaffected."""
    from cuda.bindings import runtime as cudart
    with pytest.raises(CudaError):
        be.raw_memory.malloc(1 << 60)
    assert cudart.cudaGetLastError()[0] == cudart.cudaError_t.cudaSuccess


def test_cudamalloc_in_global_capture_invalidates_it_and_the_stream_recovers(be):
    """cudaMalloc while capturing (global mode): cudaErrorStreamCaptureUnsupported, then
    CaptureError at the end naming the capture and that call; the stream works afterwards."""
    s = be.stream()
    d = be.empty((256,), np.float32)
    be.launch(s, Axpb(), d, d, a=1.0, b=0.0)
    with pytest.raises(CaptureError, match=r"capture 'malloc-in-capture'.*cudaErrorStreamCaptureUnsupported") as info:
        with be.capture(s, name="malloc-in-capture"):
            be.launch(s, Axpb(), d, d, a=1.0, b=0.0)
            with pytest.raises(CudaError, match=r"^cudaErrorStreamCaptureUnsupported: cudaMalloc"):
                be.raw_memory.malloc(1 << 20)
    assert info.value.capture == "malloc-in-capture"
    assert info.value.first_error.name == "cudaErrorStreamCaptureUnsupported"
    assert isinstance(info.value.__cause__, CudaError)
    assert info.value.__cause__.name == "cudaErrorStreamCaptureInvalidated"
    assert not be.is_capturing(s) and be.pool.capture_name is None
    x_h = be.pinned_empty((256,), np.float32)
    x_h[:] = np.arange(256)
    be.copy_h2d(d, x_h, s)
    be.launch(s, Axpb(), d, d, a=2.0, b=1.0)
    be.copy_d2h(x_h, d, s)
    s.synchronize()
    np.testing.assert_array_equal(x_h, 2.0 * np.arange(256, dtype=np.float32) + 1.0)


def test_elapsed_time_of_an_unrecorded_event_names_the_error(be):
    """elapsed_ms before either event was recorded: a CudaError from cudaEventElapsedTime."""
    start, end = be.event(timing_enabled=True), be.event(timing_enabled=True)
    with pytest.raises(CudaError, match=r"^cudaError\w+: cudaEventElapsedTime failed"):
        end.elapsed_ms(start)
