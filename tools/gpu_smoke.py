#!/usr/bin/env python3
"""Exercise every CudaBackend method once and print PASS/FAIL per item (run first on a GPU).

Each item is independent: a failure prints its exception and where it happened, and the next
item still runs. Exit status 1 if any item failed. `--traceback` prints full tracebacks.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ITEMS = []


def item(fn):
    ITEMS.append(fn)
    return fn


class Axpb:
    """y = a*x + b with CuPy temporaries (so CuPy allocates through the backend's allocator)."""

    def run_numpy(self, y, x, a, b):
        y[...] = a * x + b

    def run_cupy(self, stream_handle, y, x, a, b):
        y[...] = a * x + b


class Env:
    be = None


def roundtrip(be, n=1024):
    x_h, y_h = be.pinned_empty((n,), np.float32), be.pinned_empty((n,), np.float32)
    x_d, y_d = be.empty((n,), np.float32), be.empty((n,), np.float32)
    return x_h, y_h, x_d, y_d


@item
def cuda_available():
    from vt.backend.cuda import cuda_available
    assert cuda_available() is True, "cuda_available() returned False"


@item
def construct_backend():
    from vt.backend.cuda import CudaBackend
    Env.be = CudaBackend()
    return repr(Env.be)


@item
def info():
    info = Env.be.info()
    return ", ".join(f"{k}={v}" for k, v in info.items())


@item
def stream_query_synchronize():
    s = Env.be.stream(name="smoke")
    assert s.query() is True
    s.synchronize()
    assert not Env.be.is_capturing(s)
    s.close()
    s.close()
    return f"handle={s.handle:#x}"


@item
def legacy_stream():
    legacy = Env.be.legacy_stream()
    assert legacy.handle == 0 and legacy.borrowed
    legacy.synchronize()
    try:
        Env.be.capture(legacy, name="legacy")
    except ValueError:
        return "refused for capture"
    raise AssertionError("capture of the legacy stream was not refused")


@item
def event_record_query_synchronize():
    be = Env.be
    s = be.stream()
    ev = be.event(blocking_sync=True, timing_enabled=False)
    ev.record(s)
    ev.synchronize()
    assert ev.query() is True
    s.wait_event(ev)
    s.synchronize()


@item
def busy_wait_and_elapsed_ms():
    be = Env.be
    s = be.stream()
    start, end = be.event(timing_enabled=True), be.event(timing_enabled=True)
    be.busy_wait(s, 0.0)
    start.record(s)
    be.busy_wait(s, 0.02)
    end.record(s)
    assert end.query() is False, "event complete before a 20 ms spin could finish"
    end.synchronize()
    ms = end.elapsed_ms(start)
    assert 19.0 <= ms < 60.0, f"20 ms busy_wait measured {ms:.2f} ms"
    return f"{ms:.2f} ms"


@item
def pinned_memory_is_page_locked():
    from vt.backend.cuda._memory import memory_type
    h = Env.be.pinned_empty((256,), np.int32)
    kind = memory_type(h.ctypes.data).name
    assert kind == "cudaMemoryTypeHost", kind
    h.base.close()
    return kind


@item
def device_empty_and_retained():
    be = Env.be
    d = be.empty((16, 16), np.float16)
    r = be.empty((4, 8), np.float32, retained=True)
    assert isinstance(d, be.xp.ndarray) and d.shape == (16, 16) and r.dtype == np.float32
    z = be.empty((0,), np.float32)
    assert z.size == 0
    return str(be.pool.stats())


@item
def copies_h2d_d2d_d2h():
    be = Env.be
    s = be.stream()
    x_h, y_h, x_d, y_d = roundtrip(be)
    x_h[:] = np.arange(x_h.size)
    y_h[:] = -1
    be.copy_h2d(x_d, x_h, s)
    be.copy_d2d(y_d, x_d, s)
    be.copy_d2h(y_h, y_d, s)
    s.synchronize()
    np.testing.assert_array_equal(y_h, x_h)
    try:
        be.copy_h2d(be.empty((3,), np.float32), x_h, s)
    except ValueError as exc:
        return f"size mismatch refused: {exc}"
    raise AssertionError("size mismatch not refused")


@item
def launch_with_cupy_temporaries():
    be = Env.be
    s = be.stream()
    x_h, y_h, x_d, y_d = roundtrip(be)
    x_h[:] = np.random.default_rng(0).standard_normal(x_h.size)
    be.copy_h2d(x_d, x_h, s)
    be.launch(s, Axpb(), y_d, x_d, a=3.0, b=-1.0)
    be.copy_d2h(y_h, y_d, s)
    s.synchronize()
    np.testing.assert_allclose(y_h, 3.0 * x_h - 1.0, rtol=1e-6)


@item
def capture_upload_replay_with_new_input():
    be = Env.be
    s = be.stream()
    x_h, y_h, x_d, y_d = roundtrip(be)
    with be.pool.scratch_warmup("smoke"):
        be.launch(s, Axpb(), y_d, x_d, a=2.0, b=1.0)
    s.synchronize()
    mallocs = be.pool.stats().driver_mallocs
    with be.capture(s, name="smoke") as cap:
        assert be.is_capturing(s)
        be.copy_h2d(x_d, x_h, s)
        be.launch(s, Axpb(), y_d, x_d, a=2.0, b=1.0)
        be.copy_d2h(y_h, y_d, s)
    assert not be.is_capturing(s)
    assert be.pool.stats().driver_mallocs == mallocs, "driver malloc during capture"
    g = cap.graph
    g.upload(s)
    for i in range(3):
        x_h[:] = i
        y_h[:] = np.nan
        g.launch(s)
        s.synchronize()
        np.testing.assert_array_equal(y_h, np.full(y_h.size, 2.0 * i + 1.0, np.float32))
    g.close()
    g.close()
    return f"{g.num_nodes} nodes, mallocs_during_capture={be.pool.stats().mallocs_during_capture}"


@item
def inputs_read_external_event():
    be = Env.be
    s = be.stream()
    x_h, y_h, x_d, y_d = roundtrip(be)
    inputs_read = be.event(blocking_sync=True)
    done = be.event(blocking_sync=True)
    be.busy_wait(s, 0.0)
    s.synchronize()
    with be.capture(s, name="inputs-read") as cap:
        be.copy_h2d(x_d, x_h, s)
        inputs_read.record(s, external=True)
        be.busy_wait(s, 0.1)
        be.copy_d2h(y_h, x_d, s)
    x_h[:] = 5.0
    t0 = time.perf_counter()
    cap.graph.launch(s)
    done.record(s)
    inputs_read.synchronize()
    waited = time.perf_counter() - t0
    still_running = not done.query()
    x_h[:] = -1.0
    done.synchronize()
    total = time.perf_counter() - t0
    assert still_running, "replay already finished when the inputs-read event completed"
    np.testing.assert_array_equal(y_h, 5.0)
    return f"inputs read after {waited * 1e3:.2f} ms of a {total * 1e3:.1f} ms replay"


@item
def synchronize_in_capture_raises_capture_error():
    from vt.backend import CaptureError
    be = Env.be
    s = be.stream()
    d = be.empty((64,), np.float32)
    try:
        with be.capture(s, name="sync-in-capture"):
            be.launch(s, Axpb(), d, d, a=1.0, b=0.0)
            s.synchronize()
    except CaptureError as exc:
        message = str(exc)
    else:
        raise AssertionError("no CaptureError")
    assert "cudaErrorStreamCaptureUnsupported" in message, message
    assert not be.is_capturing(s)
    s.synchronize()
    return message


@item
def capture_allocation_error():
    from vt.backend import CaptureAllocationError
    be = Env.be
    s = be.stream()
    try:
        with be.capture(s, name="alloc-in-capture"):
            be.empty((1 << 22,), np.float32, retained=True)
    except CaptureAllocationError as exc:
        message = str(exc)
    else:
        raise AssertionError("no CaptureAllocationError")
    assert not be.is_capturing(s) and be.pool.stats().mallocs_during_capture == 0
    s.synchronize()
    return message


@item
def empty_capture_warns():
    be = Env.be
    s = be.stream()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with be.capture(s, name="empty") as cap:
            pass
    assert any(issubclass(w.category, RuntimeWarning) for w in caught), "no RuntimeWarning"
    cap.graph.launch(s)
    s.synchronize()


@item
def orphaned_capture_is_ended():
    be = Env.be
    s = be.stream()
    cap = be.capture(s, name="orphan")
    cap.__enter__()
    del cap
    gc.collect()
    assert not be.is_capturing(s), "stream still capturing after the capture was collected"
    assert be.pool.capture_name is None
    s.synchronize()


@item
def error_name_from_failing_call():
    from vt.backend import CudaError
    try:
        Env.be.raw_memory.malloc(1 << 60)
    except CudaError as exc:
        assert str(exc).startswith("cudaErrorMemoryAllocation: cudaMalloc"), str(exc)
        return str(exc)
    raise AssertionError("no CudaError")


@item
def malloc_in_capture_invalidates():
    from vt.backend import CaptureError, CudaError
    be = Env.be
    s = be.stream()
    d = be.empty((64,), np.float32)
    first = "cudaMalloc in capture did not raise"
    try:
        with be.capture(s, name="malloc-in-capture"):
            be.launch(s, Axpb(), d, d, a=1.0, b=0.0)
            try:
                be.raw_memory.malloc(1 << 20)
            except CudaError as exc:
                first = str(exc)
    except CaptureError as exc:
        assert "cudaErrorStreamCaptureUnsupported" in first, first
        assert not be.is_capturing(s)
        s.synchronize()
        return str(exc)
    raise AssertionError("no CaptureError")


@item
def selfcheck():
    from vt.backend.selfcheck import run_selfcheck
    ok, message = run_selfcheck(Env.be)
    assert ok, message
    return message


@item
def pool_debug_backend():
    from vt.backend.cuda import CudaBackend
    with CudaBackend(pool_debug=True) as be:
        before = be.pool.stats().driver_mallocs
        keep = [be.empty((10,), np.float32) for _ in range(3)]
        assert be.pool.stats().driver_mallocs == before + 3
        del keep
    return "3 buffers -> 3 cudaMallocs"


@item
def close_and_closed_error():
    from vt.backend import ClosedError
    be = Env.be
    s = be.stream(name="last")
    be.synchronize()
    be.close()
    be.close()
    try:
        s.synchronize()
    except ClosedError as exc:
        return str(exc)
    raise AssertionError("stream usable after be.close()")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--traceback", action="store_true", help="print full tracebacks")
    args = parser.parse_args()
    failed = 0
    for fn in ITEMS:
        t0 = time.perf_counter()
        try:
            if Env.be is None and fn.__name__ not in ("cuda_available", "construct_backend"):
                raise RuntimeError("no backend (construct_backend failed)")
            note = fn()
            status = "PASS"
        except Exception as exc:  # noqa: BLE001 (each item reports its own failure)
            failed += 1
            status = "FAIL"
            frames = traceback.extract_tb(exc.__traceback__)
            where = "; ".join(f"{os.path.relpath(f.filename)}:{f.lineno} in {f.name}" for f in frames[-3:])
            note = f"{type(exc).__name__}: {exc}  [{where}]"
            if args.traceback:
                traceback.print_exc()
        ms = (time.perf_counter() - t0) * 1e3
        print(f"{status}  {fn.__name__:<42} {ms:8.1f} ms  {note or ''}", flush=True)
    print(f"{len(ITEMS) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
